"""Heartbeats from a node with running rentals: few statements, and the desired state sent
again only when it changed (the digest the agent sends back)."""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from accounts.services.secrets import secret_set
from accounts.services.sshkeys import ssh_key_add
from billing.models import UsageSegment
from marketplace.lifecycle import rental_stop, rentals_mark_running
from marketplace.models import Node, Rental, RentalEvent, RentalStatus
from marketplace.services.rentals import RuntimeSpec
from notifications.models import Notification
from provisioning.models import ContainerRun, RunLogLine, RunMetric
from provisioning.services import node_credential_revoke
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team
from tests.provisioning.test_agent_api import HOST, _gpus

pytestmark = pytest.mark.django_db

# The reads with the token check, the usage, the writes (tests/provisioning/test_agent_api.py
# counts the idle heartbeat's one).
BUSY_STATEMENTS = 3


@pytest.fixture
def node_agent(api, join_token):
    r = api.post(
        "/api/agent/v1/join/",
        {"join_token": join_token, "hostname": "busy-1", "host": HOST,
         "internet_filtered": True, "gpus": _gpus(8)},
        format="json",
    )  # fmt: skip
    assert r.status_code == 201, r.content
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {r.json()['node_token']}")
    client.node = Node.objects.get(pk=r.json()["node_id"])
    return client


class Host:
    """A node's side: the desired state it holds under its digest, and what it reports of
    its runs each heartbeat (a container report, a usage report, a metric line, two log
    lines per run), as bench/agents.py and the real agent send."""

    def __init__(self, client: APIClient) -> None:
        self.client = client
        self.digest = ""
        self.desired: list[dict] = []
        self.started: dict[str, float] = {}
        self.seq = self.line_no = self.step = 0

    def body(self, **overrides) -> dict:
        now = time.time()
        self.step += 1
        containers, usage, metrics, logs = [], [], [], []
        for entry in self.desired:
            run = {"rental_id": entry["rental_id"], "run_id": entry["run_id"]}
            started = self.started.setdefault(entry["run_id"], now - 10)
            self.seq += 1
            containers.append({**run, "status": "running", "started_at": started})
            usage.append({**run, "seq": self.seq, "gpu_count": len(entry["gpu_indices"]),
                          "started_at": started, "confirmed_at": now})  # fmt: skip
            line = json.dumps({"event": "step", "step": self.step, "loss": 2.5})
            metrics.append({**run, "line": line})
            for _ in range(2):
                self.line_no += 1
                logs.append({**run, "line_no": self.line_no, "line": f"step {self.step}"})
        body = {"containers": containers, "usage": usage, "metrics": metrics, "logs": logs,
                "telemetry": [_sample(g, now) for g in range(8)]}  # fmt: skip
        if self.digest:
            body["desired_digest"] = self.digest
        return {**body, **overrides}

    def beat(self, **overrides) -> dict:
        r = self.client.post("/api/agent/v1/heartbeat/", self.body(**overrides), format="json")
        assert r.status_code == 200, r.content
        answer = r.json()
        if not answer.get("desired_unchanged"):
            self.desired = answer["desired"]
        self.digest = answer.get("desired_digest", "")
        return answer


def _sample(gpu: int, ts: float) -> dict:
    return {"gpu_index": gpu, "ts": ts, "util_pct": 90.0, "mem_used_mb": 1000, "power_w": 300.0,
            "temp_c": 60.0}  # fmt: skip


def _running(node_agent, rent, n: int = 4, **kwargs) -> Host:
    for _ in range(n):
        rent(2, **kwargs)
    scheduler_cycle_run()
    host = Host(node_agent)
    host.beat()  # handed over
    host.beat()  # reported running
    assert len(host.desired) == n
    assert Rental.objects.filter(status=RentalStatus.RUNNING).count() == n
    return host


