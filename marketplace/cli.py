"""`gpumarket`: the customer's command line, a thin client of the REST API (no Django import).

    gpumarket --server URL --token TOKEN offers --gpu-family h100 --min-free-gpus 8
    gpumarket advise --model llama2-7b --tokens-b 100 --deadline-hours 48
    gpumarket book --model llama2-7b --tokens-b 100 --plan h100-sxm5-80gb:2x8
    gpumarket rent --gpus 4 --gpu-family a100 --region eu --hours 12 --image IMAGE -- CMD ...
    gpumarket rentals | show ID | metrics ID | logs [-f] ID | stop ID | cancel ID
    gpumarket budget [--monthly 500 --warn-percent 80 --max-gpus 16 --max-rentals-per-minute 10]
    gpumarket data push PATH [--name NAME] | data ls | data rm NAME
    gpumarket rent ... --data NAME --resume-from RENTAL
    gpumarket artifacts ls RENTAL | artifacts pull RENTAL [DEST]
    gpumarket ssh-key add ~/.ssh/id_ed25519.pub | ssh-key ls | ssh-key rm ID
    gpumarket rent --ssh ... ; gpumarket ssh-command ID     (ssh -p PORT harness@HOST)
    gpumarket notify show | set --webhook-url URL --email-off rental.started | deliveries

Every command takes `--json`, anywhere on the line: it prints the server's answer as JSON
instead of a table (one JSON object per line for `logs`), for scripts.

The server and token come from flags or GPUMARKET_SERVER_URL / GPUMARKET_TOKEN.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from urllib.parse import urlencode, urlsplit

from marketplace.cli_http import Connection, HttpError

# A call is one short process: what it does not use, it does not import (typing included).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_json = json  # Api.call takes a keyword named json, as requests did

# Its own small HTTP client (cli_http) rather than requests or http.client: one call is one
# short process, and importing either costs more than the call itself. Only the file commands
# (datasets, artifacts) load the transfers module, which streams with requests.
TIMEOUT_S = 30
RETRIES = 3


class CliError(Exception):
    pass


class Api:
    """The REST API over one kept-alive connection."""

    def __init__(self, server: str, token: str | None) -> None:
        self.base = server.rstrip("/")
        parts = urlsplit(self.base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CliError(f"the server must be an http:// or https:// URL, not {server!r}")
        try:
            port = parts.port
        except ValueError:
            raise CliError(f"the server's port is not a number: {server!r}") from None
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, port
        self._prefix = parts.path
        self.headers = {"Accept": "application/json", "User-Agent": "gpumarket-cli"}
        self.last: Any = None  # the last answer's body, for --json
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._conn = Connection(self._host, self._port, https=self._https, timeout=TIMEOUT_S)

    def _send(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        return self._conn.request(method, url, headers=headers, body=body)

    def call(self, method: str, path: str, *, params: dict | None = None, json: Any = None) -> Any:
        """One request; 4xx are shown. Connection errors and 5xx are retried with backoff for
        the methods that may repeat; a POST is sent once (it could create a second rental)."""
        url = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        body = None if json is None else _json.dumps(json).encode()
        tries = RETRIES if method in ("GET", "PUT", "PATCH", "DELETE") else 1
        for attempt in range(tries):
            try:
                status, content = self._send(method, url, body)
            except (OSError, HttpError) as exc:
                if attempt == tries - 1:
                    raise CliError(f"cannot reach {self.base}: {exc}") from exc
            else:
                if status < 500:
                    break
                if attempt == tries - 1:
                    raise CliError(f"server error {status}")
            time.sleep(0.5 * 2**attempt)
        if status >= 400:
            text = content.decode(errors="replace")
            with contextlib.suppress(ValueError):
                text = _json.dumps(_json.loads(text))
            raise CliError(f"{status}: {text}")
        self.last = _json.loads(content) if content else None
        return self.last


# A followed rental that reached one of these has nothing more to print once its lines are read.
FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "expired", "preempted"})


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


def _cell(value: Any) -> str:
    """A table cell: a float to four significant digits (--json keeps every digit)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _duration(hours: float) -> str:
    """Hours as a person reads them: 42 s, 6.4 min, 3.2 h, 12 d."""
    seconds = hours * 3600
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:,.0f} {unit}"
    return f"{seconds:.0f} s"


