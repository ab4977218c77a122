"""Text a customer or an agent gives that becomes a name, a path or a URL: checked in one place.

- `unsafe_character`: control, format (bidi overrides and isolates such as U+202E, zero-width
  characters), line and paragraph separators: a file shown as `txt.exe` or a name that hides
  part of itself is refused wherever a name or a path is taken.
- `url_parse`: every URL a customer gives (a dataset's source, a webhook): every way the
  standard library can fail on one (a port past 65535, a host label too long or empty for
  IDNA) is a ValidationFailed naming the field, never a 500.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from urllib.parse import urlsplit

from core.errors import ValidationFailed

# Cc: controls; Cf: format (bidi embeddings, overrides and isolates, zero-width joiners, the
# BOM); Zl, Zp: line and paragraph separators; Cs: lone surrogates; Co, Cn: private use and
# unassigned code points, which no font shows as what they are.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})

URL_MAX_LENGTH = 2000


def unsafe_character(text: str) -> str | None:
    """The first character of `text` that must not be in a name or a path, as U+XXXX; None
    when there is none."""
    for char in text:
        if unicodedata.category(char) in _UNSAFE_CATEGORIES:
            return f"U+{ord(char):04X}"
    return None


def text_check(text: str, *, field: str) -> str:
    """`text`, or ValidationFailed naming `field` when it holds an unsafe character."""
    bad = unsafe_character(text)
    if bad is not None:
        raise ValidationFailed(
            f"{bad} (a control, bidi or invisible character) is not allowed", field=field
        )
    return text


@dataclass(frozen=True, slots=True)
class ParsedUrl:
    """A URL that parsed whole: its host in ASCII (IDNA), its port (the scheme's default when
    none was given)."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    has_credentials: bool


def url_parse(url: str, *, field: str, schemes: tuple[str, ...] = ("https", "http")) -> ParsedUrl:
    """Parse a URL a customer gave, or raise ValidationFailed naming `field`."""
    if len(url) > URL_MAX_LENGTH:
        raise ValidationFailed(f"at most {URL_MAX_LENGTH} characters", field=field)
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url) or unsafe_character(url):
        raise ValidationFailed("a URL has no spaces, control or bidi characters", field=field)
    try:
        parts = urlsplit(url)
        port = parts.port  # urlsplit checks the port only when it is read
        hostname = parts.hostname
    except ValueError as exc:
        raise ValidationFailed(f"not a valid URL: {exc}", field=field) from None
    if parts.scheme not in schemes or not hostname:
        raise ValidationFailed(
            f"a {' or '.join(f'{s}://' for s in schemes)} URL with a host name", field=field
        )
    try:
        host = hostname.encode("idna").decode("ascii")
    except UnicodeError:
        raise ValidationFailed(
            "the host name is not valid (a label empty or longer than 63 characters)",
            field=field,
        ) from None
    return ParsedUrl(
        url=url,
        scheme=parts.scheme,
        host=host,
        port=port or (443 if parts.scheme == "https" else 80),
        path=parts.path,
        has_credentials=parts.username is not None or parts.password is not None,
    )
