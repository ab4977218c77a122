"""The whole marketplace on one control plane: 10,000 simulated nodes, customers, billing at once.

Runs the real deployables on this machine in the production layout (deploy/): the customers'
web and the agent API, each under its own gunicorn (config/gunicorn.py) so that neither's
slow requests hold the threads the other's wait for; Celery workers in one pool per queue
(CELERY_TASK_ROUTES: the scheduler's cycles, the billing pass, the rest), Celery beat with the
product's own schedule (scheduler tick, node sweeps, telemetry flush, the billing pass every
minute), PostgreSQL and Redis. Against them one asyncio process (aiohttp) plays, at once:

- every node's agent, heartbeating at the production interval (HEARTBEAT_INTERVAL_S) with
  telemetry for its 8 GPUs; the nodes that run rentals also send, per run, a container report,
  a usage report, a harness step line and two log lines (bench/agents.py's Host, imported);
- customers of `--teams` teams (50) creating rentals through the REST API at 50/s, in turn
  (open loop: a slow answer does not slow the arrivals), stopping each one a while later, and
  browsing offers (GET offers) and the advisor (POST advisor). Many teams, as a marketplace
  has: a create locks its team's billing account row, so one team's creates queue on it.

Set-up is not measured: the inventory is COPYed (bench/_common.build_inventory), the nodes'
credentials COPYed beside it, and the busy nodes' rentals booked through rental_create and one
in-process scheduler cycle. Then, each beside the others' absence, short single-component
phases (heartbeats alone, offers alone, creates alone), and the whole load for `--seconds`.

Printed: heartbeat p50 / p99 and handled vs offered rate, create->SCHEDULED p50 / p99 (from the
rental's event rows), offers and advisor p95, the billing lag (the age of the oldest usage not
yet rated: now - the rating time of the meters with newer reports, sampled every 5 s), and the
CPU seconds each process group used (web, worker, beat, the database's backends, Redis, the
load generator; psutil), beside the same figures of the single-component phases; and each
billing pass's duration (its log line in the billing pool's log).

    python bench/marketplace.py [--nodes 10000] [--seconds 300] [--busy-fraction 0.2]
                                [--create-rate 50] [--teams 50] [--baseline-seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

from _common import (
    ROOT,
    CpuMeter,
    Sampler,
    bench_database,
    build_inventory,
    emit,
    funded_team,
    gunicorn,
    parse_args,
    percentile,
)
from agents import Host, run_agents
from launch import wake_server
from offers import QUERY

TARGETS = {"heartbeat_p99_ms": 250, "create_scheduled_p99_s": 1.0, "offers_p95_ms": 100,
           "billing_lag_s": 120}  # fmt: skip
RENTAL_BODY = {"gpus_per_node": 1, "duration_s": 3600, "network": "internal",
               "runtime": {"image": "gpumarket/harness:dev"}}  # fmt: skip
ADVISOR_BODY = {"params_b": 0.5, "tokens_b": 1}


def node_tokens(url: str) -> list[tuple[int, str]]:
    """A live node token for every node of the inventory, COPYed as the join would store it:
    (node id, token)."""
    import io

    import psycopg

    from accounts.services import token_hash, token_mint
    from provisioning.models import NodeCredential

    table = NodeCredential._meta.db_table
    with psycopg.connect(url) as conn:
        ids = [r[0] for r in conn.execute("SELECT id FROM marketplace_node ORDER BY id")]
        tokens = [token_mint("gpn")[1] for _ in ids]
        rows = io.StringIO()
        for node_id, raw in zip(ids, tokens, strict=True):
            rows.write(f"{node_id}\t{token_hash(raw)}\tnow\n")
        with conn.cursor().copy(f"COPY {table} (node_id, key_hash, created_at) FROM STDIN") as cp:
            cp.write(rows.getvalue())
    return list(zip(ids, tokens, strict=True))


def book_busy(rentals: int) -> int:
    """`rentals` rentals of 4 GPUs booked through rental_create and placed by the scheduler
    (best fit puts two on a node): the busy nodes' runs. Returns how many were placed."""
    from marketplace.models import Rental, RentalStatus
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
    from scheduler.services import scheduler_cycle_run

    customer, team = funded_team("busy")
    request = RentalRequest(
        gpus_per_node=4,
        duration_s=7200,
        network="internal",
        runtime=RuntimeSpec(image="gpumarket/harness:dev", command=["python", "train.py"]),
    )
    for _ in range(rentals):
        rental_create(customer=customer, team=team, request=request)
    for _ in range(20):
        scheduler_cycle_run()
        if not Rental.objects.filter(team=team, status=RentalStatus.PENDING).exists():
            break
    return Rental.objects.filter(team=team, status=RentalStatus.SCHEDULED).count()


