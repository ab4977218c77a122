"""The agent's side of artifact sync: which node may write a rental's output, where each file
of it is stored, then the storage services presign and record it.

A multi-node rental has one result (gangs.member_output_path): its checkpoint directory is one
tree that every member adds its ranks' files to, member 0's other output is stored as it is,
and each member's logs (and any other file of another member) under `nodes/<node rank>/`. A
path that another member of the same placement stored is refused, never overwritten."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from core.errors import NotFound
from marketplace.models import Allocation, Node, Rental
from provisioning.models import ContainerRun
from provisioning.services.gangs import member_output_path, same_placement
from storage import services as storage
from storage.models import Artifact

log = logging.getLogger(__name__)


def _syncing_run(*, node: Node, rental_id, run_id: str) -> tuple[Rental, ContainerRun]:
    """The rental and its run, when `run_id` is its run on this node and the node holds (or
    held, within STORAGE["ARTIFACT_SYNC_GRACE_S"]) its GPUs: a stopped or preempted run writes
    its last checkpoint after its GPUs were freed. Anything else is NotFound, like a rental that
    does not exist: a node learns nothing about other nodes' rentals."""
    run = ContainerRun.objects.filter(run_id=run_id, node=node, rental_id=rental_id).first()
    if run is None:
        raise NotFound("no such run of this rental on this node")
    since = timezone.now() - timedelta(seconds=int(settings.STORAGE["ARTIFACT_SYNC_GRACE_S"]))
    held = Allocation.objects.filter(rental_id=rental_id, node=node).filter(
        Q(released_at__isnull=True) | Q(released_at__gte=since)
    )
    if not held.exists():
        raise NotFound("this node does not hold the rental")
    return Rental.objects.get(pk=rental_id), run


def _stored_paths(rental: Rental, run: ContainerRun, paths: Sequence[str]) -> dict[str, str]:
    """The agent's path -> where it is stored, for the paths this run may write (another
    member's of the same placement are left out, with a warning)."""
    if rental.node_count == 1 or run.node_rank is None:
        return {path: path for path in paths}
    stored = {path: member_output_path(path, run.node_rank) for path in paths}
    owners = dict(
        Artifact.objects.filter(rental=rental, path__in=set(stored.values())).values_list(
            "path", "run_id"
        )
    )
    mine = {}
    for path, target in stored.items():
        owner = owners.get(target)
        if owner is not None and owner != run.run_id and same_placement(owner, run.run_id):
            log.warning("rental %s: %s stored by %s, not %s", rental.pk, target, owner, run.run_id)
            continue
        mine[path] = target
    return mine


def artifact_uploads_for_node(
    *, node: Node, rental_id, run_id: str, files: Sequence[storage.FileSpec]
) -> list[storage.Upload]:
    rental, run = _syncing_run(node=node, rental_id=rental_id, run_id=run_id)
    storage.files_check(files)
    stored = _stored_paths(rental, run, [f.path for f in files])
    if not stored:
        return []
    agent_path = {target: path for path, target in stored.items()}
    uploads = storage.artifact_uploads_presign(
        rental=rental,
        files=[dataclasses.replace(f, path=stored[f.path]) for f in files if f.path in stored],
    )
    return [dataclasses.replace(u, path=agent_path[u.path]) for u in uploads]


def artifacts_commit_for_node(
    *,
    node: Node,
    rental_id,
    run_id: str,
    files: Sequence[storage.UploadedFile],
    reason: str,
) -> storage.CommitResult:
    rental, run = _syncing_run(node=node, rental_id=rental_id, run_id=run_id)
    stored = _stored_paths(rental, run, [f.path for f in files])
    agent_path = {target: path for path, target in stored.items()}
    mine = [dataclasses.replace(f, path=stored[f.path]) for f in files if f.path in stored]
    result = (
        storage.artifacts_commit(rental=rental, run_id=run_id, files=mine, reason=reason)
        if mine
        else storage.CommitResult()
    )
    refused = {agent_path.get(path, path): why for path, why in result.refused.items()}
    for f in files:
        if f.path not in stored:
            refused[f.path] = "another member of the rental stored this path"
    return storage.CommitResult(stored=result.stored, refused=refused)
