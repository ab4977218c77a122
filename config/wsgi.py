"""WSGI entry point (gunicorn config.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")
application = get_wsgi_application()
# The URL configuration (and with it every view module) is imported here, when the worker
# starts, not by its first request: about 0.2 s that request would wait.
get_resolver().url_patterns  # noqa: B018
