"""plan_reconcile: desired + actual in, starts/stops/removals out (a pure function)."""

from __future__ import annotations

from typing import Any

from agentprotocol import DEFAULT_STOP_GRACE_S, DesiredRun
from nodeagent.reconcile import Plan, plan_reconcile
from nodeagent.runtime.base import ContainerState


def desired(run_id: str, gpus: tuple[int, ...] = (0,), **overrides: Any) -> DesiredRun:
    fields: dict[str, Any] = {
        "rental_id": f"rental-{run_id}",
        "run_id": run_id,
        "image": "img",
        "command": ("python", "-c", "pass"),
        "env": {},
        "gpu_indices": gpus,
        "gpu_uuids": (),
        "cpu_limit": 1.0,
        "memory_limit_mb": 1024,
        "ports": (),
        "stop_grace_s": 12.0,
    }
    fields.update(overrides)
    return DesiredRun(**fields)


def actual(run_id: str, status: str, exit_code: int | None = None) -> ContainerState:
    return ContainerState(
        rental_id=f"rental-{run_id}",
        run_id=run_id,
        status=status,
        exit_code=exit_code,
        started_at=100.0 if status != "created" else None,
        finished_at=200.0 if status == "exited" else None,
        ports={},
    )


def test_missing_desired_run_is_started():
    # given a desired run the runtime does not have
    run = desired("a")
    # when planning
    plan = plan_reconcile(desired=[run], actual=[], delivered=set())
    # then it is started, and nothing else happens
    assert plan == Plan(start=(run,))


def test_running_desired_run_is_left_alone_never_duplicated():
    plan = plan_reconcile(desired=[desired("a")], actual=[actual("a", "running")], delivered=set())
    assert plan == Plan()


def test_created_but_never_started_desired_run_is_started():
    run = desired("a")
    plan = plan_reconcile(desired=[run], actual=[actual("a", "created")], delivered=set())
    assert plan == Plan(start=(run,))


def test_exited_desired_run_is_not_restarted():
    # given a desired run that has exited (the server decides what becomes of it)
    plan = plan_reconcile(
        desired=[desired("a")], actual=[actual("a", "exited", 1)], delivered={"a"}
    )
    # then it is neither restarted nor removed
    assert plan == Plan()


def test_running_undesired_run_is_stopped_with_its_last_grace():
    plan = plan_reconcile(
        desired=[],
        actual=[actual("a", "running")],
        delivered=set(),
        grace_of={"a": 7.5},
        gpus_of={"a": (0,)},
    )
    assert plan == Plan(stop=(("a", 7.5),))


def test_stop_grace_defaults_to_30_seconds_when_unknown():
    plan = plan_reconcile(desired=[], actual=[actual("a", "running")], delivered=set())
    assert plan.stop == (("a", DEFAULT_STOP_GRACE_S),)
    assert DEFAULT_STOP_GRACE_S == 30.0


def test_exited_undesired_run_waits_until_its_final_state_was_delivered():
    # given an exited run the server no longer wants, its exit not yet reported
    state = actual("a", "exited", 0)
    # then it is kept (its exit code and log tail must reach the server first)
    assert plan_reconcile(desired=[], actual=[state], delivered=set()) == Plan()
    # and once delivered, it is removed
    assert plan_reconcile(desired=[], actual=[state], delivered={"a"}) == Plan(remove=("a",))


def test_created_undesired_run_is_removed_at_once():
    plan = plan_reconcile(desired=[], actual=[actual("a", "created")], delivered=set())
    assert plan == Plan(remove=("a",))


def test_runs_with_an_operation_in_flight_are_not_touched():
    # given a stop in flight for "a", a start in flight for "b", a removal in flight for "c"
    plan = plan_reconcile(
        desired=[desired("b", gpus=(5,))],
        actual=[actual("a", "running"), actual("c", "exited", 0)],
        delivered={"c"},
        hold={"a", "b", "c"},
        gpus_of={"a": (0,)},
    )
    # then nothing is issued twice
    assert plan == Plan()


def test_new_run_waits_while_a_leaving_run_still_holds_its_gpus():
    # given "old" (GPUs 0,1) being stopped and "new" desired on GPU 1
    new = desired("new", gpus=(1, 2))
    plan = plan_reconcile(
        desired=[new],
        actual=[actual("old", "running")],
        delivered=set(),
        hold={"old"},
        gpus_of={"old": (0, 1)},
    )
    # then "new" waits rather than sharing a GPU with a process still checkpointing
    assert plan == Plan(waiting=("new",))


def test_new_run_on_other_gpus_starts_while_another_run_stops():
    new = desired("new", gpus=(2, 3))
    plan = plan_reconcile(
        desired=[new],
        actual=[actual("old", "running")],
        delivered=set(),
        gpus_of={"old": (0, 1)},
        grace_of={"old": 30.0},
    )
    assert plan == Plan(start=(new,), stop=(("old", 30.0),))


def test_leaving_run_with_unknown_gpus_blocks_every_start():
    # given a running run adopted after a restart, no longer desired, GPUs unknown
    new = desired("new", gpus=(7,))
    plan = plan_reconcile(desired=[new], actual=[actual("old", "running")], delivered=set())
    # then it is stopped and the new run waits for it
    assert plan == Plan(stop=(("old", DEFAULT_STOP_GRACE_S),), waiting=("new",))


def test_duplicate_desired_entries_start_once():
    run = desired("a")
    plan = plan_reconcile(desired=[run, desired("a", gpus=(3,))], actual=[], delivered=set())
    assert plan == Plan(start=(run,))


def test_mixed_round():
    # given: a running desired run, a new desired run, an undesired running run, a delivered
    # exited run and an exited desired run
    keep, new = desired("keep", gpus=(0,)), desired("new", gpus=(1,))
    plan = plan_reconcile(
        desired=[keep, new, desired("done", gpus=(3,))],
        actual=[
            actual("keep", "running"),
            actual("gone", "running"),
            actual("old", "exited", 0),
            actual("done", "exited", 0),
        ],
        delivered={"old", "done"},
        gpus_of={"gone": (2,)},
        grace_of={"gone": 5.0},
    )
    assert plan == Plan(start=(new,), stop=(("gone", 5.0),), remove=("old",))