def busy_node_ids() -> set[int]:
    """The nodes holding the busy rentals' GPUs."""
    from marketplace.models import Allocation

    rows = Allocation.objects.filter(rental__customer__username="busy", released_at__isnull=True)
    return set(rows.values_list("node_id", flat=True))


def steady_idle(agent_base: str, hosts: list[Host], interval: float) -> float:
    """Put the idle `hosts` where a fleet that has been running has them: one heartbeat of the
    first says the interval the server asks idle nodes for; every host is then heard from now,
    stored at that interval (as its own heartbeat stores it), and due at a random phase of it.
    Returns the interval."""
    if not hosts:
        return interval
    asyncio.run(run_agents(agent_base, hosts[:1], interval, interval, follow=True))
    idle = hosts[0].interval or interval
    from django.utils import timezone

    from marketplace.models import Node
    from provisioning.services import heartbeat_interval_s

    stored = int(idle) if idle > heartbeat_interval_s() else 0
    Node.objects.filter(pk__in=[h.node_id for h in hosts]).update(
        last_seen_at=timezone.now(), heartbeat_interval_s=stored
    )
    rng = random.Random(7)
    now = time.monotonic()
    for host in hosts:
        host.interval = idle
        host.next_at = now + rng.uniform(0, idle)
    return idle


def busy_statuses() -> dict[str, int]:
    from django.db.models import Count

    from marketplace.models import Rental

    rows = Rental.objects.filter(customer__username="busy").values_list("status")
    return dict(rows.annotate(n=Count("id")).order_by())


LOG_DIR = ROOT / ".var" / "bench"
# The worker pools of deploy/ (one per queue of CELERY_TASK_QUEUES), with their process counts.
WORKER_POOLS = {"celery": 2, "scheduler": 1, "billing": 1}


@contextmanager
def celery(*args: str, name: str, level: str = "warning"):
    """A Celery process of the project (`celery -A config ARGS`), its log under .var/bench."""
    log_path = LOG_DIR / f"marketplace-{name}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", *args, "-l", level],
        cwd=ROOT, env={**os.environ, "LOG_LEVEL": level.upper()}, stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    process.log_path = log_path
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # a warm shutdown waits for its tasks: not this long
            process.kill()
            process.wait(10)


