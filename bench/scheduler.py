"""Scheduler throughput at marketplace scale: 10,000 nodes, 80,000 GPUs, 20,000 pending rentals.

Prints, each beside a baseline measured in the same run:
- engine-only decisions/s (the pure planner on a snapshot) and the share of whole free 8-GPU
  nodes best-fit keeps versus first-fit on the same snapshot;
- end-to-end placements/s of one cycle (snapshot + plan + bind through the exclusion
  constraint), beside the single-row INSERT rate of the same PostgreSQL as the ceiling;
- streaming: rentals created through rental_create (the real service) at 25, 50, 100 and
  200/s for 20 s each, a real Celery worker running the cycles: per rate the achieved rate and
  p50 / p99 create->SCHEDULED, beside the one-thread rental_create rate;
- creates through the REST API under gunicorn (4 keep-alive clients, one team, from cold
  connections) beside the same server's /healthz rate, and the `gpumarket rent` call time
  beside a bare interpreter start.

    python bench/scheduler.py [--nodes 10000] [--pending 20000] [--rates 25 50 100 200]
                              [--seconds 20] [--parts cycle stream api]

`--parts api --nodes 64 --pending 0` measures creates alone, on the cluster size of the
comparison with Slurm; `--parts stream --pending 0` streams into an empty queue.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager

from _common import (
    RENTAL_COPY,
    ROOT,
    CpuMeter,
    bench_database,
    bench_team,
    build_inventory,
    emit,
    gunicorn,
    median,
    parse_args,
    percentile,
)
from launch import wake_server

# gpus per node, nodes, weight %: about 2.25 GPUs a rental, so 20,000 rentals ask ~45,000 of the
# ~57,000 GPUs free, and how they are packed decides how many whole nodes stay free.
SIZES = [(1, 1, 55), (2, 1, 25), (4, 1, 12), (8, 1, 7), (8, 2, 1)]


def insert_pending(url: str, count: int, seed: int = 11) -> int:
    """COPY `count` pending rentals of mixed sizes (some gangs, some model or NVLink bound)."""
    import psycopg

    rng = random.Random(seed)
    weights = [w for *_, w in SIZES]
    with psycopg.connect(url) as conn:
        user_id = conn.execute("SELECT id FROM marketplace_user LIMIT 1").fetchone()[0]
        team_id = bench_team(user_id)
        rows = io.StringIO()
        gpus = 0
        t0 = time.time()
        for i in range(count):
            k, m, _ = rng.choices(SIZES, weights)[0]
            gpus += k * m
            families = "{a100,h100}" if rng.random() < 0.2 else "{}"
            same_group = "t" if k == 4 and rng.random() < 0.5 else "f"
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 - count + i))
            created += f".{i % 1000:03d}+00"
            deadline = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(t0 + 3600))
            rows.write(
                f"{uuid.uuid4()}\t{user_id}\t\tpending\twaiting\t{{}}\t{families}\t0\t0\t{k}\t{m}"
                f"\t{same_group}\t\tdefault\t\\N\ton_demand\t\\N\t0\t{created}\t{deadline}"
                f"\t{rng.choice([3600, 7200, 14400, 28800])}\timg\t[]\t\\N\t{{}}\t{{}}\t\\N\t\\N"
                f"\t\\N\t\\N\t\\N\t\\N\t\t{created}\t{created}\t{team_id}\tf\n"
            )
        with conn.cursor().copy(RENTAL_COPY) as copy:
            copy.write(rows.getvalue())
        conn.commit()
        conn.execute("ANALYZE marketplace_rental")
    return gpus


def whole_free_nodes(snapshot, plan) -> int:
    """8-GPU nodes with no GPU busy now and none placed by the plan."""
    used = {b.gpu_id for b in snapshot.busy if b.start <= snapshot.now < b.end}
    placed_nodes = {node_id for p in plan.placements for node_id, _ in p.nodes}
    return sum(
        1
        for node in snapshot.nodes
        if len(node.gpus) == 8
        and node.node_id not in placed_nodes
        and not any(g.gpu_id in used for g in node.gpus)
    )


def engine_only(pool: str = "default") -> dict:
    from django.utils import timezone

    from scheduler.engine import planner
    from scheduler.engine.types import Policy
    from scheduler.services import snapshot_take

    snapshot = snapshot_take(pool=pool, now=timezone.now())
    t0 = time.perf_counter()
    best = planner.plan(snapshot, Policy())
    best_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = planner.plan(snapshot, Policy(first_fit=True))
    first_s = time.perf_counter() - t0
    return {
        "pending": len(snapshot.pending),
        "best_s": best_s,
        "first_s": first_s,
        "best_placed": len(best.placements),
        "first_placed": len(first.placements),
        "best_whole": whole_free_nodes(snapshot, best),
        "first_whole": whole_free_nodes(snapshot, first),
    }


def pg_insert_rate(url: str, n: int = 5000) -> float:
    """Single-row INSERTs, each its own transaction, on the same server: the ceiling."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_insert (id bigserial, v text, t timestamptz)"
        )
        t0 = time.perf_counter()
        for i in range(n):
            conn.execute("INSERT INTO bench_insert (v, t) VALUES (%s, now())", (str(i),))
        rate = n / (time.perf_counter() - t0)
        conn.execute("DROP TABLE bench_insert")
    return rate


