"""The CLI's argument parser: help laid out as argparse lays it out, and a line parsed without
importing what it does not use (each import is paid on every `gpumarket` call, `--help` and a
refused line included; requests comes only with a call to the server)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpumarket_cli import main as cli

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


def test_parsing_a_line_imports_neither_requests_nor_shutil_nor_compression():
    code = (
        "import sys; from gpumarket_cli.main import build_parser;"
        " build_parser().parse_args(['rent', '--gpus', '1', '--image', 'img']);"
        " print(sorted(m for m in ('shutil', 'bz2', 'lzma', 'requests') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ), capture_output=True,
        text=True, check=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "[]"


# Each command of the CLI with the least it needs, one word per argument (`--flag=value`); a
# command added without a line here fails the test below, so every command's parser is tried.
COMMANDS = {
    "offers": ["offers"],
    "advise": ["advise", "--tokens-b=1"],
    "book": ["book", "--tokens-b=1", "--plan=a100-sxm4-40gb:1x8"],
    "rent": ["rent", "--gpus=1", "--image=img", "train"],
    "ssh-key add": ["ssh-key", "add", "key.pub"],
    "ssh-key ls": ["ssh-key", "ls"],
    "ssh-key rm": ["ssh-key", "rm", "3"],
    "ssh-command": ["ssh-command", "RID"],
    "secret set": ["secret", "set", "HF_TOKEN", "--from-file", "token.txt"],
    "secret ls": ["secret", "ls"],
    "secret rm": ["secret", "rm", "HF_TOKEN"],
    "jupyter": ["jupyter", "RID"],
    "rentals": ["rentals"],
    "show": ["show", "RID"],
    "metrics": ["metrics", "RID"],
    "stop": ["stop", "RID"],
    "cancel": ["cancel", "RID"],
    "template save": ["template", "save", "NAME", "train", "--image=img", "--env=A=1"],
    "template ls": ["template", "ls"],
    "template show": ["template", "show", "NAME"],
    "template rm": ["template", "rm", "NAME"],
    "data push": ["data", "push", "PATH"],
    "data ls": ["data", "ls"],
    "data rm": ["data", "rm", "NAME"],
    "artifacts ls": ["artifacts", "ls", "RID"],
    "artifacts pull": ["artifacts", "pull", "RID", "DEST"],
    "logs": ["logs", "RID"],
    "balance": ["balance"],
    "budget": ["budget"],
    "notify show": ["notify", "show"],
    "notify set": ["notify", "set"],
    "notify rotate-secret": ["notify", "rotate-secret"],
    "notify deliveries": ["notify", "deliveries"],
    "nodes": ["nodes"],
    "price": ["price", "7"],
    "drain": ["drain", "7"],
    "maintenance": ["maintenance", "7"],
    "relist": ["relist", "7"],
    "earnings": ["earnings"],
    "join-token": ["join-token", "--provider=p", "--region=eu", "--price=2", "--min-bid=1"],
}  # fmt: skip


def _leaf_commands(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        return {prefix}
    return {
        leaf
        for name, child in subparsers[0].choices.items()
        for leaf in _leaf_commands(child, f"{prefix} {name}".strip())
    }


def test_every_command_is_tried_below():
    assert _leaf_commands(cli.build_parser()) == set(COMMANDS)


def _placements(argv: list[str]) -> list[list[str]]:
    """--json before the command, after each of its words and arguments, and at the end."""
    return [[*argv[:i], "--json", *argv[i:]] for i in range(len(argv) + 1)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_json_is_taken_anywhere_on_the_line_by_every_command(command):
    # Given a command's line, with --json put in each place a person might put it
    argv = COMMANDS[command]
    parser = cli.build_parser()
    plain = vars(parser.parse_args(argv))
    assert plain["json"] is False
    for line in _placements(argv):
        # When it is parsed, then it asks for JSON and reads every other argument the same
        parsed = vars(parser.parse_args(line))
        assert parsed == {**plain, "json": True}, line
    # Given twice (before and after the command), it is still just on
    assert parser.parse_args(["--json", *argv, "--json"]).json is True


def test_json_after_the_double_dash_is_the_rentals_command_not_the_flag():
    args = cli.build_parser().parse_args(
        ["rent", "--gpus", "1", "--image", "img", "--json", "--", "train", "--json"]
    )
    assert (args.json, args.cmd) == (True, ["train", "--json"])


def test_rent_takes_the_gpus_per_node_and_the_nodes_of_a_multi_node_rental():
    from gpumarket_cli.rentals import _rent_body

    parser = cli.build_parser()
    long = parser.parse_args(["rent", "--gpus-per-node", "2", "--nodes", "3", "--image", "i"])
    short = parser.parse_args(["rent", "--gpus", "2", "--nodes", "3", "--image", "i"])
    for args in (long, short):
        body = _rent_body(args)
        assert (body["gpus_per_node"], body["node_count"]) == (2, 3)
