"""Shared set-up for the benchmarks: a fresh database on DATABASE_URL or on embedded services."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# Rentals written with COPY by the benchmarks, tab-separated in this column order.
RENTAL_COPY = (
    "COPY marketplace_rental (id, customer_id, name, status, status_reason, gpu_models,"
    " gpu_families, min_memory_gb, min_tensor_tflops, gpus_per_node, node_count,"
    " same_group, region, pool, max_price_per_gpu_hour, kind, bid_per_gpu_hour,"
    " priority, start_at, start_deadline, duration_s, image, command, harness_config,"
    " env, ports, price_per_gpu_hour, scheduled_start, scheduled_end, started_at,"
    " ended_at, exit_code, log_tail, created_at, updated_at, team_id, ssh) FROM STDIN"
)


def bench_team(user_id: int) -> int:
    """The personal team of the user, made as the app makes it (rentals belong to a team)."""
    from accounts.services import team_personal_ensure
    from marketplace.models import User

    return team_personal_ensure(user=User.objects.get(pk=user_id)).pk


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@contextmanager
def bench_database(name: str):
    """Create database `name` afresh on the server, migrate it, and point Django at it. On a
    shared server (DATABASE_URL set) the name is prefixed with DATABASE_URL's own database, so
    that benches run from two checkouts never drop each other's database."""
    from devstack.embedded import ensure_services

    given = os.environ.get("DATABASE_URL")
    if given and urlsplit(given).path.strip("/"):
        name = f"{urlsplit(given).path.strip('/')}_{name}"
    # The benchmarks on this database store no object: no SeaweedFS (artifacts.py starts its own).
    services = ensure_services(ROOT / ".var" / "bench", durable=False, object_storage=False)
    import psycopg

    admin_url = _with_database(services.database_url, "postgres")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _with_database(services.database_url, name)
    os.environ["DATABASE_URL"] = url
    os.environ["REDIS_URL"] = services.redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.base")
    os.environ.setdefault("GPUMARKET_EPHEMERAL_SECRET", "1")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    # One bench account creates far more rentals and GPUs than the ceilings an operator sets
    # for customers (30 a minute, 64 GPUs by default): the benches measure the service, not them.
    os.environ.setdefault("BILLING_MAX_RENTALS_PER_MINUTE", "0")
    os.environ.setdefault("BILLING_MAX_CONCURRENT_GPUS", "0")
    # Nor the per-client API throttles (60 anonymous requests a minute by default).
    os.environ.setdefault("API_ANON_THROTTLE_RATE", "1000000/min")
    os.environ.setdefault("API_USER_THROTTLE_RATE", "1000000/min")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    try:
        yield url
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        services.stop()


def parse_args(parser: argparse.ArgumentParser, **quick) -> argparse.Namespace:
    """The bench's arguments, with `--quick`: the sizes given here instead of the defaults, so
    the test command runs every bench to its JSON line in seconds (figures not checked: only
    that the bench still runs)."""
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: that it runs, not what it measures"
    )
    args = parser.parse_args()
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    return args


def emit(figures: dict) -> None:
    """The last line of every benchmark: one JSON object of its figures."""
    print(json.dumps(figures), flush=True)


REGIONS = ["eu-west", "eu-central", "us-east", "us-west", "ap-southeast", "ap-northeast"]


