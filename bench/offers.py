"""Offers latency at marketplace scale: 10,000 nodes, 80,000 GPUs, a quarter of them busy.

Measures a filtered, sorted offers page through the real API (gunicorn over HTTP, the same
process layout as production) and the same statement through raw psycopg in
the same run, so the ratio shows what HTTP, Django and DRF cost on top of the database.

    python bench/offers.py [--nodes 10000] [--requests 300]
"""

from __future__ import annotations

import argparse
import io
import os
import random
import socket
import subprocess
import sys
import time
import uuid
from contextlib import closing

from _common import ROOT, bench_database, emit, percentile

QUERY = {
    "min_memory_gb": "40",
    "min_free_gpus": "2",
    "max_price": "3.00",
    "ordering": "price_per_tflop",
    "limit": "50",
}

# The statement the API runs for QUERY, written out by hand: the baseline is the database alone.
RAW_PAGE = """
SELECT n.id AS node_id, n.hostname, p.name AS provider, n.region, n.nvlink, n.simulated,
       n.reliability, n.price_per_gpu_hour, n.min_bid_per_gpu_hour, n.cpu_cores, n.ram_gb,
       n.disk_gb, n.cuda_version, n.gpu_count, m.slug AS gpu_model, m.name AS gpu_name,
       m.memory_gb, m.tensor_tflops,
       n.gpu_count - COALESCE(busy.held, 0) AS free_gpus,
       round(n.price_per_gpu_hour / m.tensor_tflops, 6) AS price_per_tflop_hour,
       n.measured_tflops,
       round(n.price_per_gpu_hour / NULLIF(n.measured_tflops, 0)::numeric, 6)
           AS price_per_measured_tflop_hour
FROM marketplace_node n
JOIN marketplace_gpumodel m ON m.id = n.gpu_model_id
JOIN marketplace_provider p ON p.id = n.provider_id
LEFT JOIN (
    SELECT node_id, count(*) AS held FROM marketplace_allocation
    WHERE released_at IS NULL AND during @> now()
    GROUP BY node_id
) busy ON busy.node_id = n.id
WHERE n.status = 'online' AND n.gpu_count - COALESCE(busy.held, 0) >= 2
  AND m.memory_gb >= 40 AND n.price_per_gpu_hour <= 3.00
ORDER BY price_per_tflop_hour, n.id
LIMIT 51 OFFSET 0
"""

REGIONS = ["eu-west", "eu-central", "us-east", "us-west", "ap-southeast", "ap-northeast"]


