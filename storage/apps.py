from django.apps import AppConfig


class StorageConfig(AppConfig):
    name = "storage"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The marketplace cannot import this app (it depends on the marketplace), so the app
        # hands rental_create the service that links a new rental to the datasets it reads.
        from marketplace.lifecycle import last_checkpoint_lookup_register
        from marketplace.services.rentals import datasets_attach_register
        from storage.selectors import rental_last_checkpoint_at
        from storage.services import rental_datasets_attach

        datasets_attach_register(rental_datasets_attach)
        # A node-fault ending credits the GPU time since the rental's last synced checkpoint.
        last_checkpoint_lookup_register(rental_last_checkpoint_at)