class Watch(Sampler):
    """What the database shows while the load runs, from one connection in a thread:
    - every second, what each busy backend of this database is doing (its wait event, or CPU,
      and the start of its statement): where the time goes when something is the bottleneck;
    - every 5 s, the billing lag: how long the oldest usage not yet rated has waited, from the
      sample that first saw its meter's reports newer than its rating (so up to 5 s short);
      beside it the /metrics gauge's figure, now - the meter's last rating, which overstates
      the wait of a meter whose reports resume after a gap (a pass rates only meters with new
      reports): a minute-long heartbeat outage reads as a minute of billing lag; and how long
      ago the newest rating was (the last pass that rated anything)."""

    def __init__(self, url: str) -> None:
        from collections import Counter

        import psycopg

        from billing.models import UsageMeter

        super().__init__()
        self.table = UsageMeter._meta.db_table
        self.conn = psycopg.connect(url, autocommit=True)
        # (lag, the gauge's lag, since the newest rating)
        self.billing: list[tuple[float, float, float | None]] = []
        self.unrated: dict[int, tuple[int, float]] = {}  # meter -> (rated_version, first seen)
        self.activity: Counter = Counter()
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        for wait, query in self.conn.execute(
            "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'),"
            " regexp_replace(left(query, 70), '\\s+', ' ', 'g') FROM pg_stat_activity"
            " WHERE datname = current_database() AND state = 'active'"
            " AND pid <> pg_backend_pid()"
        ).fetchall():
            self.activity[(wait, query)] += 1
        if self.ticks % 5:
            return
        now = time.monotonic()
        gauge, since = self.conn.execute(
            "SELECT EXTRACT(EPOCH FROM now() - min(coalesce(rated_at, created_at))"
            " FILTER (WHERE rated_version < usage_version)),"
            f" EXTRACT(EPOCH FROM now() - max(rated_at)) FROM {self.table}"
        ).fetchone()
        rows = self.conn.execute(
            f"SELECT id, rated_version FROM {self.table} WHERE rated_version < usage_version"
        ).fetchall()
        unrated = {}
        for meter, rated in rows:
            before, seen = self.unrated.get(meter, (rated, now))
            # A meter rated since the last sample has waited only since this one.
            unrated[meter] = (rated, seen if rated == before else now)
        self.unrated = unrated
        lag = now - min((seen for _, seen in self.unrated.values()), default=now)
        self.billing.append((lag, float(gauge or 0.0), None if since is None else float(since)))

    def figures(self) -> dict:
        lags = [lag for lag, _, _ in self.billing]
        return {
            "samples": len(lags),
            "max_lag_s": max(lags, default=0.0),
            "end_lag_s": lags[-1] if lags else 0.0,
            "gauge_max_lag_s": max((g for _, g, _ in self.billing), default=0.0),
            "since_last_rating_s": self.billing[-1][2] if self.billing else None,
            # Busy backends on average (per second sampled), by what they were doing.
            "db_busy": [(round(n / max(1, self.ticks), 2), wait, query)
                        for (wait, query), n in self.activity.most_common(8)],
        }  # fmt: skip

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.conn.close()


class Customers:
    """The customers' side, open loop over one aiohttp session: creates (each stopped `life`
    seconds later, the teams' tokens in turn), offers pages and advisor answers, each at its
    own rate."""

    def __init__(self, session, base: str, tokens: list[str], life: float) -> None:
        self.session, self.base, self.life = session, base, life
        self.teams = [{"Authorization": f"Bearer {token}"} for token in tokens]
        self.turn = 0
        self.created: list[tuple[str, float]] = []  # (rental id, create latency ms)
        self.create_errors: list[str] = []
        self.stops: dict[int, int] = {}
        self.offers: list[float] = []
        self.advice: list[float] = []
        self.errors: dict[str, int] = {"offers": 0, "advisor": 0, "stop": 0}

    async def _timed(self, method: str, path: str, kind: str, **kwargs) -> float | None:
        import aiohttp

        t0 = time.perf_counter()
        try:
            async with self.session.request(method, self.base + path, **kwargs) as r:
                await r.read()
                ok = r.status < 400
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if not ok:
            self.errors[kind] += 1
            return None
        return (time.perf_counter() - t0) * 1000

    async def create(self, deadline: float) -> None:
        import aiohttp

        headers = self.teams[self.turn % len(self.teams)]
        self.turn += 1
        t0 = time.perf_counter()
        try:
            async with self.session.post(
                self.base + "/api/v1/rentals/", json=RENTAL_BODY, headers=headers
            ) as r:
                answer = await r.json(content_type=None)
                if r.status != 201:
                    self.create_errors.append(f"{r.status} {str(answer)[:200]}")
                    return
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.create_errors.append(f"{type(exc).__name__} {exc}"[:200])
            return
        self.created.append((answer["id"], (time.perf_counter() - t0) * 1000))
        wait = min(self.life, deadline - time.monotonic())
        if wait < self.life:
            return
        await asyncio.sleep(wait)
        try:
            path = f"{self.base}/api/v1/rentals/{answer['id']}/stop/"
            async with self.session.post(path, headers=headers) as r:
                await r.read()
                self.stops[r.status] = self.stops.get(r.status, 0) + 1
        except (aiohttp.ClientError, TimeoutError):
            self.errors["stop"] += 1

    async def offer(self, deadline: float) -> None:
        ms = await self._timed("GET", "/api/v1/offers/", "offers", params=QUERY)
        if ms is not None:
            self.offers.append(ms)

    async def advise(self, deadline: float) -> None:
        ms = await self._timed("POST", "/api/v1/advisor/", "advisor", json=ADVISOR_BODY)
        if ms is not None:
            self.advice.append(ms)


