"""A hostile provider against a live stack (gunicorn, Celery worker and beat: tests/e2e/stack.py)
for 60 s: one agent, joined like any other, forges every kind of report it can send while
customers rent its GPUs, and one of them stops a rental the agent keeps reporting as running.

Whatever it sends, no answer is a 5xx, and every meter's billed GPU-seconds stay within
(allocation held on that node ∩ the server's RUNNING span, a stop counted for its grace) x GPUs,
the bound computed from the rows (tests/adversarial/test_metering.py), not by the rating SQL."""

# The e2e suite's fixtures are imported below, so test arguments "redefine" them.
# ruff: noqa: F811

from __future__ import annotations

import itertools
import json
import random
import time
import uuid
from decimal import Decimal

import pytest
import requests
from django.utils import timezone

from billing.models import UsageMeter
from billing.services import billing_pass_run
from marketplace.lifecycle import rental_stop
from marketplace.models import Rental, RentalStatus
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning.services import join_token_create
from tests.adversarial.test_metering import _bound
from tests.e2e.conftest import credit_customer, stack_env, wait_for  # noqa: F401
from tests.e2e.stack import Stack
from tests.factories import personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SOAK_S = 60
GPUS = 4
BIDI = "\u202e"


class Forger:
    """An agent that lies in every report kind, and counts what the server answered."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.statuses: list[int] = []
        self.seq = itertools.count(1)
        self.runs: dict[str, str] = {}  # run id -> rental id, as the server handed them
        self.rng = random.Random(7)

    def post(self, path: str, body) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        r = self.session.post(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30
        )
        self.statuses.append(r.status_code)
        return r

    def beat(self, **body) -> dict:
        r = self.post("/api/agent/v1/heartbeat/", body)
        if r.status_code == 200:
            for run in r.json()["desired"]:
                self.runs[run["run_id"]] = run["rental_id"]
            return r.json()
        return {}

    def forged_round(self, stopped: set[str]) -> None:
        now = time.time()
        rng = self.rng
        containers, usage, metrics, logs = [], [], [], []
        stranger = str(uuid.uuid4())
        for run_id, rental_id in self.runs.items():
            # Running since an hour ago (an hour before the rental existed), whatever the
            # server said; a stopped rental is reported running on and on.
            containers.append({
                "rental_id": rental_id, "run_id": run_id, "status": "running",
                "started_at": now - 3600,
                "published": [{"container_port": 22, "host": "evil.example", "host_port": 1}],
            })  # fmt: skip
            for _ in range(3):
                usage.append({
                    "seq": next(self.seq), "rental_id": rental_id, "run_id": run_id,
                    "gpu_count": rng.choice([1, GPUS, 64]),
                    "started_at": now - rng.choice([3600, 86400, 5]),
                    "confirmed_at": now + rng.choice([0, 60, 110, 10**6]),
                    "final": rng.random() < 0.1,
                })  # fmt: skip
            # The same seq again (a replay) and a report for a run the server never handed out
            usage.append({**usage[-1]})
            usage.append({**usage[-1], "seq": next(self.seq), "run_id": "r-forged"})
            step = json.dumps({"event": "step", "step": 1, "loss": 1e308})
            metrics.append({"rental_id": rental_id, "run_id": run_id, "line": step})
            metrics.append({"rental_id": rental_id, "run_id": run_id, "line": "{" * 500})
            logs.append({"rental_id": rental_id, "run_id": run_id, "line_no": 2**62,
                         "line": f"\x1b[2J{BIDI}gnp.exe"})  # fmt: skip
        # Another customer's rental, an unknown run, exits and losses that did not happen
        containers.append({"rental_id": stranger, "run_id": "r-x", "status": "exited",
                           "exit_code": 0})  # fmt: skip
        if self.runs and rng.random() < 0.2:
            run_id, rental_id = rng.choice(sorted(self.runs.items()))
            if rental_id not in stopped:
                containers.append({"rental_id": rental_id, "run_id": run_id + "-twin",
                                   "status": "missing", "error": "x" * 500})  # fmt: skip
        usage.append({"seq": next(self.seq), "rental_id": stranger, "run_id": "r-x",
                      "gpu_count": 8, "started_at": now - 60, "confirmed_at": now})  # fmt: skip
        telemetry = [
            {"gpu_index": i, "ts": now + rng.choice([0, 10**7]), "util_pct": rng.choice([50, 1e9]),
             "mem_used_mb": 1, "power_w": 1, "temp_c": 1, "xid_errors": 0}
            for i in range(GPUS + 2)
        ]  # fmt: skip
        benchmark = rng.choice([
            {"matmul_tflops": 1e11, "device_name": f"H100{BIDI}"},
            {"matmul_tflops": 5000.0, "raw": {"simulated": True}},
            {"matmul_tflops": -1},
        ])  # fmt: skip
        self.beat(containers=containers, usage=usage, metrics=metrics, logs=logs,
                  telemetry=telemetry, benchmark=benchmark, sent_at=now + 10**6)  # fmt: skip
        # Bodies that are not heartbeats at all, and an artifact named to deceive
        self.post("/api/agent/v1/heartbeat/", b'{"containers": [' * 2000)
        self.post("/api/agent/v1/heartbeat/", b"\xff\xfe")
        self.post("/api/agent/v1/heartbeat/", {"usage": "all of it"})
        if self.runs:
            run_id, rental_id = rng.choice(sorted(self.runs.items()))
            self.post(
                f"/api/agent/v1/rentals/{rental_id}/artifacts/uploads/",
                {"run_id": run_id,
                 "files": [{"path": f"out/{BIDI}txt.exe", "size_bytes": 1, "sha256": "0" * 64},
                           {"path": "../../etc/passwd", "size_bytes": 1, "sha256": "0" * 64}]},
            )  # fmt: skip


def _rent(user) -> Rental:
    return rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=1, duration_s=3600, runtime=RuntimeSpec(image="img", command=["x"])
        ),
    )


def test_a_provider_forging_every_report_for_60_s_bills_only_what_the_server_allowed(
    stack_env, provider, user, tmp_path
):
    # Given a live stack, a funded customer, and a node joined by a hostile agent
    credit_customer(user)
    _, join = join_token_create(
        provider=provider, created_by=provider.owner, region="soak",
        price_per_gpu_hour=Decimal("1.00"), min_bid_per_gpu_hour=Decimal("0.20"),
    )  # fmt: skip
    stack = Stack(env=stack_env, tmp=tmp_path, join_token=None, agent=None).start()
    try:
        gpus = [
            {"index": i, "uuid": f"GPU-soak-{i}", "name": "NVIDIA A100-SXM4-80GB",
             "memory_mb": 81920, "topology_group": "nvl0"}
            for i in range(GPUS)
        ]  # fmt: skip
        joined = requests.post(
            stack.url + "/api/agent/v1/join/",
            json={"join_token": join, "hostname": "forger",
                  "host": {"cpu_cores": 32, "ram_gb": 256, "disk_gb": 2000}, "gpus": gpus,
                  "internet_filtered": True},
            timeout=30,
        )  # fmt: skip
        assert joined.status_code == 201, joined.content
        forger = Forger(stack.url, joined.json()["node_token"])
        # When customers rent its GPUs and it forges every report kind for 60 s; one rental
        # is stopped by its customer half way and the agent keeps reporting it running
        rentals = [_rent(user) for _ in range(3)]
        stopped: set[str] = set()
        started = time.monotonic()
        while time.monotonic() - started < SOAK_S:
            forger.beat()
            forger.forged_round(stopped)
            if not stopped and time.monotonic() - started > SOAK_S / 2:
                victim = next(
                    (r for r in rentals if Rental.objects.get(pk=r.pk).status == "running"), None
                )
                if victim is not None:
                    rental_stop(team=personal_team(user), actor=user, rental_id=victim.pk)
                    stopped.add(str(victim.pk))
            time.sleep(0.5)
        # (the stack's beat sweeps the stop grace every 15 s)
        if stopped:
            wait_for(
                lambda: (
                    Rental.objects.filter(pk__in=stopped, status=RentalStatus.COMPLETED).count()
                    == len(stopped)
                ),
                60,
                "the stopped rental freed after its grace",
            )
    finally:
        stack.stop()
    # Then no answer was a 5xx, and some rentals ran and were billed
    assert forger.statuses and max(forger.statuses) < 500, sorted(set(forger.statuses))
    billing_pass_run(now=timezone.now())
    meters = list(UsageMeter.objects.filter(node__hostname="forger"))
    assert meters, [r.status for r in Rental.objects.all()]
    assert any(m.gpu_seconds > 0 for m in meters)
    # And every billed second lies inside the bound: held on the node ∩ server RUNNING + grace
    now = timezone.now()
    for meter in meters:
        bound = _bound(meter.rental_id, meter.node_id)
        assert meter.gpu_seconds + meter.credited_gpu_seconds <= bound, (meter.rental_id, bound)
        # nor past now: a run still going is billed no further than the server's clock
        first_run = meter.rental.events.filter(to_status=RentalStatus.RUNNING).earliest(
            "created_at"
        )
        held = meter.rental.allocations.filter(node_id=meter.node_id).count()
        elapsed = (now - first_run.created_at).total_seconds()
        assert meter.gpu_seconds + meter.credited_gpu_seconds <= held * elapsed
        print(f"soak meter {meter.rental_id}: billed {meter.gpu_seconds} GPU-s, credited "
              f"{meter.credited_gpu_seconds}, bound {bound}")  # fmt: skip
    print(f"soak: {len(forger.statuses)} requests, statuses {sorted(set(forger.statuses))}")
    # And the stopped rental was freed whatever its agent said
    assert stopped, "no rental ran to be stopped"
    assert not Rental.objects.filter(pk__in=stopped, allocations__released_at__isnull=True).exists()
