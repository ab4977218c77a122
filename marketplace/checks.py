"""Start-up checks of the request rates: a bad value fails `manage.py check`, not every request."""

from django.conf import settings
from django.core.checks import Error, register

from marketplace.ratelimit import parse_rate

# Each rate's setting, as the error's hint names it.
_RATE_SETTINGS = {
    "agent": "AGENT_THROTTLE_RATE",
    "user": "API_USER_THROTTLE_RATE",
    "anon": "API_ANON_THROTTLE_RATE",
}


@register()
def rates_are_valid(app_configs, **kwargs):
    rates = settings.REST_FRAMEWORK.get("DEFAULT_THROTTLE_RATES", {})
    errors = []
    for scope, name in _RATE_SETTINGS.items():
        try:
            parse_rate(str(rates.get(scope)))
        except ValueError as exc:
            errors.append(
                Error(f"{scope}: {exc}", hint=f"set {name} to N/s, N/min, N/hour or N/day",
                      id="marketplace.E001")
            )  # fmt: skip
    return errors
