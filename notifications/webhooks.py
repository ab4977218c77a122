"""The webhook channel: where a URL may point, how a body is signed, the POST itself.

Signing follows Stripe's scheme: the receiver gets the event id, a Unix timestamp and
`v1=<hex HMAC-SHA256 of "<timestamp>.<body>">` under the owner's secret, so it can check the
body, refuse old timestamps (replays) and drop a second delivery of the same event id.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass

import requests
from django.conf import settings
from django.utils.crypto import salted_hmac

from core.errors import ValidationFailed
from core.untrusted_text import url_parse

EVENT_HEADER = "X-Gpumarket-Event-Id"
TIMESTAMP_HEADER = "X-Gpumarket-Timestamp"
SIGNATURE_HEADER = "X-Gpumarket-Signature"
USER_AGENT = "gpumarket-webhooks/1"
URL_MAX_LENGTH = 500

_FIELD = "webhook_url"


class UnsafeUrl(ValidationFailed):
    """The URL may not receive webhooks: a 400 naming the field when it is set, a permanent
    failure when a delivery finds it (DNS can change after the URL was accepted)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field=_FIELD)


class UnresolvableHost(UnsafeUrl):
    """The host name does not resolve now: refused when set, retried when delivering."""


def _allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address, *, loopback: bool) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if loopback and address.is_loopback:
        return True
    # is_global leaves out private, loopback, link-local (cloud metadata at 169.254.169.254),
    # carrier-grade NAT, documentation and reserved ranges.
    return address.is_global and not address.is_multicast


def _addresses(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UnresolvableHost(f"the host {host!r} does not resolve") from exc
    return [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]


def webhook_url_check(url: str) -> str:
    """The URL, if webhooks may be sent to it; else UnsafeUrl naming the field.

    https only, to public addresses only (no private, loopback, link-local or metadata
    addresses: the server must not be made to call its own network). With
    NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK (development and tests) http and loopback addresses
    are accepted too, and nothing else private.
    """
    loopback = settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK
    if len(url) > URL_MAX_LENGTH:
        raise UnsafeUrl(f"at most {URL_MAX_LENGTH} characters")
    try:
        parts = url_parse(url, field="webhook_url")
    except ValidationFailed as exc:
        raise UnsafeUrl(exc.message) from None
    if parts.has_credentials:
        raise UnsafeUrl("no credentials in the URL; check the signature instead")
    if parts.scheme == "http" and not loopback:
        raise UnsafeUrl("webhooks are sent over https only")
    addresses = _addresses(parts.host, parts.port)
    refused = [a for a in addresses if not _allowed(a, loopback=loopback)]
    if refused or not addresses:
        raise UnsafeUrl(
            f"{parts.host} is a private, loopback or reserved address; "
            "webhooks go to public addresses only"
        )
    if parts.scheme == "http" and not all(a.is_loopback for a in addresses):
        raise UnsafeUrl("webhooks are sent over https only (http to this machine in development)")
    return url


def webhook_secret(salt: str) -> str:
    """The signing secret an owner's salt stands for (shown to the owner once, on rotation)."""
    digest = salted_hmac("notifications.webhook-secret", salt, algorithm="sha256").hexdigest()
    return f"whsec_{digest}"


def signature(*, secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def body_encode(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class PostResult:
    status_code: int

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


def webhook_post(
    *, url: str, secret: str, event_id: str, timestamp: int, body: bytes
) -> PostResult:
    """POST one signed body. Redirects are not followed (one could lead to a private address);
    a network error raises requests.RequestException (retryable)."""
    webhook_url_check(url)
    response = requests.post(
        url,
        data=body,
        headers={
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            EVENT_HEADER: event_id,
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: signature(secret=secret, timestamp=timestamp, body=body),
        },
        timeout=(
            settings.NOTIFICATIONS_WEBHOOK_CONNECT_TIMEOUT_S,
            settings.NOTIFICATIONS_WEBHOOK_READ_TIMEOUT_S,
        ),
        allow_redirects=False,
        # The receiver's answer body is never read: only its status counts.
        stream=True,
    )
    response.close()
    return PostResult(status_code=response.status_code)
