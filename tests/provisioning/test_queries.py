"""Each hand-written statement of provisioning/queries.py against the same question asked
through the ORM, on rows made by the real services."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace import lifecycle
from marketplace.models import (
    Allocation,
    Gpu,
    GpuHealth,
    Node,
    NodeStatus,
    Rental,
    RentalStatus,
)
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from provisioning import queries
from provisioning.models import ContainerRun, NodeCredential, RunLogLine, RunMetric
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

HEALTH = (GpuHealth.OK.value, GpuHealth.DEGRADED.value, GpuHealth.FAILED.value)

pytestmark = pytest.mark.django_db

WANTED = [str(s) for s in lifecycle.CONTAINER_WANTED]


def _credential(node: Node, key: str) -> str:
    key_hash = key * 64
    NodeCredential.objects.create(node=node, key_hash=key_hash)
    return key_hash


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


def _placed(user, *, gpus: int) -> Rental:
    rental = rental_create(
        customer=user,
        team=personal_team(user),
        request=RentalRequest(
            gpus_per_node=gpus,
            node_count=1,
            duration_s=7200,
            runtime=RuntimeSpec(image="gpumarket/harness:dev"),
        ),
    )
    scheduler_cycle_run(pool=rental.pool)
    return Rental.objects.get(pk=rental.pk)


def _orm_held(node: Node, now) -> list[tuple]:
    return list(
        Allocation.objects.filter(
            node=node, released_at__isnull=True, during__contains=now, rental__status__in=WANTED
        )
        .order_by("rental_id", "gpu__index")
        .values_list("rental_id", "gpu__index", "gpu__uuid")
    )


def test_gpus_held_are_the_allocations_the_orm_finds(make_node, user):
    node = make_node(gpus=8)
    first = _placed(user, gpus=3)
    second = _placed(user, gpus=2)
    now = max(first.scheduled_start, second.scheduled_start) + timedelta(minutes=1)
    held = queries.gpus_held(node_id=node.pk, now=now, statuses=WANTED)
    assert held == _orm_held(node, now)
    assert len(held) == 5
    assert queries.gpus_held(node_id=node.pk, now=now, statuses=["running"]) == []


def test_an_idle_heartbeat_marks_the_node_seen_and_says_what_the_orm_says_it_holds(make_node, user):
    # Given a busy node (the cheaper one, where the rental is placed) and an idle one
    idle, busy = make_node(gpus=8, price="9.00"), make_node(gpus=8)
    idle_hash, busy_hash = _credential(idle, "a"), _credential(busy, "b")
    # and a throttled GPU on the idle one
    Gpu.objects.filter(node=idle, index=3).update(health=GpuHealth.DEGRADED)
    Gpu.objects.filter(node=idle, index__in=[5, 1]).update(health=GpuHealth.FAILED)
    rental = _placed(user, gpus=8)
    assert Allocation.objects.filter(rental=rental, node=busy).exists()
    now = rental.scheduled_start + timedelta(minutes=1)
    for node, key_hash in ((idle, idle_hash), (busy, busy_hash)):
        node_id, seen, benchmark, holds, degraded, failed = queries.idle_heartbeat(
            key_hash=key_hash, now=now, interval_s=40, offline=NodeStatus.OFFLINE.value,
            statuses=WANTED, health=HEALTH,
        )  # fmt: skip
        stored = Node.objects.get(pk=node.pk)
        assert (node_id, seen, benchmark, holds, degraded, failed) == (
            node.pk,
            True,
            stored.benchmark_requested,
            bool(_orm_held(node, now)),
            Gpu.objects.filter(node=node, health=GpuHealth.DEGRADED).exists(),
            list(
                Gpu.objects.filter(node=node, health=GpuHealth.FAILED)
                .order_by("index")
                .values_list("index", flat=True)
            ),
        )
        assert (stored.last_seen_at, stored.heartbeat_interval_s) == (now, 40)
    assert holds and not degraded


def test_an_idle_heartbeat_leaves_an_offline_node_and_refuses_an_unknown_token(make_node):
    node = make_node(gpus=8, status=NodeStatus.OFFLINE)
    key_hash = _credential(node, "c")
    before = Node.objects.get(pk=node.pk).last_seen_at
    now = timezone.now()
    assert queries.idle_heartbeat(
        key_hash=key_hash, now=now, interval_s=40, offline=NodeStatus.OFFLINE.value,
        statuses=WANTED, health=HEALTH,
    ) == (node.pk, False, None, False, False, [])  # fmt: skip
    stored = Node.objects.get(pk=node.pk)
    assert (stored.last_seen_at, stored.heartbeat_interval_s) == (before, 0)
    NodeCredential.objects.filter(node=node).update(revoked_at=now)
    for unknown in (key_hash, "d" * 64):
        assert (
            queries.idle_heartbeat(
                key_hash=unknown,
                now=now,
                interval_s=0,
                offline=NodeStatus.OFFLINE.value,
                statuses=WANTED,
                health=HEALTH,
            )
            is None
        )


def test_node_by_token_reads_the_node_the_orm_reads(make_node):
    node = make_node(gpus=4)
    key_hash = _credential(node, "e")
    found = queries.node_by_token(key_hash=key_hash)
    assert _fields(found) == _fields(
        Node.objects.get(credentials__key_hash=key_hash, credentials__revoked_at__isnull=True)
    )
    NodeCredential.objects.filter(node=node).update(revoked_at=timezone.now())
    assert queries.node_by_token(key_hash=key_hash) is None


def _orm_runs(node: Node, run_ids) -> list[list]:
    """BusyState.runs, asked through the ORM."""
    runs = []
    for run in ContainerRun.objects.filter(node=node, run_id__in=run_ids).select_related("rental"):
        rental = run.rental
        steady = (
            run.status == ContainerRun.Status.RUNNING
            and run.exit_code is None
            and run.started_at is not None
            and run.finished_at is None
            and rental.status == RentalStatus.RUNNING
        )
        runs.append([run.run_id, str(rental.pk), steady, run.published, rental.ports, rental.ssh,
                     rental.jupyter, bool(rental.secrets or rental.registry_secret)])  # fmt: skip
    return sorted(runs)


def _read(now, run_ids, interval_s: int = 15) -> queries.BusyRead:
    return queries.BusyRead(
        now=now, interval_s=interval_s, offline=NodeStatus.OFFLINE.value,
        running=ContainerRun.Status.RUNNING.value, run_ids=run_ids, statuses=WANTED, health=HEALTH,
    )  # fmt: skip


def test_a_busy_heartbeat_reads_what_the_orm_reads(make_node, user):
    # Given a node holding two rentals, one of them running, with a FAILED and a DEGRADED GPU
    node = make_node(gpus=8)
    first, second = _placed(user, gpus=3), _placed(user, gpus=2)
    now = max(first.scheduled_start, second.scheduled_start) + timedelta(minutes=1)
    for rental in (first, second):
        ContainerRun.objects.create(rental=rental, node=node, run_id=f"run-{rental.pk}")
    ContainerRun.objects.filter(rental=first).update(
        status=ContainerRun.Status.RUNNING, started_at=now, published=[{"container_port": 22}]
    )
    Rental.objects.filter(pk=first.pk).update(status=RentalStatus.RUNNING, ports=[8080])
    Gpu.objects.filter(node=node, index=7).update(health=GpuHealth.FAILED)
    Gpu.objects.filter(node=node, index=6).update(health=GpuHealth.DEGRADED)
    run_ids = [f"run-{first.pk}", f"run-{second.pk}", "run-of-another-node"]
    # When a heartbeat reading them runs
    state = queries.busy_heartbeat(node_id=node.pk, read=_read(now, run_ids))
    # Then it says what the ORM says
    assert (state.seen, state.degraded, state.failed) == (True, True, [7])
    assert sorted(state.runs) == _orm_runs(node, run_ids)
    assert state.held == _orm_held(node, now)
    assert set(state.versions) == {first.pk, second.pk} and state.runs_recorded
    assert Node.objects.values_list("last_seen_at", "heartbeat_interval_s").get(pk=node.pk) == (
        now, 15
    )  # fmt: skip
    # and gpus_held_versions reads the same held GPUs and versions
    assert queries.gpus_held_versions(node_id=node.pk, now=now, statuses=WANTED) == (
        state.held, state.versions, True
    )  # fmt: skip


def test_a_busy_heartbeat_by_token_reads_the_node_and_what_busy_heartbeat_reads(make_node, user):
    # Given a node holding a rental with a run, and its token
    node = make_node(gpus=8)
    rental = _placed(user, gpus=2)
    now = rental.scheduled_start + timedelta(minutes=1)
    ContainerRun.objects.create(rental=rental, node=node, run_id="run-1")
    key_hash = _credential(node, "f")
    read = _read(now, ["run-1"])
    before = Node.objects.get(pk=node.pk)
    # When a busy heartbeat names the node by its token
    found, state = queries.busy_heartbeat_by_token(key_hash=key_hash, read=read)
    # Then the node is the one node_by_token reads (its row as it was before the heartbeat)
    assert _fields(found) == _fields(before)
    # and the rest is what busy_heartbeat reads of the node, which it marked seen
    assert Node.objects.get(pk=node.pk).last_seen_at == now
    assert state == queries.busy_heartbeat(node_id=node.pk, read=read)


@pytest.mark.parametrize("revoked", [True, False])
def test_a_busy_heartbeat_by_an_unknown_or_revoked_token_changes_nothing(make_node, user, revoked):
    # Given a node holding a rental with a run, whose token is revoked (or another token)
    node = make_node(gpus=8)
    rental = _placed(user, gpus=2)
    ContainerRun.objects.create(rental=rental, node=node, run_id="run-1")
    key_hash = _credential(node, "g")
    if revoked:
        NodeCredential.objects.filter(node=node).update(revoked_at=timezone.now())
    else:
        key_hash = "h" * 64
    before = _fields(Node.objects.get(pk=node.pk))
    # When a busy heartbeat comes with it
    found = queries.busy_heartbeat_by_token(
        key_hash=key_hash, read=_read(rental.scheduled_start + timedelta(minutes=1), ["run-1"])
    )
    # Then it finds no node and the node is as it was
    assert found is None
    assert _fields(Node.objects.get(pk=node.pk)) == before


def test_a_held_rental_s_version_changes_with_its_row_keys_secrets_and_run(make_node, user):
    from accounts.services.secrets import secret_set
    from accounts.services.sshkeys import ssh_key_add

    node = make_node(gpus=8)
    rental = _placed(user, gpus=2)
    now = rental.scheduled_start + timedelta(minutes=1)

    def version() -> tuple[str, bool]:
        _, versions, recorded = queries.gpus_held_versions(
            node_id=node.pk, now=now, statuses=WANTED
        )
        return versions[rental.pk], recorded

    before, recorded = version()
    assert not recorded  # no run of it on the node yet
    ContainerRun.objects.create(rental=rental, node=node, run_id="run-1")
    assert version() == (before, True)
    # Its team's SSH keys count once it asks for SSH; its named secrets once it names them
    Rental.objects.filter(pk=rental.pk).update(
        ssh=True, secrets=[{"name": "TOKEN", "env": "TOKEN", "file": ""}]
    )
    changes = [version()[0]]
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFh"
    ssh_key_add(team=personal_team(user), owner=user, public_key=key)
    changes.append(version()[0])
    secret_set(team=personal_team(user), actor=user, name="TOKEN", value="value-one")
    changes.append(version()[0])
    secret_set(team=personal_team(user), actor=user, name="TOKEN", value="value-two")
    changes.append(version()[0])
    secret_set(team=personal_team(user), actor=user, name="OTHER", value="value-three")
    changes.append(version()[0])
    assert len({before, *changes[:4]}) == 5 and changes[4] == changes[3]


def test_heartbeat_writes_mark_and_insert_as_the_orm_would(make_node, user):
    node = make_node(gpus=8)
    rental = _placed(user, gpus=2)
    ContainerRun.objects.create(rental=rental, node=node, run_id="run-1")
    ContainerRun.objects.create(rental=_placed(user, gpus=2), node=node, run_id="run-2")
    now = timezone.now()
    metrics, logs = queries.Rows.metrics(), queries.Rows.logs()
    metrics.add(rental.pk, "run-1", "h1", "step", 3, '{"step": 3, "loss": 1.5}')
    metrics.add(rental.pk, "run-1", "h1", "step", 3, '{"step": 3, "loss": 1.5}')  # twice
    metrics.add(rental.pk, "run-1", "h2", "", None, '{"note": "x"}')
    logs.add(rental.pk, "run-1", 0, "first")
    logs.add(rental.pk, "run-1", 1, "second")
    assert queries.heartbeat_writes(
        node_id=node.pk, now=now, steady=["run-1"], metrics=metrics, logs=logs
    ) == (1, 2, 2)
    # A replay inserts nothing; a run of another node is not marked
    assert queries.heartbeat_writes(
        node_id=node.pk + 1, now=now, steady=["run-1"], metrics=metrics, logs=logs
    ) == (0, 0, 0)
    assert list(
        ContainerRun.objects.order_by("run_id").values_list("run_id", "last_report_at")
    ) == [("run-1", now), ("run-2", None)]
    assert sorted(
        RunMetric.objects.values_list("run_id", "line_hash", "event", "step", "data")
    ) == [
        ("run-1", "h1", "step", 3, {"step": 3, "loss": 1.5}),
        ("run-1", "h2", "", None, {"note": "x"}),
    ]
    logged = RunLogLine.objects.order_by("line_no").values_list("line_no", "line", "received_at")
    assert list(logged) == [(0, "first", now), (1, "second", now)]


def test_runs_mark_started_writes_each_run_as_save_would_and_keeps_a_start(make_node, user):
    node = make_node(gpus=8)
    kept = timezone.now() - timedelta(minutes=5)
    first = ContainerRun.objects.create(
        rental=_placed(user, gpus=2), node=node, run_id="run-1", exit_code=3, started_at=kept
    )
    second = ContainerRun.objects.create(rental=_placed(user, gpus=2), node=node, run_id="run-2")
    untouched = ContainerRun.objects.create(rental=_placed(user, gpus=2), node=node, run_id="run-3")
    now, reported = timezone.now(), timezone.now() - timedelta(seconds=2)
    ports = [{"container_port": 8888, "host_port": 40001, "protocol": "tcp"}]
    queries.runs_mark_started(
        status="running", now=now,
        runs=[(first.pk, reported, []), (second.pk, reported, ports)],
    )  # fmt: skip
    for run in (first, second, untouched):
        run.refresh_from_db()
    assert (first.status, first.exit_code, first.started_at, first.published) == (
        "running",
        None,
        kept,
        [],
    )
    assert (second.status, second.started_at, second.published, second.last_report_at) == (
        "running",
        reported,
        ports,
        now,
    )
    assert (untouched.status, untouched.started_at, untouched.last_report_at) == (
        ContainerRun.Status.REQUESTED,
        None,
        None,
    )
