"""The drawing of a rental's states in docs/architecture.md is the lifecycle's table: every edge
drawn is allowed, and every allowed edge is drawn."""

from __future__ import annotations

import re
from pathlib import Path

from marketplace.lifecycle import ALLOWED_TRANSITIONS, TERMINAL

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
EDGE = re.compile(r"^\s*(\[\*\]|\w+) --> (\[\*\]|\w+)(?::.*)?$")


def _drawn() -> set[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    block = text.split("```mermaid", 1)[1].split("```", 1)[0]
    return {m.groups() for line in block.splitlines() if (m := EDGE.match(line))}


def test_the_drawn_edges_are_the_allowed_transitions():
    drawn = _drawn()
    allowed = {(str(a), str(b)) for a, targets in ALLOWED_TRANSITIONS.items() for b in targets}
    between_states = {(a, b) for a, b in drawn if "[*]" not in (a, b)}
    assert between_states == allowed


def test_the_drawing_starts_pending_and_ends_at_each_terminal_state():
    drawn = _drawn()
    assert {b for a, b in drawn if a == "[*]"} == {"pending"}
    assert {a for a, b in drawn if b == "[*]"} == {str(s) for s in TERMINAL}
