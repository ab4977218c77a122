"""Agent API load: 200 simulated agents heartbeating once a second against one server.

The server is one gunicorn instance in the production layout (config/gunicorn.py: two
processes per core, two threads each; `--workers` to change) on the same PostgreSQL and Redis a
deployment would use. The agents are protocol clients in one asyncio
process (a real agent per simulated host would need 200 processes): each joins with its own
one-time token, then sends a heartbeat every second carrying telemetry for its 8 GPUs, exactly
the payload shape the real agent sends. Printed beside the figures: the offered rate, and the
server's own CPU time per heartbeat (psutil on the gunicorn processes).

Two phases: idle hosts, then busy ones; for each, the SQL statements one heartbeat makes are
also counted in this process (the same view and services, Django's query log). For the busy
phase `--busy` rentals of 2 GPUs per host are booked and placed through the real services; each
host learns its runs from the heartbeat answers, as the real agent does (sending back the
digest of the desired state it holds, so the server answers "unchanged" while it is), and from
then on every heartbeat carries, per run, a container report, a usage report, a harness step
line and two log lines.

Then one real agent (`python -m nodeagent`, Docker runtime when an engine answers,
else the local-process runtime) gets a rental, and the time from SCHEDULED to RUNNING is read
from the rental's event rows.

    python bench/agents.py [--agents 200] [--seconds 20] [--interval 1] [--busy 4]

`--interval 5` is the agents' real heartbeat interval (the server's HEARTBEAT_INTERVAL_S): with
`--agents 1000` it offers the same 200 heartbeats a second from five times the hosts, each
connection idle for 5 s between its heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

from _common import ROOT, CpuMeter, bench_database, emit, gunicorn, parse_args, percentile

BIN = Path(sys.executable).parent
GPUS_PER_HOST = 8


def server_cpu_seconds(server: subprocess.Popen) -> float:
    import psutil

    parent = psutil.Process(server.pid)
    total = 0.0
    for proc in [parent, *parent.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def join_tokens(n: int) -> list[str]:
    from accounts.services import user_create
    from marketplace.models import Provider
    from provisioning.services import join_token_create

    owner = user_create(username="provider", email="p@example.invalid", password="x")
    provider = Provider.objects.create(name="bench", owner=owner)
    return [
        join_token_create(
            provider=provider,
            created_by=owner,
            region="bench",
            price_per_gpu_hour=Decimal("1.00"),
            min_bid_per_gpu_hour=Decimal("0.40"),
        )[1]
        for _ in range(n)
    ]


async def join_agents(base: str, tokens: list[str]) -> list[str]:
    """Join one simulated host per one-time token; returns their node tokens."""
    import aiohttp

    from agentprotocol import JOIN_PATH

    node_tokens = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for i, token in enumerate(tokens):
            body = {
                "join_token": token,
                "hostname": f"sim-{i:04d}",
                "host": {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000},
                "gpus": [
                    {
                        "index": g,
                        "uuid": f"GPU-bench-{i}-{g}",
                        "name": "rtx4090-24gb",
                        "memory_mb": 24564,
                        "topology_group": "",
                    }
                    for g in range(GPUS_PER_HOST)
                ],
                "simulated": True,
            }
            async with session.post(base + JOIN_PATH, json=body) as r:
                assert r.status == 201, await r.text()
                node_tokens.append((await r.json())["node_token"])
    return node_tokens


class Host:
    """One simulated host's side of the protocol: the runs the server gave it (from each
    heartbeat's answer) and what it reports about them, as the real agent does."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.runs: dict[str, tuple[str, int, float]] = {}  # run -> (rental, gpus, started)
        self.seq = 0
        self.line_no = 0
        self.step = 0
        self.digest = ""  # of the desired state it holds, sent back as the real agent does
        self.interval: float | None = None  # what the server's last answer asked for
        self.refused = 0  # heartbeats the server refused before any work (503 + Retry-After)
        # When its next heartbeat is due (time.monotonic()), kept from one run_agents call to
        # the next: a fleet does not restart in step at each phase of a benchmark.
        self.next_at: float | None = None
        self.node_id: int | None = None

    def learn(self, answer: dict) -> None:
        if answer.get("heartbeat_interval_s"):
            self.interval = float(answer["heartbeat_interval_s"])
        # As the real agent: the digest an answer gives names the state held from now on, also
        # when the answer says it is unchanged (the server may rename it).
        self.digest = answer.get("desired_digest", "")
        if answer.get("desired_unchanged"):
            return
        wanted = {entry["run_id"]: entry for entry in answer.get("desired", ())}
        for run_id in list(self.runs):
            if run_id not in wanted:
                del self.runs[run_id]
        for run_id, entry in wanted.items():
            if run_id not in self.runs:
                self.runs[run_id] = (entry["rental_id"], len(entry["gpu_indices"]), time.time())

    def body(self, rng: random.Random) -> dict:
        """A heartbeat: telemetry for every GPU, and for each run its container report, a usage
        report, a harness step line and two log lines (what a training run sends a second)."""
        import json

        from agentprotocol import (
            ContainerReport,
            ContainerStatus,
            GpuSample,
            Heartbeat,
            LogLine,
            MetricLine,
            UsageReport,
        )

        now = time.time()
        containers, usage, metrics, logs = [], [], [], []
        self.step += 1
        for run_id, (rental_id, gpus, started) in self.runs.items():
            self.seq += 1
            containers.append(
                ContainerReport(
                    rental_id=rental_id,
                    run_id=run_id,
                    status=ContainerStatus.RUNNING,
                    started_at=started,
                )
            )
            usage.append(
                UsageReport(
                    seq=self.seq,
                    rental_id=rental_id,
                    run_id=run_id,
                    gpu_count=gpus,
                    started_at=started,
                    confirmed_at=now,
                )
            )
            line = {"event": "step", "step": self.step, "loss": round(rng.uniform(2, 4), 4),
                    "samples_per_s": round(rng.uniform(90, 110), 1), "ts": now}  # fmt: skip
            metrics.append(MetricLine(rental_id=rental_id, run_id=run_id, line=json.dumps(line)))
            for _ in range(2):
                self.line_no += 1
                logs.append(
                    LogLine(
                        rental_id=rental_id,
                        run_id=run_id,
                        line_no=self.line_no,
                        line=f"step {self.step} loss {line['loss']} rank 0",
                    )
                )
        return Heartbeat(
            agent_version="bench",
            sent_at=now,
            telemetry=tuple(
                GpuSample(
                    gpu_index=g,
                    ts=now,
                    util_pct=rng.uniform(0, 100),
                    mem_used_mb=rng.randint(0, 24000),
                    power_w=rng.uniform(50, 450),
                    temp_c=rng.uniform(30, 80),
                )
                for g in range(GPUS_PER_HOST)
            ),
            containers=tuple(containers),
            usage=tuple(usage),
            metrics=tuple(metrics),
            logs=tuple(logs),
            desired_digest=self.digest,
        ).to_payload()


