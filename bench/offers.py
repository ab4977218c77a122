"""Offers latency at marketplace scale: 10,000 nodes, 80,000 GPUs, a quarter of them busy.

Measures a filtered, sorted offers page through the real API (gunicorn over HTTP, the same
process layout as production) and the same statement through raw psycopg in the same run, so
the ratio shows what HTTP, Django and DRF cost on top of the database. Each API phase runs
twice in the same run: with the offers cache off (`OFFERS_CACHE_TTL_S=0`: every page runs the
statement, as before the cache) and on (the settings' TTL), one client after another and then
`--clients` clients at once (browsers arriving together: what the whole-marketplace benchmark
saw). `--distinct` gives every request of the cached phases its own query (a price a cent
apart), so each one misses: what the cache costs when it never helps. Last, the advisor's
question (every card's cheapest offers) on one raw connection, a statement per card beside the
one statement for all cards that answers read now.

    python bench/offers.py [--nodes 10000] [--requests 300] [--clients 8] [--distinct]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from decimal import Decimal
from urllib.parse import urlsplit

from _common import bench_database, build_inventory, emit, gunicorn, parse_args, percentile

QUERY = {
    "min_memory_gb": "40",
    "min_free_gpus": "2",
    "max_price": "3.00",
    "ordering": "price_per_tflop",
    "limit": "50",
}


def _query(i: int, distinct: bool) -> dict:
    """QUERY, or with `distinct` a query of its own for request `i` (same rows, another key)."""
    if not distinct:
        return QUERY
    return {**QUERY, "max_price": str(Decimal("3.00") + Decimal(i) / 10_000)}


def _cpu_seconds(web_pid: int, database: str) -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) so far of each web process (gunicorn and its workers) and of
    each PostgreSQL backend connected to the bench's database (the web workers keep theirs
    open between requests, so a phase's difference is what its requests cost)."""
    import psutil

    root = psutil.Process(web_pid)
    out = {}
    for group, procs in (
        ("web", [root, *root.children(recursive=True)]),
        (
            "postgres",
            [
                p
                for p in psutil.process_iter(["name", "cmdline"])
                if f" {database} " in " ".join(p.info["cmdline"] or ())
            ],
        ),
    ):
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            out[(group, proc.pid)] = times.user + times.system
    return out


def _cpu_ms_per_request(before: dict, after: dict, requests_n: int) -> dict[str, float]:
    spent = {"web": 0.0, "postgres": 0.0}
    for (group, pid), seconds in after.items():
        spent[group] += seconds - before.get((group, pid), 0.0)
    return {group: seconds * 1000 / requests_n for group, seconds in spent.items()}


def _timed_gets(url: str, n: int, start: int, distinct: bool) -> list[float]:
    import requests

    session = requests.Session()
    latencies = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        r = session.get(url, params=_query(i, distinct), timeout=30)
        latencies.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    return latencies


