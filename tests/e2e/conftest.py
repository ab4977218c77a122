"""The real stack for end-to-end tests: the web app on a live server, a real Celery worker on
the test database, real node agents running containers in the real Docker Engine.

The test command (`python3 dev.py test`) starts the Docker Engine and builds the harness image
before pytest; these fixtures only check that both answer, and fail (never skip) otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from tests.factories import personal_team

# A root agent runs process-runtime commands as nobody: the agents here keep their dirs in
# pytest's (0700) temporary directories, which must then be searchable.
from tests.nodeagent.conftest import agent_dirs_searchable  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
HARNESS_IMAGE = os.environ.get("GPUMARKET_HARNESS_IMAGE", "gpumarket/harness:dev")


def credit_customer(user, *, dollars: int = 50) -> None:
    """Credit from ops, so the funds check and billing's pass let the customer's rentals run."""
    from billing.services.ledger import account_adjust, account_for_team

    account = account_for_team(team=personal_team(user))
    account_adjust(
        account_id=account.pk, amount_micros=dollars * 1_000_000, reason="e2e credit", actor=None
    )


def wait_for(check: Callable[[], object], timeout: float, what: str, every: float = 0.25):
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _database_url() -> str:
    db = connection.settings_dict
    host = db["HOST"] or db.get("OPTIONS", {}).get("host", "")
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    if host.startswith("/"):
        return f"postgresql://{user}{password}@/{db['NAME']}?host={quote(host, safe='/')}"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgresql://{user}{password}@{host}{port}/{db['NAME']}"


@pytest.fixture
def stack_env(transactional_db) -> dict[str, str]:
    """Environment for subprocesses that must see the test database."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=_database_url(),
        REDIS_URL=settings.REDIS_URL,
        DJANGO_SETTINGS_MODULE="config.settings.test",
        GPUMARKET_EPHEMERAL_SECRET="1",
        PYTHONPATH=str(ROOT),
    )
    return env


@pytest.fixture
def celery_worker(stack_env, tmp_path) -> Iterator[subprocess.Popen]:
    """A real Celery worker consuming the scheduler tasks that rental_create queues."""
    celery = str(Path(sys.executable).parent / "celery")
    subprocess.run(
        [celery, "-A", "config", "purge", "-f"], env=stack_env, cwd=ROOT, check=False,
        capture_output=True, timeout=60,
    )  # fmt: skip
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen(
        [celery, "-A", "config", "worker", "-P", "solo", "-l", "info", "--without-heartbeat",
         "--without-mingle", "--without-gossip"],
        env=stack_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_for(lambda: b"ready" in (tmp_path / "worker.log").read_bytes(), 60, "the Celery worker")
    yield proc
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="session")
def docker_client():
    import docker

    client = docker.from_env(timeout=30)
    try:
        client.ping()
        client.images.get(HARNESS_IMAGE)
    except Exception as exc:  # the test command provides both; say which is missing
        pytest.fail(
            f"e2e tests need a Docker Engine and the {HARNESS_IMAGE} image "
            f"(`python3 dev.py test` provides both): {exc}"
        )
    return client


def managed_containers(client, rental_id: str | None = None) -> list:
    labels = ["gpumarket.managed=1"]
    if rental_id:
        labels.append(f"gpumarket.rental={rental_id}")
    # ignore_removed: a container the agent removes between the listing and its inspection.
    return client.containers.list(all=True, filters={"label": labels}, ignore_removed=True)


def remove_managed(client, rental_id: str | None = None) -> None:
    """Remove the managed containers (of one rental), then what the driver made for their
    rentals (network, quota mount), as an agent's removal would."""
    from nodeagent.runtime.docker import DockerDriver, DockerDriverConfig

    driver = DockerDriver(DockerDriverConfig(gpu_mode="none"))
    for container in managed_containers(client, rental_id):
        container.remove(force=True)
        driver.release_unused_rentals(container.labels.get("gpumarket.rental"))


@pytest.fixture
def funded_customer(settings, user):
    """The real path: the funds check is on and the customer has credit from ops."""
    settings.BILLING_FUNDS_CHECK = True
    credit_customer(user)


@pytest.fixture
def no_leftover_containers(docker_client):
    """Every managed container (and what the driver made for it) removed after the test."""
    yield
    remove_managed(docker_client)


def remove_process_runs(root: Path) -> None:
    """Remove the process-runtime runs left under `root`, as a provider uninstalling the agent
    would: they outlive the agent (as containers do), and a test's runs sleeping for an hour
    would outlive the test session."""
    from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig

    for state_dir in {meta.parent.parent for meta in root.rglob("meta.json")}:
        driver = LocalProcessDriver(ProcessDriverConfig(state_dir=str(state_dir)))
        for run in driver.list_managed():
            driver.remove(run.run_id)


