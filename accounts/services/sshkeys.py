"""SSH public keys of an account: parsed and checked before anything is stored.

A key is one OpenSSH public key line, `TYPE BASE64 [COMMENT]`. It is refused, naming the
`public_key` field, unless its type is one OpenSSH accepts by default, its body is valid base64
that decodes to exactly the key of that type (RFC 4253 / 5656 wire format, nothing left over),
the key itself loads in the `cryptography` library, which checks its numbers (an RSA exponent
of at least 3, odd, below the modulus; an ECDSA point on its curve), and it is strong enough
(RSA of at least 2048 bits; DSA is refused). The line nodes receive is
rebuilt from the parsed parts (`TYPE BASE64`), so no authorized_keys option or stray byte of the
input ever reaches a container.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from accounts import selectors
from accounts.models import SshKey, Team
from core.errors import NotFound, ValidationFailed

User = get_user_model()

MAX_KEY_CHARS = 16 * 1024
MAX_KEYS_PER_TEAM = 50
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 16384
_FIELD = "public_key"

_ECDSA_CURVES = {"nistp256": (256, 65), "nistp384": (384, 97), "nistp521": (521, 133)}
KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)


@dataclass(frozen=True, slots=True)
class ParsedKey:
    key_type: str
    body: str  # the base64 as given (canonical: it decoded strictly)
    comment: str
    bits: int
    fingerprint: str

    @property
    def line(self) -> str:
        return f"{self.key_type} {self.body}"


class _Reader:
    """RFC 4251 wire format: uint32-length-prefixed strings."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def string(self) -> bytes:
        if self.pos + 4 > len(self.data):
            raise ValidationFailed("the key body ends early", field=_FIELD)
        (length,) = struct.unpack(">I", self.data[self.pos : self.pos + 4])
        start, self.pos = self.pos + 4, self.pos + 4 + length
        if self.pos > len(self.data):
            raise ValidationFailed("the key body ends early", field=_FIELD)
        return self.data[start : self.pos]

    def done(self) -> None:
        if self.pos != len(self.data):
            raise ValidationFailed("the key body has bytes after the key", field=_FIELD)


def _bits(key_type: str, blob: bytes) -> int:
    reader = _Reader(blob)
    if reader.string() != key_type.encode():
        raise ValidationFailed(f"the key body is not an {key_type} key", field=_FIELD)
    if key_type in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(reader.string()) != 32:
            raise ValidationFailed("an ed25519 key is 32 bytes", field=_FIELD)
        bits = 256
    elif key_type == "ssh-rsa":
        exponent, modulus = reader.string(), reader.string()
        if not exponent or not modulus or modulus[0] & 0x80 or exponent[0] & 0x80:
            raise ValidationFailed("the RSA key's numbers are malformed", field=_FIELD)
        bits = int.from_bytes(modulus, "big").bit_length()
        if bits < MIN_RSA_BITS:
            raise ValidationFailed(
                f"an RSA key of {bits} bits is too weak: at least {MIN_RSA_BITS}", field=_FIELD
            )
        if bits > MAX_RSA_BITS:
            raise ValidationFailed(f"RSA keys go up to {MAX_RSA_BITS} bits", field=_FIELD)
    else:  # ecdsa, plain or security-key
        curve = key_type.removeprefix("sk-").split("-")[2].split("@")[0]
        if reader.string() != curve.encode():
            raise ValidationFailed(f"the key's curve is not {curve}", field=_FIELD)
        bits, point_size = _ECDSA_CURVES[curve]
        point = reader.string()
        if len(point) != point_size or point[0] != 4:
            raise ValidationFailed(f"not an uncompressed {curve} point", field=_FIELD)
    if key_type.startswith("sk-"):
        reader.string()  # the security key's application ("ssh:")
    reader.done()
    return bits