def refusal_delay(response, answer) -> float | None:
    """The wait a refused heartbeat (429/503 with Retry-After) was told, read as the real agent
    reads it (nodeagent.client.refusal_wait); None when the answer is no refusal."""
    from nodeagent.client import refusal_wait

    if response.status not in (429, 503):
        return None
    said = refusal_wait(response.headers.get("Retry-After"), answer)
    return None if said is None else said[0]


async def run_agents(
    base: str, hosts: list[Host], seconds: float, interval: float = 1.0, *, follow: bool = False
) -> tuple[list[float], int]:
    """Every host heartbeats every `interval` seconds for `seconds`; with `follow`, as the real
    agent does, at the interval the server's last answer asked it for, and after a refusal
    (503 with Retry-After, counted in `Host.refused`) at the Retry-After, then at the interval
    the refusal names. Without `follow` (the raw load), a refusal is an error like any other.
    As the real agent, a host that fell behind does not catch up, and one whose heartbeat
    failed backs off (nodeagent.client.backoff_delay). A host goes on from its own schedule
    (`Host.next_at`, kept for the next call: nothing waits past `seconds`), or, with none yet,
    starts at its place in one `interval`. Returns the latencies (ms) of the heartbeats not
    refused, and the errors."""
    import aiohttp

    from agentprotocol import HEARTBEAT_PATH
    from nodeagent.client import backoff_delay

    latencies: list[float] = []
    errors = 0
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        deadline = time.monotonic() + seconds

        async def agent(host: Host, offset: float) -> None:
            nonlocal errors
            headers = {"Authorization": f"Bearer {host.token}"}
            now = time.monotonic()
            next_at = host.next_at if host.next_at is not None else now + offset
            if next_at < now:  # beats missed between calls are skipped, the host's phase kept
                every = (host.interval or interval) if follow else interval
                next_at += math.ceil((now - next_at) / every) * every
            if next_at >= deadline:
                return
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            rng = random.Random(host.token)
            failures = 0
            while time.monotonic() < deadline:
                body = host.body(rng)
                t0 = time.perf_counter()
                failures += 1
                retry_after = None
                try:
                    async with session.post(base + HEARTBEAT_PATH, json=body, headers=headers) as r:
                        answer = await r.json(content_type=None)
                        if r.status == 200:
                            host.learn(answer)
                            failures = 0
                        elif follow and (retry_after := refusal_delay(r, answer)) is not None:
                            r.close()  # as the agent: back on a new connection
                            host.interval = answer.get("heartbeat_interval_s") or host.interval
                            host.refused += 1
                            failures -= 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    errors += 1
                if retry_after is None:
                    latencies.append((time.perf_counter() - t0) * 1000)
                every = (host.interval or interval) if follow else interval
                if retry_after is not None:
                    next_at = time.monotonic() + retry_after
                elif failures:
                    next_at = time.monotonic() + backoff_delay(failures, base_s=every, max_s=60.0)
                else:
                    next_at = max(next_at + every, time.monotonic())
                host.next_at = next_at
                if next_at >= deadline:
                    return
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

        await asyncio.gather(*(agent(h, i * interval / len(hosts)) for i, h in enumerate(hosts)))
    return latencies, errors


