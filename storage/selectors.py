"""Every read of object storage's rows: datasets, their files, the datasets rentals read and the
artifacts they synced out."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
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
# directory inside the output directory (/workspace/checkpoints in its image); a sharded one is
# a directory `step_<step>/` (harness/sharded_checkpoint.py) holding DCP's `.metadata`, rank 0's
# `harness.pt` and one `__<rank>_<n>.distcp` file per rank.
CHECKPOINT_NAME = re.compile(r"(?:^|/)step_(\d+)\.pt$")
SHARDED_FILE = re.compile(r"^(?P<dir>(?:.*/)?step_(?P<step>\d+))/(?P<name>[^/]+)$")
SHARD_NAME = re.compile(r"^__(\d+)_\d+\.distcp$")
SHARDED_WHOLE = frozenset({".metadata", "harness.pt"})
CHECKPOINT_FILES_SQL = r"(^|/)step_[0-9]+(\.pt|/[^/]+)$"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One complete synced checkpoint: its step and every file a resumed run needs of it."""

    step: int
    files: tuple[Artifact, ...]

    @property
    def synced_at(self) -> float:
        return max(f.synced_at.timestamp() for f in self.files)


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


def latest_checkpoint(artifacts: Iterable[Artifact], *, world_size: int = 1) -> Checkpoint | None:
    """The complete checkpoint with the highest step among these artifacts, the last synced on
    a tie. A sharded one is complete when its `.metadata`, `harness.pt` and a shard of each of
    the `world_size` ranks are there (a job across nodes syncs each node's part on its own)."""
    found: list[Checkpoint] = []
    steps: dict[str, list[Artifact]] = {}
    for artifact in artifacts:
        if match := CHECKPOINT_NAME.search(artifact.path):
            found.append(Checkpoint(int(match.group(1)), (artifact,)))
        elif match := SHARDED_FILE.match(artifact.path):
            steps.setdefault(match.group("dir"), []).append(artifact)
    for directory, files in steps.items():
        names = {f.path.rsplit("/", 1)[1] for f in files}
        ranks = {int(m.group(1)) for name in names if (m := SHARD_NAME.match(name))}
        if names >= SHARDED_WHOLE and ranks >= set(range(world_size)):
            step = int(directory.rsplit("step_", 1)[1])
            found.append(Checkpoint(step, tuple(sorted(files, key=lambda f: f.path))))
    return max(found, key=lambda c: (c.step, c.synced_at), default=None)


def rental_last_checkpoint_at(rental: Rental) -> datetime | None:
    """When the rental's own last complete checkpoint (the one it would resume from) was
    synced: its last file's sync."""
    checkpoint = latest_checkpoint(
        Artifact.objects.filter(rental=rental, path__regex=CHECKPOINT_FILES_SQL).only(
            "path", "synced_at"
        ),
        world_size=rental.node_count * rental.gpus_per_node,
    )
    return max(f.synced_at for f in checkpoint.files) if checkpoint is not None else None


def rentals_resume_checkpoints(rentals: Iterable[Rental]) -> dict[object, Checkpoint]:
    """rental id -> the checkpoint it starts from: its own latest complete synced checkpoint
    (a requeued rental), else the latest one of the rental it was created to resume from."""
    rentals = list(rentals)
    sources = {r.pk for r in rentals} | {r.resume_from_id for r in rentals if r.resume_from_id}
    world_sizes = {
        pk: nodes * gpus
        for pk, nodes, gpus in Rental.objects.filter(pk__in=sources).values_list(
            "pk", "node_count", "gpus_per_node"
        )
    }
    by_rental: dict = {}
    # Only checkpoint files are read: a rental's logs and other output can be many rows, and
    # this runs on every heartbeat of a busy node.
    checkpoints = Artifact.objects.filter(
        rental_id__in=sources, path__regex=CHECKPOINT_FILES_SQL
    ).only("rental_id", "path", "size_bytes", "sha256", "synced_at")
    for artifact in checkpoints:
        by_rental.setdefault(artifact.rental_id, []).append(artifact)

    def latest(rental_id) -> Checkpoint | None:
        return latest_checkpoint(
            by_rental.get(rental_id, ()), world_size=world_sizes.get(rental_id, 1)
        )

    found = {}
    for rental in rentals:
        checkpoint = latest(rental.pk)
        if checkpoint is None and rental.resume_from_id:
            checkpoint = latest(rental.resume_from_id)
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
