"""Structured logs with structlog: one JSON object per line (LOG_FORMAT=json) or a readable
console line (LOG_FORMAT=console), for structlog's loggers and the standard library's alike
(Django, Celery, gunicorn), each carrying the context bound for the request: request_id, and
rental_id or node_id where the view knows them.
"""

from __future__ import annotations

import re
import uuid

import structlog
from django.http import HttpRequest, HttpResponse

# Taken from the client or the proxy only when it looks like an id: a log line is no place for
# an attacker's text.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def logging_config(*, log_format: str, level: str) -> dict:
    """The LOGGING dict for Django settings; also configures structlog to hand its events to it."""
    if log_format not in ("json", "console"):
        raise ValueError(f"LOG_FORMAT must be json or console, not {log_format!r}")
    structlog.configure(
        processors=[
            *_SHARED,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "structured": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": [
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    renderer,
                ],
                # Records from the standard library (Django, Celery) get the same fields.
                "foreign_pre_chain": [*_SHARED, structlog.stdlib.ExtraAdder()],
            }
        },
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {"django.db.backends": {"level": "WARNING"}},
    }


class RequestIdMiddleware:
    """Takes X-Request-ID from the client or proxy (or makes one), binds it, with the rental id
    of rental URLs, to every log line of the request, and returns it in the response."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        given = request.headers.get("X-Request-ID", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            response = self.get_response(request)
        finally:
            structlog.contextvars.clear_contextvars()
        response["X-Request-ID"] = request_id
        return response

    def process_view(self, request, view_func, view_args, view_kwargs):
        rental_id = view_kwargs.get("rental_id")
        if rental_id is not None:
            structlog.contextvars.bind_contextvars(rental_id=str(rental_id))
        return None