def book_busy(per_host: int, hosts: int) -> int:
    """`per_host` rentals of 2 GPUs on every simulated host, booked and placed through the real
    services (rental_create, the scheduler cycle). Returns how many were placed."""
    from accounts.services import team_personal_ensure, user_create
    from billing.services.ledger import account_adjust, account_for_team
    from marketplace.models import Rental, RentalStatus
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
    from scheduler.services import scheduler_cycle_run

    customer = user_create(username="busy", email="busy@example.invalid", password="x")
    team = team_personal_ensure(user=customer)
    account_adjust(
        account_id=account_for_team(team=team).pk,
        amount_micros=10**12,
        reason="benchmark credit",
        actor=None,
    )
    for _ in range(per_host * hosts):
        rental_create(
            customer=customer,
            team=team,
            request=RentalRequest(
                gpus_per_node=2,
                duration_s=3600,
                region="bench",
                network="internal",  # simulated hosts on no runtime of theirs filter nothing
                runtime=RuntimeSpec(image="gpumarket/harness:dev", command=["python", "train.py"]),
            ),
        )
    for _ in range(10):
        scheduler_cycle_run()
        if not Rental.objects.filter(team=team, status=RentalStatus.PENDING).exists():
            break
    return Rental.objects.filter(team=team, status=RentalStatus.SCHEDULED).count()


def running_count() -> int:
    from marketplace.models import Rental, RentalStatus

    return Rental.objects.filter(customer__username="busy", status=RentalStatus.RUNNING).count()


def measure(server, hosts: list[Host], seconds: float, interval: float) -> dict:
    """Heartbeats for `seconds`: handled rate, latencies, and the server's and the database's
    CPU per heartbeat."""
    from django.db import connection

    cpu0 = server_cpu_seconds(server)
    with CpuMeter({"web": [server.pid]}, connection.settings_dict["NAME"]) as meter:
        pg0 = meter.totals().get("postgres", 0.0)
        latencies, errors = asyncio.run(run_agents(server.base_url, hosts, seconds, interval))
        pg = meter.totals().get("postgres", 0.0) - pg0
    cpu = server_cpu_seconds(server) - cpu0
    return {
        "pg_ms": pg * 1000 / max(1, len(latencies)),
        "handled_per_s": (len(latencies) - errors) / seconds,
        "errors": errors,
        "p50": percentile(latencies, 50),
        "p99": percentile(latencies, 99),
        "cpu_ms": cpu * 1000 / max(1, len(latencies)),
        "cpu_s": cpu,
    }


def statements_per_heartbeat(host: Host) -> int:
    """The SQL statements one heartbeat of `host` makes (its BEGIN and COMMIT too), counted
    in this process through the same view and services (Django's query log): the second of
    two, so that the token is one this process has seen valid, as a web process has."""
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from agentprotocol import HEARTBEAT_PATH

    client = Client(HTTP_AUTHORIZATION=f"Bearer {host.token}", HTTP_HOST="localhost")
    rng = random.Random(host.token)
    for _ in range(2):
        body = host.body(rng)
        with CaptureQueriesContext(connection) as queries:
            r = client.post(HEARTBEAT_PATH, body, content_type="application/json", secure=True)
        assert r.status_code == 200, r.content
        host.learn(r.json())
    return len(queries)


