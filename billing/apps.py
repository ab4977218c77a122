from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Models are loaded only now. The marketplace cannot import billing (billing depends
        # on it), so billing hands it the funds hold that guards every new rental.
        from accounts.signup import signup_onboard_register
        from billing.services import customer_signup, funds_hold_create
        from marketplace.services.rentals import funds_hold_register

        funds_hold_register(funds_hold_create)
        # Likewise the accounts app, below billing, is handed what a new sign-up gets.
        signup_onboard_register(customer_signup)