def _load_checked(key_type: str, body: str) -> None:
    """The key loaded by a kept library, which checks what the wire format cannot: an RSA
    exponent below 3 (e=0 lets anyone in) or a point that is not on its curve is refused."""
    try:
        key = load_ssh_public_key(f"{key_type} {body}".encode())
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ValidationFailed(f"not a valid {key_type} key: {exc}", field=_FIELD) from None
    if isinstance(key, rsa.RSAPublicKey) and key.public_numbers().e % 2 == 0:
        raise ValidationFailed("the RSA key's exponent is even", field=_FIELD)


def ssh_key_parse(text: str) -> ParsedKey:
    """Parse one OpenSSH public key line; ValidationFailed on `public_key` saying what is
    wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValidationFailed("paste an OpenSSH public key (the .pub file)", field=_FIELD)
    if len(text) > MAX_KEY_CHARS:
        raise ValidationFailed(f"longer than {MAX_KEY_CHARS} characters", field=_FIELD)
    line = text.strip()
    if "\n" in line or "\r" in line:
        raise ValidationFailed("one key per request: the text has several lines", field=_FIELD)
    if "PRIVATE KEY" in line:
        raise ValidationFailed(
            "this is a private key: paste the public one (the .pub file), and treat this one "
            "as exposed",
            field=_FIELD,
        )
    parts = line.split(None, 2)
    key_type = parts[0]
    if key_type == "ssh-dss":
        raise ValidationFailed("DSA keys are refused (OpenSSH disabled them)", field=_FIELD)
    if key_type not in KEY_TYPES:
        raise ValidationFailed(
            f"unknown key type {key_type[:40]!r} (authorized_keys options are not accepted); "
            f"one of {', '.join(KEY_TYPES)}",
            field=_FIELD,
        )
    if len(parts) < 2:
        raise ValidationFailed("the key has a type but no body", field=_FIELD)
    body = parts[1]
    try:
        blob = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationFailed("the key body is not valid base64", field=_FIELD) from None
    if base64.b64encode(blob).decode() != body:
        raise ValidationFailed("the key body is not valid base64", field=_FIELD)
    comment = parts[2].strip() if len(parts) > 2 else ""
    if len(comment) > 200 or not comment.isprintable():
        raise ValidationFailed(
            "the comment must be printable, at most 200 characters", field=_FIELD
        )
    bits = _bits(key_type, blob)
    _load_checked(key_type, body)
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return ParsedKey(
        key_type=key_type, body=body, comment=comment, bits=bits, fingerprint=f"SHA256:{digest}"
    )


def ssh_key_add(*, team: Team, owner: User, public_key: str, name: str = "") -> SshKey:
    """Add a checked public key to the team (`owner`, the member adding it, is shown in the
    listing); a key the team already has is refused."""
    parsed = ssh_key_parse(public_key)
    name = name.strip() or parsed.comment[:80]
    with transaction.atomic():
        keys = selectors.ssh_key_scope(team=team)
        if keys.filter(fingerprint=parsed.fingerprint).exists():
            raise ValidationFailed(
                f"this key ({parsed.fingerprint}) is already on your team", field=_FIELD
            )
        if keys.count() >= MAX_KEYS_PER_TEAM:
            raise ValidationFailed(f"at most {MAX_KEYS_PER_TEAM} keys per team", field=_FIELD)
        try:
            with transaction.atomic():
                return SshKey.objects.create(
                    team=team, owner=owner, name=name, key_type=parsed.key_type,
                    public_key=parsed.line, comment=parsed.comment,
                    fingerprint=parsed.fingerprint, bits=parsed.bits,
                )  # fmt: skip
        except IntegrityError:  # the same key added concurrently
            raise ValidationFailed(
                f"this key ({parsed.fingerprint}) is already on your team", field=_FIELD
            ) from None


def ssh_key_delete(*, team: Team, key_id: int) -> None:
    """Remove one of the team's keys (any member may); rentals started later no longer let it
    in (running ones keep the keys they started with). Another team's key id is not found."""
    deleted, _ = selectors.ssh_key_scope(team=team).filter(pk=key_id).delete()
    if not deleted:
        raise NotFound("no such SSH key")
