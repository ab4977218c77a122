"""Metering and billing at marketplace scale: 25,000 nodes, 200,000 GPUs, 100,000 running rentals.

Measures, through the real services:
- GPU telemetry ingestion (telemetry_ingest: raw samples plus per-minute rollups) in large
  batches (the COPY path) and in one-heartbeat batches, against a raw COPY of the same rows into
  the same table in the same run (the ceiling);
- usage report ingestion (usage_report_apply one by one, usage_reports_apply per heartbeat);
- one billing pass over 100,000 running rentals: rating plus the first posting of every meter
  (the worst case), a steady pass (rating only), and an hourly pass (rating plus posting),
  beside a COPY of the first pass's ledger entries into the ledger in the same run (the
  ceiling). Each rental is loaded as the product writes it: its four events (created, placed,
  handed to the agent, RUNNING) and one allocation per GPU bound when it was placed.

    python bench/metering.py [--nodes 25000] [--samples 200000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

from _common import bench_database, build_inventory, emit, parse_args

RENTAL_COLUMNS = (
    "id, customer_id, name, status, status_reason, gpu_models, gpu_families, min_memory_gb,"
    " min_tensor_tflops, gpus_per_node, node_count, same_group, region, pool,"
    " max_price_per_gpu_hour, kind, bid_per_gpu_hour, priority, start_at, start_deadline,"
    " duration_s, image, command, harness_config, env, ports, price_per_gpu_hour,"
    " scheduled_start, scheduled_end, started_at, ended_at, exit_code, log_tail, created_at,"
    " updated_at, team_id, ssh"
)


def build_rentals(url: str, *, customers: int, start: datetime) -> int:
    """Two GPUs per rental, four rentals per node, spread over `customers` funded customers:
    each a person with their personal team (owned by them, as `user_create` makes it) and the
    team's customer account."""
    import psycopg

    with psycopg.connect(url) as conn:
        # The bench's customers, whatever else the inventory made: person, team, and their
        # 0-based number k that rentals are dealt out by.
        conn.execute(
            "CREATE TEMP TABLE customers (user_id bigint, team_id bigint, k bigint) ON COMMIT DROP"
        )
        conn.execute(
            "WITH u AS ("
            "  INSERT INTO marketplace_user (password, is_superuser, username, first_name,"
            "  last_name, email, is_staff, is_active, date_joined)"
            "  SELECT '!', false, 'c' || i, '', '', 'c' || i || '@example.invalid', false, true,"
            "  now() FROM generate_series(1, %s) i RETURNING id, username),"
            " t AS ("
            "  INSERT INTO marketplace_team (name, personal_of_id, created_at)"
            "  SELECT left(username, 80), id, now() FROM u RETURNING id, personal_of_id)"
            " INSERT INTO customers"
            " SELECT personal_of_id, id, row_number() OVER (ORDER BY personal_of_id) - 1 FROM t",
            (customers,),
        )
        conn.execute(
            "INSERT INTO marketplace_membership (team_id, user_id, role, created_at)"
            " SELECT team_id, user_id, 'owner', now() FROM customers"
        )
        conn.execute(
            "INSERT INTO billing_account (kind, team_id, balance_micros, stripe_customer_id,"
            " stripe_connect_account_id, created_at)"
            " SELECT 'customer', team_id, 1000000000000, '', '', now() FROM customers"
        )
        conn.execute(
            "CREATE TEMP TABLE pairs AS"
            " SELECT gen_random_uuid() AS rental_id, g.node_id, n.price_per_gpu_hour,"
            "        array_agg(g.id ORDER BY g.index) AS gpu_ids,"
            "        row_number() OVER (ORDER BY g.node_id, g.index / 2) AS n"
            " FROM marketplace_gpu g JOIN marketplace_node n ON n.id = g.node_id"
            " GROUP BY g.node_id, g.index / 2, n.price_per_gpu_hour"
        )
        # Each rental's history as the product writes it: created (rental_submit), placed by
        # the scheduler (rentals_mark_placed, its allocations bound at the same instant by
        # allocation_bind, booked from then), handed to the agent (rental_mark_provisioning)
        # and RUNNING at the agent's report (rental_mark_container_started), which is where
        # rating starts billing.
        created, placed, handed = (start - timedelta(seconds=s) for s in (12, 10, 8))
        end = placed + timedelta(hours=12)
        times = {"created": created, "placed": placed, "start": start, "end": end}
        conn.execute(
            f"INSERT INTO marketplace_rental ({RENTAL_COLUMNS})"
            " SELECT p.rental_id, c.user_id, '', 'running',"
            "  'container running on node' || p.node_id, '{}', '{}', 0, 0, 2, 1, false, '',"
            "  'default', NULL, 'on_demand', NULL, 0, %(created)s, %(created)s, 43200, 'img',"
            "  '[]', NULL, '{}', '{}', p.price_per_gpu_hour, %(placed)s, %(end)s, %(start)s,"
            "  NULL, NULL, '', %(created)s, %(start)s, c.team_id, false"
            " FROM pairs p JOIN customers c ON c.k = p.n %% %(customers)s",
            {**times, "customers": customers},
        )
        conn.execute(
            "INSERT INTO marketplace_rentalevent (rental_id, from_status, to_status, actor_kind,"
            " actor_id, reason, created_at)"
            " SELECT p.rental_id, e.from_status, e.to_status, e.actor_kind,"
            "  CASE WHEN e.actor_kind = 'customer' THEN c.user_id END,"
            "  replace(replace(e.reason, '$node', p.node_id::text), '$price',"
            "          p.price_per_gpu_hour::text), e.at"
            " FROM pairs p JOIN customers c ON c.k = p.n %% %(customers)s"
            " CROSS JOIN (VALUES"
            "  ('', 'pending', 'customer', 'created', %(created)s::timestamptz),"
            "  ('pending', 'scheduled', 'scheduler',"
            "   'placed on node(s) $node at $$price/GPU-hour', %(placed)s),"
            "  ('scheduled', 'provisioning', 'agent', 'starting on node$node', %(handed)s),"
            "  ('provisioning', 'running', 'agent', 'container running on node$node', %(start)s)"
            " ) AS e(from_status, to_status, actor_kind, reason, at)"
            " ORDER BY e.at, p.n",
            {**times, "handed": handed, "customers": customers},
        )
        conn.execute(
            "INSERT INTO marketplace_allocation (rental_id, gpu_id, node_id, during, released_at,"
            " created_at)"
            " SELECT p.rental_id, gpu_id, p.node_id, tstzrange(%(placed)s, %(end)s), NULL,"
            "  %(placed)s"
            " FROM pairs p, unnest(p.gpu_ids) AS gpu_id",
            times,
        )
        conn.commit()
        conn.autocommit = True
        conn.execute("VACUUM ANALYZE")
        return conn.execute("SELECT count(*) FROM marketplace_rental").fetchone()[0]


