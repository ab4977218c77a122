"""The wake channel: how fast a wake-up reaches a waiting agent, and what idle long-polls cost.

Runs the real wake server (`manage.py wake_server`, its own process) on the bench's Redis, and
holds `--polls` idle long-polls against it from this process (one aiohttp client, one
connection per simulated node, each with its node's signed ticket). Prints, each beside a
baseline of the same run:

- wake latency: `nodes_wake` (the publishing the web tier does after commit) -> the waiting
  poll answered, p50 / p99 over `--wakes` wake-ups one after another, with every poll held;
  beside the bare Redis PUBLISH -> subscriber round trip on the same Redis (the floor), and
  beside the wait the heartbeat alone gives (half the interval on average, HEARTBEAT_INTERVAL_S);
- memory: the wake server's RSS with the polls held, per poll, beside its RSS with none;
- CPU: the wake server's CPU seconds per second while the polls are held idle, and per poll
  answered while they cycle every `--cycle-s` seconds (what re-polling costs), beside the
  same process's CPU per second with no polls at all.

    python bench/wake.py [--polls 2000] [--wakes 200] [--hold-s 10] [--cycle-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import threading
import time

from _common import ROOT, bench_database, emit, median, parse_args, percentile


def _open_files(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


def _start_server(port: int, channel: str) -> subprocess.Popen:
    import requests
    from django.conf import settings

    env = {
        **os.environ,
        "SECRET_KEY": settings.SECRET_KEY,
        "WAKE_CHANNEL": channel,
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "wake_server", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/wake/v1/healthz", timeout=1).ok:
                return proc
        except requests.RequestException:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the wake server did not start")


def _cpu_s(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _redis_round_trips(count: int) -> list[float]:
    """PUBLISH -> the subscriber's receipt on the bench's Redis: the floor of any wake-up."""
    import redis

    url = os.environ["REDIS_URL"]
    channel = f"bench-floor-{os.getpid()}"
    sub = redis.Redis.from_url(url).pubsub()
    sub.subscribe(channel)
    sub.get_message(timeout=5)
    pub = redis.Redis.from_url(url)
    out = []
    for _ in range(count):
        began = time.perf_counter()
        pub.publish(channel, b"x")
        while sub.get_message(timeout=5) is None:
            pass
        out.append(time.perf_counter() - began)
        time.sleep(0.005)
    sub.close()
    return out


class Polls:
    """`count` nodes' agents, each holding one long-poll and re-polling when answered."""

    def __init__(self, url: str, count: int, timeout_s: float) -> None:
        from core.wake import wake_ticket_issue

        self.url = url
        self.timeout_s = timeout_s
        self.tickets = {
            n: wake_ticket_issue(node_id=n, issued_at=time.time()) for n in range(1, count + 1)
        }
        self.answered = 0
        self.errors = 0
        self.woken_at: dict[int, float] = {}
        self.stop = False

    async def _one(self, session, node_id: int) -> None:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.tickets[node_id]}"}
        while not self.stop:
            try:
                async with session.get(
                    self.url, params={"timeout": str(self.timeout_s)}, headers=headers
                ) as response:
                    body = await response.json()
            except (TimeoutError, aiohttp.ClientError):
                self.errors += 1
                await asyncio.sleep(0.5)
                continue
            self.answered += 1
            if body.get("woken"):
                self.woken_at[node_id] = time.perf_counter()
                # As the agent does: a fresh ticket (its heartbeat's) before polling again.
                from core.wake import wake_ticket_issue

                self.tickets[node_id] = wake_ticket_issue(node_id=node_id, issued_at=time.time())
                headers = {"Authorization": f"Bearer {self.tickets[node_id]}"}

    async def run(self) -> None:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s + 15)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._one(session, n) for n in self.tickets))


def _hold(url: str, count: int, timeout_s: float) -> tuple[Polls, threading.Thread]:
    polls = Polls(url, count, timeout_s)
    loop = asyncio.new_event_loop()

    def run() -> None:
        loop.run_until_complete(polls.run())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return polls, thread


