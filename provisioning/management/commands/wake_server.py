"""Run the wake server: `manage.py wake_server [--host H] [--port P]` (provisioning.wakeserver).

It reads the settings for the SECRET_KEY (tickets), REDIS_URL and WAKE_CHANNEL only, never the
database. Access logs are off: 10,000 agents re-poll about 400 times a second.
"""

from __future__ import annotations

import logging
import resource

from aiohttp import web
from django.conf import settings
from django.core.management.base import BaseCommand

from core.wake import wake_settings
from provisioning.wakeserver import wake_app


def _raise_open_files_limit() -> int:
    """Each waiting agent holds a socket: take the hard limit on open files as the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1_048_576 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            return soft
    return soft


class Command(BaseCommand):
    help = "Serve the agents' wake-up long-polls (one Redis channel, no database)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8001)

    def handle(self, *args, host: str, port: int, **options):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        config = wake_settings()
        files = _raise_open_files_limit()
        app = wake_app(
            redis_url=settings.REDIS_URL,
            channel=config["channel"],
            keep_s=config["ticket_ttl_s"],
        )
        self.stdout.write(
            f"wake server on http://{host}:{port}/ channel={config['channel']} open_files={files}"
        )
        self.stdout.flush()
        web.run_app(
            app,
            host=host,
            port=port,
            access_log=None,
            print=None,
            backlog=4096,
            handler_cancellation=True,  # a poll whose agent went away stops waiting at once
            shutdown_timeout=5,  # the polls are answered at shutdown; this bounds the rest
        )