def _plan_row(plan: dict) -> dict:
    """One of the advisor's plans as a table row: the memory a GPU needs in all (the JSON
    output keeps its parts), the estimated time, what booking it books and holds (to the
    micro-dollar: the hold of a short plan is cents), MFU as a percentage."""
    from decimal import Decimal

    return {
        **plan,
        "gb_per_gpu": f"{plan['per_gpu_gb']['total']:.1f}",
        "time": _duration(plan["hours"]),
        "booked": _duration(plan["booked_hours"]),
        "held": f"${Decimal(plan['hold_usd']).normalize():f}",
        "mfu": f"{plan['mfu']:.0%}",
        "flags": ",".join(plan["flags"]),
    }


def _when(stamp: str | None) -> str:
    """An API timestamp as `2026-12-06 03:10:39` (UTC), or `-`."""
    return stamp[:19].replace("T", " ") if stamp else "-"


def _rental_summary(rental: dict) -> str:
    """`gpumarket show`: what a person looks for first; --json gives the whole rental."""
    from datetime import datetime

    def span(start: str | None, end: str | None) -> str:
        if not start:
            return "-"
        text = f"{_when(start)} to {_when(end)[11:] if end else 'now'}"
        if end:
            seconds = (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
            text += f" ({_duration(max(0.0, seconds) / 3600)})"
        return text

    status = rental["status"]
    if rental["status_reason"]:
        status += f": {rental['status_reason']}"
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
        ("booked", span(rental["scheduled_start"], rental["scheduled_end"])),
        ("ran", span(rental["started_at"], rental["ended_at"])),
    ]
    if rental.get("datasets"):
        fields.append(("datasets", ", ".join(rental["datasets"])))
    fields += [("access", a["command"] or f"{a['host']}:{a['host_port']}")
               for a in rental.get("access", [])]  # fmt: skip
    lines = [f"{rental['id']}  {rental['name']}".rstrip()]
    lines += [f"{label:<9} {value}" for label, value in fields]
    lines += ["", "events"]
    lines += [f"  {_when(e['created_at'])}  {e['to_status']:<12} {e['reason']}"
              for e in rental["events"]]  # fmt: skip
    tail = rental["log_tail"].rstrip("\n").splitlines()[-5:]
    if tail:
        lines += ["", "log (last lines; `gpumarket logs ID` for all)", *(f"  {t}" for t in tail)]
    return "\n".join(lines)