@contextmanager
def celery_worker():
    """A real Celery worker running the cycles, from the running interpreter's environment."""
    env = dict(os.environ)
    celery = [sys.executable, "-m", "celery"]
    subprocess.run([*celery, "-A", "config", "purge", "-f"], env=env, cwd=ROOT, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    log_path = ROOT / ".var" / "bench" / "scheduler-worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    worker = subprocess.Popen(
        [*celery, "-A", "config", "worker", "-P", "solo", "-l", "info", "--without-heartbeat"],
        cwd=ROOT,
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(4)  # the worker connects before the load starts
        yield worker
    finally:
        worker.terminate()
        worker.wait(20)


def funded_customer(username: str):
    from accounts.services import team_personal_ensure, user_create
    from billing.services.ledger import account_adjust, account_for_team

    customer = user_create(username=username, email=f"{username}@example.invalid", password="x")
    account_adjust(
        account_id=account_for_team(team=team_personal_ensure(user=customer)).pk,
        amount_micros=10**13,
        reason="benchmark credit",
        actor=None,
    )
    return customer


def meter_start(roots: dict[str, list[int]], **kwargs) -> tuple[CpuMeter, dict[str, float]]:
    """A CpuMeter of `roots` and this database's backends, sampling every 0.5 s from now, and
    its totals now: what one create costs each side, whatever share of the cores the run got."""
    from django.db import connection

    meter = CpuMeter(roots, connection.settings_dict["NAME"], **kwargs)
    meter.period = 0.5
    meter.__enter__()
    return meter, meter.totals()


def meter_since(meter: CpuMeter, before: dict[str, float]) -> dict[str, float]:
    """CPU seconds per group since `before` (meter.totals() then); the meter stops."""
    after = meter.totals()
    meter.__exit__(None, None, None)
    return {group: seconds - before.get(group, 0.0) for group, seconds in after.items()}


def offered_load(rate: float, seconds: float, customer, worker=None) -> dict:
    """rental_create at `rate`/s for `seconds` from 4 threads; create->SCHEDULED of each, and
    (with the worker's process) the CPU per create of the creators, the worker and
    PostgreSQL."""
    from django.db import connection, connections

    from accounts.services import team_personal_ensure
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create

    team = team_personal_ensure(user=customer)
    created: list[str] = []
    lag = 0.0
    threads_n = 4
    lock = threading.Lock()

    def create_loop(offset: int) -> None:
        nonlocal lag
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(offset, n, threads_n):
            due = start + i / rate
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            else:
                with lock:
                    lag = max(lag, now - due)
            rental = rental_create(
                customer=customer,
                team=team,
                request=RentalRequest(
                    gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="img")
                ),
            )
            with lock:
                created.append(str(rental.pk))
        connections.close_all()

    threads = [threading.Thread(target=create_loop, args=(k,)) for k in range(threads_n)]
    meter = None
    if worker:
        meter, cpu_before = meter_start(
            {"creator": [os.getpid()], "worker": [worker.pid]}, alone=frozenset({"creator"})
        )
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    achieved = len(created) / (time.perf_counter() - t0)
    deadline = time.monotonic() + 120
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM marketplace_rental WHERE id = ANY(%s::uuid[])"
                " AND status = 'pending'",
                [created],
            )
            if cursor.fetchone()[0] == 0:
                break
            time.sleep(0.5)
        cpu = meter_since(meter, cpu_before) if meter else {}
        load_average = os.getloadavg()[0]
        cursor.execute(
            """
            SELECT EXTRACT(EPOCH FROM (e.created_at - r.created_at))
            FROM marketplace_rental r
            JOIN marketplace_rentalevent e ON e.rental_id = r.id AND e.to_status = 'scheduled'
            WHERE r.id = ANY(%s::uuid[])
            """,
            [created],
        )
        latencies = [float(row[0]) for row in cursor.fetchall()]
    return {
        "offered": rate,
        "achieved": achieved,
        "created": len(created),
        "scheduled": len(latencies),
        "p50": percentile(latencies, 50) if latencies else float("nan"),
        "p99": percentile(latencies, 99) if latencies else float("nan"),
        "max_create_lag_s": lag,
        **{f"cpu_ms_per_create_{k}": 1000 * v / max(1, len(created)) for k, v in cpu.items()},
        "load_average": load_average,
    }


