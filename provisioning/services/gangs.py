"""A rental over several nodes is ONE job: its members find each other, start together and end
together.

- **Rendezvous.** Every member's run gets torchrun's variables, the same on every runtime and in
  customer images: `NNODES`, `NODE_RANK` (members ordered by node id), `MASTER_ADDR` (node rank
  0's fabric address), `MASTER_PORT` (one per rental), `NPROC_PER_NODE` (the GPUs it has there),
  `WORLD_SIZE`; and the platform's: `GPUMARKET_RENTAL_ID`, `GPUMARKET_NODE_ADDR` (this member's
  address, for binding gloo/NCCL to the right interface) and `GPUMARKET_GANG_ADDRS` (every
  member's address, by node rank). The harness's launcher (`--nproc auto`) reads exactly these.
- **A start barrier.** The rental is RUNNING, and billed, from the moment its LAST member runs;
  the members that started earlier wait unbilled. A gang whose members have not all started
  `GANG_START_TIMEOUT_S` after its placement is re-queued (placed again, anywhere) with the
  reason, and failed with it after `GANG_START_ATTEMPTS` placements.
- **One end.** A member that fails (or whose node is lost) ends the rental, which stops every
  member; a member that exits 0 waits for the others, and the rental completes when all have.
  A lost node re-queues an interruptible gang as a whole (every member's run dropped, so the
  survivors are stopped), to resume from its last complete checkpoint on live nodes.
- **One result.** The members' output directories are stored as one (`member_output_path`):
  the checkpoint directory is one tree (rank 0's files, or each rank's shard of one sharded
  checkpoint under its step), member 0's other output as it is, and each member's logs under
  `nodes/<node rank>/`. A path another member of the same placement stored is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from marketplace import lifecycle
from marketplace.models import Allocation, Rental, RentalEvent, RentalStatus
from provisioning.models import ContainerRun

log = logging.getLogger(__name__)

S = RentalStatus
# The rendezvous store's port: one per rental (members of two gangs may share a host), above the
# ports services commonly use and below the ephemeral range.
PORT_BASE, PORT_SPAN = 20000, 10000
REQUEUE_REASON = "not every member started"
# The output subdirectory the platform points the harness's checkpoints at (HARNESS_CHECKPOINT_DIR
# in the agent's runs; harness.paths.CHECKPOINT_SUBDIR): the one every member writes into.
CHECKPOINT_SUBDIR = "checkpoints"
MEMBER_SUBDIR = "nodes"


@dataclass(frozen=True, slots=True)
class Member:
    node_id: int
    hostname: str
    address: str  # the fabric address, else the hostname


def gang_timeout_s() -> float:
    return float(settings.GPUMARKET.get("GANG_START_TIMEOUT_S", 600))


def gang_attempts() -> int:
    return int(settings.GPUMARKET.get("GANG_START_ATTEMPTS", 3))


def members_of(rental_ids) -> dict:
    """rental id -> its members (the nodes it holds GPUs on now), ordered by node id."""
    rows = (
        Allocation.objects.filter(rental_id__in=list(rental_ids), released_at__isnull=True)
        .values_list("rental_id", "node_id", "node__hostname", "node__fabric_address")
        .distinct()
        .order_by("rental_id", "node_id")
    )
    members: dict = {}
    for rental_id, node_id, hostname, address in rows:
        members.setdefault(rental_id, []).append(Member(node_id, hostname, address or hostname))
    return members


def member_output_path(path: str, node_rank: int) -> str:
    """Where a member's output file is stored, so that the members' output directories make
    one result and none overwrites another's: files under the checkpoint directory as they are
    (each rank's files have names of their own), member 0's other files as they are, except
    its `logs/` (and `nodes/`); every other file under `nodes/<node rank>/`."""
    top = path.split("/", 1)[0]
    if top == CHECKPOINT_SUBDIR or (node_rank == 0 and top not in ("logs", MEMBER_SUBDIR)):
        return path
    return f"{MEMBER_SUBDIR}/{node_rank}/{path}"


def same_placement(run_id: str, other_run_id: str) -> bool:
    """Whether two runs belong to one placement of a rental (heartbeat.run_id_for)."""
    return run_id.rsplit("-p", 1)[-1] == other_run_id.rsplit("-p", 1)[-1] and (
        run_id.split("-n", 1)[0] == other_run_id.split("-n", 1)[0]
    )


def master_port(rental: Rental) -> int:
    return PORT_BASE + rental.pk.int % PORT_SPAN


def rendezvous_env(rental: Rental, members: list[Member], node_id: int) -> dict[str, str]:
    """The job description the run on `node_id` gets (see the module's docstring)."""
    rank = next(i for i, m in enumerate(members) if m.node_id == node_id)
    return {
        "NNODES": str(len(members)),
        "NODE_RANK": str(rank),
        "MASTER_ADDR": members[0].address,
        "MASTER_PORT": str(master_port(rental)),
        "NPROC_PER_NODE": str(rental.gpus_per_node),
        "WORLD_SIZE": str(rental.gpus_per_node * len(members)),
        "GPUMARKET_RENTAL_ID": str(rental.pk),
        "GPUMARKET_NODE_ADDR": members[rank].address,
        "GPUMARKET_GANG_ADDRS": ",".join(m.address for m in members),
    }


def _current_runs(rental: Rental) -> list[ContainerRun]:
    """The runs of the rental's current placement, one per member that has been handed its run."""
    from provisioning.services.heartbeat import run_id_for

    if rental.scheduled_start is None:
        return []
    nodes = [m.node_id for m in members_of([rental.pk]).get(rental.pk, [])]
    wanted = [run_id_for(rental.pk, node_id, rental.scheduled_start) for node_id in nodes]
    return list(ContainerRun.objects.filter(run_id__in=wanted))


@dataclass(frozen=True, slots=True)
class Barrier:
    started: int
    needed: int
    started_at: datetime | None  # when the last member started, once all have

    @property
    def open(self) -> bool:
        return self.started >= self.needed


def barrier(rental: Rental) -> Barrier:
    """How many members run (or ran) in the current placement, out of how many."""
    runs = _current_runs(rental)
    began = [
        run.started_at
        for run in runs
        if run.started_at is not None
        and run.status in (ContainerRun.Status.RUNNING, ContainerRun.Status.EXITED)
    ]
    needed = rental.node_count
    return Barrier(len(began), needed, max(began) if len(began) >= needed else None)


def others_still_running(rental: Rental, node_id: int) -> bool:
    """Whether a member other than `node_id`'s has not ended yet (a member that exits 0 waits
    for these)."""
    return (
        any(
            run.node_id != node_id and run.status != ContainerRun.Status.EXITED
            for run in _current_runs(rental)
        )
        or len(_current_runs(rental)) < rental.node_count
    )


def gangs_start_timeout(*, now: datetime | None = None) -> int:
    """Gangs placed longer than the timeout ago whose members have not all started: re-queued
    with the reason (the members that ran are stopped by the new desired state), failed after
    `gang_attempts()` placements. Returns how many were handled."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=gang_timeout_s())
    ids = list(
        Rental.objects.filter(
            node_count__gt=1,
            status__in=(S.SCHEDULED, S.PROVISIONING),
            scheduled_start__lte=cutoff,
        ).values_list("pk", flat=True)
    )
    handled = 0
    for rental_id in ids:
        with transaction.atomic():
            rental = Rental.objects.select_for_update().get(pk=rental_id)
            if rental.status not in (S.SCHEDULED, S.PROVISIONING):
                continue
            if rental.scheduled_start is None or rental.scheduled_start > cutoff:
                continue
            state = barrier(rental)
            if state.open:
                continue
            waiting = sorted(
                m.hostname
                for m in members_of([rental.pk]).get(rental.pk, [])
                if m.node_id not in {r.node_id for r in _current_runs(rental) if r.started_at}
            )
            reason = (
                f"{REQUEUE_REASON} within {gang_timeout_s():.0f} s: "
                f"{state.started} of {state.needed} ran (waiting for {', '.join(waiting)})"
            )
            tries = RentalEvent.objects.filter(
                rental=rental, reason__startswith=REQUEUE_REASON
            ).count()
            ContainerRun.objects.filter(rental=rental).delete()
            if tries + 1 >= gang_attempts():
                lifecycle.rental_gang_fail(rental=rental, reason=reason, at=now)
            else:
                lifecycle.rental_gang_requeue(rental=rental, reason=reason, at=now)
            log.warning("gang %s: %s", rental.pk, reason)
            handled += 1
    return handled
