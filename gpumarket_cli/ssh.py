"""`gpumarket ssh-key`, `ssh-command` and `jupyter`: the team's SSH keys, and the ways into a
rental: its ssh command, and its JupyterLab through an SSH tunnel opened with the real `ssh`."""

from __future__ import annotations

import argparse
import signal
import sys

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("ssh-key", "ssh-command", "jupyter")

JUPYTER_PORT = 8888  # where a rental's JupyterLab listens in its container (the agent's)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("ssh-key", help="your team's SSH public keys")
    key_sub = keys.add_subparsers(dest="action", required=True, prog="gpumarket ssh-key")
    add_key = key_sub.add_parser("add", help="add a public key")
    add_key.add_argument("key", metavar="FILE", help="the .pub file, or - for standard input")
    add_key.add_argument("--name")
    key_sub.add_parser("ls", help="list them")
    key_sub.add_parser("rm", help="remove one").add_argument("key", metavar="ID", type=int)
    sub.add_parser("ssh-command", help="the ssh command into a rental").add_argument("id")
    notebook = sub.add_parser(
        "jupyter", help="a rental's JupyterLab through an SSH tunnel (rent with --jupyter --ssh)"
    )
    notebook.add_argument("id")
    notebook.add_argument(
        "--local-port", type=int, default=0, help="the port on this machine (default: a free one)"
    )
    notebook.add_argument("-i", dest="identity", metavar="FILE", help="ssh's identity file")
    notebook.add_argument(
        "-o", dest="ssh_options", action="append", default=[], metavar="OPTION",
        help="an ssh option (repeatable), e.g. -o StrictHostKeyChecking=accept-new",
    )  # fmt: skip


TUNNEL_STOP_GRACE_S = 5.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def jupyter(args: argparse.Namespace, api: Api) -> str | None:
    """Open `ssh -N -L` to the rental's JupyterLab, print the local URL with its token, and
    keep the tunnel until ssh ends (Ctrl-C). Without SSH, the published URL is printed."""
    import subprocess

    rental = api.call("GET", f"/api/v1/rentals/{args.id}/")
    if not rental.get("jupyter"):
        raise CliError(f"{args.id} has no JupyterLab: rent with --jupyter")
    access = rental.get("access", [])
    published = [a["url"] for a in access if a["container_port"] == JUPYTER_PORT and a["url"]]
    ssh_entry = next((a for a in access if a["command"]), None)
    if ssh_entry is None:
        if published:
            return f"{published[0]}\n(no SSH into it: rent with --ssh for a tunnel)"
        raise CliError(f"no JupyterLab in {args.id} now (status {rental['status']})")
    local = args.local_port or _free_port()
    argv = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes",
            "-L", f"127.0.0.1:{local}:127.0.0.1:{JUPYTER_PORT}",
            "-p", str(ssh_entry["host_port"])]  # fmt: skip
    if args.identity:
        argv += ["-i", args.identity]
    for option in args.ssh_options:
        argv += ["-o", option]
    argv.append(ssh_entry["command"].rsplit(" ", 1)[-1])  # harness@HOST
    try:
        tunnel = subprocess.Popen(argv)
    except OSError as exc:
        raise CliError(f"cannot run ssh: {exc.strerror}") from None
    print(f"http://127.0.0.1:{local}/lab?token={rental['jupyter_token']}", flush=True)
    print("(the tunnel stays open until you press Ctrl-C)", file=sys.stderr, flush=True)
    # A process started in the background of a script inherits SIGINT ignored, and Python then
    # never raises KeyboardInterrupt: `kill -INT` would leave the tunnel open for good.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = tunnel.wait()
    except KeyboardInterrupt:
        # Ctrl-C ends the tunnel: asked first, killed if ssh has not gone within the grace.
        tunnel.terminate()
        try:
            tunnel.wait(TUNNEL_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            tunnel.kill()
            tunnel.wait()
        return None
    if code != 0:
        raise CliError(f"ssh ended with exit code {code}")
    return None


def run(args: argparse.Namespace, api: Api) -> str | None:
    if args.command == "jupyter":
        return jupyter(args, api)
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
