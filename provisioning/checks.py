"""Start-up checks of the provisioning settings: a bad value fails `manage.py check`, not every
heartbeat."""

from django.conf import settings
from django.core.checks import Error, register

from provisioning.ratelimit import parse_rate


@register()
def agent_rate_is_valid(app_configs, **kwargs):
    rate = settings.REST_FRAMEWORK.get("DEFAULT_THROTTLE_RATES", {}).get("agent")
    try:
        parse_rate(str(rate))
    except ValueError as exc:
        return [Error(str(exc), hint="set AGENT_THROTTLE_RATE to N/s, N/min, N/hour or N/day",
                      id="provisioning.E001")]  # fmt: skip
    return []
