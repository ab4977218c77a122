"""Text that came from a container or an agent: bounded before it is parsed, cleaned before it is
forwarded or stored.

A container prints whatever it likes, and an agent sends whatever it likes; both ends use these
checks, so a line the agent forwards as a metric is one the server accepts, and a line the server
refuses is one no honest agent sends. Standard library only, like the messages.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from agentprotocol import ProtocolError

METRIC_LINE_MAX_BYTES = 4096
# A metric line is an object of scalars with a few nested objects (the harness's `config` in its
# start line, `eval` in its summary): four levels hold all of them.
METRIC_MAX_DEPTH = 4
METRIC_MAX_KEYS = 64
# Past 2^53 a float cannot say which integer it was; past 1e18 no training figure is honest.
_MAX_INT = 1 << 53
_MAX_ABS_FLOAT = 1e18
# The harness's figures, each a number in a range; any other key takes the generic bounds above.
# A field out of its range refuses the whole line: half a metric would mislead.
_STEP_MAX = (1 << 31) - 1
_METRIC_FIELDS: dict[str, tuple[float, float]] = {
    "step": (0, _STEP_MAX),
    "steps": (0, _STEP_MAX),
    "start_step": (0, _STEP_MAX),
    "steps_this_run": (0, _STEP_MAX),
    "loss": (-1e12, 1e12),
    "final_loss": (-1e12, 1e12),
    "lr": (0, 1e6),
    "grad_norm": (0, 1e15),
    "accuracy": (0, 1),
    "mfu": (0, 10),
    "samples_per_s": (0, 1e12),
    "tokens_per_s": (0, 1e12),
    "time": (0, 1e10),
}
_INTEGER_FIELDS = frozenset({"step", "steps", "start_step", "steps_this_run"})

# C0 controls but tab, newline and carriage return; DEL; and lone surrogates (a JSON "\ud800"
# decodes to one, and no database or UTF-8 encoder takes it).
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
# A JSON string, written as "unrolled loop" (runs of plain characters between escapes): the same
# strings as `"(?:[^"\\]|\\.)*"`, matched a run at a time instead of a character at a time, which
# took ten times longer than parsing a heartbeat.
_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_OPENING = frozenset(b"[{")


def text_sanitize(text: str) -> str:
    """`text` with control characters (NUL first of all) and lone surrogates replaced by U+FFFD:
    every string the agent forwards and the server stores from a container passes here."""
    return _UNSAFE.sub("\ufffd", text)


def json_depth(document: str | bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, found without parsing it.

    Parsers recurse once per level, so a line of 100,000 `[` costs them the stack; this scan
    does not recurse. Brackets inside strings do not count; on text that is not JSON at all the
    count errs high, and the parser refuses that text anyway.
    """
    if isinstance(document, str):
        # Quotes, backslashes and brackets are ASCII, which no other character's UTF-8 holds.
        document = document.encode(errors="surrogatepass")
    depth = deepest = 0
    for char in _STRING_BYTES.sub(b"", document).translate(None, _NOT_BRACKETS):
        if char in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _openings(document: str | bytes) -> int:
    """How many `[` and `{` the text holds, strings included: no nesting is deeper, so a text
    with few of them (a heartbeat has about ten) needs no scan."""
    if isinstance(document, bytes):
        return document.count(b"[") + document.count(b"{")
    return document.count("[") + document.count("{")


def json_loads_bounded(document: str | bytes, *, max_depth: int) -> Any:
    """json.loads for untrusted text: nesting past `max_depth` and NaN/Infinity are refused with
    a ValueError before the parser could recurse on them or store them."""
    if _openings(document) > max_depth and json_depth(document) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return json.loads(document, parse_constant=_refuse_constant)


def _check_value(value: Any, path: str) -> None:
    if isinstance(value, str):
        if _UNSAFE.search(value):
            raise ProtocolError("metric line", path, "control character in a string")
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if abs(value) > _MAX_INT:
            raise ProtocolError("metric line", path, f"integer beyond {_MAX_INT}")
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > _MAX_ABS_FLOAT:
            raise ProtocolError("metric line", path, f"number beyond {_MAX_ABS_FLOAT:g}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_value(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_value(key, f"{path}.(key)")
            _check_value(item, f"{path}.{key[:40]}")


def metric_line_parse(line: str) -> dict[str, Any]:
    """The JSON object a metric line holds, checked: at most METRIC_LINE_MAX_BYTES and
    METRIC_MAX_DEPTH levels, no NaN or Infinity, no control characters in strings, every number
    bounded and the harness's figures (step, loss, throughput) in their ranges.

    Raises ProtocolError naming what is wrong; a line that does not start with `{` is plain
    output, not a metric, and is refused too (callers tell the two apart by that first byte).
    """
    if not line.startswith("{"):
        raise ProtocolError("metric line", "line", "not a JSON object")
    too_long = len(line) > METRIC_LINE_MAX_BYTES  # checked first: a 1 MB line is not encoded
    if too_long or len(line.encode(errors="surrogatepass")) > METRIC_LINE_MAX_BYTES:
        raise ProtocolError("metric line", "line", f"longer than {METRIC_LINE_MAX_BYTES} bytes")
    try:
        data = json_loads_bounded(line, max_depth=METRIC_MAX_DEPTH)
    except ValueError as exc:
        raise ProtocolError("metric line", "line", str(exc)[:200]) from None
    if not isinstance(data, dict):
        raise ProtocolError("metric line", "line", "not a JSON object")
    if len(data) > METRIC_MAX_KEYS:
        raise ProtocolError("metric line", "line", f"more than {METRIC_MAX_KEYS} keys")
    _check_value(data, "line")
    for name, (low, high) in _METRIC_FIELDS.items():
        if name not in data or data[name] is None:
            continue
        value = data[name]
        wanted = int if name in _INTEGER_FIELDS else (int, float)
        if isinstance(value, bool) or not isinstance(value, wanted) or not low <= value <= high:
            raise ProtocolError("metric line", name, f"must be a number from {low:g} to {high:g}")
    return data


# Secret values are blanked out of what a run prints before it is forwarded (the agent) and
# again before it is stored (the server, which does not trust the agent to have done it).
MASK = "****"
# A value shorter than this is not masked: it would blank ordinary words and digits.
MIN_MASKED_CHARS = 4


def mask_terms(values: Iterable[str]) -> tuple[str, ...]:
    """What to blank out of a run's output for these secret values: each value, each of its
    lines (a key printed line by line) and its JSON-escaped form (a value inside a printed JSON
    document), longest first so that a value is never half masked by a shorter one."""
    terms: set[str] = set()
    for value in values:
        candidates = {value, *value.splitlines(), json.dumps(value)[1:-1]}
        terms.update(t for t in (c.strip() for c in candidates) if len(t) >= MIN_MASKED_CHARS)
    return tuple(sorted(terms, key=lambda t: (-len(t), t)))


def secrets_mask(text: str, terms: Sequence[str]) -> str:
    """`text` with every term (mask_terms) replaced by MASK."""
    for term in terms:
        if term in text:
            text = text.replace(term, MASK)
    return text