def build_inventory(url: str, nodes: int) -> int:
    """Fill the database with COPY: nodes of 8 GPUs, a quarter of the GPUs held right now."""
    import psycopg

    rng = random.Random(7)
    with psycopg.connect(url) as conn:
        models = conn.execute("SELECT id, slug FROM marketplace_gpumodel").fetchall()
        conn.execute(
            "INSERT INTO marketplace_user (password, is_superuser, username, first_name,"
            " last_name, email, is_staff, is_active, date_joined) VALUES"
            " ('!', false, 'bench', '', '', 'bench@example.invalid', false, true, now())"
        )
        user_id = conn.execute("SELECT id FROM marketplace_user").fetchone()[0]
        provider_id = conn.execute(
            "INSERT INTO marketplace_provider (name, owner_id, is_platform, created_at)"
            " VALUES ('bench', %s, false, now()) RETURNING id",
            (user_id,),
        ).fetchone()[0]
        node_rows = io.StringIO()
        node_models = [rng.choice(models)[0] for _ in range(nodes)]
        for i in range(nodes):
            price = round(rng.uniform(0.2, 4.0), 4)
            node_rows.write(
                f"{provider_id}\t{node_models[i]}\t8\tnode{i:05d}\t{rng.choice(REGIONS)}\t"
                "default\t64\t512\t4000\t"
                f"10000\t10000\t550.54\t12.4\t{'t' if rng.random() < 0.5 else 'f'}\t"
                f"{'online' if rng.random() < 0.95 else 'offline'}\t"
                f"{round(rng.uniform(0.8, 1.0), 4)}\tt\t{price}\t{round(price * 0.4, 4)}\tnow\n"
            )
        with conn.cursor().copy(
            "COPY marketplace_node (provider_id, gpu_model_id, gpu_count, hostname, region, pool,"
            " cpu_cores, ram_gb, disk_gb, net_up_mbps, net_down_mbps, driver_version,"
            " cuda_version, nvlink, status, reliability, simulated, price_per_gpu_hour,"
            " min_bid_per_gpu_hour, created_at)"
            " FROM STDIN"
        ) as copy:
            copy.write(node_rows.getvalue())
        node_ids = [r[0] for r in conn.execute("SELECT id FROM marketplace_node ORDER BY id")]
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
        busy_nodes = rng.sample(gpus, len(gpus) // 2)
        t = time.time()
        held = "[{},{})".format(
            *(time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(x)) for x in (t - 3600, t + 3600))
        )
        for node_id, gpu_ids in busy_nodes:
            rental_id = uuid.uuid4()
            rental_rows.write(
                f"{rental_id}\t{user_id}\t\trunning\t\t{{}}\t{{}}\t0\t0\t4\t1\tf\t\tdefault\t\\N\t"
                f"on_demand\t\\N\t0\tnow\tnow\t3600\timg\t[]\t\\N\t{{}}\t{{}}\t1.0\t\\N\t\\N\t"
                f"\\N\t\\N\t\\N\t\tnow\tnow\n"
            )
            for gpu_id in gpu_ids[:4]:
                alloc_rows.write(f"{rental_id}\t{gpu_id}\t{node_id}\t{held}\t\\N\tnow\n")
        with conn.cursor().copy(
            "COPY marketplace_rental (id, customer_id, name, status, status_reason, gpu_models,"
            " gpu_families, min_memory_gb, min_tensor_tflops, gpus_per_node, node_count,"
            " same_group, region, pool, max_price_per_gpu_hour, kind, bid_per_gpu_hour,"
            " priority, start_at, start_deadline, duration_s, image, command, harness_config,"
            " env, ports, price_per_gpu_hour, scheduled_start, scheduled_end, started_at,"
            " ended_at, exit_code, log_tail, created_at, updated_at) FROM STDIN"
        ) as copy:
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


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_api(requests_n: int) -> list[float]:
    import requests

    port = _free_port()
    env = dict(os.environ, DEBUG="0", ALLOWED_HOSTS="127.0.0.1", SECURE_COOKIES="0")
    server = subprocess.Popen(
        [
            str(ROOT / ".venv" / "bin" / "gunicorn"),
            "config.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{base}/healthz", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gunicorn did not come up")
            time.sleep(0.2)
        session = requests.Session()
        url = f"{base}/api/v1/offers/"
        for _ in range(20):
            r = session.get(url, params=QUERY, timeout=10)
            r.raise_for_status()
        assert r.json()["results"], "the benchmark query matched nothing"
        latencies = []
        for _ in range(requests_n):
            t0 = time.perf_counter()
            r = session.get(url, params=QUERY, timeout=10)
            latencies.append((time.perf_counter() - t0) * 1000)
            r.raise_for_status()
        return latencies
    finally:
        server.terminate()
        server.wait(10)


def measure_raw(url: str, n: int) -> list[float]:
    import psycopg

    latencies = []
    with psycopg.connect(url) as conn:
        for _ in range(20):
            conn.execute(RAW_PAGE).fetchall()
        for _ in range(n):
            t0 = time.perf_counter()
            conn.execute(RAW_PAGE).fetchall()
            latencies.append((time.perf_counter() - t0) * 1000)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    with bench_database("gpumarket_bench_offers") as url:
        t0 = time.perf_counter()
        gpus = build_inventory(url, args.nodes)
        print(f"inventory: {args.nodes} nodes, {gpus} GPUs in {time.perf_counter() - t0:.1f} s")
        api = measure_api(args.requests)
        raw = measure_raw(url, args.requests)
    api_p50, api_p95 = percentile(api, 50), percentile(api, 95)
    raw_p50, raw_p95 = percentile(raw, 50), percentile(raw, 95)
    print(f"query: {QUERY}")
    print(f"API over HTTP   p50 {api_p50:7.2f} ms   p95 {api_p95:7.2f} ms   ({args.requests} req)")
    print(f"raw psycopg     p50 {raw_p50:7.2f} ms   p95 {raw_p95:7.2f} ms   (same statement)")
    print(f"ratio API/raw at p95: {api_p95 / raw_p95:.2f}  (goal: p95 < 50 ms, ratio <= 3)")
    emit(
        {
            "nodes": args.nodes,
            "gpus": gpus,
            "api_p50_ms": round(api_p50, 2),
            "api_p95_ms": round(api_p95, 2),
            "raw_p95_ms": round(raw_p95, 2),
            "ratio_api_to_raw": round(api_p95 / raw_p95, 2),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