def _advisor_body(args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {"tokens_b": args.tokens_b, "precision": args.precision}
    for key in ("model", "params_b", "seq_len", "deadline_hours", "budget", "region"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.interruptible:
        body["interruptible"] = True
    return body


def run(args: argparse.Namespace, api: Api) -> str:
    if args.command == "offers":
        params = {k: v for k, v in {
            "gpu_family": args.gpu_family, "gpu_model": args.gpu_model, "region": args.region,
            "min_free_gpus": args.min_free_gpus, "max_price": args.max_price,
            "ordering": args.sort, "limit": args.limit,
        }.items() if v is not None}  # fmt: skip
        rows = api.call("GET", "/api/v1/offers/", params=params)["results"]
        if not rows:
            return "no free GPUs match"
        columns = ["node_id", "hostname", "region", "gpu_name", "free_gpus"]
        return _table(rows, [*columns, "price_per_gpu_hour", "price_per_tflop_hour", "reliability"])
    if args.command == "advise":
        answer = api.call("POST", "/api/v1/advisor/", json=_advisor_body(args))
        rows = [_plan_row(p) for p in answer["plans"]]
        columns = ["id", "gpus", "gb_per_gpu", "time", "mfu", "cost", "booked", "held", "flags"]
        table = _table(rows, columns) if rows else "no plan"
        return "\n".join([table, *answer["reasons"]])
    if args.command == "book":
        which = {"plan": args.plan} if args.plan else {"card": args.card}
        body = {**_advisor_body(args), **which}
        rental = api.call("POST", "/api/v1/advisor/book/", json=body)
        return f"{rental['id']} {rental['status']}"
    if args.command == "rent":
        body = {
            "gpus_per_node": args.gpus,
            "node_count": args.nodes,
            "duration_s": int(args.hours * 3600),
            "runtime": {"image": args.image, "command": args.cmd},
        }
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
        if args.data:
            body["datasets"] = args.data
        if args.resume_from:
            body["resume_from"] = args.resume_from
        if args.ssh:
            body["ssh"] = True
        rental = api.call("POST", "/api/v1/rentals/", json=body)
        return f"{rental['id']} {rental['status']}"
    if args.command == "rentals":
        rows = api.call("GET", "/api/v1/rentals/")["results"]
        return _table(rows, ["id", "name", "status", "gpus_per_node", "node_count",
                             "price_per_gpu_hour", "status_reason"])  # fmt: skip
    if args.command == "show":
        return _rental_summary(api.call("GET", f"/api/v1/rentals/{args.id}/"))
    if args.command == "metrics":
        rows = api.call("GET", f"/api/v1/rentals/{args.id}/metrics/", params={"event": "step"})
        return _table(rows["results"], ["step", "loss", "samples_per_s", "mfu"])
    if args.command in ("stop", "cancel"):
        rental = api.call("POST", f"/api/v1/rentals/{args.id}/{args.command}/")
        return f"{rental['id']} {rental['status']}"
    if args.command == "data":
        return _data_run(args, api)
    if args.command == "artifacts":
        if args.artifacts_command == "pull":
            from pathlib import Path

            dest = Path(args.dest or args.rental)
            written = _transfer().pull(api, args.rental, dest)
            api.last = {"files": [str(path) for path in written]}
            return f"{len(written)} file{'' if len(written) == 1 else 's'} in {dest}"
        rows = list(_transfer().pages(api, f"/api/v1/rentals/{args.rental}/artifacts/"))
        api.last = rows
        return _table(rows, ["path", "size_bytes", "reason", "synced_at"]) if rows else "none"
    if args.command in ("ssh-key", "ssh-command"):
        return _ssh_run(args, api)
    if args.command == "balance":
        account = api.call("GET", "/api/v1/billing/account/")
        return "  ".join(
            f"{key.removesuffix('_micros')} ${account[key] / 1e6:,.2f}"
            for key in ("balance_micros", "available_micros", "hourly_burn_micros")
        )
    if args.command == "budget":
        return _budget_run(args, api)
    if args.command == "notify":
        return _notify_run(args, api)
    return _provider_run(args, api)


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


def _data_run(args: argparse.Namespace, api: Api) -> str:
    """Datasets: push a file or directory, list them, remove one by name (or id)."""
    if args.data_command == "push":
        from pathlib import Path

        root = Path(args.path)
        dataset = _transfer().push(api, root, args.name or root.resolve().name)
        return f"{dataset['id']} {dataset['name']} {dataset['status']} {dataset['total_bytes']} B"
    rows = list(_transfer().pages(api, "/api/v1/datasets/"))
    api.last = rows
    if args.data_command == "ls":
        columns = ["id", "name", "status", "total_bytes", "file_count", "uploaded_by", "created_at"]
        return _table(rows, columns) if rows else "no datasets"
    match = [d for d in rows if args.dataset in (d["name"], d["id"])]
    if not match:
        raise CliError(f"no dataset {args.dataset}")
    api.call("DELETE", f"/api/v1/datasets/{match[0]['id']}/")
    return f"removed {match[0]['name']}"


def _ssh_run(args: argparse.Namespace, api: Api) -> str:
    """SSH keys of the account, and the way into a rental."""
    if args.command == "ssh-command":
        rental = api.call("GET", f"/api/v1/rentals/{args.id}/")
        commands = [a["command"] for a in rental.get("access", []) if a["command"]]
        if not commands:
            raise CliError(f"no SSH into {args.id} now (status {rental['status']})")
        return "\n".join(commands)
    if args.action == "ls":
        rows = api.call("GET", "/api/v1/ssh-keys/")
        columns = ["id", "name", "key_type", "bits", "fingerprint", "added_by", "created_at"]
        return _table(rows, columns)
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


def _kinds(text: str | None) -> set[str]:
    return {k.strip() for k in (text or "").split(",") if k.strip()}


def _notify_run(args: argparse.Namespace, api: Api) -> str:
    """What you are told, by email and by webhook; each kind switched on or off per channel."""
    path = "/api/v1/notifications/settings/"
    if args.notify_command == "deliveries":
        params = {"state": args.state} if args.state else {}
        rows = api.call("GET", "/api/v1/notifications/deliveries/", params=params)["results"]
        columns = ["id", "created_at", "kind", "channel", "state", "attempts", "last_status_code"]
        return _table(rows, columns) if rows else "no deliveries"
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


def _provider_run(args: argparse.Namespace, api: Api) -> str:
    """The commands of provider owners."""
    if args.command == "nodes":
        rows = [
            row
            for provider in api.call("GET", "/api/v1/providers/")
            for row in api.call("GET", f"/api/v1/providers/{provider['id']}/nodes/")
        ]
        api.last = rows
        columns = ["id", "hostname", "region", "status", "gpu_model", "rented_gpus", "gpu_count"]
        return _table(rows, [*columns, "price_per_gpu_hour", "min_bid_per_gpu_hour"])
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
        return _table(rows, ["provider", "earned_this_month", "earned_total", "balance",
                             "paid_out"])  # fmt: skip
    if args.command == "join-token":
        body = {"provider": args.provider, "region": args.region,
                "price_per_gpu_hour": args.price, "min_bid_per_gpu_hour": args.min_bid}  # fmt: skip
        token = api.call("POST", "/api/v1/providers/join-tokens/", json=body)
        return f"gpumarket-agent --server {api.base} --join-token {token['join_token']}"
    raise CliError(f"unknown command {args.command}")


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
        namespace, rest = super().parse_known_args(args, namespace)
        if asked:
            namespace.json = True
        return namespace, rest

    def _get_formatter(self) -> argparse.HelpFormatter:
        if _Parser._width is None:
            _Parser._width = _terminal_columns() - 2  # the margin HelpFormatter leaves
        return self.formatter_class(prog=self.prog, width=_Parser._width)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpumarket", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server", default=os.environ.get("GPUMARKET_SERVER_URL", "http://127.0.0.1:8000")
    )
    parser.add_argument("--token", default=os.environ.get("GPUMARKET_TOKEN"))
    parser.set_defaults(json=False)
    # Each subparsers names its prog: argparse would build a help formatter (and import shutil,
    # with bz2 and lzma) to work it out, on every call.
    sub = parser.add_subparsers(dest="command", required=True, prog="gpumarket")
    offers = sub.add_parser("offers", help="GPUs free now")
    offers.add_argument("--gpu-family")
    offers.add_argument("--gpu-model")
    offers.add_argument("--region")
    offers.add_argument("--min-free-gpus", type=int)
    offers.add_argument("--max-price")
    offers.add_argument("--sort", default="price")
    offers.add_argument("--limit", type=int, default=20)
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
    rent = sub.add_parser("rent", help="rent GPUs for an image and command")
    rent.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    rent.add_argument("--name", help="a name to know the rental by (up to 80 characters)")
    rent.add_argument("--nodes", type=int, default=1)
    rent.add_argument("--gpu-family")
    rent.add_argument("--region")
    rent.add_argument("--max-price")
    rent.add_argument("--bid", help="interruptible, with this bid per GPU-hour")
    rent.add_argument("--hours", type=float, default=1.0)
    rent.add_argument(
        "--max-cost", help="dollars: the rental checkpoints and stops when its charge reaches this"
    )
    rent.add_argument("--image", required=True)
    rent.add_argument(
        "--data", action="append", default=[], help="a dataset (repeatable): /data/NAME"
    )
    rent.add_argument("--resume-from", help="a rental: start from its last synced checkpoint")
    rent.add_argument("cmd", nargs="*", help="the command (after --)")
    rent.add_argument("--ssh", action="store_true", help="an sshd for your SSH keys")
    keys = sub.add_parser("ssh-key", help="your team's SSH public keys")
    key_sub = keys.add_subparsers(dest="action", required=True, prog="gpumarket ssh-key")
    add_key = key_sub.add_parser("add", help="add a public key")
    add_key.add_argument("key", metavar="FILE", help="the .pub file, or - for standard input")
    add_key.add_argument("--name")
    key_sub.add_parser("ls", help="list them")
    key_sub.add_parser("rm", help="remove one").add_argument("key", metavar="ID", type=int)
    sub.add_parser("ssh-command", help="the ssh command into a rental").add_argument("id")
    sub.add_parser("rentals", help="your rentals")
    for name in ("show", "metrics", "stop", "cancel"):
        sub.add_parser(name).add_argument("id")
    data = sub.add_parser("data", help="datasets: push, ls, rm")
    data_sub = data.add_subparsers(dest="data_command", required=True, prog="gpumarket data")
    push = data_sub.add_parser("push", help="upload a file or a directory as a dataset")
    push.add_argument("path")
    push.add_argument("--name", help="the dataset's name (default: the file or folder name)")
    data_sub.add_parser("ls", help="your datasets")
    data_sub.add_parser("rm", help="delete a dataset").add_argument("dataset", help="name or id")
    artifacts = sub.add_parser("artifacts", help="a rental's synced output: ls, pull")
    artifacts_sub = artifacts.add_subparsers(
        dest="artifacts_command", required=True, prog="gpumarket artifacts"
    )
    artifacts_sub.add_parser("ls").add_argument("rental")
    pull = artifacts_sub.add_parser("pull", help="download a rental's output files")
    pull.add_argument("rental")
    pull.add_argument("dest", nargs="?", help="a folder (default: the rental id)")
    log = sub.add_parser("logs", help="the output of a rental's container")
    log.add_argument("id")
    log.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    log.add_argument("--tail", type=int, help="only the last N lines")
    log.add_argument("--interval", type=float, default=2.0, help=argparse.SUPPRESS)
    sub.add_parser("balance", help="your credit, what is available, what running rentals cost")
    budget = sub.add_parser("budget", help="your monthly budget and limits: show, or set")
    budget.add_argument("--monthly", help="dollars per month; 'none' removes the budget")
    budget.add_argument("--warn-percent", help="warn at this share of the monthly budget")
    budget.add_argument("--max-gpus", help="GPUs at once; 'none': the account's ceiling")
    budget.add_argument("--max-rentals-per-minute", help="'none': the account's ceiling")
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
    return parser


def _transfer():
    from marketplace import cli_transfer

    return cli_transfer


def _transfer_errors() -> tuple[type[Exception], ...]:
    """TransferError once a file command loaded the transfers module (only then can it raise)."""
    module = sys.modules.get("marketplace.cli_transfer")
    return (module.TransferError,) if module else ()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api = Api(args.server, args.token)
    try:
        if args.command == "logs":
            logs(args, api)
            return 0
        text = run(args, api)
        print(json.dumps(api.last, indent=2) if args.json else text)
    except (CliError, *_transfer_errors()) as exc:
        print(f"gpumarket: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`gpumarket logs ID | head`): stop quietly, as `cat` does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer cut off
    return 0


if __name__ == "__main__":
    sys.exit(main())