def service_create_rate(customer, n: int = 200) -> float:
    """rental_create back to back from one thread with no worker: the service's own ceiling
    for one caller (no scheduling, no queueing)."""
    from django.db import transaction

    from accounts.services import team_personal_ensure
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create

    team = team_personal_ensure(user=customer)
    request = RentalRequest(gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="img"))
    with transaction.atomic():
        t0 = time.perf_counter()
        for _ in range(n):
            with transaction.atomic():
                rental_create(customer=customer, team=team, request=request)
        rate = n / (time.perf_counter() - t0)
        transaction.set_rollback(True)
    return rate


def rest_rate(base: str, path: str, headers: dict, body: bytes | None, seconds: float,
              threads_n: int = 4) -> float:  # fmt: skip
    """Requests/s of `path` (POST of `body`, or GET) from `threads_n` keep-alive clients for
    `seconds`. The clients are the standard library's http.client, one kept-alive connection
    each: they share the machine's cores with the server, and requests costs about five times
    as much CPU per call."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    counts = [0] * threads_n
    errors: list[str] = []
    timeouts = [0] * threads_n
    stop = time.monotonic() + seconds
    where = urlsplit(base)

    def client(k: int) -> None:
        conn = HTTPConnection(where.hostname, where.port, timeout=10)
        try:
            while time.monotonic() < stop:
                try:
                    if body is not None:
                        conn.request("POST", path, headers=headers, body=body)
                    else:
                        conn.request("GET", path, headers=headers)
                    answer = conn.getresponse()
                    code, text = answer.status, answer.read()
                except TimeoutError:
                    # A saturated server: not counted (it may still finish the request later);
                    # the client goes on over a fresh connection.
                    timeouts[k] += 1
                    conn.close()
                    continue
                if code >= 400:
                    errors.append(f"{code} {text[:200]!r}")
                    return
                counts[k] += 1
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(threads_n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{path}: {errors[0]}")
    if sum(timeouts):
        print(f"{path}: {sum(timeouts)} requests got no answer within 10 s")
    return sum(counts) / (time.perf_counter() - t0)


CREATE_BODY = json.dumps(
    {"gpus_per_node": 1, "duration_s": 3600, "runtime": {"image": "img"}}
).encode()


def api_headers(customer) -> dict:
    """A bearer token of the customer's personal team, as a client sends it."""
    from accounts.services import team_personal_ensure
    from accounts.services.tokens import api_token_create

    _, token = api_token_create(user=customer, team=team_personal_ensure(user=customer), name="b")
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def api_creates(server, customer, seconds: float = 10.0) -> dict:
    """Creates through the REST API under gunicorn, 4 keep-alive clients; beside the same
    server's GET /healthz rate from the same clients (the HTTP stack's ceiling)."""

    from marketplace.models import Rental

    headers = api_headers(customer)
    health = rest_rate(server.base_url, "/healthz", headers, None, seconds)
    before = Rental.objects.filter(customer=customer).count()
    meter, cpu_before = meter_start({"web": [server.pid]})
    creates = rest_rate(server.base_url, "/api/v1/rentals/", headers, CREATE_BODY, seconds)
    cpu = meter_since(meter, cpu_before)
    made = max(1, Rental.objects.filter(customer=customer).count() - before)
    env = dict(
        os.environ,
        GPUMARKET_SERVER_URL=server.base_url,
        GPUMARKET_TOKEN=headers["Authorization"].removeprefix("Bearer "),
    )
    cli = [sys.executable, "-m", "gpumarket_cli", "rent", "--gpus", "1", "--image", "img"]
    python = [sys.executable, "-c", "pass"]
    cli_s = median([_wall(cli, env) for _ in range(10)])
    python_s = median([_wall(python, env) for _ in range(10)])
    return {
        "creates": creates,
        "health": health,
        "cli_s": cli_s,
        "python_s": python_s,
        "web_ms": 1000 * cpu["web"] / made,
        "postgres_ms": 1000 * cpu["postgres"] / made,
        "load_average": os.getloadavg()[0],
    }


