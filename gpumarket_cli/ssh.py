"""`gpumarket ssh-key` and `ssh-command`: the team's SSH keys, and the way into a rental."""

from __future__ import annotations

import argparse
import sys

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("ssh-key", "ssh-command")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("ssh-key", help="your team's SSH public keys")
    key_sub = keys.add_subparsers(dest="action", required=True, prog="gpumarket ssh-key")
    add_key = key_sub.add_parser("add", help="add a public key")
    add_key.add_argument("key", metavar="FILE", help="the .pub file, or - for standard input")
    add_key.add_argument("--name")
    key_sub.add_parser("ls", help="list them")
    key_sub.add_parser("rm", help="remove one").add_argument("key", metavar="ID", type=int)
    sub.add_parser("ssh-command", help="the ssh command into a rental").add_argument("id")


def run(args: argparse.Namespace, api: Api) -> str:
    if args.command == "ssh-command":
        rental = api.call("GET", f"/api/v1/rentals/{args.id}/")
        commands = [a["command"] for a in rental.get("access", []) if a["command"]]
        if not commands:
            raise CliError(f"no SSH into {args.id} now (status {rental['status']})")
        return "\n".join(commands)
    if args.action == "ls":
        rows = api.call("GET", "/api/v1/ssh-keys/")
        columns = ["id", "name", "key_type", "bits", "fingerprint", "added_by", "created_at"]
        return table(rows, columns)
    if args.action == "rm":
        api.call("DELETE", f"/api/v1/ssh-keys/{args.key}/")
        return f"removed {args.key}"
    try:
        if args.key == "-":
            text = sys.stdin.read()
        else:
            with open(args.key, encoding="utf-8") as file:
                text = file.read()
    except OSError as exc:
        raise CliError(f"cannot read {args.key}: {exc.strerror}") from None
    body = {"public_key": text, **({"name": args.name} if args.name else {})}
    key = api.call("POST", "/api/v1/ssh-keys/", json=body)
    return f"{key['id']} {key['key_type']} {key['fingerprint']} {key['name']}"
