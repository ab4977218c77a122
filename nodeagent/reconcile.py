"""Desired state vs actual state, like a kubelet: the pure decision of what to start, stop, remove.

`plan_reconcile` takes data and returns decisions; the agent executes them. The rules:

- a desired run that does not exist (or was created but never started) is started; starting is
  idempotent on run_id, so a run the agent started before a restart is adopted, not duplicated;
- a desired run that exists in any other state is left alone: one that has exited is NOT
  restarted, the server decides what happens to its rental;
- a running run that is not desired is stopped, with the grace of its last desired entry;
- an exited run that is not desired is removed once its final state (exit code, log tail) and
  its output have been delivered in a heartbeat the server answered; a created, never started
  run that is not desired is removed at once;
- runs with an operation in flight (`hold`) are not touched again until it finishes;
- a desired run waits while a run on its way out may still hold one of its GPUs (the server frees
  GPUs when it asks for the stop, the process may take its grace period to checkpoint); a run
  whose GPUs are unknown counts as holding all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from agentprotocol import DEFAULT_STOP_GRACE_S, ContainerStatus, DesiredRun
from nodeagent.runtime.base import ContainerState


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do this round."""

    start: tuple[DesiredRun, ...] = ()
    stop: tuple[tuple[str, float], ...] = ()  # (run_id, grace_s)
    remove: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()  # desired, but their GPUs are not free yet


def plan_reconcile(
    *,
    desired: Sequence[DesiredRun],
    actual: Sequence[ContainerState],
    delivered: Set[str],
    hold: Set[str] = frozenset(),
    gpus_of: Mapping[str, tuple[int, ...]] | None = None,
    grace_of: Mapping[str, float] | None = None,
) -> Plan:
    """Decide starts, stops and removals (see the module docstring).

    delivered: runs whose exited state and output the server has received.
    hold: runs with an operation in flight.
    gpus_of, grace_of: GPUs and stop grace of runs from their last desired entry (runs no longer
    desired have none in `desired`).
    """
    gpus_of = gpus_of or {}
    grace_of = grace_of or {}
    wanted = {d.run_id for d in desired}
    by_run = {state.run_id: state for state in actual}

    stop: list[tuple[str, float]] = []
    remove: list[str] = []
    # GPUs of runs on their way out; None when unknown (then they may hold any GPU).
    leaving: list[frozenset[int] | None] = []
    for state in sorted(actual, key=lambda s: s.run_id):
        if state.run_id in wanted:
            continue
        if state.status == ContainerStatus.RUNNING:
            gpus = gpus_of.get(state.run_id)
            leaving.append(None if gpus is None else frozenset(gpus))
            if state.run_id not in hold:
                stop.append((state.run_id, grace_of.get(state.run_id, DEFAULT_STOP_GRACE_S)))
        elif state.run_id in hold:
            continue
        elif state.status == ContainerStatus.CREATED or (
            state.status == ContainerStatus.EXITED and state.run_id in delivered
        ):
            remove.append(state.run_id)

    start: list[DesiredRun] = []
    waiting: list[str] = []
    seen: set[str] = set()
    for entry in desired:
        if entry.run_id in seen or entry.run_id in hold:
            continue
        seen.add(entry.run_id)
        state = by_run.get(entry.run_id)
        if state is not None and state.status != ContainerStatus.CREATED:
            continue
        if any(gpus is None or gpus & set(entry.gpu_indices) for gpus in leaving):
            waiting.append(entry.run_id)
            continue
        start.append(entry)
    return Plan(start=tuple(start), stop=tuple(stop), remove=tuple(remove), waiting=tuple(waiting))
