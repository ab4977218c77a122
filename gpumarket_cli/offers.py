"""`gpumarket offers`: the GPUs free now."""

from __future__ import annotations

import argparse

from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("offers",)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    offers = sub.add_parser("offers", help="GPUs free now")
    offers.add_argument("--gpu-family")
    offers.add_argument("--gpu-model")
    offers.add_argument("--region")
    offers.add_argument("--min-free-gpus", type=int)
    offers.add_argument("--max-price")
    offers.add_argument("--sort", default="price")
    offers.add_argument("--limit", type=int, default=20)


def run(args: argparse.Namespace, api: Api) -> str:
    params = {k: v for k, v in {
        "gpu_family": args.gpu_family, "gpu_model": args.gpu_model, "region": args.region,
        "min_free_gpus": args.min_free_gpus, "max_price": args.max_price,
        "ordering": args.sort, "limit": args.limit,
    }.items() if v is not None}  # fmt: skip
    rows = api.call("GET", "/api/v1/offers/", params=params)["results"]
    if not rows:
        return "no free GPUs match"
    for row in rows:
        # "infiniband 400 Gb/s x 32": the fabric a multi-node rental here uses, and how many
        # nodes share it; "-" for a node on its own (single-node rentals only).
        row["interconnect"] = (
            f"{row['interconnect']} {row['interconnect_gbps']} Gb/s x {row['cluster_nodes']}"
            if row.get("interconnect")
            else "-"
        )
    columns = ["node_id", "hostname", "region", "gpu_name", "free_gpus"]
    return table(
        rows,
        [*columns, "price_per_gpu_hour", "price_per_tflop_hour", "reliability", "interconnect"],
    )
