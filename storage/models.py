"""What lives in object storage: customers' datasets and the artifacts rentals sync out.

The bucket holds the bytes; these rows say whose they are, what they should be (size, SHA-256)
and whether they checked out. Object keys are built from ids only (`key` below), never from a
path a client sent.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class DatasetStatus(models.TextChoices):
    UPLOADING = "uploading", "Uploading"
    READY = "ready", "Ready"
    FAILED = "failed", "Failed"


class DatasetQuerySet(models.QuerySet):
    def ready(self) -> DatasetQuerySet:
        """The datasets a rental may read."""
        return self.filter(status=DatasetStatus.READY)


class Dataset(models.Model):
    """A team's set of files that rentals read, staged read-only at /data/<name>."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # The team owns it (any member's rentals read it; the quota is the team's); ownership is
    # read through storage.selectors (datasets_owned) only.
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="datasets")
    # The member who uploaded or registered it.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="datasets"
    )
    name = models.CharField(max_length=80)
    status = models.CharField(
        max_length=10, choices=DatasetStatus.choices, default=DatasetStatus.UPLOADING
    )
    status_reason = models.CharField(max_length=500, blank=True)
    # Registered from a URL: the server copies it into the bucket.
    source_url = models.URLField(max_length=2000, blank=True)
    # The declared size of all files: counted against the team's quota from the upload's start.
    total_bytes = models.BigIntegerField(default=0)
    file_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)

    objects = DatasetQuerySet.as_manager()

    class Meta:
        # Created by the marketplace app before storage was an app of its own.
        db_table = "marketplace_dataset"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="dataset_name_per_team"),
            models.CheckConstraint(condition=Q(total_bytes__gte=0), name="dataset_bytes"),
        ]

    def __str__(self) -> str:
        return f"dataset {self.name} ({self.status})"

    @property
    def prefix(self) -> str:
        return f"datasets/{self.pk}/"


class DatasetFile(models.Model):
    """One file of a dataset: what the client declared, and when the store confirmed it."""

    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="files")
    path = models.CharField(max_length=1024)
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    # A multipart upload in progress (its parts are part_bytes long, the last one shorter).
    upload_id = models.CharField(max_length=1024, blank=True)
    part_bytes = models.BigIntegerField(default=0)
    stored_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "marketplace_datasetfile"
        ordering = ["path"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "path"], name="dataset_file_path"),
            models.CheckConstraint(condition=Q(size_bytes__gte=0), name="dataset_file_size"),
        ]

    def __str__(self) -> str:
        return f"{self.dataset_id}:{self.path}"

    @property
    def key(self) -> str:
        return f"datasets/{self.dataset_id}/files/{self.pk}"


class RentalDataset(models.Model):
    """A dataset a rental reads (named at create; the dataset was ready and the rental's team's)."""

    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.CASCADE, related_name="dataset_links"
    )
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="rental_links")

    class Meta:
        db_table = "marketplace_rentaldataset"
        constraints = [
            models.UniqueConstraint(fields=["rental", "dataset"], name="rental_dataset_once")
        ]

    def __str__(self) -> str:
        return f"{self.rental_id} reads {self.dataset_id}"


class Artifact(models.Model):
    """A file of a rental's output directory that its agent synced and the store confirmed."""

    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.CASCADE, related_name="artifacts"
    )
    path = models.CharField(max_length=1024)
    size_bytes = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    run_id = models.CharField(max_length=128)
    # Why the agent synced: checkpoint, stop, complete, preempt, fail.
    reason = models.CharField(max_length=12, blank=True)
    synced_at = models.DateTimeField()

    class Meta:
        db_table = "marketplace_artifact"
        ordering = ["path"]
        constraints = [
            models.UniqueConstraint(fields=["rental", "path"], name="artifact_path_per_rental"),
            models.CheckConstraint(condition=Q(size_bytes__gte=0), name="artifact_size"),
        ]

    def __str__(self) -> str:
        return f"{self.rental_id}:{self.path}"

    @property
    def key(self) -> str:
        return artifact_key(self.rental_id, self.path)


def artifact_key(rental_id, path: str) -> str:
    """The object key of an output file; `path` is one the server validated (relative, no
    `..`), so the key stays under the rental's prefix."""
    return f"rentals/{rental_id}/output/{path}"
