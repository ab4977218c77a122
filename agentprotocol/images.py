"""Image references and allow-list patterns, judged the same way by the agent (which refuses an
image outside its allow-list) and the scheduler (which never places a rental where it would be
refused). Standard library only: both ends import it.

A pattern is a shell wildcard (`fnmatch`, case-sensitive) matched against the normalized
reference: `*` matches any characters, "/" and ":" included, and an image named without a tag
is matched as `:latest`, as Docker pulls it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def image_split(image: str) -> tuple[str, str]:
    """(repository, tag or "") of a reference, as Docker reads it: the tag is what follows the
    last ":" after the last "/" (a ":" before it is a registry's port). A digest reference
    (`repo@sha256:...`) gives its digest as the tag."""
    if "@" in image:
        repository, _, digest = image.partition("@")
        return repository, digest
    head, sep, tail = image.rpartition(":")
    if sep and "/" not in tail:
        return head, tail
    return image, ""


def image_normalize(image: str) -> str:
    """The reference with Docker's implicit ":latest" made explicit (a digest reference as is)."""
    image = image.strip()
    if "@" in image:
        return image
    repository, tag = image_split(image)
    return f"{repository}:{tag or 'latest'}"


def image_pattern_matches(pattern: str, image: str) -> bool:
    return fnmatch.fnmatchcase(image_normalize(image), pattern)


def image_allowed(patterns: Iterable[str] | None, image: str) -> bool:
    """Whether an allow-list admits the image; None (a node that never said) admits any."""
    if patterns is None:
        return True
    return any(image_pattern_matches(pattern, image) for pattern in patterns)


def allow_patterns(entries: Iterable[str]) -> tuple[str, ...]:
    """The patterns of agent allow-list entries (`PATTERN` or `PATTERN=USER`)."""
    return tuple(
        entry.strip().partition("=")[0] for entry in entries if entry.strip().partition("=")[0]
    )