def build_inventory(url: str, nodes: int, *, busy_node_fraction: float = 0.0, seed: int = 7) -> int:
    """Fill the database with COPY: nodes of 8 GPUs (two NVLink groups of 4), and on the given
    fraction of nodes half of the GPUs held right now by running rentals. Returns the GPU count."""
    import psycopg

    rng = random.Random(seed)
    with psycopg.connect(url) as conn:
        models = conn.execute("SELECT id, slug FROM marketplace_gpumodel").fetchall()
        conn.execute(
            "INSERT INTO marketplace_user (password, is_superuser, username, first_name,"
            " last_name, email, is_staff, is_active, date_joined) VALUES"
            " ('!', false, 'bench', '', '', 'bench@example.invalid', false, true, now())"
        )
        user_id = conn.execute("SELECT id FROM marketplace_user").fetchone()[0]
        conn.commit()
        team_id = bench_team(user_id)
        provider_id = conn.execute(
            "INSERT INTO marketplace_provider (name, owner_id, is_platform, created_at)"
            " VALUES ('bench', %s, false, now()) RETURNING id",
            (user_id,),
        ).fetchone()[0]
        node_rows = io.StringIO()
        node_models = [rng.choice(models)[0] for _ in range(nodes)]
        for i in range(nodes):
            # Providers price in cents; 381 price points over 10,000 nodes.
            price = round(rng.uniform(0.2, 4.0), 2)
            reliability = round(rng.uniform(0.8, 1.0), 4)
            node_rows.write(
                f"{provider_id}\t{node_models[i]}\t8\tnode{i:05d}\t{rng.choice(REGIONS)}\t"
                "default\t64\t512\t4000\t"
                f"10000\t10000\t550.54\t12.4\t{'t' if rng.random() < 0.5 else 'f'}\t"
                f"{'online' if rng.random() < 0.95 else 'offline'}\t"
                f"{reliability}\t{reliability}\t0\tt\t{price}\t{round(price * 0.4, 4)}\tnow\tf\t"
                "docker\tt\tt\tt\n"
            )
        with conn.cursor().copy(
            "COPY marketplace_node (provider_id, gpu_model_id, gpu_count, hostname, region, pool,"
            " cpu_cores, ram_gb, disk_gb, net_up_mbps, net_down_mbps, driver_version,"
            " cuda_version, nvlink, status, reliability, reliability_declared,"
            " reliability_observed_hours, simulated, price_per_gpu_hour,"
            " min_bid_per_gpu_hour, created_at, benchmark_requested, runtime, ssh_capable,"
            # Docker hosts whose engines filter the internet: a rental's default network.
            " internet_filtered, internet_capable)"
            " FROM STDIN"
        ) as copy:
            copy.write(node_rows.getvalue())
        node_ids = [r[0] for r in conn.execute("SELECT id FROM marketplace_node ORDER BY id")]
        # Clusters of up to 32 nodes of one card and region, where the gangs go.
        conn.execute(
            "WITH n AS (SELECT id, gpu_model_id, region, (row_number() OVER (PARTITION BY"
            " gpu_model_id, region ORDER BY id) - 1) / 32 AS k FROM marketplace_node),"
            " c AS (INSERT INTO marketplace_cluster (provider_id, name, interconnect,"
            " bandwidth_gbps, created_at) SELECT DISTINCT %s::bigint, 'c' || gpu_model_id || '-'"
            " || region || '-' || k, 'infiniband', 400, now() FROM n RETURNING id, name)"
            " UPDATE marketplace_node x SET cluster_id = c.id FROM n JOIN c"
            " ON c.name = 'c' || n.gpu_model_id || '-' || n.region || '-' || n.k WHERE x.id = n.id",
            (provider_id,),
        )
        gpu_rows = io.StringIO()
        for node_id, model_id in zip(node_ids, node_models, strict=True):
            for idx in range(8):
                gpu_rows.write(f"{node_id}\t{idx}\tGPU-{uuid.uuid4()}\t{model_id}\tg{idx // 4}\n")
        with conn.cursor().copy(
            "COPY marketplace_gpu (node_id, index, uuid, model_id, topology_group) FROM STDIN"
        ) as copy:
            copy.write(gpu_rows.getvalue())
        gpus = conn.execute(
            "SELECT node_id, array_agg(id ORDER BY index) FROM marketplace_gpu GROUP BY node_id"
        ).fetchall()
        rental_rows, alloc_rows = io.StringIO(), io.StringIO()
        busy_nodes = rng.sample(gpus, int(len(gpus) * busy_node_fraction))
        t = time.time()
        held = "[{},{})".format(
            *(time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(x)) for x in (t - 3600, t + 3600))
        )
        for node_id, gpu_ids in busy_nodes:
            rental_id = uuid.uuid4()
            rental_rows.write(
                f"{rental_id}\t{user_id}\t\trunning\t\t{{}}\t{{}}\t0\t0\t4\t1\tf\t\tdefault\t\\N\t"
                f"on_demand\t\\N\t0\tnow\tnow\t3600\timg\t[]\t\\N\t{{}}\t{{}}\t1.0\t\\N\t\\N\t"
                f"\\N\t\\N\t\\N\t\tnow\tnow\t{team_id}\tf\n"
            )
            for gpu_id in gpu_ids[:4]:
                alloc_rows.write(f"{rental_id}\t{gpu_id}\t{node_id}\t{held}\t\\N\tnow\n")
        with conn.cursor().copy(RENTAL_COPY) as copy:
            copy.write(rental_rows.getvalue())
        with conn.cursor().copy(
            "COPY marketplace_allocation (rental_id, gpu_id, node_id, during, released_at,"
            " created_at) FROM STDIN"
        ) as copy:
            copy.write(alloc_rows.getvalue())
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE")
        return conn.execute("SELECT count(*) FROM marketplace_gpu").fetchone()[0]


