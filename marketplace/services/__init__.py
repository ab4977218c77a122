"""Every write of the marketplace: typed, keyword-only functions, each owning its transaction."""

from marketplace.services.accounts import (
    api_token_create,
    api_token_revoke,
    token_hash,
    user_email_verified_set,
)
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
    "api_token_create",
    "api_token_revoke",
    "node_bring_online",
    "node_drain",
    "node_register",
    "node_request_benchmark",
    "node_set_maintenance",
    "node_set_status",
    "provider_create",
    "provider_node_action",
    "provider_node_price",
    "token_hash",
    "user_email_verified_set",
]
