"""Start-up checks: a bad request rate, or a hook another app must hand the marketplace (billing's
funds hold, the notifications' event recorder, storage's datasets attach), fails `manage.py check`
and every process's start instead of failing open at the first request."""

from django.conf import settings
from django.core.checks import Error, register

from core.ratelimit import parse_rate

# Each rate's setting, as the error's hint names it.
_RATE_SETTINGS = {
    "agent": "AGENT_THROTTLE_RATE",
    "agent_unverified": "AGENT_UNVERIFIED_THROTTLE_RATE",
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


@register()
def hooks_are_registered(app_configs, **kwargs):
    """The apps above the marketplace hand it these when they are ready; without them a
    rental would hold no funds, a transition notify nobody, or a rental not read its datasets."""
    from marketplace.lifecycle import (
        MISSING_CHECKPOINT_LOOKUP,
        MISSING_EVENT_RECORDER,
        checkpoint_lookup_registered,
        event_recorder_registered,
    )
    from marketplace.services.rentals import (
        MISSING_DATASETS_ATTACH,
        MISSING_FUNDS_HOLD,
        datasets_attach_registered,
        funds_hold_registered,
    )

    errors = []
    if not funds_hold_registered():
        errors.append(Error(MISSING_FUNDS_HOLD, id="marketplace.E002"))
    if not event_recorder_registered():
        errors.append(Error(MISSING_EVENT_RECORDER, id="marketplace.E003"))
    if not datasets_attach_registered():
        errors.append(Error(MISSING_DATASETS_ATTACH, id="marketplace.E004"))
    if not checkpoint_lookup_registered():
        errors.append(Error(MISSING_CHECKPOINT_LOOKUP, id="marketplace.E005"))
    return errors
