"""Marketplace models, one module per concern."""

from marketplace.models.accounts import ApiToken, Provider, User
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
from marketplace.models.teams import MONEY_ROLES, Invitation, Membership, Team, TeamRole

__all__ = [
    "MONEY_ROLES",
    "Allocation",
    "ApiToken",
    "Gpu",
    "GpuModel",
    "GpuTier",
    "Invitation",
    "Membership",
    "Node",
    "NodeEvent",
    "NodeStatus",
    "Provider",
    "Rental",
    "RentalEvent",
    "RentalKind",
    "RentalStatus",
    "SshKey",
    "Team",
    "TeamRole",
    "User",
]