async def open_loop(rate: float, seconds: float, fire) -> None:
    """`fire(deadline)` at `rate` a second for `seconds`, each call its own task: arrivals keep
    their schedule however slowly the server answers."""
    if rate <= 0:
        return
    start = time.monotonic()
    deadline = start + seconds
    tasks = []
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(fire(deadline)))
    await asyncio.gather(*tasks)


async def customers_run(base: str, tokens: list[str], seconds: float, rates: dict, life: float):
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        people = Customers(session, base, tokens, life)
        await asyncio.gather(
            open_loop(rates.get("create", 0), seconds, people.create),
            open_loop(rates.get("offers", 0), seconds, people.offer),
            open_loop(rates.get("advisor", 0), seconds, people.advise),
        )
    return people


def scheduled_latencies(ids: list[str], wait_s: float = 60.0) -> tuple[list[float], int]:
    """Seconds from each rental's creation to its SCHEDULED event (waiting up to `wait_s` for
    the queue to drain); and how many were still PENDING at the end."""
    from django.db import connection

    from marketplace.models import Rental, RentalEvent

    rental, event = Rental._meta.db_table, RentalEvent._meta.db_table
    deadline = time.monotonic() + wait_s
    with connection.cursor() as cursor:
        while True:
            cursor.execute(
                f"SELECT count(*) FROM {rental} WHERE id = ANY(%s::uuid[]) AND status = 'pending'",
                [ids],
            )
            pending = cursor.fetchone()[0]
            if pending == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        cursor.execute(
            f"SELECT EXTRACT(EPOCH FROM (e.created_at - r.created_at)) FROM {rental} r"
            f" JOIN {event} e ON e.rental_id = r.id AND e.to_status = 'scheduled'"
            " WHERE r.id = ANY(%s::uuid[])",
            [ids],
        )
        return [float(row[0]) for row in cursor.fetchall()], pending


def phase(
    meter: CpuMeter,
    seconds: float,
    *,
    base: str,
    agent_base: str,
    tokens: list[str],
    hosts: list[Host] | None,
    interval: float,
    rates: dict,
    life: float,
) -> dict:
    """One measured phase: the heartbeats of `hosts` (if any, to the agent API at `agent_base`)
    and the customers at `rates` (to the web at `base`), together in one event loop; its
    figures and each process group's CPU seconds."""

    async def both():
        agents = (
            run_agents(agent_base, hosts, seconds, interval, follow=True)
            if hosts
            else asyncio.sleep(0, ([], 0))
        )
        return await asyncio.gather(agents, customers_run(base, tokens, seconds, rates, life))

    cpu0 = meter.totals()
    t0 = time.monotonic()
    (latencies, errors), people = asyncio.run(both())
    wall = time.monotonic() - t0
    cpu = {k: v - cpu0[k] for k, v in meter.totals().items()}
    # What each phase served, to turn its CPU seconds into milliseconds per request.
    served = len(latencies) - errors + len(people.created) + len(people.offers) + len(people.advice)
    out: dict = {"seconds": wall, "cpu": cpu, "served": served}
    if hosts:
        out["heartbeat"] = {
            # Each host at the interval the server asked it for (idle ones less often in a
            # large fleet with a wake server: provisioning.services.heartbeat).
            "offered_per_s": sum(1 / (h.interval or interval) for h in hosts),
            "handled_per_s": (len(latencies) - errors) / seconds,
            "errors": errors,
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            # Per heartbeat answered: one the agent gave up on may never have been served.
            "cpu_ms_agent_api": cpu["agent_api"] * 1000 / max(1, len(latencies) - errors),
        }
    if rates.get("create"):
        ids = [rental_id for rental_id, _ in people.created]
        waits, pending = scheduled_latencies(ids) if ids else ([], 0)
        out["create"] = {
            "offered_per_s": rates["create"],
            "achieved_per_s": len(ids) / seconds,
            "errors": len(people.create_errors),
            "first_error": people.create_errors[0] if people.create_errors else "",
            "http_p99_ms": percentile([ms for _, ms in people.created], 99) if ids else None,
            "scheduled": len(waits),
            "pending_after": pending,
            "p50": percentile(waits, 50) if waits else None,
            "p99": percentile(waits, 99) if waits else None,
            "stops": people.stops,
        }
    if rates.get("offers"):
        out["offers"] = {
            "n": len(people.offers),
            "errors": people.errors["offers"],
            "p50": percentile(people.offers, 50) if people.offers else None,
            "p95": percentile(people.offers, 95) if people.offers else None,
        }
    if rates.get("advisor"):
        out["advisor"] = {
            "n": len(people.advice),
            "errors": people.errors["advisor"],
            "p95": percentile(people.advice, 95) if people.advice else None,
        }
    return out


