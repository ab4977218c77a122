"""The CLI's argument parser: help laid out as argparse lays it out, and a call that imports
nothing it does not use (each import is paid on every `gpumarket` call)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marketplace import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("columns", ["44", "120", ""])
def test_help_is_laid_out_as_argparses_own_formatter_lays_it_out(monkeypatch, columns):
    # Given a terminal width (or none: the terminal's, else 80)
    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.setattr(cli._Parser, "_width", None)
    parser = cli.build_parser()
    rent = parser._subparsers._group_actions[0].choices["rent"]
    ours = (parser.format_help(), rent.format_help())

    # When argparse's own formatter (which asks shutil for the width) lays out the same parsers
    monkeypatch.setattr(cli._Parser, "_get_formatter", argparse.ArgumentParser._get_formatter)

    # Then the help reads the same
    assert (parser.format_help(), rent.format_help()) == ours


def test_a_call_imports_neither_shutil_nor_the_compression_modules():
    code = (
        "import sys; from marketplace.cli import build_parser;"
        " build_parser().parse_args(['rent', '--gpus', '1', '--image', 'img']);"
        " print(sorted(m for m in ('shutil', 'bz2', 'lzma') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), capture_output=True,
        text=True, check=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "[]"
