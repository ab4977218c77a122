"""Offers latency at marketplace scale: 10,000 nodes, 80,000 GPUs, a quarter of them busy.

Measures a filtered, sorted offers page through the real API (gunicorn over HTTP, the same
process layout as production) and the same statement through raw psycopg in
the same run, so the ratio shows what HTTP, Django and DRF cost on top of the database.

    python bench/offers.py [--nodes 10000] [--requests 300]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import bench_database, build_inventory, emit, gunicorn, parse_args, percentile

QUERY = {
    "min_memory_gb": "40",
    "min_free_gpus": "2",
    "max_price": "3.00",
    "ordering": "price_per_tflop",
    "limit": "50",
}


def measure_api(requests_n: int) -> list[float]:
    import requests

    with gunicorn() as server:
        session = requests.Session()
        url = f"{server.base_url}/api/v1/offers/"
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


def raw_statement() -> tuple[str, list]:
    """The very statement and parameters the API runs for QUERY (one extra row for `next`)."""
    from decimal import Decimal

    from marketplace.selectors import OfferFilters, offer_list_sql

    filters = OfferFilters(
        min_memory_gb=40, min_free_gpus=2, max_price=Decimal("3.00"), ordering="price_per_tflop"
    )
    return offer_list_sql(filters=filters, limit=51, offset=0)


def measure_raw(url: str, n: int) -> list[float]:
    import psycopg

    sql, params = raw_statement()
    latencies = []
    with psycopg.connect(url) as conn:
        for _ in range(20):
            conn.execute(sql, params).fetchall()
        for _ in range(n):
            t0 = time.perf_counter()
            conn.execute(sql, params).fetchall()
            latencies.append((time.perf_counter() - t0) * 1000)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300)
    args = parse_args(parser, nodes=40, requests=10)
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
