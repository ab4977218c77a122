from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from provisioning import checks  # noqa: F401  (registers the start-up checks)
