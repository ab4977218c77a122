"""Marketplace models, one module per concern."""

from marketplace.models.accounts import ApiToken, Provider, User
from marketplace.models.advisor import AdvisorCheck, AdvisorPrior
from marketplace.models.catalog import GpuModel, GpuTier
from marketplace.models.inventory import Gpu, Node, NodeEvent, NodeStatus
from marketplace.models.rentals import (
    Allocation,
    Rental,
    RentalEvent,
    RentalKind,
    RentalStatus,
)
from marketplace.models.sshkeys import SshKey
from marketplace.models.storage import (
    Artifact,
    Dataset,
    DatasetFile,
    DatasetStatus,
    RentalDataset,
    artifact_key,
)

__all__ = [
    "AdvisorCheck",
    "AdvisorPrior",
    "Allocation",
    "ApiToken",
    "Artifact",
    "Dataset",
    "DatasetFile",
    "DatasetStatus",
    "Gpu",
    "GpuModel",
    "GpuTier",
    "Node",
    "NodeEvent",
    "NodeStatus",
    "Provider",
    "Rental",
    "RentalDataset",
    "RentalEvent",
    "RentalKind",
    "RentalStatus",
    "SshKey",
    "User",
    "artifact_key",
]
