"""`gpumarket advise` and `book`: which card, how long, what cost; then book one plan."""

from __future__ import annotations

import argparse

from gpumarket_cli.output import duration, table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpumarket_cli.api import Api

COMMANDS = ("advise", "book")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name in ("advise", "book"):
        p = sub.add_parser(name, help="which card, how long, what cost" if name == "advise"
                           else "book one of the advisor's plans")  # fmt: skip
        p.add_argument("--model", help="a preset: llama2-7b, gpt2-124m, ...")
        p.add_argument("--params-b", type=float, help="parameters, in billions")
        p.add_argument("--tokens-b", type=float, required=True, help="tokens, in billions")
        p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
        p.add_argument("--region")
        p.add_argument("--interruptible", action="store_true")
        p.add_argument("--seq-len", type=int)
        p.add_argument("--deadline-hours", type=float)
        p.add_argument("--budget", help="dollars")
        if name == "book":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--plan", help="a plan id from advise (card:NODESxGPUS)")
            which.add_argument("--card", help="a card: its cheapest plan")
            p.add_argument("--dataset", help="your team's dataset of token files to train on")
            p.add_argument(
                "--series",
                action="store_true",
                help="a plan longer than one booking: book the next of its series",
            )
            p.add_argument("--resume-from", help="the series' previous rental id")


def plan_row(plan: dict) -> dict:
    """One of the advisor's plans as a table row: the memory a GPU needs in all (the JSON
    output keeps its parts), the estimated time, what booking it books and holds (to the
    micro-dollar: the hold of a short plan is cents), the cost in dollars and cents, MFU as a
    percentage."""
    from decimal import Decimal

    return {
        **plan,
        "gb_per_gpu": f"{plan['per_gpu_gb']['total']:.1f}",
        "time": duration(plan["hours"]),
        "booked": duration(plan["booked_hours"]),
        "cost": f"${Decimal(plan['cost']).quantize(Decimal('0.01')):f}",
        "held": f"${Decimal(plan['hold_usd']).normalize():f}",
        "mfu": f"{plan['mfu']:.0%}",
        "flags": ",".join(plan["flags"]),
        # The fabric a multi-node plan crosses, and was priced with; "-" on one node.
        "interconnect": plan.get("interconnect") or "-",
    }


def _body(args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {"tokens_b": args.tokens_b, "precision": args.precision}
    for key in ("model", "params_b", "seq_len", "deadline_hours", "budget", "region"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.interruptible:
        body["interruptible"] = True
    return body


def run(args: argparse.Namespace, api: Api) -> str:
    if args.command == "advise":
        answer = api.call("POST", "/api/v1/advisor/", json=_body(args))
        rows = [plan_row(p) for p in answer["plans"]]
        columns = [
            *("id", "gpus", "gb_per_gpu", "time", "mfu", "cost", "booked", "held", "flags"),
            "interconnect",
        ]
        text = table(rows, columns) if rows else "no plan"
        return "\n".join([text, *answer["reasons"]])
    which = {"plan": args.plan} if args.plan else {"card": args.card}
    if args.dataset:
        which["dataset"] = args.dataset
    if args.series:
        which["series"] = True
    if args.resume_from:
        which["resume_from"] = args.resume_from
    rental = api.call("POST", "/api/v1/advisor/book/", json={**_body(args), **which})
    return "\n".join([f"{rental['id']} {rental['status']}", *filter(None, [rental.get("message")])])
