"""Marketplace models, one module per concern."""

from marketplace.models.accounts import Provider, User
from marketplace.models.catalog import GpuModel, GpuTier
from marketplace.models.inventory import Gpu, GpuHealth, GpuHealthEvent, Node, NodeEvent, NodeStatus
from marketplace.models.rentals import (
    Allocation,
    Rental,
    RentalEvent,
    RentalKind,
    RentalStatus,
)

__all__ = [
    "Allocation",
    "Gpu",
    "GpuHealth",
    "GpuHealthEvent",
    "GpuModel",
    "GpuTier",
    "Node",
    "NodeEvent",
    "NodeStatus",
    "Provider",
    "Rental",
    "RentalEvent",
    "RentalKind",
    "RentalStatus",
    "User",
]
