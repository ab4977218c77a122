from django.apps import AppConfig


class MarketplaceConfig(AppConfig):
    name = "marketplace"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from marketplace import checks, schema  # noqa: F401 - start-up checks, OpenAPI auth schemes
