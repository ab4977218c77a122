"""Every read of object storage's rows: datasets, their files, the datasets rentals read and the
artifacts they synced out."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from django.db.models import Prefetch, QuerySet, Sum
from django.db.models.functions import Coalesce

from accounts.models import Team
from core.errors import NotFound
from marketplace.models import Rental
from marketplace.selectors import rental_owned
from storage.models import Artifact, Dataset, DatasetFile, RentalDataset

# Who owns a dataset is decided here and nowhere else: the team (its `owner` is the member who
# uploaded it).

# The harness names each checkpoint `step_<step>.pt` (harness/checkpoint.py) in its checkpoint
# directory inside the output directory (/workspace/checkpoints in its image).
CHECKPOINT_NAME = re.compile(r"(?:^|/)step_(\d+)\.pt$")
CHECKPOINT_NAME_SQL = r"(^|/)step_[0-9]+\.pt$"


def datasets_owned(team: Team) -> QuerySet[Dataset]:
    """The team's datasets, whichever member uploaded them."""
    return Dataset.objects.filter(team=team)


def dataset_owned(*, team: Team, dataset_id) -> Dataset:
    """One of the team's datasets; another team's (or none) is NotFound."""
    dataset = datasets_owned(team).filter(pk=dataset_id).first()
    if dataset is None:
        raise NotFound("no such dataset")
    return dataset


def datasets_owned_by_name(*, team: Team, names: Iterable[str]) -> dict[str, Dataset]:
    return {d.name: d for d in datasets_owned(team).filter(name__in=list(names))}


def dataset_bytes_used(team: Team) -> int:
    """The bytes counted against the team's dataset quota (declared sizes, uploads included)."""
    return datasets_owned(team).aggregate(total=Coalesce(Sum("total_bytes"), 0))["total"]


def rental_artifacts(*, team: Team, rental_id) -> QuerySet[Artifact]:
    """The synced output files of one of the team's rentals (NotFound for another team's)."""
    rental = rental_owned(team=team, rental_id=rental_id)
    return Artifact.objects.filter(rental=rental).order_by("path")


def latest_checkpoint(artifacts: Iterable[Artifact]) -> Artifact | None:
    """The checkpoint with the highest step among these artifacts, the last synced on a tie."""
    best: tuple[int, float, Artifact] | None = None
    for artifact in artifacts:
        match = CHECKPOINT_NAME.search(artifact.path)
        if match is None:
            continue
        rank = (int(match.group(1)), artifact.synced_at.timestamp(), artifact)
        if best is None or rank[:2] > best[:2]:
            best = rank
    return best[2] if best else None


def rental_last_checkpoint_at(rental: Rental) -> datetime | None:
    """When the rental's own last checkpoint (the one it would resume from) was synced."""
    checkpoint = latest_checkpoint(
        Artifact.objects.filter(rental=rental, path__regex=CHECKPOINT_NAME_SQL).only(
            "path", "synced_at"
        )
    )
    return checkpoint.synced_at if checkpoint is not None else None


def rentals_resume_checkpoints(rentals: Iterable[Rental]) -> dict:
    """rental id -> the checkpoint artifact it starts from: its own latest synced checkpoint
    (a requeued rental), else the latest one of the rental it was created to resume from."""
    rentals = list(rentals)
    sources = {r.pk for r in rentals} | {r.resume_from_id for r in rentals if r.resume_from_id}
    by_rental: dict = {}
    # Only checkpoint files are read: a rental's logs and other output can be many rows, and
    # this runs on every heartbeat of a busy node.
    checkpoints = Artifact.objects.filter(
        rental_id__in=sources, path__regex=CHECKPOINT_NAME_SQL
    ).only("rental_id", "path", "size_bytes", "sha256", "synced_at")
    for artifact in checkpoints:
        by_rental.setdefault(artifact.rental_id, []).append(artifact)
    found = {}
    for rental in rentals:
        checkpoint = latest_checkpoint(by_rental.get(rental.pk, ()))
        if checkpoint is None and rental.resume_from_id:
            checkpoint = latest_checkpoint(by_rental.get(rental.resume_from_id, ()))
        if checkpoint is not None:
            found[rental.pk] = checkpoint
    return found


def rentals_dataset_files(rental_ids: Iterable) -> dict:
    """rental id -> [(dataset, [its stored files])] of the datasets each rental reads."""
    links = (
        RentalDataset.objects.filter(rental_id__in=list(rental_ids))
        .select_related("dataset")
        .prefetch_related(
            Prefetch(
                "dataset__files",
                queryset=DatasetFile.objects.filter(stored_at__isnull=False).order_by("path"),
            )
        )
        .order_by("dataset__name")
    )
    found: dict = {}
    for link in links:
        found.setdefault(link.rental_id, []).append((link.dataset, list(link.dataset.files.all())))
    return found
