"""The commands of provider owners: `nodes`, `price`, `drain`, `maintenance`, `relist`,
`earnings`, `join-token`."""

from __future__ import annotations

import argparse

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("nodes", "price", "drain", "maintenance", "relist", "earnings", "join-token")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("nodes", help="providers: your nodes and what is rented")
    price = sub.add_parser("price", help="providers: a node's prices for new bookings")
    price.add_argument("node", type=int)
    price.add_argument("--price", help="per GPU-hour")
    price.add_argument("--min-bid", help="lowest interruptible bid per GPU-hour")
    for name, text in (
        ("drain", "no new rentals; running ones finish"),
        ("maintenance", "take the node out"),
        ("relist", "list it again"),
    ):
        sub.add_parser(name, help=f"providers: {text}").add_argument("node", type=int)
    sub.add_parser("earnings", help="providers: earnings and payouts")
    join = sub.add_parser("join-token", help="providers: a one-time token for a new host")
    join.add_argument("--provider", required=True)
    join.add_argument("--region", required=True)
    join.add_argument("--price", required=True)
    join.add_argument("--min-bid", required=True)


def run(args: argparse.Namespace, api: Api) -> str:
    """The commands of provider owners."""
    if args.command == "nodes":
        rows = [
            row
            for provider in api.call("GET", "/api/v1/providers/")
            for row in api.call("GET", f"/api/v1/providers/{provider['id']}/nodes/")
        ]
        api.last = rows
        columns = ["id", "hostname", "region", "status", "gpu_model", "rented_gpus", "gpu_count"]
        return table(rows, [*columns, "price_per_gpu_hour", "min_bid_per_gpu_hour"])
    if args.command == "price":
        body = {k: v for k, v in (("price_per_gpu_hour", args.price),
                                  ("min_bid_per_gpu_hour", args.min_bid)) if v}  # fmt: skip
        node = api.call("PATCH", f"/api/v1/providers/nodes/{args.node}/", json=body)
        return f"{node['hostname']} {node['price_per_gpu_hour']} {node['min_bid_per_gpu_hour']}"
    if args.command in ("drain", "relist", "maintenance"):
        action = "online" if args.command == "relist" else args.command
        node = api.call(
            "POST", f"/api/v1/providers/nodes/{args.node}/action/", json={"action": action}
        )
        return f"{node['hostname']} {node['status']}"
    if args.command == "earnings":
        rows = api.call("GET", "/api/v1/billing/earnings/")
        for row in rows:
            for key in [k for k in row if k.endswith("_micros")]:
                row[key.removesuffix("_micros")] = f"{row.pop(key) / 1e6:,.2f}"
        return table(rows, ["provider", "earned_this_month", "earned_total", "balance",
                            "paid_out"])  # fmt: skip
    if args.command == "join-token":
        body = {"provider": args.provider, "region": args.region,
                "price_per_gpu_hour": args.price, "min_bid_per_gpu_hour": args.min_bid}  # fmt: skip
        token = api.call("POST", "/api/v1/providers/join-tokens/", json=body)
        return f"gpumarket-agent --server {api.base} --join-token {token['join_token']}"
    raise CliError(f"unknown command {args.command}")