def _heartbeat_load(
    base: str, hosts: list, seconds: float, interval: float, follow: bool, out
) -> None:
    """The busy hosts' heartbeats for `seconds` (a forked process, so that the load generator
    and the REST clients do not share one interpreter's lock); sends back what it measured."""
    from agents import run_agents

    for host in hosts:
        host.refused = 0  # the warm-up's are not this window's
    latencies, errors = asyncio.run(run_agents(base, hosts, seconds, interval, follow=follow))
    p99 = percentile(latencies, 99) if latencies else float("nan")
    # At the end, each host at the interval the server last asked it for (or --interval).
    offered = sum(1 / ((h.interval if follow else None) or interval) for h in hosts)
    out.send((len(latencies), errors, p99, sum(h.refused for h in hosts), offered))


def api_creates_busy(server, customer, hosts_n: int, busy: int, interval: float,
                     seconds: float, follow: bool = True) -> dict:  # fmt: skip
    """REST creates while `hosts_n` simulated hosts, each running `busy` rentals, heartbeat
    every `interval` s (bench/agents.py's busy phase: per run a container report, a usage
    report, a step line and two log lines), beside the same server's /healthz rate under the
    same heartbeats. With `follow`, the hosts heartbeat as the real agent does: at the
    interval the server asks for, and after a refusal at its Retry-After."""
    import multiprocessing

    from agents import (
        Host,
        book_busy,
        join_agents,
        join_tokens,
        run_agents,
        running_count,
        server_cpu_seconds,
    )
    from django.db import connections

    from marketplace.models import Provider

    # agents.join_tokens names its provider "bench", as the inventory's is named here.
    Provider.objects.filter(name="bench").update(name="bench-inventory")
    tokens = join_tokens(hosts_n)
    hosts = [Host(t) for t in asyncio.run(join_agents(server.base_url, tokens))]
    placed = book_busy(busy, hosts_n)
    # The hosts learn their runs and report them running (a start is a one-off, not measured).
    deadline = time.monotonic() + 180
    while running_count() < placed and time.monotonic() < deadline:
        asyncio.run(run_agents(server.base_url, hosts, 2 * interval, interval, follow=follow))
    running = running_count()
    headers = api_headers(customer)
    connections.close_all()  # the forked load generator shares no connection
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    lead = interval  # every host is in its rhythm before the creates start
    window = 2 * seconds + 2 * lead
    load = context.Process(
        target=_heartbeat_load, args=(server.base_url, hosts, window, interval, follow, send)
    )
    cpu0 = server_cpu_seconds(server)
    load.start()
    time.sleep(lead)
    health = rest_rate(server.base_url, "/healthz", headers, None, seconds)
    # Where the cores go while the creates run: this process (the REST clients) and the load
    # generator apart from their children (the server is one of this process's).
    roots = {"web": [server.pid], "loadgen": [load.pid], "clients": [os.getpid()]}
    meter, split0 = meter_start(roots, alone=frozenset({"loadgen", "clients"}))
    t0 = time.perf_counter()
    creates = rest_rate(server.base_url, "/api/v1/rentals/", headers, CREATE_BODY, seconds)
    split = meter_since(meter, split0)
    cores = {group: cpu_s / (time.perf_counter() - t0) for group, cpu_s in split.items()}
    beats, errors, beat_p99, refused, offered = receive.recv()
    load.join(60)
    cpu = server_cpu_seconds(server) - cpu0
    return {
        "hosts": hosts_n,
        "running": running,
        "creates": creates,
        "health": health,
        "heartbeats_per_s": (beats - errors) / window,
        "offered_heartbeats_per_s": offered,
        "heartbeat_errors": errors,
        "heartbeats_refused_per_s": refused / window,
        "heartbeat_p99_ms": beat_p99,
        "server_cpu_share": cpu / window,
        "cores_during_creates": cores,
    }


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=60)
    return time.perf_counter() - t0