def _waiting(port: int) -> int:
    import requests

    return requests.get(f"http://127.0.0.1:{port}/wake/v1/healthz", timeout=5).json()["waiting"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--wakes", type=int, default=200)
    parser.add_argument("--hold-s", type=float, default=10.0)
    parser.add_argument("--cycle-s", type=float, default=2.0)
    args = parse_args(parser, polls=50, wakes=10, hold_s=1.0, cycle_s=0.5)
    _open_files(2 * args.polls + 256)
    import psutil

    from devstack.embedded import free_port

    with bench_database("bench_wake"):
        from django.conf import settings

        from core.wake import nodes_wake

        channel = f"bench-wake-{os.getpid()}"
        settings.GPUMARKET = {**settings.GPUMARKET, "WAKE_URL": "bench", "WAKE_CHANNEL": channel}
        port = free_port()
        server = _start_server(port, channel)
        try:
            proc = psutil.Process(server.pid)
            floor = _redis_round_trips(args.wakes)
            # The server alone: memory and CPU with nothing to hold.
            time.sleep(1)
            rss_empty = proc.memory_info().rss
            cpu0 = _cpu_s(proc)
            time.sleep(args.hold_s)
            idle_empty_cpu = (_cpu_s(proc) - cpu0) / args.hold_s

            url = f"http://127.0.0.1:{port}/wake/v1/wait"
            polls, _ = _hold(url, args.polls, timeout_s=55)
            began = time.monotonic()
            while _waiting(port) < args.polls:
                if time.monotonic() - began > 120:
                    raise RuntimeError(f"only {_waiting(port)} of {args.polls} polls held")
                time.sleep(0.2)
            connect_s = time.monotonic() - began
            time.sleep(1)
            rss_held = proc.memory_info().rss
            cpu0 = _cpu_s(proc)
            time.sleep(args.hold_s)
            idle_held_cpu = (_cpu_s(proc) - cpu0) / args.hold_s

            # Wake-ups one after another, every other poll still held.
            latencies = []
            nodes = list(range(1, args.polls + 1))
            for i in range(args.wakes):
                node = nodes[(i * 7919) % len(nodes)]
                # Each node is woken once (7919 is prime): its poll has waited since the start.
                start = time.perf_counter()
                nodes_wake(node_ids=[node])  # autocommit: published at once
                deadline = time.monotonic() + 10
                while node not in polls.woken_at and time.monotonic() < deadline:
                    time.sleep(0.0005)
                if node in polls.woken_at:
                    latencies.append(polls.woken_at[node] - start)
            polls.stop = True
            errors = polls.errors
        finally:
            server.terminate()
            server.wait(30)

        # Cycling: every poll answered after cycle_s and sent again (re-poll churn).
        port = free_port()
        server = _start_server(port, channel)
        try:
            proc = psutil.Process(server.pid)
            cycling, _ = _hold(
                f"http://127.0.0.1:{port}/wake/v1/wait", args.polls, timeout_s=args.cycle_s
            )
            time.sleep(args.cycle_s * 2 + 2)
            answered0, cpu0 = cycling.answered, _cpu_s(proc)
            time.sleep(args.hold_s)
            answered = cycling.answered - answered0
            cycle_cpu = _cpu_s(proc) - cpu0
            cycling.stop = True
            errors += cycling.errors
        finally:
            server.terminate()
            server.wait(30)

    interval = float(os.environ.get("HEARTBEAT_INTERVAL_S", 5))
    wake_ms = [round(v * 1000, 2) for v in (median(latencies), percentile(latencies, 99))]
    print(f"{args.polls} polls held ({connect_s:.1f} s to connect)")
    print(
        f"wake-up -> poll answered p50/p99 {wake_ms[0]} / {wake_ms[1]} ms "
        f"({len(latencies)}/{args.wakes}); Redis PUBLISH -> subscriber "
        f"{median(floor) * 1000:.2f} / {percentile(floor, 99) * 1000:.2f} ms; heartbeat alone: "
        f"{interval / 2:.1f} s on average"
    )
    print(
        f"wake server RSS {rss_empty / 2**20:.1f} MB empty, {rss_held / 2**20:.1f} MB holding "
        f"{args.polls} ({(rss_held - rss_empty) / 1024 / args.polls:.1f} KB a poll); CPU idle "
        f"{idle_empty_cpu * 100:.2f}% empty, {idle_held_cpu * 100:.2f}% holding"
    )
    print(
        f"re-polling every {args.cycle_s} s: {answered / args.hold_s:.0f} polls/s, "
        f"{cycle_cpu / max(1, answered) * 1000:.3f} ms CPU each"
    )
    emit(
        {
            "bench": "wake",
            "polls": args.polls,
            "polls_connected_s": round(connect_s, 2),
            "wake_p50_ms": wake_ms[0],
            "wake_p99_ms": wake_ms[1],
            "wakes_answered": f"{len(latencies)}/{args.wakes}",
            "redis_pubsub_p50_ms": round(median(floor) * 1000, 3),
            "redis_pubsub_p99_ms": round(percentile(floor, 99) * 1000, 3),
            "heartbeat_only_mean_wait_ms": round(interval / 2 * 1000),
            "rss_empty_mb": round(rss_empty / 2**20, 1),
            "rss_held_mb": round(rss_held / 2**20, 1),
            "kb_per_poll": round((rss_held - rss_empty) / 1024 / args.polls, 1),
            "cpu_idle_empty_pct": round(idle_empty_cpu * 100, 2),
            "cpu_idle_held_pct": round(idle_held_cpu * 100, 2),
            "cycle_s": args.cycle_s,
            "cycled_polls_per_s": round(answered / args.hold_s),
            "cpu_ms_per_poll_answered": round(cycle_cpu / max(1, answered) * 1000, 3),
            "poll_errors": errors,
        }
    )


if __name__ == "__main__":
    main()