def test_a_busy_heartbeat_is_three_statements_and_applies_every_report(node_agent, rent):
    # Given a node running 4 rentals whose agent holds the desired state's digest
    host = _running(node_agent, rent)
    first = host.beat()
    assert first["desired_unchanged"] is True and first["desired"] == []
    runs = [e["run_id"] for e in host.desired]
    metrics, lines = RunMetric.objects.count(), RunLogLine.objects.count()
    # When it heartbeats with a container, usage, metric and two log lines per run
    body = host.body()
    with CaptureQueriesContext(connection) as queries:
        r = node_agent.post("/api/agent/v1/heartbeat/", body, format="json")
    # Then it is BUSY_STATEMENTS statements (savepoints of the test's transaction aside)
    assert r.status_code == 200, r.content
    statements = [q["sql"] for q in queries if "SAVEPOINT" not in q["sql"]]
    assert len(statements) == BUSY_STATEMENTS, statements
    answer = r.json()
    assert answer["desired_unchanged"] is True and answer["dropped"] == {}
    assert answer["ack_usage_seq"] == max(u["seq"] for u in body["usage"])
    # and every report is applied: each run marked reported now, its lines stored, its usage
    # confirmed to the heartbeat's time
    assert RunMetric.objects.count() == metrics + 4
    assert RunLogLine.objects.count() == lines + 8
    stored = set(RunLogLine.objects.filter(run_id__in=runs).values_list("run_id", "line_no"))
    assert {(line["run_id"], line["line_no"]) for line in body["logs"]} <= stored
    reported = ContainerRun.objects.filter(run_id__in=runs).values_list("last_report_at", flat=True)
    assert len(set(reported)) == 1
    for usage in body["usage"]:
        segment = UsageSegment.objects.get(run_id=usage["run_id"])
        assert segment.last_seq == usage["seq"]
    # and the same heartbeat again changes nothing
    node_agent.post("/api/agent/v1/heartbeat/", body, format="json")
    assert (RunMetric.objects.count(), RunLogLine.objects.count()) == (metrics + 4, lines + 8)


def test_an_agent_without_a_digest_gets_the_whole_state_every_time(node_agent, rent):
    # Given an agent that predates digests (it sends none)
    host = _running(node_agent, rent, n=2)
    host.digest = ""
    whole = node_agent.post("/api/agent/v1/heartbeat/", host.body(), format="json").json()
    again = node_agent.post("/api/agent/v1/heartbeat/", host.body(), format="json").json()
    # Then each answer carries the whole desired state, the same both times
    assert len(whole["desired"]) == 2 and "desired_unchanged" not in whole
    assert again["desired"] == whole["desired"]
    assert again["desired_digest"] == whole["desired_digest"] != ""
    # and a digest the server never gave gets the whole state too
    host.digest = "0" * 32
    assert host.beat()["desired"] == whole["desired"]


def test_the_digest_changes_with_what_the_desired_state_is_made_of(
    node_agent, rent, user, make_join_token
):
    host = _running(node_agent, rent, n=2)
    assert host.beat()["desired_unchanged"] is True
    digest = host.digest
    # A rental placed on the node: the state with it
    rent(2)
    scheduler_cycle_run()
    answer = host.beat()
    assert "desired_unchanged" not in answer and len(answer["desired"]) == 3
    assert host.digest != digest
    # (its row changes as it is handed over and reported running: a whole state each time)
    assert _settles(host)
    # A rental stopped: the state without it
    stopped = Rental.objects.filter(status=RentalStatus.RUNNING).first()
    rental_stop(team=personal_team(user), actor=user, rental_id=stopped.pk)
    answer = host.beat()
    assert str(stopped.pk) not in {e["rental_id"] for e in answer["desired"]}
    assert "desired_unchanged" not in answer


def _settles(host: Host, beats: int = 3) -> bool:
    return any(host.beat().get("desired_unchanged") for _ in range(beats))