def cpu_per_request(server: subprocess.Popen, url: str, n: int = 2000) -> float:
    """Server CPU milliseconds per GET of `url` (4 keep-alive clients): the floor a request
    through the same server and middleware costs, the baseline beside the heartbeat's."""
    import aiohttp

    async def hammer() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

            async def client() -> None:
                for _ in range(n // 4):
                    async with session.get(url) as r:
                        await r.read()
                        assert r.status == 200, r.status

            await asyncio.gather(*(client() for _ in range(4)))

    cpu0 = server_cpu_seconds(server)
    asyncio.run(hammer())
    return (server_cpu_seconds(server) - cpu0) * 1000 / n


def scheduled_to_running(base: str) -> tuple[float, str]:
    """One real agent, one rental: seconds from the SCHEDULED event to the RUNNING event."""
    import docker

    from accounts.services import team_personal_ensure, user_create
    from marketplace.models import Rental, RentalEvent, RentalStatus
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
    from scheduler.services import scheduler_cycle_run

    try:
        docker.from_env(timeout=5).images.get("gpumarket/harness:dev")
        runtime, image = "docker", "gpumarket/harness:dev"
    except Exception:
        runtime, image = "process", "local"
    from marketplace.models import Provider
    from provisioning.services import join_token_create

    provider = Provider.objects.get(name="bench")
    _, token = join_token_create(
        provider=provider, created_by=provider.owner, region="bench-real",
        price_per_gpu_hour=Decimal("1.00"), min_bid_per_gpu_hour=Decimal("0.40"),
    )  # fmt: skip
    state = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    state.chmod(0o711)  # run as root, the process runtime runs a rental as nobody (uid 65534)
    log_path = ROOT / ".var" / "bench" / "agents-real-agent.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "--server", base, "--join-token", token,
         "--runtime", runtime, "--gpu-mode", "none", "--telemetry", "simulated",
         "--simulate-gpus", "rtx4090-24gb:1", "--hostname", "bench-real",
         "--state-dir", str(state / "s"), "--volume-root", str(state / "v"),
         "--process-dir", str(state / "r"), "--interval", "1"],
        cwd=ROOT, env=dict(os.environ), stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        from marketplace.models import Node

        deadline = time.monotonic() + 60
        while not Node.objects.filter(hostname="bench-real").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the real agent did not join")
            time.sleep(0.2)
        customer = user_create(username="renter", email="r@example.invalid", password="x")
        from billing.services.ledger import account_adjust, account_for_team

        account_adjust(
            account_id=account_for_team(team=team_personal_ensure(user=customer)).pk,
            amount_micros=10_000_000,
            reason="benchmark credit",
            actor=None,
        )
        rental = rental_create(
            customer=customer,
            team=team_personal_ensure(user=customer),
            request=RentalRequest(
                gpus_per_node=1,
                duration_s=600,
                region="bench-real",
                network="internal",  # an engine without iptables cannot filter the internet
                runtime=RuntimeSpec(
                    image=image, command=["python", "-c", "import time; time.sleep(600)"]
                ),
            ),
        )
        scheduler_cycle_run()
        deadline = time.monotonic() + 120
        while Rental.objects.get(pk=rental.pk).status != RentalStatus.RUNNING:
            if time.monotonic() > deadline:
                rental = Rental.objects.get(pk=rental.pk)
                raise RuntimeError(
                    f"the rental did not reach RUNNING: {rental.status} ({rental.status_reason});"
                    f" the agent's log: {log_path}"
                )
            time.sleep(0.1)
        events = dict(
            RentalEvent.objects.filter(rental=rental).values_list("to_status", "created_at")
        )
        seconds = (events["running"] - events["scheduled"]).total_seconds()
        from marketplace.lifecycle import rental_stop

        rental_stop(team=team_personal_ensure(user=customer), actor=customer, rental_id=rental.pk)
        deadline = time.monotonic() + 60
        while Rental.objects.get(pk=rental.pk).status == RentalStatus.STOPPING:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return seconds, runtime
    finally:
        agent.terminate()
        agent.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between heartbeats")
    parser.add_argument("--workers", type=int, help="gunicorn processes (default: 2 per core)")
    parser.add_argument(
        "--busy", type=int, default=4, help="rentals of 2 GPUs per host in the busy phase (0: none)"
    )
    args = parse_args(parser, agents=4, seconds=3.0, busy=2)
    with bench_database("gpumarket_bench_agents"):
        tokens = join_tokens(args.agents)
        extra = {"AGENT_THROTTLE_RATE": "100000/min", "LOG_LEVEL": "WARNING"}
        with gunicorn(workers=args.workers, extra_env=extra) as server:
            hosts = [Host(t) for t in asyncio.run(join_agents(server.base_url, tokens))]
            idle = measure(server, hosts, args.seconds, args.interval)
            idle["statements"] = statements_per_heartbeat(hosts[0])
            busy = None
            if args.busy:
                placed = book_busy(args.busy, args.agents)
                # The hosts learn their runs and report them running (not measured: a start
                # is a one-off), then every heartbeat carries its runs' reports.
                deadline = time.monotonic() + 120
                while running_count() < placed and time.monotonic() < deadline:
                    asyncio.run(
                        run_agents(server.base_url, hosts, 2 * args.interval, args.interval)
                    )
                busy = measure(server, hosts, args.seconds, args.interval)
                busy["runs"] = sum(len(h.runs) for h in hosts)
                busy["statements"] = statements_per_heartbeat(hosts[0])
                busy["running"] = running_count()
            health_ms = cpu_per_request(server, server.base_url + "/healthz")
            to_running, runtime = scheduled_to_running(server.base_url)
    offered = args.agents / args.interval
    print(
        f"{args.agents} agents of {GPUS_PER_HOST} GPUs x 1 heartbeat every {args.interval:g} s"
        f" = {offered:g}/s offered for {args.seconds:.0f} s per phase"
    )
    phases = [("idle", idle)] + ([("busy", busy)] if busy else [])
    for name, phase in phases:
        what = "" if name == "idle" else (
            f" ({phase['running']} rentals running, {args.busy} per host: a container report,"
            " a usage report, a step line and two log lines each)"
        )  # fmt: skip
        print(
            f"{name}{what}: handled {phase['handled_per_s']:,.1f} heartbeats/s"
            f" ({phase['errors']} errors), p50 {phase['p50']:.1f} ms, p99 {phase['p99']:.1f} ms;"
            f" server CPU {phase['cpu_ms']:.2f} ms per heartbeat,"
            f" {phase['cpu_ms'] / health_ms:.1f}x the {health_ms:.2f} ms of a /healthz;"
            f" PostgreSQL {phase['pg_ms']:.2f} ms;"
            f" {phase['statements']} SQL statements per heartbeat"
        )
    print(f"SCHEDULED -> RUNNING with a real agent ({runtime} runtime): {to_running:.2f} s")
    figures = {
        "agents": args.agents,
        "heartbeats_per_s": round(idle["handled_per_s"], 1),
        "heartbeat_p99_ms": round(idle["p99"], 1),
        "server_cpu_ms_per_heartbeat": round(idle["cpu_ms"], 2),
        "server_cpu_ms_per_healthz": round(health_ms, 2),
        "postgres_cpu_ms_per_heartbeat": round(idle["pg_ms"], 2),
        "heartbeat_cpu_to_healthz": round(idle["cpu_ms"] / health_ms, 2),
        "statements_per_heartbeat": idle["statements"],
        "scheduled_to_running_s": round(to_running, 2),
        "offered_heartbeats_per_s": round(offered, 1),
        "interval_s": args.interval,
        "heartbeat_p50_ms": round(idle["p50"], 1),
        "errors": idle["errors"],
        "runtime": runtime,
    }
    if busy:
        figures.update(
            busy_rentals_per_host=args.busy,
            busy_running=busy["running"],
            busy_heartbeats_per_s=round(busy["handled_per_s"], 1),
            busy_heartbeat_p99_ms=round(busy["p99"], 1),
            busy_server_cpu_ms_per_heartbeat=round(busy["cpu_ms"], 2),
            busy_to_healthz=round(busy["cpu_ms"] / health_ms, 2),
            busy_postgres_cpu_ms_per_heartbeat=round(busy["pg_ms"], 2),
            busy_statements_per_heartbeat=busy["statements"],
            busy_errors=busy["errors"],
        )
    emit(figures)


if __name__ == "__main__":
    sys.exit(main())
