"""`gpumarket`: the customer's command line, a thin client of the REST API (no Django import).

    gpumarket --server URL --token TOKEN offers --gpu-family h100 --min-free-gpus 8
    gpumarket advise --model llama2-7b --tokens-b 100 --deadline-hours 48
    gpumarket book --model llama2-7b --tokens-b 100 --plan h100-sxm5-80gb:2x8
    gpumarket rent --gpus-per-node 4 --nodes 2 --gpu-family a100 --hours 12 --image IMAGE -- CMD
    gpumarket rentals | show ID | metrics ID | logs [-f] ID | stop ID | cancel ID
    gpumarket budget [--monthly 500 --warn-percent 80 --max-gpus 16 --max-rentals-per-minute 10]
    gpumarket data push PATH [--name NAME] | data ls | data rm NAME
    gpumarket rent ... --data NAME --resume-from RENTAL --env NAME=VALUE --port 8000
    gpumarket template save NAME --image IMAGE [--env ..] -- CMD | template ls | show | rm
    gpumarket rent --gpus 1 --hours 2 --template NAME
    gpumarket artifacts ls RENTAL | artifacts pull RENTAL [DEST]
    gpumarket ssh-key add ~/.ssh/id_ed25519.pub | ssh-key ls | ssh-key rm ID
    gpumarket rent --ssh ... ; gpumarket ssh-command ID     (ssh -p PORT harness@HOST)
    gpumarket rent --jupyter --ssh ... ; gpumarket jupyter ID    (a tunnel to its JupyterLab)
    gpumarket notify show | set --webhook-url URL --email-off rental.started | deliveries

Every command takes `--json`, anywhere on the line: it prints the server's answer as JSON
instead of a table (one JSON object per line for `logs`), for scripts.

The server and token come from flags or GPUMARKET_SERVER_URL / GPUMARKET_TOKEN; proxies and CA
bundles from the usual variables (see gpumarket_cli.http). Each command group is a module of
this package: its parsers (`add_parsers`) and what it does (`run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpumarket_cli import (
    advisor,
    billing,
    notify,
    offers,
    providers,
    rentals,
    secrets,
    ssh,
    storage,
    templates,
)
from gpumarket_cli.api import Api, CliError

# A call is one short process: what it does not use, it does not import (typing included).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

GROUPS = (offers, advisor, rentals, templates, ssh, secrets, storage, billing, notify, providers)
HANDLERS: dict[str, Callable[[argparse.Namespace, Api], str | None]] = {
    command: group.run for group in GROUPS for command in group.COMMANDS
}


def _terminal_columns() -> int:
    """What shutil.get_terminal_size() answers, without importing shutil: $COLUMNS when it is a
    positive number, else the terminal's width, else 80."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Parser(argparse.ArgumentParser):
    """argparse builds a help formatter for every argument it adds (to check its metavar), and
    a formatter not told the width imports shutil, with bz2 and lzma, to ask the terminal: a
    tenth of a call. Subcommands' parsers are of this class too (argparse makes them of the
    parent's)."""

    _width: int | None = None
    # The top-level parser takes what follows `--` as the command (see parse_known_args).
    takes_command = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Listed in every command's help; parse_known_args takes it wherever it is.
        self.add_argument(
            "--json",
            action="store_true",
            default=argparse.SUPPRESS,
            help="print the server's answer as JSON, for scripts",
        )

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """`--json` anywhere before `--`: before or after the subcommand, between its
        positional arguments. argparse alone cannot take a flag between two positionals when
        the second is optional (`artifacts pull ID --json DEST` would refuse DEST), so the flag,
        which takes no value, is taken out of the line first; after `--` it is the rental's."""
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)
        asked = "--json" in args[:end]
        if asked:
            args = [a for a in args[:end] if a != "--json"] + args[end:]
        command = None
        end = args.index("--") if "--" in args else len(args)
        if self.takes_command and end < len(args):
            # What follows `--` is the rental's command (`rent`, `template save`): taken here,
            # as argparse loses `--` on its way into a sub-subcommand.
            args, command = args[:end], args[end + 1 :]
        namespace, rest = super().parse_known_args(args, namespace)
        if command is not None:
            if hasattr(namespace, "cmd"):
                namespace.cmd = command
            else:
                rest += ["--", *command]
        if asked:
            namespace.json = True
        return namespace, rest

    def _get_formatter(self) -> argparse.HelpFormatter:
        if _Parser._width is None:
            _Parser._width = _terminal_columns() - 2  # the margin HelpFormatter leaves
        return self.formatter_class(prog=self.prog, width=_Parser._width)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpumarket", description=__doc__.splitlines()[0])
    parser.takes_command = True
    parser.add_argument(
        "--server", default=os.environ.get("GPUMARKET_SERVER_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument("--token", default=os.environ.get("GPUMARKET_TOKEN"))
    parser.set_defaults(json=False)
    # Each subparsers names its prog: argparse would build a help formatter (and import shutil,
    # with bz2 and lzma) to work it out, on every call.
    sub = parser.add_subparsers(dest="command", required=True, prog="gpumarket")
    # In the order the help has always listed them.
    offers.add_parsers(sub)
    advisor.add_parsers(sub)
    rentals.add_rent_parser(sub)
    ssh.add_parsers(sub)
    secrets.add_parsers(sub)
    rentals.add_parsers(sub)
    storage.add_parsers(sub)
    templates.add_parsers(sub)
    rentals.add_logs_parser(sub)
    billing.add_parsers(sub)
    notify.add_parsers(sub)
    providers.add_parsers(sub)
    return parser


def _transfer_errors() -> tuple[type[Exception], ...]:
    """TransferError once a file command loaded the transfers module (only then can it raise)."""
    module = sys.modules.get("gpumarket_cli.transfer")
    return (module.TransferError,) if module else ()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        api = Api(args.server, args.token)
        text = HANDLERS[args.command](args, api)
        if text is not None:  # `logs` printed its lines as they came
            print(json.dumps(api.last, indent=2) if args.json else text)
    except (CliError, *_transfer_errors()) as exc:
        print(f"gpumarket: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`gpumarket logs ID | head`): stop quietly, as `cat` does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer cut off
    return 0
