from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Models are loaded only now. The marketplace cannot import billing (billing depends
        # on it), so billing hands it the funds hold that guards every new rental.
        from billing.services import funds_hold_create
        from marketplace.services.rentals import funds_hold_register

        funds_hold_register(funds_hold_create)