_PASS_LINE = re.compile(r"Task billing\.pass\[[^\]]+\] succeeded in ([\d.]+)s")


def billing_passes(log_path) -> list[float]:
    """The seconds each billing pass took (one that found another running takes none), from
    the billing pool's log."""
    return [float(t) for t in _PASS_LINE.findall(log_path.read_text(errors="replace"))]


def _fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(args, setup: dict, alone: dict, whole: dict, billing: dict) -> dict:
    hb, hb0 = whole["heartbeat"], alone["heartbeat"]["heartbeat"]
    cr, cr0 = whole["create"], alone["create"]["create"]
    of, of0 = whole["offers"], alone["offers"]["offers"]
    print(
        f"{args.nodes} nodes x 8 GPUs, heartbeat every {args.interval:g} s to the agent API's"
        f" own processes; creates from {args.teams} teams"
        f"{', idle nodes as the server asks (wake server)' if setup['wake'] else ''}"
        f" ({hb['offered_per_s']:.0f}/s offered); {setup['busy_nodes']} nodes busy with"
        f" {setup['runs']} runs; set-up {setup['seconds']:.0f} s (not measured)"
    )
    print(f"whole load for {whole['seconds']:.0f} s; alone phases {args.baseline_seconds:g} s each")
    print(
        f"heartbeats: handled {hb['handled_per_s']:.0f}/s of {hb['offered_per_s']:.0f}/s"
        f" ({hb['errors']} errors), p50 {hb['p50']:.1f} ms, p99 {hb['p99']:.1f} ms;"
        f" alone {hb0['handled_per_s']:.0f}/s, p50 {hb0['p50']:.1f} ms, p99 {hb0['p99']:.1f} ms"
    )
    print(
        f"creates at {cr['offered_per_s']:g}/s: achieved {cr['achieved_per_s']:.1f}/s"
        f" ({cr['errors']} errors {cr['first_error']}), {cr['scheduled']} scheduled,"
        f" {cr['pending_after']} still pending; create->SCHEDULED p50 {_fmt(cr['p50'], '.2f')} s,"
        f" p99 {_fmt(cr['p99'], '.2f')} s (POST p99 {_fmt(cr['http_p99_ms'])} ms);"
        f" alone p50 {_fmt(cr0['p50'], '.2f')} s, p99 {_fmt(cr0['p99'], '.2f')} s;"
        f" stops answered {cr['stops']}"
    )
    ad, ad0 = whole["advisor"], alone["offers"]["advisor"]
    print(
        f"offers ({of['n']} GETs, {of['errors']} errors): p50 {_fmt(of['p50'])} ms,"
        f" p95 {_fmt(of['p95'])} ms; alone p95 {_fmt(of0['p95'])} ms;"
        f" advisor p95 {_fmt(ad['p95'])} ms, alone {_fmt(ad0['p95'])} ms"
    )
    passes = billing["passes"]
    print(
        f"billing: lag max {billing['max_lag_s']:.0f} s, at the end {billing['end_lag_s']:.0f} s"
        f" ({billing['samples']} samples every 5 s; the pass runs every 60 s); the gauge's"
        f" (since the meter's last rating) max {billing['gauge_max_lag_s']:.0f} s;"
        f" newest rating {_fmt(billing['since_last_rating_s'], '.0f')} s before the end;"
        f" {len(passes)} passes in the run (warm-up included), longest"
        f" {max(passes, default=0):.1f} s"
    )
    print("database backends busy (average per second, by wait event or CPU, and statement):")
    for busy, wait, query in billing["db_busy"]:
        print(f"  {busy:5.2f}  {wait:28s} {query}")
    # CPU per request in the single-component phases: what one core of each tier serves.
    per_request = {
        name: {g: round(part["cpu"][g] * 1000 / max(1, part["served"]), 2)
               for g in ("web", "agent_api", "worker", "postgres")}
        for name, part in alone.items()
    }  # fmt: skip
    print("CPU ms per request alone (heartbeat; create; offers and advisor):")
    for name, costs in per_request.items():
        cells = ", ".join(f"{g} {ms:.2f} ms ({1000 / ms if ms else 0:,.0f}/s a core)"
                          for g, ms in costs.items())  # fmt: skip
        print(f"  {name:9s} ({alone[name]['served']} served): {cells}")
    groups = list(whole["cpu"])
    print("CPU seconds per process group (cores busy = seconds / wall):")
    for name, part in [*alone.items(), ("whole", whole)]:
        cells = ", ".join(f"{g} {part['cpu'][g]:.1f}" for g in groups)
        busy = sum(part["cpu"].values()) / part["seconds"]
        print(f"  {name:9s} ({part['seconds']:.0f} s): {cells}; {busy:.2f} cores")
    met = {
        "heartbeat_p99": hb["p99"] < TARGETS["heartbeat_p99_ms"] and hb["errors"] == 0,
        "create_scheduled_p99": cr["p99"] is not None
        and cr["p99"] < TARGETS["create_scheduled_p99_s"]
        and cr["achieved_per_s"] >= 0.95 * cr["offered_per_s"]
        and cr["pending_after"] == 0,
        "offers_p95": of["p95"] is not None and of["p95"] < TARGETS["offers_p95_ms"],
        "billing_lag": billing["samples"] > 0 and billing["max_lag_s"] < TARGETS["billing_lag_s"],
    }
    met["all"] = all(met.values())
    print(
        "targets (heartbeat p99 < 250 ms, create->SCHEDULED p99 < 1 s at the offered rate,"
        " offers p95 < 100 ms, billing lag < 2 min, all at once): "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items())
    )
    whole_cpu = whole["cpu"]
    return {
        "nodes": args.nodes,
        "interval_s": args.interval,
        "idle_interval_s": setup["idle_interval_s"],
        "wake": setup["wake"],
        "seconds": round(whole["seconds"], 1),
        "busy_nodes": setup["busy_nodes"],
        "heartbeats_offered_per_s": round(hb["offered_per_s"], 1),
        "heartbeats_handled_per_s": round(hb["handled_per_s"], 1),
        "heartbeat_errors": hb["errors"],
        "heartbeat_p50_ms": round(hb["p50"], 1),
        "heartbeat_p99_ms": round(hb["p99"], 1),
        "heartbeat_p99_alone_ms": round(hb0["p99"], 1),
        "heartbeats_handled_alone_per_s": round(hb0["handled_per_s"], 1),
        "agent_api_cpu_ms_per_heartbeat_alone": round(hb0["cpu_ms_agent_api"], 2),
        "teams": args.teams,
        "creates_offered_per_s": cr["offered_per_s"],
        "creates_per_s": round(cr["achieved_per_s"], 1),
        "create_errors": cr["errors"],
        "create_scheduled_p50_s": cr["p50"] and round(cr["p50"], 3),
        "create_scheduled_p99_s": cr["p99"] and round(cr["p99"], 3),
        "create_scheduled_p99_alone_s": cr0["p99"] and round(cr0["p99"], 3),
        "creates_pending_after": cr["pending_after"],
        "offers_p95_ms": of["p95"] and round(of["p95"], 1),
        "offers_p95_alone_ms": of0["p95"] and round(of0["p95"], 1),
        "advisor_p95_ms": ad["p95"] and round(ad["p95"], 1),
        "billing_lag_max_s": round(billing["max_lag_s"], 1),
        "billing_lag_end_s": round(billing["end_lag_s"], 1),
        "billing_lag_gauge_max_s": round(billing["gauge_max_lag_s"], 1),
        "billing_pass_max_s": round(max(passes, default=0.0), 2),
        "cpu_s": {k: round(v, 1) for k, v in whole_cpu.items()},
        "db_busy_top": billing["db_busy"][:3],
        "cpu_ms_per_request_alone": per_request,
        "cpu_s_alone": {k: {g: round(v, 1) for g, v in p["cpu"].items()} for k, p in alone.items()},
        "targets_met": met,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=300.0, help="the whole load's length")
    parser.add_argument("--baseline-seconds", type=float, default=30.0,
                        help="length of each single-component phase")  # fmt: skip
    parser.add_argument("--busy-fraction", type=float, default=0.2,
                        help="share of the nodes running two 4-GPU rentals each")  # fmt: skip
    parser.add_argument("--create-rate", type=float, default=50.0, help="REST creates a second")
    parser.add_argument("--offers-rate", type=float, default=10.0, help="offers GETs a second")
    parser.add_argument("--advisor-rate", type=float, default=1.0, help="advisor POSTs a second")
    parser.add_argument("--life", type=float, default=60.0, help="seconds before each stop")
    parser.add_argument(
        "--interval", type=float, help="seconds between heartbeats (default HEARTBEAT_INTERVAL_S)"
    )
    parser.add_argument("--teams", type=int, default=50, help="customers' teams creating in turn")
    parser.add_argument("--workers", type=int, help="web gunicorn processes (default: 2 per core)")
    parser.add_argument(
        "--agent-workers", type=int, help="agent API gunicorn processes (default: 2 per core)"
    )
    parser.add_argument(
        "--no-wake",
        dest="wake",
        action="store_false",
        help="run without the wake server (every node at the base interval)",
    )
    args = parse_args(parser, nodes=50, seconds=10.0, baseline_seconds=2.0, create_rate=5.0,
                      offers_rate=2.0, advisor_rate=1.0, life=4.0, interval=1.0,
                      teams=3)  # fmt: skip
    # The processes' logs; wake_server (launch.py) writes there too, and a fresh clone has none.
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    # The customers' mail (a rental started, failed) goes to a relay that takes it at once, as
    # production's does: with none listening here every delivery would fail, and the
    # notification sweep's retries would fill the default queue.
    os.environ.setdefault("EMAIL_BACKEND", "django.core.mail.backends.dummy.EmailBackend")
    with bench_database("gpumarket_bench_marketplace") as url:
        from django.conf import settings

        if args.interval is None:
            args.interval = float(settings.GPUMARKET["HEARTBEAT_INTERVAL_S"])
        t0 = time.monotonic()
        build_inventory(url, args.nodes)
        hosts = []
        for node_id, token in node_tokens(url):
            hosts.append(Host(token))
            hosts[-1].node_id = node_id
        placed = book_busy(int(args.nodes * args.busy_fraction) * 2)
        from accounts.services.tokens import api_token_create

        api_tokens = []
        for i in range(args.teams):
            customer, team = funded_team(f"customer{i}")
            api_tokens.append(api_token_create(user=customer, team=team, name="bench")[1])
        setup_s = time.monotonic() - t0
        print(f"set-up: {args.nodes} nodes, {placed} busy rentals placed in {setup_s:.1f} s",
              flush=True)  # fmt: skip
        from django.utils import timezone

        from marketplace.models import Node

        # As if every agent had just heartbeaten: the silent-node sweep's first pass would
        # otherwise take every COPYed node (never seen) offline, one transaction each.
        Node.objects.update(last_seen_at=timezone.now())
        # The statistics autovacuum keeps on a production database (the shared server here runs
        # without it): the set-up's allocations came after build_inventory's ANALYZE, and
        # without their statistics the offers statement is planned as a nested loop (155 ms a
        # page at 10,000 nodes, 26 ms with them).
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        extra = {"AGENT_THROTTLE_RATE": "100000000/min", "LOG_LEVEL": "WARNING"}
        with ExitStack() as stack:
            beat_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-beat-"))
            # The wake server the product runs beside the web (dev.py up, deploy/): with it, a
            # placement reaches its node at once and idle nodes heartbeat less often.
            wake_url = stack.enter_context(wake_server()) if args.wake else None
            server = stack.enter_context(gunicorn(workers=args.workers, extra_env=extra))
            # The agent API in gunicorn processes of its own (deploy/: its own pods), the same
            # server: heartbeats never wait for threads that customers' pages hold.
            agent_api = stack.enter_context(gunicorn(workers=args.agent_workers, extra_env=extra))
            pools = {
                queue: stack.enter_context(celery(
                    "worker", "-Q", queue, "-c", str(processes), "-n", f"{queue}@%h",
                    name=f"worker-{queue}",
                    # The billing pool logs each pass (its duration, for the report).
                    level="info" if queue == "billing" else "warning",
                ))
                for queue, processes in WORKER_POOLS.items()
            }  # fmt: skip
            beat = stack.enter_context(
                celery("beat", "-s", os.path.join(beat_dir, "schedule"), name="beat")
            )
            roots = {"web": [server.pid], "agent_api": [agent_api.pid],
                     "worker": [p.pid for p in pools.values()], "beat": [beat.pid],
                     "loadgen": [os.getpid()]}  # fmt: skip
            database = urlsplit(url).path.strip("/")
            redis_port = urlsplit(os.environ["REDIS_URL"]).port
            meter = stack.enter_context(CpuMeter(roots, database, redis_port))
            base, agent_base = server.base_url, agent_api.base_url
            up = time.monotonic()
            # The steady state is measured, not a start: first the busy nodes alone learn
            # their runs from the answers and report them running, until all run or three
            # rounds change nothing; then every idle node is as in a fleet that has been
            # running: heard from, asked for the interval the server gives idle nodes (one
            # real heartbeat's answer says which), each at its own phase of it.
            busy_ids = busy_node_ids()
            busy_hosts = [h for h in hosts if h.node_id in busy_ids]
            idle_hosts = [h for h in hosts if h.node_id not in busy_ids]
            # The busy nodes spread over a busy interval (BUSY_HEARTBEAT_MAX_S), as a running
            # fleet's are, not all within the first seconds. Rounds of at least 15 s: a refused
            # node comes back after up to a minute.
            rng = random.Random(11)
            for host in busy_hosts:
                host.next_at = time.monotonic() + rng.uniform(0, max(15.0, args.interval))
            deadline, seen = time.monotonic() + max(300.0, 6 * args.interval), []
            while time.monotonic() < deadline:
                # The idle nodes, silent meanwhile, are kept as heard from: the silent-node
                # sweep would take them offline, which no running fleet is.
                Node.objects.filter(pk__in=[h.node_id for h in idle_hosts]).update(
                    last_seen_at=timezone.now()
                )
                asyncio.run(
                    run_agents(agent_base, busy_hosts, max(15.0, args.interval), args.interval,
                               follow=True)
                )  # fmt: skip
                seen.append(statuses := busy_statuses())
                if statuses.get("running", 0) >= placed or seen[-5:] == [statuses] * 5:
                    break
            idle_s = steady_idle(agent_base, idle_hosts, args.interval)
            runs = sum(len(h.runs) for h in hosts)
            print(
                f"warm-up: busy rentals {busy_statuses()} after {time.monotonic() - up:.0f} s"
                f" of heartbeats (processes up in {up - t0 - setup_s:.0f} s); idle nodes asked"
                f" for one every {idle_s:g} s",
                flush=True,
            )
            setup = {"seconds": setup_s, "busy_nodes": sum(1 for h in hosts if h.runs),
                     "runs": runs, "wake": bool(wake_url), "idle_interval_s": idle_s}  # fmt: skip
            common = {"base": base, "agent_base": agent_base, "tokens": api_tokens,
                      "interval": args.interval, "life": args.life}  # fmt: skip
            rates = {"create": args.create_rate, "offers": args.offers_rate,
                     "advisor": args.advisor_rate}  # fmt: skip
            alone = {
                "heartbeat": phase(meter, args.baseline_seconds, hosts=hosts, rates={}, **common),
                "offers": phase(meter, args.baseline_seconds, hosts=None, **common,
                                rates={"offers": args.offers_rate, "advisor": args.advisor_rate}),
                "create": phase(meter, args.baseline_seconds, hosts=None, **common,
                                rates={"create": args.create_rate}),
            }  # fmt: skip
            with Watch(url) as watch:
                whole = phase(meter, args.seconds, hosts=hosts, rates=rates, **common)
            billing = watch.figures()
        billing["passes"] = billing_passes(pools["billing"].log_path)
    emit(report(args, setup, alone, whole, billing))


if __name__ == "__main__":
    sys.exit(main())
