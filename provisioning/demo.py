"""The demo inventory that `python3 dev.py up` loads: simulated nodes across regions and cards."""

from __future__ import annotations

import os
import secrets
import uuid
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.db import transaction

from billing.services import account_adjust, customer_onboard
from marketplace.models import Node, NodeStatus, Provider, User
from marketplace.services import GpuSpec, node_register, user_email_verified_set
from provisioning.services import join_token_create

# hostname, region, card, GPUs, NVLink groups, $/GPU-hour, reliability
DEMO_NODES = [
    ("fra-h100-01", "eu-central", "h100-sxm5-80gb", 8, 1, "2.49", "0.995"),
    ("fra-h100-02", "eu-central", "h100-sxm5-80gb", 8, 1, "2.39", "0.990"),
    ("ams-a100-01", "eu-west", "a100-sxm4-80gb", 8, 1, "1.49", "0.985"),
    ("ams-a100-02", "eu-west", "a100-sxm4-40gb", 8, 2, "1.19", "0.980"),
    ("iad-h200-01", "us-east", "h200-sxm-141gb", 8, 1, "3.29", "0.995"),
    ("iad-v100-01", "us-east", "v100-sxm2-32gb", 8, 2, "0.49", "0.960"),
    ("sjc-l40s-01", "us-west", "l40s-48gb", 4, 0, "0.89", "0.975"),
    ("sjc-a6000-01", "us-west", "rtx-a6000-48gb", 4, 2, "0.69", "0.970"),
    ("ber-4090-01", "eu-central", "rtx4090-24gb", 4, 0, "0.39", "0.930"),
    ("waw-3090-01", "eu-central", "rtx3090-24gb", 2, 1, "0.22", "0.910"),
    ("sgp-a10-01", "ap-southeast", "a10-24gb", 4, 0, "0.45", "0.965"),
    ("sgp-t4-01", "ap-southeast", "t4-16gb", 4, 0, "0.19", "0.960"),
]


def _gpus(card: str, count: int, groups: int) -> list[GpuSpec]:
    per_group = count // groups if groups else 0
    return [
        GpuSpec(
            index=i,
            uuid=f"GPU-{uuid.uuid4()}",
            model_slug=card,
            topology_group=f"nvl{i // per_group}" if groups else f"pcie{i // 2}",
        )
        for i in range(count)
    ]


@transaction.atomic
def load_demo(*, var_dir: Path | None = None) -> dict[str, int]:
    """Idempotent: creates the ops user, a demo customer, the platform provider and the nodes."""
    var_dir = var_dir or Path(settings.BASE_DIR) / ".var" / "dev"
    var_dir.mkdir(parents=True, exist_ok=True)
    password_file = var_dir / "ops_password"
    ops = User.objects.filter(username="ops").first()
    if ops is None:
        password = secrets.token_urlsafe(12)
        ops = User.objects.create_superuser("ops", "ops@example.invalid", password)
        password_file.write_text(password + "\n")
        password_file.chmod(0o600)
    demo = User.objects.filter(username="demo").first()
    if demo is None:
        password = secrets.token_urlsafe(12)
        demo = User.objects.create_user("demo", "demo@example.invalid", password)
        (var_dir / "demo_password").write_text(password + "\n")
    # The seed vouches for its own people: no verification mail to an .invalid address.
    for person in (ops, demo):
        user_email_verified_set(user=person)
    demo_account = customer_onboard(user=demo)
    # Demo credit, once (the key makes a second load a no-op), so the demo customer can rent.
    account_adjust(
        account_id=demo_account.pk,
        amount_micros=100_000_000,
        reason="demo credit",
        actor=ops,
        key="demo-credit",
    )
    platform, _ = Provider.objects.get_or_create(
        is_platform=True, defaults={"name": "Platform", "owner": ops}
    )
    created = 0
    for hostname, region, card, count, groups, price, reliability in DEMO_NODES:
        if Node.objects.filter(provider=platform, hostname=hostname).exists():
            continue
        price_d = Decimal(price)
        node_register(
            provider=platform,
            hostname=hostname,
            region=region,
            cpu_cores=16 * count,
            ram_gb=128 * count,
            disk_gb=1000 * count,
            net_up_mbps=10000,
            net_down_mbps=10000,
            price_per_gpu_hour=price_d,
            min_bid_per_gpu_hour=(price_d * Decimal("0.4")).quantize(Decimal("0.0001")),
            gpus=_gpus(card, count, groups),
            status=NodeStatus.ONLINE,
            simulated=True,
            nvlink=groups > 0,
            reliability=Decimal(reliability),
            driver_version="550.54.15",
            cuda_version="12.4",
        )
        created += 1
    _local_agent_env(platform, ops, var_dir)
    return {"nodes_created": created, "nodes": Node.objects.count()}


def _local_agent_env(platform: Provider, ops: User, var_dir: Path) -> None:
    """A join token for the stack's own agent (simulated GPUs, local processes), written where
    `python -m nodeagent --dev-local` reads it. Once the agent has joined, it keeps its
    node token and the file is left alone."""
    env_file = var_dir / "agent.env"
    if env_file.exists():
        return
    _, raw = join_token_create(
        provider=platform,
        created_by=ops,
        region="local",
        price_per_gpu_hour=Decimal("0.50"),
        min_bid_per_gpu_hour=Decimal("0.20"),
    )
    server = os.environ.get("GPUMARKET_SERVER_URL", "http://127.0.0.1:8000")
    env_file.write_text(
        f"GPUMARKET_SERVER_URL={server}\n"
        f"GPUMARKET_JOIN_TOKEN={raw}\n"
        "GPUMARKET_SIMULATE_GPUS=rtx4090-24gb:2\n"
        "GPUMARKET_HOSTNAME=local-sim-01\n"
    )
    env_file.chmod(0o600)