def _ssh_key(user, byte: bytes) -> str:
    blob = base64.b64encode(
        b"".join(struct.pack(">I", len(p)) + p for p in (b"ssh-ed25519", byte * 32))
    ).decode()
    ssh_key_add(team=personal_team(user), owner=user, public_key=f"ssh-ed25519 {blob} me@laptop")
    return f"ssh-ed25519 {blob}"  # as stored: the comment is the key's name


def test_a_new_ssh_key_or_secret_value_is_sent_at_once(node_agent, rent, user):
    # Given a rental with SSH and a team secret, running
    team = personal_team(user)
    first = _ssh_key(user, b"a")
    secret_set(team=team, actor=user, name="API_TOKEN", value="first-value-1234")
    host = _running(
        node_agent,
        rent,
        n=1,
        ssh=True,
        secrets=({"name": "API_TOKEN", "env": "API_TOKEN", "file": ""},),
    )
    assert host.beat()["desired_unchanged"] is True
    # When the team adds an SSH key
    second = _ssh_key(user, b"b")
    # Then the next answer carries it
    [entry] = host.beat()["desired"]
    assert entry["ssh_authorized_keys"] == [first, second]
    assert host.beat()["desired_unchanged"] is True
    # And when the secret's value changes, the next answer carries the new value
    secret_set(team=team, actor=user, name="API_TOKEN", value="second-value-5678")
    [entry] = host.beat()["desired"]
    assert [s["value"] for s in entry["secrets"]] == ["second-value-5678"]
    # and what the run prints of it is masked before it is stored
    line = json.dumps({"event": "step", "step": 99, "note": "second-value-5678"})
    run = {"rental_id": entry["rental_id"], "run_id": entry["run_id"]}
    host.beat(metrics=[{**run, "line": line}],
              logs=[{**run, "line_no": 10_000, "line": "token second-value-5678"}])  # fmt: skip
    assert RunMetric.objects.get(run_id=entry["run_id"], step=99).data["note"] == "****"
    assert RunLogLine.objects.get(run_id=entry["run_id"], line_no=10_000).line == "token ****"


def test_a_launch_builds_the_desired_state_once(node_agent, rent):
    # Given three rentals placed on one node
    for _ in range(3):
        rent(2)
    scheduler_cycle_run()
    host = Host(node_agent)
    # When it is handed them (they move to PROVISIONING), then reports them running (RUNNING)
    handed = host.beat()
    assert len(handed["desired"]) == 3
    with CaptureQueriesContext(connection) as reported:
        answer = host.beat()
    # Then neither move renews the state: the report's answer says the one handed over still
    # stands, under the name the next heartbeat reads, and the next says so in three statements
    assert Rental.objects.filter(status=RentalStatus.RUNNING).count() == 3
    assert answer["desired_unchanged"] is True
    assert answer["desired_digest"] != handed["desired_digest"]
    assert not any('"marketplace_gpumodel"' in q["sql"] for q in reported)  # nothing built
    with CaptureQueriesContext(connection) as steady:
        assert host.beat()["desired_unchanged"] is True
    assert len([q for q in steady if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]) == 3


def test_a_key_added_during_a_launch_reaches_the_agent_with_the_running_report(
    node_agent, rent, user
):
    # Given a rental with SSH handed over to its node
    first = _ssh_key(user, b"a")
    rent(2, ssh=True)
    scheduler_cycle_run()
    host = Host(node_agent)
    [entry] = host.beat()["desired"]
    assert entry["ssh_authorized_keys"] == [first]
    # When the team adds a key before the node reports the run running
    second = _ssh_key(user, b"b")
    answer = host.beat()
    # Then that answer carries the whole state again, with the key
    assert Rental.objects.get().status == RentalStatus.RUNNING
    [entry] = answer["desired"]
    assert entry["ssh_authorized_keys"] == [first, second]
    assert host.beat()["desired_unchanged"] is True