def heartbeat_reports(url: str) -> dict[int, list[tuple[uuid.UUID, int]]]:
    """node -> [(rental, gpus)] of the running rentals."""
    import psycopg

    by_node: dict[int, list[tuple[uuid.UUID, int]]] = {}
    with psycopg.connect(url) as conn:
        for node_id, rental_id in conn.execute(
            "SELECT DISTINCT node_id, rental_id FROM marketplace_allocation ORDER BY 1, 2"
        ):
            by_node.setdefault(node_id, []).append((rental_id, 2))
    return by_node


def measure_usage(by_node, *, start: datetime, nodes: int) -> tuple[float, float]:
    """Reports per second: one call per report (as the agent API calls it today), and one call
    per node heartbeat."""
    from billing.services import UsageReport, usage_report_apply, usage_reports_apply

    node_ids = sorted(by_node)
    confirmed = start + timedelta(minutes=30)
    single_nodes, batch_nodes = node_ids[:nodes], node_ids[nodes : 2 * nodes]
    seq = 0
    t0 = time.perf_counter()
    for node_id in single_nodes:
        for rental_id, gpus in by_node[node_id]:
            seq += 1
            usage_report_apply(
                node_id=node_id,
                rental_id=rental_id,
                run_id="run-1",
                seq=seq,
                gpu_count=gpus,
                started_at=start,
                confirmed_at=confirmed,
            )
    single = seq / (time.perf_counter() - t0)
    count = 0
    t0 = time.perf_counter()
    for node_id in batch_nodes:
        reports = []
        for rental_id, gpus in by_node[node_id]:
            seq += 1
            reports.append(
                UsageReport(
                    rental_id=rental_id,
                    run_id="run-1",
                    seq=seq,
                    gpu_count=gpus,
                    started_at=start,
                    confirmed_at=confirmed,
                )
            )
        count += usage_reports_apply(node_id=node_id, reports=reports).applied
    batched = count / (time.perf_counter() - t0)
    return single, batched


