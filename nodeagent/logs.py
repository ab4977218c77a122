"""Structured logs for the agent: one `key=value` line per event on stderr.

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


def configure_logging(level: str = "info") -> None:
    """Route every logger (ours, the runtime drivers', urllib3's) to stderr as key=value."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
