"""`gpumarket balance` and `budget`: the customer's money, budget and limits."""

from __future__ import annotations

import argparse

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("balance", "budget")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("balance", help="your credit, what is available, what running rentals cost")
    budget = sub.add_parser("budget", help="your monthly budget and limits: show, or set")
    budget.add_argument("--monthly", help="dollars per month; 'none' removes the budget")
    budget.add_argument("--warn-percent", help="warn at this share of the monthly budget")
    budget.add_argument("--max-gpus", help="GPUs at once; 'none': the account's ceiling")
    budget.add_argument("--max-rentals-per-minute", help="'none': the account's ceiling")


def _cleared(value: str) -> str | int | None:
    """'none' clears a budget or limit; a whole number is sent as one, anything else as typed
    (the server names what is wrong with it)."""
    if value.lower() == "none":
        return None
    return int(value) if value.isdigit() else value


def _budget_run(args: argparse.Namespace, api: Api) -> str:
    """Show the account's budgets and limits, or set those given."""
    changes = {
        key: _cleared(value)
        for key, value in (
            ("monthly_budget", args.monthly),
            ("budget_warn_percent", args.warn_percent),
            ("max_concurrent_gpus", args.max_gpus),
            ("max_rentals_per_minute", args.max_rentals_per_minute),
        )
        if value is not None
    }
    if "monthly_budget" in changes and isinstance(changes["monthly_budget"], int):
        changes["monthly_budget"] = str(changes["monthly_budget"])
    if changes:
        b = api.call("PATCH", "/api/v1/billing/budgets/", json=changes)
    else:
        b = api.call("GET", "/api/v1/billing/budgets/")

    def usd(micros: int | None) -> str:
        return "none" if micros is None else f"${micros / 1e6:,.2f}"

    def limit(value: int, ceiling: int) -> str:
        return (str(value) if value else "no limit") + (f" (ceiling {ceiling})" if ceiling else "")

    return "\n".join([
        f"monthly budget      {usd(b['monthly_budget_micros'])}"
        f" (warn at {b['budget_warn_percent']} %)",
        f"charged this month  {usd(b['month_spent_micros'])}, held {usd(b['held_micros'])}",
        f"GPUs at once        {b['active_gpus']} of "
        + limit(b["max_concurrent_gpus"], b["ceiling_concurrent_gpus"]),
        f"rentals per minute  {b['rentals_last_minute']} of "
        + limit(b["max_rentals_per_minute"], b["ceiling_rentals_per_minute"]),
    ])  # fmt: skip


def run(args: argparse.Namespace, api: Api) -> str:
    if args.command == "budget":
        return _budget_run(args, api)
    account = api.call("GET", "/api/v1/billing/account/")
    return "  ".join(
        f"{key.removesuffix('_micros')} ${account[key] / 1e6:,.2f}"
        for key in ("balance_micros", "available_micros", "hourly_burn_micros")
    )
