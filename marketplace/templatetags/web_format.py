"""Display filters the web pages share: shell commands as a person copies them, a cluster's
fabric as a customer reads it."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from django import template

from marketplace.models import interconnect_label

register = template.Library()

# A command that fits this many characters on one line stays on one line.
ONE_LINE = 80


@register.filter
def shell_command(argv: Sequence[str] | str | None) -> str:
    """An argument vector as a shell command line a person can paste: every argument quoted as
    the shell needs, the line breaks inside an argument kept, and a long command broken before
    each option with backslash continuations (the same layout as the pages' shellCommand)."""
    if not argv:
        return ""
    if isinstance(argv, str):
        return argv
    words = [shlex.quote(str(arg)) for arg in argv]
    one_line = " ".join(words)
    if len(one_line) <= ONE_LINE and "\n" not in one_line:
        return one_line
    return CONTINUATION.join(_option_lines(words))


CONTINUATION = " \\\n  "


def _option_lines(words: list[str]) -> list[str]:
    """The words grouped a line per option: an option and the values after it share a line."""
    lines = [words[0]]
    for word in words[1:]:
        if word.startswith("-"):
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    return lines


# The agent's flags for a development machine without NVIDIA GPUs (see nodeagent/config.py):
# the local-process runtime, no GPU devices, simulated GPUs and their telemetry, and its state,
# volumes and run records in writable directories under the working directory (the defaults
# are under /var/lib).
SIMULATED_HOST_FLAGS = [
    "--runtime", "process", "--gpu-mode", "none",
    "--telemetry", "simulated", "--simulate-gpus", "rtx4090-24gb:2",
    "--state-dir", ".var/dev/agent",
    "--volume-root", ".var/dev/volumes",
    "--process-dir", ".var/dev/runs",
]  # fmt: skip


@register.simple_tag
def simulated_host_flags() -> str:
    """The flags above as continuation lines to follow an agent command, one option a line as
    shell_command lays out a long command."""
    return CONTINUATION.join(_option_lines([shlex.quote(flag) for flag in SIMULATED_HOST_FLAGS]))


@register.filter(name="interconnect_label")
def interconnect_label_filter(kind: str, gbps: int) -> str:
    """A cluster's fabric as customers read it: "InfiniBand 400 Gb/s"."""
    return interconnect_label(kind, gbps)