def test_a_held_rental_without_its_run_recorded_gets_the_whole_state(node_agent, rent):
    # Given a node whose agent holds the digest of its state
    host = _running(node_agent, rent, n=1)
    assert host.beat()["desired_unchanged"] is True
    # When the run's row is gone (nothing else changed)
    [entry] = host.desired
    ContainerRun.objects.filter(run_id=entry["run_id"]).delete()
    # Then the state is sent whole and the run recorded again
    answer = host.beat(containers=[], metrics=[], logs=[], usage=[])
    assert [e["run_id"] for e in answer["desired"]] == [entry["run_id"]]
    assert ContainerRun.objects.filter(run_id=entry["run_id"]).exists()
    assert host.beat()["desired_unchanged"] is True


def test_the_digest_turns_over_within_the_refresh_time(node_agent, rent, monkeypatch):
    """Inputs the digest does not version (a dataset's files, the card's figures, presigned
    URLs) reach the agent within DESIRED_REFRESH_S."""
    from provisioning.services import heartbeat

    host = _running(node_agent, rent, n=1)
    assert host.beat()["desired_unchanged"] is True
    monkeypatch.setattr(heartbeat, "DESIRED_REFRESH_S", 0.5)
    seen = set()
    deadline = time.monotonic() + 10
    while len(seen) < 2:
        assert time.monotonic() < deadline
        if not host.beat().get("desired_unchanged"):
            seen.add(host.digest)
        time.sleep(0.1)


def test_a_runtime_change_reported_by_the_agent_is_folded_and_the_state_follows(node_agent, rent):
    # Given a running rental whose container exits 0
    host = _running(node_agent, rent, n=1, runtime=RuntimeSpec(image="img"))
    assert host.beat()["desired_unchanged"] is True
    [entry] = host.desired
    report = {"rental_id": entry["rental_id"], "run_id": entry["run_id"], "status": "exited",
              "exit_code": 0, "started_at": 1.0e9, "finished_at": 1.0e9 + 5}  # fmt: skip
    answer = host.beat(containers=[report], usage=[], metrics=[], logs=[])
    # Then the rental completes and the same answer no longer desires it
    assert Rental.objects.get(pk=entry["rental_id"]).status == RentalStatus.COMPLETED
    assert answer["desired"] == [] and "desired_unchanged" not in answer


def test_runs_handed_over_and_reported_running_together_move_together(node_agent, rent):
    # Given three rentals placed on one node, handed over in one heartbeat (PROVISIONING)
    for _ in range(3):
        rent(2)
    scheduler_cycle_run()
    host = Host(node_agent)
    host.beat()
    assert set(Rental.objects.values_list("status", flat=True)) == {RentalStatus.PROVISIONING}
    assert ContainerRun.objects.count() == 3
    for rental in Rental.objects.all():
        [event] = RentalEvent.objects.filter(rental=rental, to_status=RentalStatus.PROVISIONING)
        assert event.from_status == RentalStatus.SCHEDULED
        assert event.reason == "starting on busy-1"
    # When its next heartbeat reports the three running
    host.beat()
    # Then each is RUNNING from its one RUNNING event, its run row running, its start notified
    for rental in Rental.objects.all():
        [event] = RentalEvent.objects.filter(rental=rental, to_status=RentalStatus.RUNNING)
        assert rental.status == RentalStatus.RUNNING
        assert event.from_status == RentalStatus.PROVISIONING
        assert event.reason == "container running on busy-1"
        assert rental.started_at == event.created_at
        run = ContainerRun.objects.get(rental=rental)
        assert run.status == "running" and run.started_at is not None
        assert Notification.objects.filter(rental=rental, kind="rental.started").count() == 1
    # and a report of them again changes nothing
    before = RentalEvent.objects.count()
    host.beat()
    assert RentalEvent.objects.count() == before


def _running_report_statements(host, rent, n: int) -> int:
    before = Rental.objects.filter(status=RentalStatus.RUNNING).count()
    for _ in range(n):
        rent(1)
    scheduler_cycle_run()
    host.beat()  # handed over
    with CaptureQueriesContext(connection) as queries:
        host.beat()  # reported running
    assert Rental.objects.filter(status=RentalStatus.RUNNING).count() == before + n
    assert Notification.objects.filter(kind="rental.started").count() == before + n
    return len(queries)


