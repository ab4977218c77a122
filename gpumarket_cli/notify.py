"""`gpumarket notify`: what the team is told, by email and by webhook."""

from __future__ import annotations

import argparse

from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpumarket_cli.api import Api

COMMANDS = ("notify",)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    notify = sub.add_parser("notify", help="what you are told by email and webhook")
    notify_sub = notify.add_subparsers(
        dest="notify_command", required=True, prog="gpumarket notify"
    )
    notify_sub.add_parser("show", help="your notification settings")
    notify_set = notify_sub.add_parser("set", help="switch channels and kinds on or off")
    notify_set.add_argument("--email", action=argparse.BooleanOptionalAction, default=None)
    notify_set.add_argument("--webhook-url", help="https URL; empty turns the webhook off")
    for channel in ("email", "webhook"):
        for state in ("on", "off"):
            notify_set.add_argument(
                f"--{channel}-{state}", metavar="KINDS", help=f"comma-separated kinds, e.g. "
                f"rental.started,balance.low: switch them {state} for {channel}"
            )  # fmt: skip
    notify_sub.add_parser("rotate-secret", help="a new webhook signing secret, shown once")
    deliveries = notify_sub.add_parser("deliveries", help="recent deliveries and their attempts")
    deliveries.add_argument("--state", choices=["pending", "delivered", "failed", "skipped"])


def _kinds(text: str | None) -> set[str]:
    return {k.strip() for k in (text or "").split(",") if k.strip()}


def run(args: argparse.Namespace, api: Api) -> str:
    """What you are told, by email and by webhook; each kind switched on or off per channel."""
    path = "/api/v1/notifications/settings/"
    if args.notify_command == "deliveries":
        params = {"state": args.state} if args.state else {}
        rows = api.call("GET", "/api/v1/notifications/deliveries/", params=params)["results"]
        columns = ["id", "created_at", "kind", "channel", "state", "attempts", "last_status_code"]
        return table(rows, columns) if rows else "no deliveries"
    if args.notify_command == "rotate-secret":
        answer = api.call("POST", f"{path}rotate-secret/")
    elif args.notify_command == "set":
        current = api.call("GET", path)
        body: dict[str, Any] = {}
        if args.email is not None:
            body["email_enabled"] = args.email
        if args.webhook_url is not None:
            body["webhook_url"] = args.webhook_url
        for channel in ("email", "webhook"):
            on, off = getattr(args, f"{channel}_on"), getattr(args, f"{channel}_off")
            if on or off:
                kinds = (set(current[f"{channel}_kinds"]) | _kinds(on)) - _kinds(off)
                body[f"{channel}_kinds"] = [k for k in current["kinds"] if k in kinds] + sorted(
                    kinds - set(current["kinds"])  # unknown ones: the server names them
                )
        answer = api.call("PATCH", path, json=body)
    else:
        answer = api.call("GET", path)
    lines = [
        f"email: {'on' if answer['email_enabled'] else 'off'}  {','.join(answer['email_kinds'])}",
        f"webhook: {answer['webhook_url'] or 'none'}  {','.join(answer['webhook_kinds'])}",
    ]
    if answer.get("webhook_secret"):
        lines.append(f"signing secret (shown once): {answer['webhook_secret']}")
    return "\n".join(lines)
