"""Scheduler throughput at marketplace scale: 10,000 nodes, 80,000 GPUs, 20,000 pending rentals.

Prints, each beside a baseline measured in the same run:
- engine-only decisions/s (the pure planner on a snapshot) and the share of whole free 8-GPU
  nodes best-fit keeps versus first-fit on the same snapshot;
- end-to-end placements/s of one cycle (snapshot + plan + bind through the exclusion
  constraint), beside the single-row INSERT rate of the same PostgreSQL as the ceiling;
- p99 time from create to SCHEDULED at an offered load of 200 rentals/s, with rental_create
  (the real service) feeding a real Celery worker that runs the cycles.

    python bench/scheduler.py [--nodes 10000] [--pending 20000] [--load-seconds 10]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import sys
import threading
import time
import uuid

from _common import RENTAL_COPY, ROOT, bench_database, build_inventory, emit, percentile

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
                f"\t\\N\t\\N\t\\N\t\\N\t\t{created}\t{created}\n"
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


def offered_load(rate: float, seconds: float) -> dict:
    """rental_create at `rate`/s for `seconds`, cycles run by a real Celery worker."""
    from django.db import connection, connections

    from marketplace.models import User
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create

    env = dict(os.environ)
    # The running interpreter's Celery, whatever virtualenv the bench runs from.
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
        customer = User.objects.create_user("load", "load@example.invalid", "x")
        from billing.services.ledger import account_adjust, account_for_customer

        account_adjust(
            account_id=account_for_customer(user=customer).pk,
            amount_micros=1_000_000_000,
            reason="benchmark credit",
            actor=None,
        )
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
                    request=RentalRequest(
                        gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="img")
                    ),
                )
                with lock:
                    created.append(str(rental.pk))
            connections.close_all()

        threads = [threading.Thread(target=create_loop, args=(k,)) for k in range(threads_n)]
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
                    "SELECT count(*) FROM marketplace_rental WHERE customer_id = %s"
                    " AND status = 'pending'",
                    [customer.pk],
                )
                if cursor.fetchone()[0] == 0:
                    break
                time.sleep(0.5)
            cursor.execute(
                """
                SELECT EXTRACT(EPOCH FROM (e.created_at - r.created_at))
                FROM marketplace_rental r
                JOIN marketplace_rentalevent e ON e.rental_id = r.id AND e.to_status = 'scheduled'
                WHERE r.customer_id = %s
                """,
                [customer.pk],
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
        }
    finally:
        worker.terminate()
        worker.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument("--load-rate", type=float, default=200.0)
    parser.add_argument("--load-seconds", type=float, default=10.0)
    args = parser.parse_args()
    with bench_database("gpumarket_bench_scheduler") as url:
        # Half the nodes run work on half their GPUs: the fragmentation packing has to handle.
        gpus = build_inventory(url, args.nodes, busy_node_fraction=0.5)
        wanted = insert_pending(url, args.pending)
        print(f"cluster: {args.nodes} nodes, {gpus} GPUs; {args.pending} pending asking {wanted}")

        eng = engine_only()
        decisions = eng["pending"] / eng["best_s"]
        kept = eng["best_whole"] / max(1, eng["first_whole"])
        print(
            f"engine only: {decisions:,.0f} decisions/s best-fit ({eng['best_s']:.2f} s, "
            f"{eng['best_placed']} placed); first-fit {eng['pending'] / eng['first_s']:,.0f}/s "
            f"({eng['first_placed']} placed)"
        )
        print(
            f"whole free 8-GPU nodes left: best-fit {eng['best_whole']}, first-fit "
            f"{eng['first_whole']} -> kept {kept:.2f}x"
        )

        from scheduler.services import scheduler_cycle_run

        t0 = time.perf_counter()
        result = scheduler_cycle_run(pool="default")
        cycle_s = time.perf_counter() - t0
        placements = result.placed / cycle_s
        ceiling = pg_insert_rate(url)
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
        load = offered_load(args.load_rate, args.load_seconds)
        print(
            f"offered load {load['offered']:.0f}/s (achieved {load['achieved']:.0f}/s): "
            f"{load['scheduled']}/{load['created']} scheduled, create->SCHEDULED p50 "
            f"{load['p50']:.2f} s, p99 {load['p99']:.2f} s"
        )
    emit(
        {
            "engine_decisions_per_s": round(decisions),
            "placements_per_s": round(placements),
            "p99_create_to_scheduled_s": round(load["p99"], 3),
            "whole_free_nodes_kept_vs_first_fit": round(kept, 3),
            "pg_insert_rows_per_s": round(ceiling),
            "best_fit_whole_free_nodes": eng["best_whole"],
            "first_fit_whole_free_nodes": eng["first_whole"],
            "offered_rentals_per_s": load["offered"],
            "achieved_rentals_per_s": round(load["achieved"], 1),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
