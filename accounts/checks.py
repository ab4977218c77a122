"""System checks of the accounts app: the hooks the apps above it must hand over."""

from django.core.checks import Error, register


@register()
def hooks_are_registered(app_configs, **kwargs):
    """Billing hands sign-up its onboarding when ready; without it a new account would have no
    billing account and no sign-up credit."""
    from accounts.signup import MISSING_SIGNUP_ONBOARD, signup_onboard_registered

    if signup_onboard_registered():
        return []
    return [Error(MISSING_SIGNUP_ONBOARD, id="accounts.E001")]
