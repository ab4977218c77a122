"""Request rates for the customer API: per account once signed in, per client address before.

Rates are read from `REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]` at each request (DRF binds them
once at import), and the address is `guards.client_ip`, the same one the sign-in lockout uses."""

from __future__ import annotations

from rest_framework.settings import api_settings
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle

from marketplace.api.guards import client_ip


class _RatesFromSettings:
    scope: str

    def get_rate(self) -> str | None:
        return api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)

    def get_ident(self, request) -> str:
        return client_ip(request)


class CustomerAnonThrottle(_RatesFromSettings, AnonRateThrottle):
    scope = "anon"


class CustomerUserThrottle(_RatesFromSettings, UserRateThrottle):
    scope = "user"
