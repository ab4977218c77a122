"""The one guard against odd input, in front of every view.

PostgreSQL refuses a NUL character in text and JSONB, Python's JSON parser recurses once per
nesting level, and a body read in full is held in memory: each would otherwise surface as a 500 (or
worse) somewhere deep in a view. So before any view runs, the middleware refuses a NUL in the path,
the query string or a header, and the JSON parser refuses a body that is too big, nested too
deeply or carries a NUL in any string (key or value). Each refusal names what it refused.

The client's address is decided here too, once: proxies are trusted only when configured, so a
client cannot pick its own address for the sign-in lockout or the throttles by sending
`X-Forwarded-For`.
"""

from __future__ import annotations

import ipaddress
import json
from functools import lru_cache

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError, ValidationError
from rest_framework.parsers import JSONParser

NUL = "\x00"
NUL_MESSAGE = "NUL characters are not allowed"


class PayloadTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"


def _max_body_bytes() -> int:
    return settings.API_MAX_BODY_BYTES


def _max_depth() -> int:
    return settings.API_MAX_JSON_DEPTH


def _first_problem(value: object) -> tuple[str, str] | None:
    """The first NUL or too-deep place in a parsed document, as (dotted path, message).

    Walked with an explicit stack, so a document deep enough to trouble Python's recursion limit is
    measured, not followed."""
    limit = _max_depth()
    stack: list[tuple[object, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict | list) and len(path) >= limit:  # the document is level 1
            return ".".join(path), f"nested more than {limit} levels deep"
        if isinstance(node, str):
            if NUL in node:
                return ".".join(path), NUL_MESSAGE
        elif isinstance(node, dict):
            for key, child in node.items():
                if NUL in key:
                    return ".".join((*path, key.replace(NUL, "\\u0000"))), NUL_MESSAGE
                stack.append((child, (*path, key)))
        elif isinstance(node, list):
            stack.extend((child, (*path, str(i))) for i, child in enumerate(node))
    return None


def _refusal(path: str, message: str, *, in_object: bool = False) -> ValidationError:
    """A 400 naming the place: `{"runtime": ["... (at runtime.env.A)"]}` for a field of an
    object, `body` for the document itself or a document that is not an object."""
    field = path.partition(".")[0] if in_object else ""
    return ValidationError({field or "body": [f"{message} (at {path})" if path else message]})


class GuardedJSONParser(JSONParser):
    """JSON with a size limit, a depth limit and no NUL anywhere; the API's only parser."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = _max_body_bytes()
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            data = json.loads(raw.decode(encoding), parse_constant=_refuse_constant)
        except RecursionError as exc:
            raise _refusal("", f"nested more than {_max_depth()} levels deep") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from exc
        problem = _first_problem(data)
        if problem is not None:
            raise _refusal(*problem, in_object=isinstance(data, dict))
        return data


def _refuse_constant(name: str):
    # NaN and Infinity are not JSON, and no column holds them.
    raise ValueError(f"{name} is not a number JSON allows")


@lru_cache(maxsize=8)
def _networks(spec: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(s, strict=False) for s in spec)


def _is_trusted(address: str) -> bool:
    networks = _networks(tuple(settings.TRUSTED_PROXIES))
    if not networks:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


# Where the answer is kept once decided: the middleware rewrites REMOTE_ADDR with it, and a later
# call must not read that rewritten address as the peer and consult X-Forwarded-For again.
_RESOLVED = "gpumarket.client_ip"


def client_ip(request: HttpRequest) -> str:
    """The client's address: `REMOTE_ADDR`, unless the peer is one of `TRUSTED_PROXIES`; then the
    right-most `X-Forwarded-For` hop that is not a trusted proxy (the hops left of it were written
    by the client and prove nothing). The sign-in lockout and the throttles both use this."""
    meta = request.META
    if _RESOLVED in meta:
        return meta[_RESOLVED]
    peer = meta.get("REMOTE_ADDR", "")
    address = peer
    hops = [h.strip() for h in meta.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
    for hop in reversed(hops if _is_trusted(peer) else []):
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            break
        address = hop
        if not _is_trusted(hop):
            break
    meta[_RESOLVED] = address
    return address


def _nul_refusal(where: str) -> JsonResponse:
    return JsonResponse(
        {where: [NUL_MESSAGE], "detail": f"{where}: {NUL_MESSAGE}", "code": "invalid"},
        status=status.HTTP_400_BAD_REQUEST,
    )


class RequestGuardMiddleware:
    """Refuses a NUL in the path, a query parameter or a header before any view sees it (400
    naming the parameter), and sets `REMOTE_ADDR` to `client_ip(request)` so that everything
    downstream (DRF's throttles, logs) reads one answer."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if NUL in request.path_info:
            return _nul_refusal("path")
        for key, values in request.GET.lists():
            if NUL in key:
                return _nul_refusal("query")
            if any(NUL in v for v in values):
                return _nul_refusal(key)
        for key, value in request.META.items():
            if key.startswith("HTTP_") and isinstance(value, str) and NUL in value:
                return _nul_refusal(key[5:].lower().replace("_", "-"))
        request.META["REMOTE_ADDR"] = client_ip(request)
        response = self.get_response(request)
        _unread_body_drain(request)
        return response


# The most of a request body left unread that is read and dropped before the answer: the server
# (gunicorn) itself drains only 64 KiB and otherwise closes the connection after a keep-alive
# answer, which a client that sends its next request on it sees as a dropped request.
DRAIN_MAX_BYTES = 64 << 20


def _unread_body_drain(request: HttpRequest) -> None:
    """Read and drop what the view did not read of the request's body (a 401, 404 or 413 that
    answered without parsing), so the connection stays in step for the next request."""
    if hasattr(request, "_body"):
        return  # read whole already (the parsers read it through `request.body`)
    left = DRAIN_MAX_BYTES
    try:
        while left > 0:
            chunk = request.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)
    except (OSError, ValueError):
        return  # the client went away, or the body was consumed another way