def fill_usage(*, start: datetime, confirmed: datetime) -> None:
    """Every other running rental gets its run confirmed too (set-based: this is set-up)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_usagesegment (rental_id, node_id, run_id, gpu_count, started_at,"
            " confirmed_until, final, first_seq, last_seq, reports, created_at, updated_at)"
            " SELECT DISTINCT ON (a.rental_id) a.rental_id, a.node_id, 'run-1', 2, %s, %s, false,"
            "        1, 1, 1, now(), now()"
            " FROM marketplace_allocation a ON CONFLICT DO NOTHING",
            [start, confirmed],
        )
        cursor.execute(
            "INSERT INTO billing_usagemeter (rental_id, node_id, fee_bps, usage_version,"
            " rated_version, gpu_seconds, charge_micros, posting_seq, posted_gpu_seconds,"
            " posted_charge_micros, posted_earning_micros, created_at)"
            " SELECT rental_id, node_id, 2000, 1, 0, 0, 0, 0, 0, 0, 0, now()"
            " FROM billing_usagesegment ON CONFLICT DO NOTHING"
        )
        cursor.execute("ANALYZE")


def confirm_all(*, until: datetime) -> None:
    """Every agent confirms its run again: segments move, meters need rating (set-up)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE billing_usagesegment SET confirmed_until = %s, last_seq = last_seq + 1,"
            " reports = reports + 1",
            [until],
        )
        cursor.execute("UPDATE billing_usagemeter SET usage_version = usage_version + 1")
        cursor.execute("VACUUM ANALYZE billing_usagesegment")
        cursor.execute("VACUUM ANALYZE billing_usagemeter")


def timed_pass(now: datetime):
    from billing.services import billing_pass_run

    t0 = time.perf_counter()
    result = billing_pass_run(now=now)
    return time.perf_counter() - t0, result


