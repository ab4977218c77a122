"""Offers latency at marketplace scale: 10,000 nodes, 80,000 GPUs, a quarter of them busy.

Measures a filtered, sorted offers page through the real API (gunicorn over HTTP, the same
process layout as production) and the same statement through raw psycopg in
the same run, so the ratio shows what HTTP, Django and DRF cost on top of the database.

    python bench/offers.py [--nodes 10000] [--requests 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from contextlib import closing

from _common import ROOT, bench_database, build_inventory, emit, percentile

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
        gpus = build_inventory(url, args.nodes, busy_node_fraction=0.5)
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
