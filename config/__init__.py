"""Project configuration: settings from the environment, URLs, the Celery app, WSGI/ASGI."""

from config import checks  # noqa: F401  (registers the Celery start-up check with Django)
from config.celery import app as celery_app

__all__ = ["celery_app"]