PARTS = ("cycle", "stream", "api")


def cycle_part(ceiling: float) -> dict:
    eng = engine_only()
    decisions = eng["pending"] / eng["best_s"]
    kept_ratio = eng["best_whole"] / max(1, eng["first_whole"])
    print(
        f"engine only: {decisions:,.0f} decisions/s best-fit ({eng['best_s']:.2f} s, "
        f"{eng['best_placed']} placed); first-fit {eng['pending'] / eng['first_s']:,.0f}/s "
        f"({eng['first_placed']} placed)"
    )
    print(
        f"whole free 8-GPU nodes left: best-fit {eng['best_whole']}, first-fit "
        f"{eng['first_whole']} -> kept {kept_ratio:.2f}x"
    )

    from scheduler.services import scheduler_cycle_run

    t0 = time.perf_counter()
    result = scheduler_cycle_run(pool="default")
    cycle_s = time.perf_counter() - t0
    placements = result.placed / cycle_s
    print(
        f"end to end: {result.placed} placements in {cycle_s:.2f} s = {placements:,.0f}/s "
        f"(snapshot {result.seconds.get('snapshot', 0):.2f} s, plan "
        f"{result.seconds.get('plan', 0):.2f} s, bind {result.seconds.get('bind', 0):.2f} s;"
        f" {result.conflicts} conflicts)"
    )
    print(
        f"ceiling: {ceiling:,.0f} single-row INSERTs/s on the same PostgreSQL; placements are"
        f" {placements / ceiling:.2f}x that (each placement writes 1 update + "
        f"GPUs allocations + 1 event)"
    )
    return {
        "engine_decisions_per_s": round(decisions),
        "placements_per_s": round(placements),
        "whole_free_nodes_kept_vs_first_fit": round(kept_ratio, 3),
        "best_fit_whole_free_nodes": eng["best_whole"],
        "first_fit_whole_free_nodes": eng["first_whole"],
    }


def stream_part(rates: list[float], seconds: float, service_rate: float) -> dict:
    stream = []
    with celery_worker() as worker:
        for rate in rates:
            load = offered_load(rate, seconds, funded_customer(f"load{rate:g}"), worker)
            stream.append(load)
            print(
                f"stream {load['offered']:.0f}/s offered (achieved {load['achieved']:.1f}/s):"
                f" {load['scheduled']}/{load['created']} scheduled, create->SCHEDULED p50 "
                f"{load['p50']:.3f} s, p99 {load['p99']:.3f} s; CPU per create: creators "
                f"{load['cpu_ms_per_create_creator']:.1f} ms, worker "
                f"{load['cpu_ms_per_create_worker']:.1f} ms, PostgreSQL "
                f"{load['cpu_ms_per_create_postgres']:.1f} ms; load average "
                f"{load['load_average']:.1f}"
            )
    # The highest offered rate the machine kept up with (achieved within 10%).
    kept = [x for x in stream if x["achieved"] >= 0.9 * x["offered"]] or stream[:1]
    top = max(kept, key=lambda x: x["offered"])
    at_100 = next((x for x in stream if x["offered"] == 100), None)
    return {
        "stream": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()} for x in stream
        ],
        "stream_p99_s_at_100": round(at_100["p99"], 3) if at_100 else None,
        "stream_max_rate": top["offered"],
        "stream_achieved_at_max": round(top["achieved"], 1),
        "stream_p99_s_at_max": round(top["p99"], 3),
    }