def measure_api(requests_n: int, clients: int, ttl_s: str, distinct: bool, database: str) -> dict:
    """One gunicorn with OFFERS_CACHE_TTL_S=`ttl_s`: `requests_n` GETs one after another, then
    `requests_n` spread over `clients` threads at once. Latencies in ms, requests a second, and
    the web's and PostgreSQL's CPU per request over both."""
    import requests

    # Connections kept through the phase: a backend closed mid-phase would take its CPU along.
    env = {"OFFERS_CACHE_TTL_S": ttl_s, "DB_CONN_MAX_AGE": "3600"}
    with gunicorn(extra_env=env) as server:
        url = f"{server.base_url}/api/v1/offers/"
        # A connection of its own per request, so that every worker has served before timing.
        for _ in range(40):
            r = requests.get(url, params=QUERY, timeout=30)
            r.raise_for_status()
        assert r.json()["results"], "the benchmark query matched nothing"
        before = _cpu_seconds(server.pid, database)
        serial = _timed_gets(url, requests_n, 0, distinct)
        per_client = max(1, requests_n // clients)
        results: list[list[float]] = [[] for _ in range(clients)]

        def client(k: int) -> None:
            # Each client's queries differ from every other request's under --distinct.
            results[k] = _timed_gets(url, per_client, (k + 1) * per_client + requests_n, distinct)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        together = [ms for rs in results for ms in rs]
        assert len(together) == per_client * clients, "a client failed"
        cpu = _cpu_ms_per_request(
            before, _cpu_seconds(server.pid, database), len(serial) + len(together)
        )
    return {
        "serial": serial,
        "concurrent": together,
        "concurrent_per_s": len(together) / wall,
        "cpu_ms": cpu,
    }


def raw_statement() -> tuple[str, list]:
    """The very statement and parameters the API runs for QUERY (one extra row for `next`)."""
    from marketplace.selectors import OfferFilters, offer_list_sql

    filters = OfferFilters(
        min_memory_gb=40, min_free_gpus=2, max_price=Decimal("3.00"), ordering="price_per_tflop"
    )
    return offer_list_sql(filters=filters, limit=51, offset=0)


def measure_raw(url: str, n: int) -> tuple[list[float], float]:
    """The statement `n` times on one connection: latencies in ms, and its backend's CPU ms a
    statement (what a page that runs it costs PostgreSQL, without HTTP or Django)."""
    import psutil
    import psycopg

    sql, params = raw_statement()
    latencies = []
    with psycopg.connect(url) as conn:
        backend = psutil.Process(conn.info.backend_pid)
        for _ in range(20):
            conn.execute(sql, params).fetchall()
        cpu0 = sum(backend.cpu_times()[:2])
        for _ in range(n):
            t0 = time.perf_counter()
            conn.execute(sql, params).fetchall()
            latencies.append((time.perf_counter() - t0) * 1000)
        cpu_ms = (sum(backend.cpu_times()[:2]) - cpu0) * 1000 / n
    return latencies, cpu_ms


def measure_advisor_raw(url: str, n: int) -> dict[str, tuple[list[float], float]]:
    """The advisor's question (every card's cheapest offers, what an answer reads) `n` times on
    one connection, asked two ways: a statement per card (as answers read them before) and all
    cards in one statement (as they read them now). Per way: the latencies of the whole
    question in ms, and its backend's CPU ms a question."""
    import psutil
    import psycopg

    from advisor.plans import OFFERS_PER_CARD
    from advisor.selectors import advisor_cards
    from marketplace.selectors import OfferFilters, offer_list_sql, offers_by_card_sql

    slugs = tuple(card.slug for card in advisor_cards())
    ways = {
        "a statement per card": [
            offer_list_sql(
                filters=OfferFilters(gpu_models=(slug,)), limit=OFFERS_PER_CARD, offset=0
            )
            for slug in slugs
        ],
        "one statement": [
            offers_by_card_sql(filters=OfferFilters(gpu_models=slugs), per_card=OFFERS_PER_CARD)
        ],
    }
    out = {}
    with psycopg.connect(url) as conn:
        backend = psutil.Process(conn.info.backend_pid)
        for way, statements in ways.items():
            for sql, params in statements * 2:
                conn.execute(sql, params).fetchall()
            latencies = []
            cpu0 = sum(backend.cpu_times()[:2])
            for _ in range(n):
                t0 = time.perf_counter()
                for sql, params in statements:
                    conn.execute(sql, params).fetchall()
                latencies.append((time.perf_counter() - t0) * 1000)
            out[way] = (latencies, (sum(backend.cpu_times()[:2]) - cpu0) * 1000 / n)
    return out


def _line(name: str, values: list[float], extra: str = "") -> str:
    p50, p95 = percentile(values, 50), percentile(values, 95)
    return f"{name:<34} p50 {p50:7.2f} ms   p95 {p95:7.2f} ms   ({len(values)} req{extra})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300, help="GETs per phase")
    parser.add_argument("--clients", type=int, default=8, help="clients of the concurrent phase")
    parser.add_argument("--ttl", default="5", help="OFFERS_CACHE_TTL_S of the cached phases")
    parser.add_argument(
        "--distinct", action="store_true", help="every cached-phase request a query of its own"
    )
    args = parse_args(parser, nodes=40, requests=10, clients=2)
    with bench_database("gpumarket_bench_offers") as url:
        t0 = time.perf_counter()
        gpus = build_inventory(url, args.nodes, busy_node_fraction=0.5)
        print(f"inventory: {args.nodes} nodes, {gpus} GPUs in {time.perf_counter() - t0:.1f} s")
        database = urlsplit(url).path.strip("/")
        off = measure_api(args.requests, args.clients, "0", distinct=False, database=database)
        on = measure_api(
            args.requests, args.clients, args.ttl, distinct=args.distinct, database=database
        )
        raw, raw_cpu_ms = measure_raw(url, args.requests)
        advisor = measure_advisor_raw(url, max(3, args.requests // 20))
    print(f"query: {QUERY}" + ("  (cached phases: a price of its own per request)" * args.distinct))
    print(_line("raw psycopg (same statement)", raw, f", PostgreSQL CPU {raw_cpu_ms:.2f} ms each"))
    for name, run in (("no cache", off), (f"cache {args.ttl} s", on)):
        print(_line(f"API {name}, 1 client", run["serial"]))
        print(
            _line(
                f"API {name}, {args.clients} clients",
                run["concurrent"],
                f", {run['concurrent_per_s']:.0f}/s",
            )
        )
        cpu = run["cpu_ms"]
        print(
            f"{'':<34} CPU a request: web {cpu['web']:.2f} ms, PostgreSQL {cpu['postgres']:.2f} ms"
        )
    for way, (latencies, cpu_ms) in advisor.items():
        print(_line(f"advisor: {way}", latencies, f", PostgreSQL CPU {cpu_ms:.1f} ms"))
    (per_card, per_card_cpu), (one, one_cpu) = advisor.values()
    print(f"advisor: PostgreSQL CPU, one statement / per card: {one_cpu / per_card_cpu:.2f}")
    raw_p95 = percentile(raw, 95)
    off_p95, on_p95 = percentile(off["serial"], 95), percentile(on["serial"], 95)
    off_c95, on_c95 = percentile(off["concurrent"], 95), percentile(on["concurrent"], 95)
    print(f"ratio API/raw at p95, no cache: {off_p95 / raw_p95:.2f}")
    print(f"p95 with {args.clients} clients: {off_c95:.1f} ms -> {on_c95:.1f} ms (goal < 100 ms)")
    emit(
        {
            "nodes": args.nodes,
            "gpus": gpus,
            "clients": args.clients,
            "cache_ttl_s": float(args.ttl),
            "distinct": args.distinct,
            "raw_p95_ms": round(raw_p95, 2),
            "raw_postgres_cpu_ms": round(raw_cpu_ms, 2),
            "api_p50_ms": round(percentile(off["serial"], 50), 2),
            "api_p95_ms": round(off_p95, 2),
            "ratio_api_to_raw": round(off_p95 / raw_p95, 2),
            "api_concurrent_p95_ms": round(off_c95, 2),
            "api_concurrent_per_s": round(off["concurrent_per_s"], 1),
            "cached_p50_ms": round(percentile(on["serial"], 50), 2),
            "cached_p95_ms": round(on_p95, 2),
            "cached_concurrent_p95_ms": round(on_c95, 2),
            "cached_concurrent_per_s": round(on["concurrent_per_s"], 1),
            "web_cpu_ms": round(off["cpu_ms"]["web"], 2),
            "postgres_cpu_ms": round(off["cpu_ms"]["postgres"], 2),
            "cached_web_cpu_ms": round(on["cpu_ms"]["web"], 2),
            "cached_postgres_cpu_ms": round(on["cpu_ms"]["postgres"], 2),
            "advisor_per_card_p95_ms": round(percentile(per_card, 95), 1),
            "advisor_per_card_postgres_cpu_ms": round(per_card_cpu, 1),
            "advisor_one_statement_p95_ms": round(percentile(one, 95), 1),
            "advisor_one_statement_postgres_cpu_ms": round(one_cpu, 1),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
