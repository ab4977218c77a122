"""Marketplace models, one module per concern."""

from marketplace.models.accounts import Provider, User
from marketplace.models.catalog import GpuModel, GpuTier
from marketplace.models.inventory import (
    CLUSTER_GBPS_MAX,
    Cluster,
    Gpu,
    GpuHealth,
    GpuHealthEvent,
    Interconnect,
    Node,
    NodeEvent,
    NodeStatus,
    interconnect_label,
    silence_timeout_s,
)
from marketplace.models.rentals import (
    Allocation,
    EndCause,
    PreemptionPolicy,
    Rental,
    RentalCredit,
    RentalEvent,
    RentalKind,
    RentalNetwork,
    RentalStatus,
)
from marketplace.models.templates import RentalTemplate

__all__ = [
    "CLUSTER_GBPS_MAX",
    "Allocation",
    "Cluster",
    "EndCause",
    "Gpu",
    "GpuHealth",
    "GpuHealthEvent",
    "GpuModel",
    "GpuTier",
    "Interconnect",
    "Node",
    "NodeEvent",
    "NodeStatus",
    "PreemptionPolicy",
    "Provider",
    "Rental",
    "RentalCredit",
    "RentalEvent",
    "RentalKind",
    "RentalNetwork",
    "RentalStatus",
    "RentalTemplate",
    "User",
    "interconnect_label",
    "silence_timeout_s",
]
