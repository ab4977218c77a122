"""Request rates for the customer API: per account once signed in, per client address before.

Rates are read from `REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]` at each request (DRF binds them
once at import), and the address is `guards.client_ip`, the same one the sign-in lockout uses.

The counters are core.ratelimit's (one atomic Redis round trip a request, on the request
path's client). When Redis cannot be reached the request is let through and the failure logged:
a Redis outage must not turn every API call into a 500 (PostgreSQL, not Redis, holds the state a
request changes).
"""

from __future__ import annotations

from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

from core import ratelimit
from core.api.guards import client_ip
from core.redis_clients import redis_clients


class RateThrottle(BaseThrottle):
    """One rate per scope, counted per identity (None: this throttle does not apply)."""

    scope: str  # names the rate
    counter: str | None = None  # names the counters, when not the scope
    _wait: float | None = None

    def ident(self, request) -> str | None:
        raise NotImplementedError

    def allow_request(self, request, view) -> bool:
        rate = api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)
        ident = self.ident(request)
        if rate is None or ident is None:
            return True
        clients = redis_clients()
        self._wait = ratelimit.hit(
            clients.hot(),
            scope=self.counter or self.scope,
            ident=ident,
            rate=rate,
            on_error=clients.hot_failed,
        )
        return self._wait is None

    def wait(self) -> float | None:
        return self._wait


class CustomerAnonThrottle(RateThrottle):
    """Requests without an account, per client address."""

    scope = "anon"

    def ident(self, request) -> str | None:
        if request.user and request.user.is_authenticated:
            return None
        return client_ip(request)


class CustomerUserThrottle(RateThrottle):
    """Requests of a signed-in account (token or session), whichever address they come from."""

    scope = "user"

    def ident(self, request) -> str | None:
        if request.user and request.user.is_authenticated:
            return f"user-{request.user.pk}"
        return None
