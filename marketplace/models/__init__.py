"""Marketplace models, one module per concern."""

from marketplace.models.accounts import Provider, User
from marketplace.models.catalog import GpuModel, GpuTier
from marketplace.models.inventory import Gpu, Node, NodeEvent, NodeStatus
from marketplace.models.rentals import (
    Allocation,
    EndCause,
    PreemptionPolicy,
    Rental,
    RentalCredit,
    RentalEvent,
    RentalKind,
    RentalStatus,
)

__all__ = [
    "Allocation",
    "EndCause",
    "Gpu",
    "GpuModel",
    "GpuTier",
    "Node",
    "NodeEvent",
    "NodeStatus",
    "PreemptionPolicy",
    "Provider",
    "Rental",
    "RentalCredit",
    "RentalEvent",
    "RentalKind",
    "RentalStatus",
    "User",
]
