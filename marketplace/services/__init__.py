"""Every write of the marketplace: typed, keyword-only functions, each owning its transaction."""

from marketplace.services.inventory import (
    GpuSpec,
    node_bring_online,
    node_drain,
    node_register,
    node_request_benchmark,
    node_set_maintenance,
    node_set_status,
    provider_create,
    provider_node_action,
    provider_node_price,
)

__all__ = [
    "GpuSpec",
    "node_bring_online",
    "node_drain",
    "node_register",
    "node_request_benchmark",
    "node_set_maintenance",
    "node_set_status",
    "provider_create",
    "provider_node_action",
    "provider_node_price",
]
