"""Launch: how fast rentals handed out at one instant run, and how fast a created one runs.

Three parts, on the stack the product runs: the web app under gunicorn (production layout), a
real Celery worker placing what customers create, PostgreSQL and Redis, and the server's wake-up
channel to agents where this checkout has one (`wake_server` below).

1. Real agents, process runtime: a fleet process (`python -m nodeagent.fleet`, the real agent
   code, a thread per host) drives `--agents` simulated 8-GPU hosts (`--fleet-processes`
   share them out: a real host runs its agent alone, not 64 to one interpreter lock).
   `--rentals` rentals of 1-8 GPUs are booked ahead (created, no worker running yet) and
   handed out at one instant T: one scheduler pass places them all. Printed: the last rental
   RUNNING after T, and per rental the hand-over (T to the driver's start: placed, heard of by
   its agent, staged, driver called), the process start (to the command running) and the
   RUNNING report (to the server's RUNNING event); beside the pass's own time, the heartbeat
   interval and a bare `python -c pass` start of the same run.
2. Simulated agents: `--sim-agents` protocol clients in one asyncio process (bench/agents.py's
   Host) heartbeating at the interval, reacting to answers as the real agent does: a run the
   answer gives them starts at once and is reported RUNNING by an immediate heartbeat; its first
   training step goes with the next regular heartbeat. A customer creates rentals through the
   REST API at `--sim-rate`/s. Printed: create->RUNNING and create->first-step p50/p99 beside
   the heartbeat interval.
3. Docker: when an engine answers and the harness image is present, one real agent on the Docker
   runtime gets `--docker` rentals (image present): create->RUNNING, beside a bare `docker run`
   of the same image. Skipped, saying why, otherwise.

    python bench/launch.py [--agents 64] [--rentals 180] [--interval 5] [--sim-agents 1000]
                           [--sim-rentals 200] [--sim-rate 10] [--docker 3]
                           [--fleet-processes 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from urllib.parse import urljoin

from _common import (
    ROOT,
    bench_database,
    emit,
    funded_team,
    gunicorn,
    median,
    parse_args,
    percentile,
)
from agents import Host, join_agents, refusal_delay, server_cpu_seconds

GPU_SLUG = "rtx4090-24gb"
LOG_DIR = ROOT / ".var" / "bench"
# The server's wake-up channel to agents, where this checkout has one: `manage.py wake_server`
# (the process agents long-poll), started beside the web, which names it to the agents
# (WAKE_URL). Without it a placement reaches its agent at the agent's next heartbeat.
WAKE_COMMAND = "provisioning.management.commands.wake_server"


# -- the stack -----------------------------------------------------------------------------------


@contextmanager
def wake_server():
    """The wake server, when this checkout has one, with WAKE_URL and a shared SECRET_KEY (its
    tickets) set in os.environ for the web started after it; yields its URL or None."""
    try:
        found = importlib.util.find_spec(WAKE_COMMAND) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        yield None
        return
    import requests
    from django.conf import settings

    from devstack.embedded import free_port
    from provisioning.wakeserver import WAKE_PATH  # where the agents poll

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    wake_url = f"{url.rstrip('/')}{WAKE_PATH}"
    os.environ.update(SECRET_KEY=settings.SECRET_KEY, WAKE_URL=wake_url)
    # This process places rentals too (part 1's pass): its settings were read before.
    settings.GPUMARKET = {**settings.GPUMARKET, "WAKE_URL": wake_url}
    LOG_DIR.mkdir(parents=True, exist_ok=True)  # also entered from bench/scheduler.py
    log = (LOG_DIR / "launch-wake.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "manage.py", "wake_server", "--port", str(port)],
        cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}wake/v1/healthz", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the wake server did not start: see {log.name}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(20)


@contextmanager
def celery_worker():
    """A real Celery worker (the cycles that place created rentals), on the bench's services."""
    log = (LOG_DIR / "launch-worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "solo", "-l", "info",
         "--without-heartbeat", "--without-gossip", "--without-mingle"],
        cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield worker
    finally:
        worker.terminate()
        worker.wait(20)