def test_a_running_report_of_many_runs_costs_what_one_costs(node_agent, rent):
    # Given a node handed one rental, then four more (the same customer's)
    host = Host(node_agent)
    # When it reports each batch running in one heartbeat
    one = _running_report_statements(host, rent, 1)
    four = _running_report_statements(host, rent, 4)
    # Then the second makes as many statements as the first: the runs, the rentals, their
    # events and their notifications (settings, recipients, deliveries) are written together
    assert four == one


def test_a_batch_moves_only_single_node_provisioning_rentals(node_agent, rent):
    # Given one rental handed over (PROVISIONING) and one still SCHEDULED
    rent(2)
    scheduler_cycle_run()
    Host(node_agent).beat()
    rent(2)
    scheduler_cycle_run()
    scheduled = Rental.objects.get(status=RentalStatus.SCHEDULED)
    events = RentalEvent.objects.count()
    # When both are marked running together
    with transaction.atomic():
        rentals = list(Rental.objects.select_for_update().order_by("pk"))
        moved = rentals_mark_running(rentals=rentals, hostname="busy-1")
    # Then only the PROVISIONING one moved, with one event
    provisioning = Rental.objects.exclude(pk=scheduled.pk).get()
    assert moved == {str(provisioning.pk)}
    assert provisioning.status == RentalStatus.RUNNING
    assert Rental.objects.get(pk=scheduled.pk).status == RentalStatus.SCHEDULED
    assert RentalEvent.objects.count() == events + 1


def test_a_busy_heartbeat_with_a_token_revoked_since_it_was_seen_is_401_and_writes_nothing(
    node_agent, rent
):
    # Given a node running 4 rentals, whose token this process has seen valid
    host = _running(node_agent, rent)
    host.beat()
    node = Node.objects.get(pk=node_agent.node.pk)
    before = (
        RunMetric.objects.count(),
        RunLogLine.objects.count(),
        sorted(UsageSegment.objects.values_list("run_id", "last_seq")),
        sorted(ContainerRun.objects.values_list("run_id", "last_report_at")),
    )
    # When its token is revoked and it sends a heartbeat with reports of every kind
    node_credential_revoke(node_id=node.pk, actor=None)
    with CaptureQueriesContext(connection) as queries:
        r = node_agent.post("/api/agent/v1/heartbeat/", host.body(), format="json")
    # Then it is told so, after one statement (the token is checked with the reads), and
    # nothing of the heartbeat is applied
    assert r.status_code == 401 and r.json() == {"detail": "invalid or revoked node token"}
    assert len([q for q in queries if "SAVEPOINT" not in q["sql"]]) == 1
    assert Node.objects.get(pk=node.pk).last_seen_at == node.last_seen_at
    assert before == (
        RunMetric.objects.count(),
        RunLogLine.objects.count(),
        sorted(UsageSegment.objects.values_list("run_id", "last_seq")),
        sorted(ContainerRun.objects.values_list("run_id", "last_report_at")),
    )


def test_only_the_row_version_of_a_rental_moved_here_may_differ():
    from provisioning.services.heartbeat import _moved_only

    a, b = uuid.uuid4(), uuid.uuid4()
    held = [(a, 0, "GPU-0"), (b, 1, "GPU-1")]
    before = (held, {a: "100|k1.5", b: "101"})
    assert _moved_only(before, (held, {a: "107|k1.5", b: "101"}), {a})
    assert not _moved_only(before, (held, {a: "107|k1.5", b: "102"}), {a})  # b not moved here
    assert not _moved_only(before, (held, {a: "107|k1.5,2.9", b: "101"}), {a})  # a new key
    assert not _moved_only(before, (held[:1], {a: "107|k1.5", b: "101"}), {a})  # a GPU freed
    assert not _moved_only(before, (held, {a: "107|k1.5"}), {a})
