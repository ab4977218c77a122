"""Structured logs for the agent: one `key=value` line (logfmt, the default) or one JSON
object (`--log-format json`, rendered by structlog) per event on stderr.

The message is the event; context travels in `extra={...}` (the runtime drivers log the same
way), so journald, Loki or grep can filter on `run_id=...` without parsing prose.
"""

from __future__ import annotations

import logging
import sys
import time

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def _value(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=info logger=... msg="..." key=value ...`"""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_value(record.getMessage())}",
        ]
        fields += [
            f"{key}={_value(value)}"
            for key, value in record.__dict__.items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        if record.exc_info:
            fields.append(f"exc={_value(self.formatException(record.exc_info))}")
        return " ".join(fields)


def _json_formatter() -> logging.Formatter:
    import structlog

    return structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        foreign_pre_chain=[
            # The node id, bound once the agent has joined (see Agent.run).
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.ExtraAdder(),
        ],
    )


def configure_logging(level: str = "info", *, log_format: str = "logfmt") -> None:
    """Route every logger (ours, the runtime drivers', urllib3's) to stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_json_formatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
