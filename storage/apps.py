from django.apps import AppConfig


class StorageConfig(AppConfig):
    name = "storage"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The marketplace cannot import this app (it depends on the marketplace), so the app
        # hands rental_create the service that links a new rental to the datasets it reads.
        from marketplace.services.rentals import datasets_attach_register
        from storage.services import rental_datasets_attach

        datasets_attach_register(rental_datasets_attach)
