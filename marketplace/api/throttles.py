"""Request rates for the customer API: per account once signed in, per client address before.

Rates are read from `REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]` at each request (DRF binds them
once at import), and the address is `guards.client_ip`, the same one the sign-in lockout uses.

The counters live in the cache (Redis). When it cannot be reached the request is let through
and the failure logged: a Redis outage must not turn every API call into a 500 (PostgreSQL, not
Redis, holds the state a request changes)."""

from __future__ import annotations

import logging

from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

from marketplace.api.guards import client_ip

log = logging.getLogger(__name__)


class _RatesFromSettings:
    scope: str

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_ident(self, request) -> str:
        return client_ip(request)

    def allow_request(self, request, view) -> bool:
        try:
            return super().allow_request(request, view)  # type: ignore[misc]
        except Exception as exc:  # the cache backend's own errors (redis-py's, say)
            log.warning("API throttle skipped, its cache is unreachable: %s", exc)
            return True


class CustomerAnonThrottle(_RatesFromSettings, AnonRateThrottle):
    scope = "anon"


class CustomerUserThrottle(_RatesFromSettings, UserRateThrottle):
    scope = "user"
