"""`gpumarket secret`: the team's secrets, write-only (set, ls, rm); rentals name them with
`rent --secret NAME` (and `--registry-secret NAME` for a private image's credentials)."""

from __future__ import annotations

import argparse
import sys

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("secret",)
MAX_VALUE_BYTES = 64 * 1024


def add_parsers(sub: argparse._SubParsersAction) -> None:
    secret = sub.add_parser("secret", help="your team's secrets (write-only): set, ls, rm")
    secret_sub = secret.add_subparsers(
        dest="secret_command", required=True, prog="gpumarket secret"
    )
    set_ = secret_sub.add_parser(
        "set",
        help="set a secret (created, or its value replaced): the value from --from-file, "
        "else standard input, else a prompt",
    )
    set_.add_argument("name", help="a variable name: a rental gets it as $NAME")
    set_.add_argument("--from-file", metavar="FILE", help="the value is this file's content")
    secret_sub.add_parser("ls", help="the team's secrets (names and times, never values)")
    secret_sub.add_parser("rm", help="delete a secret").add_argument("name")


def _value(args: argparse.Namespace) -> str:
    """The value, never from the command line (it would sit in the shell's history and the
    process list)."""
    if args.from_file:
        try:
            with open(args.from_file, "rb") as file:
                data = file.read(MAX_VALUE_BYTES + 1)
        except OSError as exc:
            raise CliError(f"--from-file {args.from_file}: {exc}") from exc
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise CliError(f"--from-file {args.from_file}: not UTF-8 text") from None
    if not sys.stdin.isatty():
        # Piped: as given, less the one newline `echo` adds.
        value = sys.stdin.read(MAX_VALUE_BYTES + 2)
        return value[:-1] if value.endswith("\n") and value.count("\n") == 1 else value
    import getpass

    return getpass.getpass(f"value of {args.name} (not shown): ")


def run(args: argparse.Namespace, api: Api) -> str:
    command = args.secret_command
    if command == "set":
        value = _value(args)
        if not value:
            raise CliError("the value is empty")
        saved = api.call("POST", "/api/v1/secrets/", json={"name": args.name, "value": value})
        return f"set {saved['name']}"
    if command == "ls":
        rows = api.call("GET", "/api/v1/secrets/")
        return table(rows, ["name", "created_by", "updated_at"]) if rows else "no secrets"
    api.call("DELETE", f"/api/v1/secrets/{args.name}/")
    return f"removed {args.name}"