@pytest.fixture(autouse=True)
def _no_process_runs_left(tmp_path):
    yield
    remove_process_runs(tmp_path)


class TcpProxy:
    """A loopback TCP forwarder that can be cut, to make the server unreachable for a while."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = threading.Event()
        self.up.set()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and drop the open ones (kept-alive included)."""
        self.up.clear()
        for s in list(self.open):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()
        self.open.clear()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 5)
            except OSError:
                client.close()
                continue
            self.open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class AgentProcess:
    """`python -m nodeagent` as a provider would run it, in its own state dir."""

    def __init__(self, *, server: str, join_token: str, state: Path, runtime: str, env: dict):
        self.args = [
            sys.executable, "-m", "nodeagent",
            "--server", server, "--join-token", join_token,
            "--runtime", runtime, "--gpu-mode", "none", "--telemetry", "simulated",
            "--simulate-gpus", "rtx4090-24gb:2", "--hostname", f"e2e-{state.name}",
            "--state-dir", str(state / "state"), "--volume-root", str(state / "volumes"),
            "--process-dir", str(state / "runs"), "--interval", "1",
            "--benchmark-command", f"{sys.executable} -m harness benchmark --quick",
        ]  # fmt: skip
        self.env = {k: v for k, v in env.items() if k != "DATABASE_URL"}
        self.log_path = state / "agent.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=ROOT, stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self

    def kill(self) -> None:
        """SIGKILL: the agent dies mid-run without any chance to clean up."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def join_token(make_join_token) -> str:
    return make_join_token(region="e2e", price="0.60", min_bid="0.20")


@pytest.fixture
def start_agent(live_server, join_token, stack_env, tmp_path):
    """Start a real agent against the live server (through `via`, a proxy, when given)."""
    agents: list[AgentProcess] = []

    def start(*, runtime: str = "docker", via: int | None = None, name: str = "node1"):
        server = live_server.url if via is None else f"http://127.0.0.1:{via}"
        state = tmp_path / name
        state.mkdir(exist_ok=True)
        agent = AgentProcess(
            server=server, join_token=join_token, state=state, runtime=runtime, env=stack_env
        )
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.stop()
    remove_process_runs(tmp_path)


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium driven through ChromeDriver (Debian's packages; the test command
    installs them). Fails, never skips, when they are missing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary = os.environ.get("GPUMARKET_CHROMIUM", "/usr/bin/chromium")
    driver_path = os.environ.get("GPUMARKET_CHROMEDRIVER", "/usr/bin/chromedriver")
    for path in (binary, driver_path):
        assert os.path.exists(path), f"{path} is missing: run the README's test command"
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(
        service=Service(executable_path=driver_path, log_output=str(tmp_path / "chromedriver.log")),
        options=options,
    )
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture
def start_stack(stack_env, make_join_token, tmp_path):
    """The stack as `dev.py up` runs it (tests/e2e/stack.py), its agent joined in `region`."""
    from tests.e2e.stack import Stack, agent_command

    stacks = []

    def start(*, runtime: str, gpus: int, region: str = "e2e"):
        token = make_join_token(region=region, price="0.60", min_bid="0.20")
        agent = agent_command(state=tmp_path / "agent", runtime=runtime, gpus=gpus, hostname="cp-1")
        stack = Stack(env=stack_env, tmp=tmp_path, join_token=token, agent=agent)
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.stop()


@pytest.fixture
def start_demo_stack(stack_env, tmp_path):
    """The stack exactly as `dev.py up` runs it: the demo inventory loaded (provisioning.demo)
    and its hosts' agents in one process (`manage.py demo_fleet`), which reach the server
    through `proxy(port)` when given one (an object with a `url`)."""
    from provisioning.demo import load_demo
    from tests.e2e.stack import Stack

    stacks = []

    def start(*, env: dict[str, str] | None = None, proxy=None, agent_args: tuple[str, ...] = ()):
        var = tmp_path / "var"
        load_demo(var_dir=var)
        stack = Stack(env={**stack_env, **(env or {})}, tmp=tmp_path, join_token=None, agent=None)
        server = proxy(stack.port).url if proxy else stack.url
        stack.agents["agents"] = [
            sys.executable, "manage.py", "demo_fleet", "--server", server, "--var-dir", str(var),
            "--", "--interval", "1", *agent_args,
        ]  # fmt: skip
        stacks.append(stack)
        return stack.start()

    yield start
    for stack in stacks:
        stack.stop()