def provider_tokens(region: str, n: int) -> list[str]:
    """`n` one-time join tokens of one provider, for hosts in `region`."""
    from accounts.services import user_create
    from marketplace.models import Provider
    from provisioning.services import join_token_create

    owner = user_create(username=f"p-{region}", email=f"{region}@example.invalid", password="x")
    provider = Provider.objects.create(name=f"launch {region}", owner=owner)
    return [
        join_token_create(
            provider=provider, created_by=owner, region=region,
            price_per_gpu_hour=Decimal("1.00"), min_bid_per_gpu_hour=Decimal("0.40"),
        )[1]
        for _ in range(n)
    ]  # fmt: skip


def wait_nodes(region: str, n: int, timeout_s: float = 120) -> None:
    from marketplace.models import Node

    deadline = time.monotonic() + timeout_s
    while Node.objects.filter(region=region, status="online").count() < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {Node.objects.filter(region=region).count()}/{n} joined")
        time.sleep(0.5)


def event_times(rental_ids: list, status: str) -> dict[str, float]:
    """Rental id -> epoch of its first event into `status`."""
    from django.db.models import Min

    from marketplace.models import RentalEvent

    rows = (
        RentalEvent.objects.filter(rental_id__in=rental_ids, to_status=status)
        .values("rental_id")
        .annotate(at=Min("created_at"))
    )
    return {str(row["rental_id"]): row["at"].timestamp() for row in rows}


