"""The agent's side of artifact sync: which node may write a rental's output, then the
storage services presign and record it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from core.errors import NotFound
from marketplace.models import Allocation, Node, Rental
from provisioning.models import ContainerRun
from storage import services as storage


def _syncing_rental(*, node: Node, rental_id, run_id: str) -> Rental:
    """The rental, when `run_id` is its run on this node and the node holds (or held, within
    STORAGE["ARTIFACT_SYNC_GRACE_S"]) its GPUs: a stopped or preempted run writes its last
    checkpoint after its GPUs were freed. Anything else is NotFound, like a rental that does not
    exist: a node learns nothing about other nodes' rentals."""
    if not ContainerRun.objects.filter(run_id=run_id, node=node, rental_id=rental_id).exists():
        raise NotFound("no such run of this rental on this node")
    since = timezone.now() - timedelta(seconds=int(settings.STORAGE["ARTIFACT_SYNC_GRACE_S"]))
    held = Allocation.objects.filter(rental_id=rental_id, node=node).filter(
        Q(released_at__isnull=True) | Q(released_at__gte=since)
    )
    if not held.exists():
        raise NotFound("this node does not hold the rental")
    return Rental.objects.get(pk=rental_id)


def artifact_uploads_for_node(
    *, node: Node, rental_id, run_id: str, files: Sequence[storage.FileSpec]
) -> list[storage.Upload]:
    rental = _syncing_rental(node=node, rental_id=rental_id, run_id=run_id)
    return storage.artifact_uploads_presign(rental=rental, files=files)


def artifacts_commit_for_node(
    *,
    node: Node,
    rental_id,
    run_id: str,
    files: Sequence[storage.UploadedFile],
    reason: str,
) -> storage.CommitResult:
    rental = _syncing_rental(node=node, rental_id=rental_id, run_id=run_id)
    return storage.artifacts_commit(rental=rental, run_id=run_id, files=files, reason=reason)
