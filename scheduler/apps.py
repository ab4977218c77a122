from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"
    default_auto_field = "django.db.models.BigAutoField"