def bare_start_s(argv: list[str], n: int = 10) -> float:
    """Median wall time of running `argv` to its end: the floor of a process start."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return median(times)


def spread(values: list[float]) -> dict:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


def fmt(figure: dict) -> str:
    return f"p50 {figure['p50']:.2f} s, p99 {figure['p99']:.2f} s, max {figure['max']:.2f} s"


# -- part 1: real agents ----------------------------------------------------------------------


def rental_sizes(hosts: int, rentals: int, seed: int = 31) -> list[int]:
    """`rentals` sizes of 1-8 GPUs that fit `hosts` 8-GPU hosts with room to spare: a tenth of
    the hosts is wanted whole, the others for 7 GPUs; parts are split until there are enough."""
    rng = random.Random(seed)
    parts = [8 if i % 10 == 0 else 7 for i in range(hosts)]
    while len(parts) < rentals:
        splittable = [i for i, size in enumerate(parts) if size > 1]
        if not splittable:
            break
        i = rng.choice(splittable)
        cut = rng.randint(1, parts[i] - 1)
        parts[i : i + 1] = [cut, parts[i] - cut]
    return sorted(parts[:rentals], reverse=True)  # the big ones first: they pack the hosts


class Fleet:
    """The fleet processes, measured as one (agents.server_cpu_seconds reads `.pid`'s)."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes

    def cpu_seconds(self) -> float:
        return sum(server_cpu_seconds(process) for process in self.processes)


@contextmanager
def fleet(base: str, tokens: list[str], region: str, processes: int = 1):
    """The real agents: `python -m nodeagent.fleet` processes, a host per token, the hosts
    dealt among `processes` of them (a real host runs its agent alone: one process for all
    shares one interpreter lock among 64 agents)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    folder.chmod(0o711)  # run as root, the process runtime runs a rental as nobody (uid 65534)
    nodes = [
        {"hostname": f"{region}-{i:03d}", "simulate_gpus": f"{GPU_SLUG}:8",
         "join_token": token, "dir": str(folder / f"h{i:03d}")}
        for i, token in enumerate(tokens)
    ]  # fmt: skip
    started = []
    for k in range(max(1, min(processes, len(nodes)))):
        spec_path = folder / f"fleet-{k}.json"
        spec_path.write_text(json.dumps({"server": base, "nodes": nodes[k::processes]}))
        log = (LOG_DIR / f"launch-fleet-{k}.log").open("wb")
        started.append(subprocess.Popen(
            [sys.executable, "-m", "nodeagent.fleet", str(spec_path)],
            cwd=ROOT, env=dict(os.environ, LOG_LEVEL="WARNING"), stdout=log,
            stderr=subprocess.STDOUT,
        ))  # fmt: skip
    try:
        yield folder, Fleet(started)
    finally:
        for process in started:
            process.terminate()
        for process in started:
            process.wait(30)
        # The runs outlive their agents by design: end them, then their supervisors end too.
        for child in folder.glob("h*/runs/*/child.json"):
            with contextlib.suppress(ValueError, KeyError, ProcessLookupError, PermissionError):
                os.killpg(json.loads(child.read_text())["pid"], signal.SIGKILL)
        time.sleep(0.5)
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def run_records(folder: Path) -> dict[str, tuple[float, float | None]]:
    """Rental id -> (the driver's start began, the command ran) from the runs' own records."""
    records = {}
    for meta_path in folder.glob("h*/runs/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        child = meta_path.parent / "child.json"
        started = json.loads(child.read_text())["started_at"] if child.exists() else None
        records[meta["rental_id"]] = (meta["created_at"], started)
    return records


def stop_all(team, customer, timeout_s: float = 90) -> None:
    """Stop the team's rentals while their agents still run, and wait until they have ended:
    what comes after is measured on a quiet control plane (otherwise the silent-node sweep and
    the requeueing of 180 rentals of agents gone run beside it)."""
    from marketplace.lifecycle import TERMINAL, rental_stop
    from marketplace.models import Rental

    for rental_id in (
        Rental.objects.filter(team=team).exclude(status__in=TERMINAL).values_list("pk", flat=True)
    ):
        rental_stop(team=team, actor=customer, rental_id=rental_id, reason="benchmark done")
    deadline = time.monotonic() + timeout_s
    while Rental.objects.filter(team=team).exclude(status__in=TERMINAL).exists():
        if time.monotonic() > deadline:
            print("  (some rentals had not ended after the stop; going on)")
            return
        time.sleep(0.5)


def real_agents(server, *, hosts: int, rentals: int, settle_s: float, processes: int) -> dict:
    from marketplace.models import Rental, RentalStatus
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
    from scheduler.services import scheduler_cycle_run

    region = "launch-real"
    tokens = provider_tokens(region, hosts)
    with fleet(server.base_url, tokens, region, processes) as (folder, agents):
        wait_nodes(region, hosts)
        customer, team = funded_team("launcher")
        for size in rental_sizes(hosts, rentals):
            rental_create(
                customer=customer,
                team=team,
                request=RentalRequest(
                    gpus_per_node=size, duration_s=900, region=region, network="internal",
                    runtime=RuntimeSpec(image="local", command=["sleep", "900"]),
                ),
            )  # fmt: skip
        time.sleep(settle_s)  # the hosts' first heartbeats and benchmarks are behind them
        load = os.getloadavg()[0]
        cpu0 = server_cpu_seconds(server), agents.cpu_seconds(), time.process_time()
        t0 = time.time()
        passes = 0
        while passes < 5:
            passes += 1
            scheduler_cycle_run()
            if not Rental.objects.filter(team=team, status=RentalStatus.PENDING).exists():
                break
        pass_s = time.time() - t0
        placed = list(
            Rental.objects.filter(team=team)
            .exclude(status=RentalStatus.PENDING)
            .values_list("pk", flat=True)
        )
        deadline = time.monotonic() + 120
        running: dict[str, float] = {}
        while len(running) < len(placed) and time.monotonic() < deadline:
            time.sleep(0.25)
            running = event_times(placed, RentalStatus.RUNNING)
        answered = event_times(placed, RentalStatus.PROVISIONING)
        cpu = (
            server_cpu_seconds(server) - cpu0[0],
            agents.cpu_seconds() - cpu0[1],
            time.process_time() - cpu0[2],
        )
        records = run_records(folder)
        stop_all(team, customer)
    handover, answer, agent, start, report = [], [], [], [], []
    for rental_id, at_running in running.items():
        began, ran = records.get(rental_id, (None, None))
        if began is None or ran is None:
            continue
        handover.append(began - t0)
        if rental_id in answered:
            answer.append(answered[rental_id] - t0)
            agent.append(began - answered[rental_id])
        start.append(ran - began)
        report.append(at_running - ran)
    return {
        "rentals": rentals,
        "placed": len(placed),
        "gpus": sum(rental_sizes(hosts, rentals)),
        "running": len(running),
        "passes": passes,
        "load": load,
        "cpu": dict(zip(("web", "agents", "bench"), cpu, strict=True)),
        "pass_s": pass_s,
        "last_running_s": max(running.values()) - t0 if running else float("nan"),
        "handover": spread(handover),
        "answer": spread(answer),
        "agent": spread(agent),
        "start": spread(start),
        "report": spread(report),
    }


# -- part 2: simulated agents -----------------------------------------------------------------


class LaunchHost(Host):
    """A simulated host that acts on its answers at once, as the real agent does: a new run
    starts and is reported RUNNING by an immediate heartbeat; its training steps go with the
    regular heartbeats after that."""

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.wake = asyncio.Event()
        self.reported: set[str] = set()  # runs whose RUNNING the server has
        self.first_step: dict[str, float] = {}  # rental id -> its first step delivered
        self.channel: dict | None = None  # the wake-up channel the last answer named
        self.fresh = asyncio.Event()  # an answer named a new channel (a fresh ticket)

    def learn(self, answer: dict) -> None:
        before = set(self.runs)
        channel = answer.get("wake") or self.channel
        if channel != self.channel:
            self.channel = channel
            self.fresh.set()
        super().learn(answer)
        if set(self.runs) - before:
            self.wake.set()

    def body(self, rng: random.Random) -> dict:
        payload = super().body(rng)
        metrics = [m for m in payload.get("metrics", ()) if m["run_id"] in self.reported]
        payload["metrics"] = metrics
        return payload

    def delivered(self, payload: dict, at: float) -> None:
        for line in payload.get("metrics", ()):
            self.first_step.setdefault(line["rental_id"], at)
        self.reported.update(c["run_id"] for c in payload.get("containers", ()))


async def heartbeat_loop(base: str, hosts: list[LaunchHost], interval: float, stop) -> int:
    import aiohttp

    from agentprotocol import HEARTBEAT_PATH

    errors = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def agent(host: LaunchHost, offset: float) -> None:
            nonlocal errors
            headers = {"Authorization": f"Bearer {host.token}"}
            rng = random.Random(host.token)
            await asyncio.sleep(offset)
            while not stop.is_set():
                began = time.monotonic()
                body = host.body(rng)
                retry = None
                try:
                    async with session.post(base + HEARTBEAT_PATH, json=body, headers=headers) as r:
                        answer = await r.json(content_type=None)
                        if (retry := refusal_delay(r, answer)) is not None:
                            r.close()  # as the agent: back on a new connection
                    if r.status == 200:
                        host.delivered(body, time.time())
                        host.learn(answer)
                    elif retry is not None:
                        # As the real agent: back at the time said, whatever wakes it meanwhile.
                        host.refused += 1
                        host.interval = answer.get("heartbeat_interval_s") or host.interval
                    else:
                        errors += 1
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    errors += 1
                if retry is not None:
                    await asyncio.sleep(retry)
                    continue
                # At the interval the server asks for (the real agent's), woken sooner by a run
                # to report or the wake-up channel.
                with contextlib.suppress(TimeoutError):
                    left = (host.interval or interval) - (time.monotonic() - began)
                    await asyncio.wait_for(host.wake.wait(), max(0.0, left))
                host.wake.clear()

        async def listen(host: LaunchHost) -> None:
            """The agent's long-poll on the wake-up channel, where the answers name one; after a
            wake-up it waits for the ticket of the heartbeat that follows, as nodeagent/wake.py
            does (the old one would be answered "woken" again at once)."""
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=40)
            ) as polls:
                while not stop.is_set():
                    if host.channel is None:
                        await asyncio.sleep(interval)
                        continue
                    url = urljoin(base + "/", host.channel["url"])
                    headers = {"Authorization": f"Bearer {host.channel['ticket']}"}
                    try:
                        async with polls.get(url, params={"timeout": 20}, headers=headers) as r:
                            woken = r.status == 200 and (await r.json()).get("woken") is True
                            if r.status != 200:
                                await asyncio.sleep(interval)
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        woken = False
                        await asyncio.sleep(1)
                    if woken:
                        host.fresh.clear()
                        host.wake.set()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(host.fresh.wait(), 30)

        offsets = [i * interval / len(hosts) for i in range(len(hosts))]
        listeners = [asyncio.create_task(listen(h)) for h in hosts]
        await asyncio.gather(*(agent(h, offset) for h, offset in zip(hosts, offsets, strict=True)))
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
    return errors


async def create_rentals(base: str, token: str, n: int, rate: float, region: str) -> list[str]:
    """`n` rentals of 1-4 GPUs through the REST API, one sent every 1/`rate` s whether or not
    the ones before were answered (customers do not wait for each other)."""
    import aiohttp

    rng = random.Random(5)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def create(size: int) -> str | None:
            body = {
                "gpus_per_node": size, "duration_s": 3600, "region": region, "network": "internal",
                "runtime": {"image": "gpumarket/harness:dev", "command": ["python", "train.py"]},
            }  # fmt: skip
            try:
                async with session.post(f"{base}/api/v1/rentals/", json=body, headers=headers) as r:
                    answer = await r.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None  # an overloaded web: counted as a failed create
            if r.status != 201:
                raise RuntimeError(f"create answered {r.status}: {answer}")
            return str(answer["id"])

        began = time.monotonic()
        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(create(rng.choice((1, 1, 2, 4)))))
        return list(await asyncio.gather(*tasks))


def simulated_agents(base: str, *, hosts_n: int, rentals: int, rate: float, interval: float):
    from accounts.services.tokens import api_token_create
    from marketplace.models import Rental

    region = "launch-sim"
    hosts = [
        LaunchHost(t) for t in asyncio.run(join_agents(base, provider_tokens(region, hosts_n)))
    ]
    customer, team = funded_team("creator")
    _, api_token = api_token_create(user=customer, team=team, name="launch")

    async def run() -> tuple[list[str | None], int]:
        stop = asyncio.Event()
        beats = asyncio.create_task(heartbeat_loop(base, hosts, interval, stop))
        await asyncio.sleep(interval)  # every host heartbeats once before the first create
        created = await create_rentals(base, api_token, rentals, rate, region)
        deadline = time.monotonic() + 3 * interval + 60
        while time.monotonic() < deadline:
            stepped = sum(len(h.first_step) for h in hosts)
            if stepped >= len([c for c in created if c]):
                break
            await asyncio.sleep(0.5)
        stop.set()
        return created, await beats

    answered, errors = asyncio.run(run())
    created = [rental_id for rental_id in answered if rental_id]
    created_at = {
        str(pk): at.timestamp()
        for pk, at in Rental.objects.filter(pk__in=created).values_list("pk", "created_at")
    }
    running = event_times(created, "running")
    scheduled = event_times(created, "scheduled")
    first = {rid: at for h in hosts for rid, at in h.first_step.items()}
    return {
        "agents": hosts_n,
        "rentals": len(created),
        "failed_creates": len(answered) - len(created),
        "running": len(running),
        "stepped": len(first),
        "errors": errors,
        "refused": sum(h.refused for h in hosts),
        "told_interval_s": median([h.interval for h in hosts if h.interval] or [interval]),
        "to_scheduled": spread([at - created_at[r] for r, at in scheduled.items()]),
        "to_running": spread([at - created_at[r] for r, at in running.items()]),
        "to_first_step": spread([at - created_at[r] for r, at in first.items() if r in created_at]),
    }


# -- part 3: Docker ---------------------------------------------------------------------------


def docker_unavailable(image: str) -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
        client.images.get(image)
    except Exception as exc:  # any failure to reach the engine or find the image: say which
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


def docker_part(base: str, *, rentals: int, image: str) -> dict:
    """One real agent on the Docker runtime; `rentals` rentals created one after another (each
    once the previous runs): create->RUNNING, beside a bare `docker run` of the image."""
    import docker

    from marketplace.lifecycle import rental_stop
    from marketplace.models import Rental, RentalStatus
    from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create

    client = docker.from_env(timeout=30)
    bare = []
    for i in range(3):
        t0 = time.perf_counter()
        client.containers.run(
            image, ["true"], remove=True, network_mode="none",
            name=f"bench-launch-bare-{os.getpid()}-{i}", labels={"bench": "launch"},
        )  # fmt: skip
        bare.append(time.perf_counter() - t0)
    region = "launch-docker"
    [token] = provider_tokens(region, 1)
    folder = Path(tempfile.mkdtemp(prefix="bench-launch-docker-"))
    log = (LOG_DIR / "launch-docker-agent.log").open("wb")
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeagent", "--server", base, "--join-token", token,
         "--runtime", "docker", "--gpu-mode", "none", "--telemetry", "simulated",
         "--simulate-gpus", f"{GPU_SLUG}:8", "--hostname", "launch-docker",
         "--state-dir", str(folder / "s"), "--volume-root", str(folder / "v"),
         "--publish-ports", "off"],
        cwd=ROOT, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    customer, team = funded_team("docker-renter")
    latencies, made = [], []
    try:
        wait_nodes(region, 1)
        for _ in range(rentals):
            rental = rental_create(
                customer=customer, team=team,
                request=RentalRequest(
                    gpus_per_node=1, duration_s=600, region=region, network="internal",
                    runtime=RuntimeSpec(image=image, command=["sleep", "600"]),
                ),
            )  # fmt: skip
            made.append(rental.pk)
            deadline = time.monotonic() + 120
            while Rental.objects.get(pk=rental.pk).status != RentalStatus.RUNNING:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a Docker rental did not run: see {log.name}")
                time.sleep(0.05)
            running = event_times([rental.pk], RentalStatus.RUNNING)[str(rental.pk)]
            latencies.append(running - rental.created_at.timestamp())
    finally:
        for pk in made:
            with contextlib.suppress(Exception):
                rental_stop(team=team, actor=customer, rental_id=pk)
        deadline = time.monotonic() + 60
        while (
            Rental.objects.filter(pk__in=made, status=RentalStatus.STOPPING).exists()
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        # The agent removes an ended run's container and unmounts its volume in the rounds
        # after it reported the end: wait for that, then end whatever is left.
        labels = [f"gpumarket.rental={pk}" for pk in made]
        while time.monotonic() < deadline and any(
            client.containers.list(all=True, filters={"label": label}) for label in labels
        ):
            time.sleep(0.5)
        agent.terminate()
        agent.wait(30)
        for label in labels:
            for container in client.containers.list(all=True, filters={"label": label}):
                with contextlib.suppress(Exception):
                    container.remove(force=True)
        volumes = folder / "v"
        for mount in Path("/proc/self/mounts").read_text().splitlines():
            target = mount.split()[1]
            if target.startswith(f"{volumes}/"):
                subprocess.run(["umount", "-l", target], check=False)
        subprocess.run(["rm", "-rf", str(folder)], check=False)
    return {"rentals": len(latencies), "to_running": spread(latencies), "bare_run_s": median(bare)}


def print_real(args, real: dict, python_s: float) -> None:
    print(
        f"real agents: {args.agents} hosts of 8 GPUs in {args.fleet_processes} fleet"
        f" process(es), process runtime;"
        f" {real['placed']}/{real['rentals']} rentals ({real['gpus']} GPUs) placed in"
        f" {real['passes']} scheduler pass(es) of {real['pass_s']:.2f} s at T:"
        f" {real['running']} RUNNING, the last {real['last_running_s']:.2f} s after T"
    )
    print(f"  hand-over (T -> the driver's start): {fmt(real['handover'])}")
    print(f"    the server's answer (T -> PROVISIONING, sent to the agent): {fmt(real['answer'])}")
    print(f"    the agent (-> the driver's start: staged, driver called): {fmt(real['agent'])}")
    print(
        f"  process start (-> the command runs): {fmt(real['start'])}"
        f" (a bare `python -c pass`: {python_s * 1000:.0f} ms)"
    )
    print(f"  RUNNING report (-> the server's event): {fmt(real['report'])}")
    cpu, cores = real["cpu"], os.cpu_count() or 1
    print(
        f"  CPU seconds from T to the last RUNNING: web {cpu['web']:.1f}, the agents' fleet"
        f" {cpu['agents']:.1f}, the bench's pass {cpu['bench']:.1f}, of"
        f" {cores * real['last_running_s']:.1f} on {cores} cores;"
        f" load average at T {real['load']:.1f}"
    )


def print_sim(args, sim: dict) -> None:
    print(
        f"simulated agents: {sim['agents']} hosts, {sim['rentals']} rentals created through the"
        f" API at {args.sim_rate:g}/s ({sim['failed_creates']} failed): {sim['running']} RUNNING,"
        f" {sim['stepped']} stepped,"
        f" {sim['errors']} heartbeat errors, {sim['refused']} refused (503, back at the turn"
        f" said); the interval the server asked of them: {sim['told_interval_s']:g} s (median)"
    )
    print(f"  create -> SCHEDULED (the worker placed it): {fmt(sim['to_scheduled'])}")
    print(f"  create -> RUNNING: {fmt(sim['to_running'])}")
    print(f"  create -> first step: {fmt(sim['to_first_step'])}")


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=64, help="real agents (8-GPU hosts)")
    parser.add_argument("--rentals", type=int, default=180, help="rentals handed out at once")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds between the hosts' joining and T"
    )
    parser.add_argument("--interval", type=int, default=5, help="heartbeat interval (s)")
    parser.add_argument(
        "--fleet-processes", type=int, default=1, help="processes the real agents are dealt among"
    )
    parser.add_argument("--sim-agents", type=int, default=1000)
    parser.add_argument("--sim-rentals", type=int, default=200)
    parser.add_argument("--sim-rate", type=float, default=10.0, help="creates per second")
    parser.add_argument("--docker", type=int, default=3, help="Docker rentals (0: none)")
    args = parse_args(
        parser, agents=2, rentals=4, settle=2.0, interval=1, sim_agents=4, sim_rentals=4,
        sim_rate=4.0, docker=0,
    )  # fmt: skip
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    image = "gpumarket/harness:dev"
    python_s = bare_start_s([sys.executable, "-c", "pass"])
    with bench_database("gpumarket_bench_launch"):
        extra = {
            "AGENT_THROTTLE_RATE": "1000000/min",
            "HEARTBEAT_INTERVAL_S": str(args.interval),
            "LOG_LEVEL": "WARNING",
        }
        os.environ.update(extra)  # the worker's and the wake server's too
        with wake_server() as wake, gunicorn(extra_env=extra) as server:
            channel = wake or "none here (a placement reaches its agent at its next heartbeat)"
            print(f"heartbeat interval {args.interval} s; wake-up channel: {channel}")
            real = real_agents(
                server, hosts=args.agents, rentals=args.rentals, settle_s=args.settle,
                processes=args.fleet_processes,
            )  # fmt: skip
            print_real(args, real, python_s)
            with celery_worker():
                sim = None
                if args.sim_agents:
                    sim = simulated_agents(
                        server.base_url, hosts_n=args.sim_agents, rentals=args.sim_rentals,
                        rate=args.sim_rate, interval=args.interval,
                    )  # fmt: skip
                    print_sim(args, sim)
                else:
                    print("simulated agents: skipped (--sim-agents 0)")
                skipped = docker_unavailable(image) if args.docker else "--docker 0"
                dock = None
                if skipped:
                    print(f"docker: skipped ({skipped})")
                else:
                    dock = docker_part(server.base_url, rentals=args.docker, image=image)
                    print(
                        f"docker: {dock['rentals']} rentals, image present: create -> RUNNING"
                        f" {fmt(dock['to_running'])} (a bare `docker run {image} true`:"
                        f" {dock['bare_run_s']:.2f} s)"
                    )
    figures = {
        "interval_s": args.interval,
        "wake_channel": bool(wake),
        "agents": args.agents,
        "fleet_processes": args.fleet_processes,
        "rentals": real["placed"],
        "pass_s": round(real["pass_s"], 2),
        "last_running_s": round(real["last_running_s"], 2),
        "web_cpu_s": round(real["cpu"]["web"], 1),
        "agents_cpu_s": round(real["cpu"]["agents"], 1),
        "load_at_t": round(real["load"], 1),
        "handover_p50_s": round(real["handover"]["p50"], 2),
        "handover_max_s": round(real["handover"]["max"], 2),
        "answer_p50_s": round(real["answer"]["p50"], 2),
        "answer_max_s": round(real["answer"]["max"], 2),
        "agent_p50_s": round(real["agent"]["p50"], 2),
        "agent_max_s": round(real["agent"]["max"], 2),
        "start_p50_s": round(real["start"]["p50"], 3),
        "start_max_s": round(real["start"]["max"], 3),
        "report_p50_s": round(real["report"]["p50"], 2),
        "report_max_s": round(real["report"]["max"], 2),
        "python_start_s": round(python_s, 3),
    }
    if sim:
        figures.update(
            sim_agents=sim["agents"],
            sim_create_to_scheduled_p99_s=round(sim["to_scheduled"]["p99"], 2),
            sim_create_to_running_p50_s=round(sim["to_running"]["p50"], 2),
            sim_create_to_running_p99_s=round(sim["to_running"]["p99"], 2),
            sim_create_to_first_step_p50_s=round(sim["to_first_step"]["p50"], 2),
            sim_create_to_first_step_p99_s=round(sim["to_first_step"]["p99"], 2),
            sim_errors=sim["errors"],
            sim_refused=sim["refused"],
            sim_interval_s=sim["told_interval_s"],
        )
    if dock:
        figures.update(
            docker_create_to_running_p50_s=round(dock["to_running"]["p50"], 2),
            docker_create_to_running_p99_s=round(dock["to_running"]["p99"], 2),
            docker_bare_run_s=round(dock["bare_run_s"], 2),
        )
    emit(figures)


if __name__ == "__main__":
    sys.exit(main())