def _samples(node_ids: list[int], count: int, t0: datetime) -> list[tuple[int, list[dict]]]:
    """(node, samples) batches: each node reports its 8 GPUs once per second."""
    rng = random.Random(3)
    per_node = max(8, count // len(node_ids))
    batches = []
    for node_id in node_ids:
        samples = [
            {
                "gpu_index": i % 8,
                "ts": (t0 + timedelta(seconds=i // 8)).timestamp(),
                "util_pct": round(rng.uniform(0, 100), 1),
                "mem_used_mb": rng.randrange(80_000),
                "power_w": round(rng.uniform(50, 700), 1),
                "temp_c": round(rng.uniform(30, 85), 1),
            }
            for i in range(per_node)
        ]
        batches.append((node_id, samples))
        if sum(len(s) for _, s in batches) >= count:
            break
    return batches


def measure_copy_ceiling(url: str, batches) -> float:
    """The same rows COPYed raw into the same table: what the table itself can absorb."""
    import psycopg

    from billing.queries import _SAMPLE_TYPES, _sample_columns
    from billing.services.metering import _rows_and_minutes

    rows = [row for node, samples in batches for row in _rows_and_minutes(node, samples)[0]]
    with psycopg.connect(url) as conn:
        t0 = time.perf_counter()
        with conn.cursor().copy(
            f"COPY billing_telemetrysample ({_sample_columns()}) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(list(_SAMPLE_TYPES))
            for row in rows:
                copy.write_row(row)
        conn.commit()
        return len(rows) / (time.perf_counter() - t0)


def measure_ledger_copy_ceiling(url: str, rows: int) -> float:
    """Seconds to COPY `rows` ledger entries of a first pass's shape (usage, earning, fee per
    meter) into the ledger itself, then roll them back: what the table can absorb, beside which
    the pass (rating too) is read."""
    import psycopg

    with psycopg.connect(url) as conn:
        accounts = [a for (a,) in conn.execute("SELECT id FROM billing_account LIMIT 1000")]
        meters = conn.execute("SELECT id, rental_id FROM billing_usagemeter").fetchall()
        now = datetime.now(UTC)
        t0 = time.perf_counter()
        with conn.cursor().copy(
            "COPY billing_ledgerentry (kind, amount_micros, posting_seq, gpu_seconds, memo,"
            " created_at, account_id, rental_id, meter_id) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(
                ["varchar", "int8", "int4", "int8", "varchar", "timestamptz", "int8", "uuid",
                 "int8"]
            )  # fmt: skip
            kinds = ("usage", "earning", "platform_fee")
            for i in range(rows):
                # (meter, posting, kind) is unique: postings numbered past any real one.
                meter_id, rental_id = meters[(i // 3) % len(meters)]
                seq = 1_000_000 + (i // 3) // len(meters)
                copy.write_row(
                    (kinds[i % 3], -1000, seq, 7200, "", now, accounts[i % len(accounts)],
                     rental_id, meter_id)
                )  # fmt: skip
        elapsed = time.perf_counter() - t0
        conn.rollback()
        return elapsed


def measure_ingest(batches) -> float:
    from billing.services import telemetry_ingest

    t0 = time.perf_counter()
    stored = sum(telemetry_ingest(node_id=node, samples=samples) for node, samples in batches)
    return stored / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=25_000)
    parser.add_argument("--customers", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--report-nodes", type=int, default=1_000)
    args = parse_args(parser, nodes=25, customers=10, samples=400, report_nodes=5)
    figures: dict[str, float | int] = {}
    with bench_database("gpumarket_bench_metering") as url:
        now = datetime.now(UTC).replace(microsecond=0)
        start = now - timedelta(hours=2)
        t0 = time.perf_counter()
        gpus = build_inventory(url, args.nodes)
        rentals = build_rentals(url, customers=args.customers, start=start)
        print(f"set-up: {args.nodes} nodes, {gpus} GPUs, {rentals} running rentals "
              f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip

        node_ids = sorted(heartbeat_reports(url))
        # Ten minutes of one node's 8 GPUs at 1 Hz per batch; the ceiling COPYs the same shape
        # of rows (other nodes, so neither run finds the other's rows) into the same table.
        spread = max(1, args.samples // 4800)
        big = _samples(node_ids[:spread], args.samples, start)
        same_shape = _samples(node_ids[spread : 2 * spread], args.samples, start)
        small = [
            (node, samples[i : i + 8])
            for node, samples in _samples(node_ids[-50:], 20_000, start)
            for i in range(0, len(samples), 8)
        ]
        copy_rate = measure_copy_ceiling(url, big)
        big_rate = measure_ingest(same_shape)
        small_rate = measure_ingest(small)
        print(f"telemetry: raw COPY {copy_rate:,.0f} rows/s (ceiling); telemetry_ingest "
              f"{big_rate:,.0f} samples/s in batches of {len(big[0][1])} (COPY path), "
              f"{small_rate:,.0f} samples/s in one-heartbeat batches of 8")  # fmt: skip

        by_node = heartbeat_reports(url)
        single, batched = measure_usage(by_node, start=start, nodes=args.report_nodes)
        print(f"usage reports: {single:,.0f}/s one call per report, "
              f"{batched:,.0f}/s one call per node heartbeat (4 runs)")  # fmt: skip

        fill_usage(start=start, confirmed=now - timedelta(minutes=1))
        first, result = timed_pass(now)
        assert result.meters_rated == rentals and result.meters_posted == rentals, result
        first_phases = result.seconds
        # The ceiling right after the pass, so that both see the same load on a shared machine.
        ceiling = measure_ledger_copy_ceiling(url, 3 * rentals)
        print(f"billing pass, first (rate + post {rentals:,} meters): {first:.2f} s "
              f"{ {k: round(v, 2) for k, v in result.seconds.items()} }")  # fmt: skip
        confirm_all(until=now + timedelta(minutes=1))
        steady, result = timed_pass(now + timedelta(minutes=2))
        assert result.meters_rated == rentals and result.meters_posted == 0, result
        print(f"billing pass, steady (rate only): {steady:.2f} s "
              f"{ {k: round(v, 2) for k, v in result.seconds.items()} }")  # fmt: skip
        confirm_all(until=now + timedelta(hours=1, minutes=1))
        hourly, result = timed_pass(now + timedelta(hours=1, minutes=2))
        assert result.meters_rated == rentals and result.meters_posted == rentals, result
        print(f"billing pass, hourly (rate + post): {hourly:.2f} s "
              f"{ {k: round(v, 2) for k, v in result.seconds.items()} }")  # fmt: skip
        print(f"ceiling: COPY of the first pass's {3 * rentals:,} ledger entries: {ceiling:.2f} s; "
              f"first pass / ceiling {first / ceiling:.1f}x")  # fmt: skip
        print("goals: telemetry >= 50,000 samples/s; one pass over 100,000 rentals < 10 s")
        figures = {
            "samples_per_s": round(big_rate),
            "copy_rows_per_s": round(copy_rate),
            "samples_per_s_heartbeat_batches": round(small_rate),
            "usage_reports_per_s_single": round(single),
            "usage_reports_per_s_batched": round(batched),
            "rentals": rentals,
            "rate_100k_rentals_s": round(max(first, hourly), 2),
            "pass_first_s": round(first, 2),
            "pass_steady_s": round(steady, 2),
            "pass_hourly_s": round(hourly, 2),
            "ledger_copy_ceiling_s": round(ceiling, 2),
            "pass_over_ceiling": round(first / ceiling, 1),
            "pass_first_rate_s": round(first_phases.get("rate", 0), 2),
            "pass_first_post_s": round(first_phases.get("post", 0), 2),
        }
    emit(figures)


if __name__ == "__main__":
    sys.exit(main())
