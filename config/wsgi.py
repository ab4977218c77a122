"""WSGI entry point (gunicorn config.wsgi)."""

import os

from django.conf import settings
from django.core.wsgi import get_wsgi_application
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")
_site = get_wsgi_application()

from provisioning.admission import HeartbeatAdmission  # noqa: E402  (the apps are loaded now)


class AgentAPIHandler(type(_site)):
    """Django's handler with settings.AGENT_MIDDLEWARE instead of settings.MIDDLEWARE: the agent
    API's requests (a node token, no cookie, no browser) skip the browser's middleware."""

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler builds its chain from settings.MIDDLEWARE alone. This runs once, as the
        # module is imported and before any request, so no request sees the swap.
        site_middleware = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.AGENT_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = site_middleware


# Heartbeats past this process's bound are refused before any work (provisioning.admission).
agent_api = HeartbeatAdmission(
    AgentAPIHandler(), bound=settings.GPUMARKET["AGENT_HEARTBEATS_IN_FLIGHT"]
)
_AGENT_API_PREFIX = settings.AGENT_API_PREFIX


def application(environ, start_response):
    if environ.get("PATH_INFO", "").startswith(_AGENT_API_PREFIX):
        return agent_api(environ, start_response)
    return _site(environ, start_response)


# The URL configuration (and with it every view module) is imported here, when the worker
# starts, not by its first request: about 0.2 s that request would wait.
get_resolver().url_patterns  # noqa: B018