def _server_kill(server) -> None:
    import psutil

    for process in psutil.Process(server.pid).children(recursive=True):
        process.kill()
    server.kill()
    server.wait(20)


def api_part(ceiling: float, service_rate: float, args: argparse.Namespace) -> dict:
    # One token creates far past the per-user request rate a deployment allows its customers;
    # the simulated hosts heartbeat far past the per-node rate.
    extra = {"API_USER_THROTTLE_RATE": "1000000/min", "AGENT_THROTTLE_RATE": "100000/min"}
    with ExitStack() as stack:
        if args.wake:
            # With a wake server listening, the busy nodes are asked for a longer interval
            # (BUSY_HEARTBEATS_PER_S): the web started after it is told its URL.
            stack.enter_context(wake_server())
        server = stack.enter_context(gunicorn(extra_env=extra))
        api = api_creates(server, funded_customer("api"), args.api_seconds)
        busy = None
        if args.hosts:
            # A customer of its own: one team's creates take turns on its account's lock, and
            # the holds summed under it grow with the team's unfinished rentals.
            busy = api_creates_busy(
                server, funded_customer("api-busy"), args.hosts, args.busy, args.interval,
                args.api_seconds, follow=not args.fixed_interval,
            )  # fmt: skip
            # Requests a saturated server still holds outlast any graceful stop: the server's
            # processes (started here) are ended at once.
            _server_kill(server)
    print(
        f"REST API alone, 4 keep-alive clients: {api['creates']:.0f} creates/s, "
        f"{api['creates'] / api['health']:.2f}x the same server's /healthz rate "
        f"({api['health']:.0f}/s) and {api['creates'] / ceiling:.3f}x the INSERT ceiling; CPU"
        f" per create: web {api['web_ms']:.1f} ms, PostgreSQL {api['postgres_ms']:.1f} ms;"
        f" load average {api['load_average']:.1f}"
    )
    figures = {
        "api_creates_per_s": round(api["creates"], 1),
        "api_health_per_s": round(api["health"], 1),
        "api_web_cpu_ms_per_create": round(api["web_ms"], 2),
        "api_postgres_cpu_ms_per_create": round(api["postgres_ms"], 2),
        "api_load_average": round(api["load_average"], 1),
    }
    if busy:
        print(
            f"REST API while {busy['hosts']} busy hosts ({busy['running']} rentals running)"
            f" heartbeat every {args.interval:g} s: {busy['creates']:.0f} creates/s"
            f" ({busy['creates'] / api['creates']:.2f}x alone), /healthz {busy['health']:.0f}/s;"
            f" heartbeats handled {busy['heartbeats_per_s']:.1f}/s of"
            f" {busy['offered_heartbeats_per_s']:.1f}/s offered at the end"
            f" ({busy['heartbeat_errors']} errors,"
            f" {busy['heartbeats_refused_per_s']:.1f}/s refused with Retry-After),"
            f" p99 {busy['heartbeat_p99_ms']:.0f} ms; the server used"
            f" {busy['server_cpu_share']:.2f} cores; during the creates, cores used by the web"
            f" {busy['cores_during_creates'].get('web', 0):.2f}, PostgreSQL"
            f" {busy['cores_during_creates'].get('postgres', 0):.2f}, the hosts' load generator"
            f" {busy['cores_during_creates'].get('loadgen', 0):.2f}, the REST clients"
            f" {busy['cores_during_creates'].get('clients', 0):.2f}"
        )
        figures.update(
            busy_hosts=busy["hosts"],
            busy_running=busy["running"],
            busy_interval_s=args.interval,
            api_creates_per_s_busy=round(busy["creates"], 1),
            api_health_per_s_busy=round(busy["health"], 1),
            busy_heartbeats_per_s=round(busy["heartbeats_per_s"], 1),
            busy_offered_per_s=round(busy["offered_heartbeats_per_s"], 1),
            busy_heartbeat_p99_ms=round(busy["heartbeat_p99_ms"], 1),
            busy_heartbeat_errors=busy["heartbeat_errors"],
            busy_heartbeats_refused_per_s=round(busy["heartbeats_refused_per_s"], 1),
            busy_fixed_interval=args.fixed_interval,
            busy_wake=args.wake,
            busy_server_cores=round(busy["server_cpu_share"], 2),
            **{
                f"busy_creates_cores_{group}": round(share, 2)
                for group, share in busy["cores_during_creates"].items()
            },
        )
    print(
        f"CLI: `gpumarket rent` {api['cli_s'] * 1000:.0f} ms (median of 10), "
        f"{api['cli_s'] / api['python_s']:.1f}x a bare interpreter start "
        f"({api['python_s'] * 1000:.0f} ms)"
    )
    figures.update(cli_rent_s=round(api["cli_s"], 3), python_start_s=round(api["python_s"], 3))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[25.0, 50.0, 100.0, 200.0],
        help="offered create rates of the streaming mode, one after the other (per second)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each stream")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS),
        help="cycle: engine and one end-to-end cycle; stream: the streaming mode; api: creates",
    )  # fmt: skip
    parser.add_argument(
        "--hosts", type=int, default=1000,
        help="api: busy simulated hosts heartbeating during the second round of creates (0: none)",
    )  # fmt: skip
    parser.add_argument("--busy", type=int, default=4, help="api: rentals of 2 GPUs per host")
    parser.add_argument(
        "--interval", type=float, default=5.0,
        help="api: seconds between a host's heartbeats (the server's HEARTBEAT_INTERVAL_S)",
    )  # fmt: skip
    parser.add_argument(
        "--fixed-interval", action="store_true",
        help="api: hosts heartbeat every --interval whatever the server answers, a refusal's "
        "Retry-After ignored (the raw load; by default they follow the server, as the agent)",
    )  # fmt: skip
    parser.add_argument(
        "--wake", action="store_true",
        help="api: a wake server beside the web, as deployed (busy nodes then asked for longer "
        "intervals as the busy fleet grows)",
    )  # fmt: skip
    parser.add_argument("--api-seconds", type=float, default=10.0, help="api: each round")
    args = parse_args(parser, nodes=40, pending=60, rates=[10.0], seconds=2.0, hosts=4, busy=1,
                      interval=1.0, api_seconds=2.0)  # fmt: skip
    figures: dict = {"nodes": args.nodes}
    with bench_database("gpumarket_bench_scheduler") as url:
        # Half the nodes run work on half their GPUs: the fragmentation packing has to handle.
        gpus = build_inventory(url, args.nodes, busy_node_fraction=0.5)
        wanted = insert_pending(url, args.pending)
        print(f"cluster: {args.nodes} nodes, {gpus} GPUs; {args.pending} pending asking {wanted}")
        ceiling = pg_insert_rate(url)
        figures["pg_insert_rows_per_s"] = round(ceiling)
        # rental_create back to back from one thread, no worker: the create's own ceiling.
        service_rate = service_create_rate(funded_customer("ceiling"))
        figures["service_creates_per_s_one_thread"] = round(service_rate, 1)
        print(
            f"creates: rental_create from one thread {service_rate:.0f}/s = "
            f"{service_rate / ceiling:.3f}x the {ceiling:,.0f}/s single-row INSERT ceiling"
        )
        if "cycle" in args.parts:
            figures.update(cycle_part(ceiling))
        if "stream" in args.parts:
            figures.update(stream_part(args.rates, args.seconds, service_rate))
        if "api" in args.parts:
            figures.update(api_part(ceiling, service_rate, args))
    emit(figures)


if __name__ == "__main__":
    sys.exit(main())