@contextmanager
def gunicorn(
    *,
    workers: int | None = None,
    threads: int | None = None,
    extra_env: dict[str, str] | None = None,
):
    """The web app under gunicorn on a free loopback port, as production runs it (the layout of
    config/gunicorn.py unless `workers` or `threads` are given); yields its URL."""
    import requests

    from devstack.embedded import free_port

    port = free_port()
    env = dict(os.environ, DEBUG="0", ALLOWED_HOSTS="127.0.0.1", SECURE_COOKIES="0")
    env.update(extra_env or {})
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "config.wsgi", "-c", "python:config.gunicorn",
         "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
         *(["--workers", str(workers)] if workers else []),
         *(["--threads", str(threads)] if threads else [])],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not come up")
            time.sleep(0.2)
        server.base_url = base
        yield server
    finally:
        server.terminate()
        server.wait(20)


def funded_team(username: str, *, micros: int = 10**14):
    """A customer whose account never runs dry during a bench, and its personal team."""
    from accounts.services import team_personal_ensure, user_create
    from billing.services.ledger import account_adjust, account_for_team

    customer = user_create(username=username, email=f"{username}@example.invalid", password="x")
    team = team_personal_ensure(user=customer)
    account = account_for_team(team=team)
    account_adjust(account_id=account.pk, amount_micros=micros, reason="bench credit", actor=None)
    return customer, team


class Sampler:
    """A daemon thread that calls `tick` every `period` seconds while in its `with` block."""

    period = 1.0

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self.stopped.wait(self.period):
            self.tick()

    def __enter__(self):
        self.tick()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(10)


class CpuMeter(Sampler):
    """CPU seconds (user + system) per process group, sampled every second in a thread so that
    short-lived processes (database backends) count up to their last sample. A group's total
    is the sum over every process it ever had of that process's last sampled counter. `roots`:
    group -> pids, each counted with its children but for the `alone` groups (the load
    generator's own process, say); PostgreSQL's backends of `database` count as "postgres", and
    the Redis server on `redis_port` (if given) as "redis"."""

    def __init__(
        self,
        roots: dict[str, list[int]],
        database: str,
        redis_port: int | None = None,
        *,
        alone: frozenset[str] = frozenset({"loadgen"}),
    ) -> None:
        import psutil

        super().__init__()
        self.roots = {name: [psutil.Process(pid) for pid in pids] for name, pids in roots.items()}
        self.database, self.redis_port, self.alone = database, redis_port, alone
        self.last: dict[int, tuple[str, float]] = {}
        self.lock = threading.Lock()

    def _members(self):
        import psutil

        for name, roots in self.roots.items():
            for root in roots:
                try:
                    yield name, root
                    if name not in self.alone:
                        for child in root.children(recursive=True):
                            yield name, child
                except psutil.NoSuchProcess:
                    continue
        for proc in psutil.process_iter(["name", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or ())
            if (proc.info["name"] or "").startswith("postgres") and (
                f" {self.database} " in cmdline
            ):
                yield "postgres", proc
            elif self.redis_port and "redis-server" in cmdline and f":{self.redis_port}" in cmdline:
                yield "redis", proc

    def tick(self) -> None:
        import psutil

        for group, proc in list(self._members()):
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            with self.lock:
                self.last[proc.pid] = (group, times.user + times.system)

    def totals(self) -> dict[str, float]:
        self.tick()
        out = dict.fromkeys([*self.roots, "postgres", *(["redis"] if self.redis_port else [])], 0.0)
        with self.lock:
            for group, seconds in self.last.values():
                out[group] += seconds
        return out
