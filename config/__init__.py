"""Project configuration: settings from the environment, URLs, the Celery app, WSGI/ASGI."""

from config.celery import app as celery_app

__all__ = ["celery_app"]
