"""Every write of the marketplace: typed, keyword-only functions, each owning its transaction."""

from marketplace.services.clusters import (
    cluster_create,
    cluster_delete,
    cluster_for_join,
    cluster_update,
    node_cluster_set,
    provider_node_update,
)
from marketplace.services.inventory import (
    GpuSpec,
    node_bring_online,
    node_drain,
    node_internet_capable,
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
    "cluster_create",
    "cluster_delete",
    "cluster_for_join",
    "cluster_update",
    "node_bring_online",
    "node_cluster_set",
    "node_drain",
    "node_internet_capable",
    "node_register",
    "node_request_benchmark",
    "node_set_maintenance",
    "node_set_status",
    "provider_create",
    "provider_node_action",
    "provider_node_price",
    "provider_node_update",
]
