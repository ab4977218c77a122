"""`gpumarket rent`, `rentals`, `show`, `metrics`, `stop`, `cancel` and `logs`: a rental from
its request to its output."""

from __future__ import annotations

import argparse
import json
import sys
import time

from gpumarket_cli.api import CliError
from gpumarket_cli.output import duration, table, when
from gpumarket_cli.templates import add_runtime_flags, runtime_from_flags, secrets_from_flags

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpumarket_cli.api import Api

COMMANDS = ("rent", "rentals", "show", "metrics", "stop", "cancel", "logs")

# A followed rental that reached one of these has nothing more to print once its lines are read.
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired", "preempted"})


def add_rent_parser(sub: argparse._SubParsersAction) -> None:
    rent = sub.add_parser("rent", help="rent GPUs for an image and command")
    rent.add_argument(
        "--gpus-per-node", "--gpus", dest="gpus", type=int, required=True, help="GPUs per node"
    )
    rent.add_argument("--name", help="a name to know the rental by (up to 80 characters)")
    rent.add_argument(
        "--nodes", type=int, default=1, help="nodes: more than one runs one job across them"
    )
    rent.add_argument("--gpu-family")
    rent.add_argument("--region")
    rent.add_argument("--max-price")
    rent.add_argument("--bid", help="interruptible, with this bid per GPU-hour")
    rent.add_argument("--hours", type=float, default=1.0)
    rent.add_argument(
        "--start-at",
        metavar="WHEN",
        help="book ahead: an ISO 8601 time (2026-12-24T08:00Z; without a zone, UTC)",
    )
    rent.add_argument(
        "--max-cost", help="dollars: the rental checkpoints and stops when its charge reaches this"
    )
    rent.add_argument("--image", help="the image (required unless --template gives it)")
    rent.add_argument("--template", help="start from one of your team's templates")
    add_runtime_flags(rent)
    rent.add_argument(
        "--data", action="append", default=[], help="a dataset (repeatable): /data/NAME"
    )
    rent.add_argument("--resume-from", help="a rental: start from its last synced checkpoint")
    rent.add_argument("cmd", nargs="*", help="the command (after --)")
    rent.add_argument("--ssh", action="store_true", help="an sshd for your SSH keys")
    rent.add_argument(
        "--network",
        choices=["internet", "internal"],
        help="internet (the default): the public internet and nothing else, not the host, "
        "its LAN or other rentals; internal: no network at all",
    )
    rent.add_argument(
        "--jupyter",
        action="store_true",
        help="JupyterLab beside the command (the command itself when none is given)",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("rentals", help="your rentals")
    for name in ("show", "metrics", "stop", "cancel"):
        sub.add_parser(name).add_argument("id")


def add_logs_parser(sub: argparse._SubParsersAction) -> None:
    log = sub.add_parser("logs", help="the output of a rental's container")
    log.add_argument("id")
    log.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    log.add_argument("--tail", type=int, help="only the last N lines")
    log.add_argument("--interval", type=float, default=2.0, help=argparse.SUPPRESS)


def _rent_body(args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {
        "gpus_per_node": args.gpus,
        "node_count": args.nodes,
        "duration_s": int(args.hours * 3600),
    }
    runtime = runtime_from_flags(args)
    if args.template:
        body["template"] = args.template
        if runtime:
            body["runtime"] = runtime  # what the template runs, with these changes
    elif not args.image:
        raise CliError("give --image (or --template)")
    else:
        body["runtime"] = {"command": [], **runtime}
    for key in ("region", "name"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    if args.gpu_family:
        body["gpu_families"] = [args.gpu_family]
    if args.max_price:
        body["max_price_per_gpu_hour"] = args.max_price
    if args.bid:
        body.update(kind="interruptible", bid_per_gpu_hour=args.bid)
    if args.max_cost:
        body["max_charge"] = args.max_cost
    if args.start_at:
        body["start_at"] = args.start_at
    if args.data:
        body["datasets"] = args.data
    if args.resume_from:
        body["resume_from"] = args.resume_from
    if args.ssh:
        body["ssh"] = True
    if args.network:
        body["network"] = args.network
    body.update(secrets_from_flags(args))
    if args.jupyter:
        body["jupyter"] = True
    return body


_NETWORK_LABELS = {
    "internet": "internet (public addresses only)",
    "internal": "internal (no network)",
}


def rental_summary(rental: dict) -> str:
    """`gpumarket show`: what a person looks for first; --json gives the whole rental."""
    from datetime import datetime

    def span(start: str | None, end: str | None) -> str:
        if not start:
            return "-"
        text = f"{when(start)} to {when(end)[11:] if end else 'now'}"
        if end:
            seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            text += f" ({duration(max(0.0, seconds) / 3600)})"
        return text

    status = rental["status"]
    if rental["status_reason"]:
        status += f": {rental['status_reason']}"
    if rental.get("pull_progress"):
        status += f" ({rental['pull_progress']['text']})"
    if rental["exit_code"] is not None:
        status += f" (exit code {rental['exit_code']})"
    price = rental["price_per_gpu_hour"] or rental["max_price_per_gpu_hour"]
    # Where it runs now; when it holds nothing (ended, or requeued), every node it was placed on.
    current = [a for a in rental["allocations"] if not a.get("released_at")]
    held: dict[str, dict[str, None]] = {}
    for a in current or rental["allocations"]:
        held.setdefault(a["node"], {})[str(a["gpu_index"])] = None
    fields = [
        ("status", status),
        (
            "gpus",
            f"{rental['gpus_per_node']} per node x {rental['node_count']}, {rental['kind']}"
            + (f" at ${price}/GPU-hour" if price else ", priced when placed"),
        ),
        ("on", "; ".join(f"{node} GPU {','.join(gpus)}" for node, gpus in held.items()) or "-"),
        ("image", " ".join([rental["image"], *map(str, rental["command"] or [])])),
        ("network", _NETWORK_LABELS.get(rental.get("network", ""), rental.get("network", "-"))),
        ("booked", span(rental["scheduled_start"], rental["scheduled_end"])),
        ("ran", span(rental["started_at"], rental["ended_at"])),
    ]
    if rental.get("datasets"):
        fields.append(("datasets", ", ".join(rental["datasets"])))
    if rental.get("secrets"):
        fields.append(("secrets", ", ".join(use["name"] for use in rental["secrets"])))
    fields += [("access", a["command"] or a.get("url") or f"{a['host']}:{a['host_port']}")
               for a in rental.get("access", [])]  # fmt: skip
    if rental.get("ports") and not rental.get("access"):
        fields.append(("ports", ", ".join(map(str, rental["ports"])) + " (published once it runs)"))
    lines = [f"{rental['id']}  {rental['name']}".rstrip()]
    lines += [f"{label:<9} {value}" for label, value in fields]
    lines += ["", "events"]
    lines += [f"  {when(e['created_at'])}  {e['to_status']:<12} {e['reason']}"
              for e in rental["events"]]  # fmt: skip
    members = rental.get("members", []) if rental["node_count"] > 1 else []
    if members:
        lines += ["", "members"]
        for m in members:
            state = m["state"] + (f" (exit code {m['exit_code']})" if m["exit_code"] is not None
                                  else "")  # fmt: skip
            lines.append(f"  node {m['node_rank']}  {m['node']:<20} {state}")
            lines += [f"    {t}" for t in m["log_tail"].rstrip("\n").splitlines()[-3:]]
    tail = rental["log_tail"].rstrip("\n").splitlines()[-5:]
    if tail:
        lines += ["", "log (last lines; `gpumarket logs ID` for all)", *(f"  {t}" for t in tail)]
    return "\n".join(lines)


def logs(args: argparse.Namespace, api: Api) -> None:
    """Print a rental's output; with --follow, keep printing new lines until it has ended."""
    out = sys.stdout
    path = f"/api/v1/rentals/{args.id}/logs/"
    params: dict[str, Any] = {"limit": 500}
    if args.tail:
        params["tail"] = args.tail
    while True:
        page = api.call("GET", path, params=params)
        for row in page["results"]:
            print(json.dumps(row) if args.json else row["line"], file=out, flush=True)
        if page["results"]:
            params = {"limit": 500, "after": page["results"][-1]["id"]}
        if page.get("next"):
            continue
        if not args.follow:
            return
        status = api.call("GET", f"/api/v1/rentals/{args.id}/")["status"]
        if status in FINAL_STATUSES:
            # The last lines may arrive with the agent's next heartbeat after the end.
            page = api.call("GET", path, params=params)
            for row in page["results"]:
                print(json.dumps(row) if args.json else row["line"], file=out, flush=True)
            if not page["results"]:
                return
            params = {"limit": 500, "after": page["results"][-1]["id"]}
            continue
        time.sleep(args.interval)


def run(args: argparse.Namespace, api: Api) -> str | None:
    """The text to print; None for `logs`, which prints its lines as they come."""
    if args.command == "logs":
        logs(args, api)
        return None
    if args.command == "rent":
        rental = api.call("POST", "/api/v1/rentals/", json=_rent_body(args))
        return f"{rental['id']} {rental['status']}"
    if args.command == "rentals":
        rows = api.call("GET", "/api/v1/rentals/")["results"]
        return table(rows, ["id", "name", "status", "gpus_per_node", "node_count",
                            "price_per_gpu_hour", "status_reason"])  # fmt: skip
    if args.command == "show":
        return rental_summary(api.call("GET", f"/api/v1/rentals/{args.id}/"))
    if args.command == "metrics":
        rows = api.call("GET", f"/api/v1/rentals/{args.id}/metrics/", params={"event": "step"})
        return table(rows["results"], ["step", "loss", "samples_per_s", "mfu"])
    rental = api.call("POST", f"/api/v1/rentals/{args.id}/{args.command}/")  # stop, cancel
    return f"{rental['id']} {rental['status']}"
