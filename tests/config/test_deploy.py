"""The deployment layouts (deploy/compose.yaml, deploy/k8s/gpumarket.yaml) put the agent API in
processes of its own, the same server as the web, with every agent path routed there; and run a
Celery pool for every queue the tasks are routed to, so that no task is sent where nobody
listens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from django.conf import settings

from agentprotocol import (
    ARTIFACT_COMMIT_PATH,
    ARTIFACT_UPLOADS_PATH,
    HEARTBEAT_PATH,
    JOIN_PATH,
)
from billing.tasks import billing_pass
from config import gunicorn
from config.celery import app
from provisioning.wakeserver import WAKE_PATH
from scheduler.tasks import scheduler_cycle, scheduler_tick

ROOT = Path(__file__).resolve().parents[2]
AGENT_PATHS = [
    JOIN_PATH,
    HEARTBEAT_PATH,
    ARTIFACT_UPLOADS_PATH.format(rental_id="0b5a3f40-3f0e-4a43-9d7c-2f1d0c7d4e11"),
    ARTIFACT_COMMIT_PATH.format(rental_id="0b5a3f40-3f0e-4a43-9d7c-2f1d0c7d4e11"),
]
CUSTOMER_PATHS = ["/api/v1/rentals/", "/api/v1/offers/", "/", "/provider/onboard/"]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())


def _k8s() -> dict[tuple[str, str], dict]:
    docs = yaml.safe_load_all((ROOT / "deploy/k8s/gpumarket.yaml").read_text())
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _caddy_routes(caddyfile: str) -> list[tuple[str, str]]:
    """(path prefix, upstream) of each reverse_proxy line; "" for the one without a matcher."""
    routes = []
    for line in caddyfile.splitlines():
        words = line.split()
        if words[-1:] == ["{"]:
            words = words[:-1]
        if words[:1] == ["reverse_proxy"]:
            matcher, upstream = (words[1], words[2]) if len(words) == 3 else ("", words[1])
            assert matcher == "" or matcher.endswith("*"), matcher
            routes.append((matcher.rstrip("*"), upstream))
    return routes


def _longest_prefix(routes: list[tuple[str, str]], path: str) -> str:
    """Where a path goes: the most specific matching prefix wins (Caddy sorts reverse_proxy
    lines by their path matchers, the one without a matcher last; an Ingress picks the
    longest Prefix path)."""
    return max((r for r in routes if path.startswith(r[0])), key=lambda r: len(r[0]))[1]


def _queues(command: list[str]) -> set[str]:
    assert command[:4] == ["celery", "-A", "config", "worker"], command
    return set(command[command.index("-Q") + 1].split(","))


def test_compose_routes_agent_paths_to_the_agent_api_and_the_rest_to_the_web():
    services = _compose()["services"]
    caddyfile = _compose()["configs"]["caddyfile"]["content"]
    routes = _caddy_routes(caddyfile)
    # Given one published address (the proxy), when an agent or a customer calls it
    assert [s for s, spec in services.items() if spec.get("ports")] == ["objectstore", "proxy"]
    # then agent paths reach the agent API, the wake path the wake server, the rest the web
    assert {_longest_prefix(routes, p) for p in AGENT_PATHS} == {"agent-api:8000"}
    assert _longest_prefix(routes, WAKE_PATH) == "wake:8001"
    assert {_longest_prefix(routes, p) for p in CUSTOMER_PATHS} == {"web:8000"}
    # and the agent API is the web's image and server in processes of its own
    web, agent_api = services["web"], services["agent-api"]
    assert agent_api["build"] == web["build"] and agent_api["environment"] == web["environment"]
    assert agent_api["command"][:4] == ["gunicorn", "config.wsgi", "-c", "python:config.gunicorn"]
    assert "0.0.0.0:8000" in agent_api["command"] and "--workers" in agent_api["command"]
    assert services["wake"]["command"][-2:] == ["--port", "8001"]
    # The proxy drops an idle connection to the web or the agent API before gunicorn does, so
    # it never sends a request on one gunicorn is closing.
    kept = re.findall(r"keepalive (\d+)s", caddyfile)
    assert kept and all(int(k) < gunicorn.keepalive for k in kept)
    assert caddyfile.count("import upstream") == 2
    # The web believes the proxy's X-Forwarded-For: the proxy is in the trusted network.
    subnet = _compose()["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert web["environment"]["TRUSTED_PROXIES"] == subnet
    assert web["environment"]["WAKE_URL"] == f"${{WAKE_URL:-{WAKE_PATH}}}"


def test_kubernetes_routes_agent_paths_to_the_agent_api_pods():
    objects = _k8s()
    paths = objects[("Ingress", "gpumarket")]["spec"]["rules"][0]["http"]["paths"]
    assert {p["pathType"] for p in paths} == {"Prefix"}
    routes = [(p["path"], p["backend"]["service"]["name"]) for p in paths]
    assert {_longest_prefix(routes, p) for p in AGENT_PATHS} == {"gpumarket-agent-api"}
    assert _longest_prefix(routes, WAKE_PATH) == "gpumarket-wake"
    assert {_longest_prefix(routes, p) for p in CUSTOMER_PATHS} == {"gpumarket-web"}
    # Each Service selects its own Deployment's pods, on the port the Ingress names.
    for path in paths:
        service = objects[("Service", path["backend"]["service"]["name"])]
        deployment = objects[("Deployment", service["metadata"]["name"])]
        assert deployment["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
        port = path["backend"]["service"]["port"]["number"]
        assert [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port] == [
            c["containerPort"] for c in _container(deployment)["ports"]
        ]
    # The agent API's pods run the web's image and server.
    web = _container(objects[("Deployment", "gpumarket-web")])
    agent_api = _container(objects[("Deployment", "gpumarket-agent-api")])
    assert (agent_api["image"], agent_api["command"]) == (web["image"], web["command"])


@pytest.mark.parametrize("layout", ["compose", "k8s"])
def test_every_queue_a_task_is_routed_to_has_a_worker_pool(layout):
    if layout == "compose":
        commands = [
            s["command"]
            for s in _compose()["services"].values()
            if s.get("command", [None])[:4] == ["celery", "-A", "config", "worker"]
        ]
    else:
        commands = [
            _container(d)["command"]
            for (kind, _), d in _k8s().items()
            if kind == "Deployment"
            and _container(d)["command"][:4] == ["celery", "-A", "config", "worker"]
        ]
    pools = [_queues(command) for command in commands]
    # One pool per queue, and together they consume every queue there is.
    assert sorted(len(p) for p in pools) == [1] * len(settings.CELERY_TASK_QUEUES)
    assert set().union(*pools) == set(settings.CELERY_TASK_QUEUES)


def test_latency_bound_tasks_have_queues_of_their_own():
    route = app.amqp.router.route
    # The routes name the tasks by the names they are sent under.
    assert route({}, scheduler_cycle.name)["queue"].name == "scheduler"
    assert route({}, scheduler_tick.name)["queue"].name == "scheduler"
    assert route({}, billing_pass.name)["queue"].name == "billing"
    # The rest stays on the default queue.
    for name in ("provisioning.flush_telemetry", "provisioning.mark_silent_nodes",
                 "notifications.deliver", "billing.telemetry_prune"):  # fmt: skip
        assert route({}, name)["queue"].name == "celery"
    # Every routed queue exists, and a worker started without -Q (dev.py up) consumes them all.
    routed = {r["queue"] for r in settings.CELERY_TASK_ROUTES.values()}
    assert routed <= set(settings.CELERY_TASK_QUEUES) == {"celery", "scheduler", "billing"}
    # (the app's own list: a test that sends to a queue of its own adds that one to it)
    assert set(settings.CELERY_TASK_QUEUES) <= set(app.amqp.queues)


def test_the_dev_stack_runs_one_worker_that_consumes_every_queue():
    from devstack.stack import stack_commands

    commands = dict(stack_commands(port=8000, beat_schedule=Path("/tmp/schedule")))
    assert "-Q" not in commands["worker"]
