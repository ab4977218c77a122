"""The demo inventory that `python3 dev.py up` runs: simulated hosts across regions and cards,
each with a live agent.

Every demo host is a real node agent on the local-process runtime with simulated GPUs (one
process drives them all: `nodeagent.fleet`), so the hosts join through the join API, heartbeat,
benchmark and run rentals like any provider's; the silent-node sweep sees them alive for as long
as the stack runs. `demo_fleet_prepare` writes what that process reads, minting a join token for
each host that can neither use its stored node token nor (re)join with the token it has.
"""

from __future__ import annotations

import json
import os
import secrets
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.services import token_hash, user_create, user_email_verified_set
from agentprotocol import simulated_gpu_uuid
from billing.services import account_adjust, customer_onboard
from marketplace.models import Gpu, Node, Provider, User
from provisioning.models import JoinToken, NodeCredential
from provisioning.services import join_token_create

# hostname, region, card, GPUs, $/GPU-hour. The first is the stack's "local" node of the
# README's quickstart; NVLink topology comes from the simulated card.
DEMO_NODES = [
    ("local-sim-01", "local", "rtx4090-24gb", 2, "0.50"),
    ("fra-h100-01", "eu-central", "h100-sxm5-80gb", 8, "2.49"),
    ("fra-h100-02", "eu-central", "h100-sxm5-80gb", 8, "2.39"),
    ("ams-a100-01", "eu-west", "a100-sxm4-80gb", 8, "1.49"),
    ("ams-a100-02", "eu-west", "a100-sxm4-40gb", 8, "1.19"),
    ("iad-h200-01", "us-east", "h200-sxm-141gb", 8, "3.29"),
    ("iad-v100-01", "us-east", "v100-sxm2-32gb", 8, "0.49"),
    ("sjc-l40s-01", "us-west", "l40s-48gb", 4, "0.89"),
    ("sjc-a6000-01", "us-west", "rtx-a6000-48gb", 4, "0.69"),
    ("ber-4090-01", "eu-central", "rtx4090-24gb", 4, "0.39"),
    ("waw-3090-01", "eu-central", "rtx3090-24gb", 2, "0.22"),
    ("sgp-a10-01", "ap-southeast", "a10-24gb", 4, "0.45"),
    ("sgp-t4-01", "ap-southeast", "t4-16gb", 4, "0.19"),
]
# Hosts that share a fabric, so a multi-node rental can run on them: the H100 hosts are one
# 400 Gb/s InfiniBand cluster of the platform provider (their agents create it at their join).
DEMO_CLUSTERS = {
    "fra-h100-01": ("fra-h100-ib", "infiniband", 400),
    "fra-h100-02": ("fra-h100-ib", "infiniband", 400),
}
FLEET_FILE = "fleet.json"
FLEET_DIR = "fleet"
# The agent's files in its state directory (nodeagent.agent's TOKEN_FILE and HOST_KEY_FILE).
_AGENT_TOKEN_FILE = "node_token.json"
_AGENT_HOST_KEY_FILE = "host_key"


@transaction.atomic
def load_demo(*, var_dir: Path | None = None) -> dict[str, int]:
    """Idempotent: creates the ops user, a demo customer and the platform provider (its hosts
    join through their agents: `demo_fleet_prepare`)."""
    var_dir = var_dir or Path(settings.BASE_DIR) / ".var" / "dev"
    var_dir.mkdir(parents=True, exist_ok=True)
    password_file = var_dir / "ops_password"
    ops = User.objects.filter(username="ops").first()
    if ops is None:
        password = secrets.token_urlsafe(12)
        ops = user_create(
            username="ops",
            email="ops@example.invalid",
            password=password,
            is_staff=True,
            is_superuser=True,
        )
        password_file.write_text(password + "\n")
        password_file.chmod(0o600)
    demo = User.objects.filter(username="demo").first()
    if demo is None:
        password = secrets.token_urlsafe(12)
        demo = user_create(username="demo", email="demo@example.invalid", password=password)
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
    Provider.objects.get_or_create(is_platform=True, defaults={"name": "Platform", "owner": ops})
    return {"users": User.objects.count(), "nodes": Node.objects.count()}


def demo_fleet_prepare(*, var_dir: Path | None = None, server_url: str) -> Path:
    """Write `fleet.json` under `var_dir`: each demo host's agent settings (nodeagent.fleet reads
    it), and return its path. Runs at every start of the fleet, so a stored node token the
    server refuses, or a join token spent or expired without a node, is replaced by a fresh
    join token instead of failing every restart."""
    var_dir = var_dir or Path(settings.BASE_DIR) / ".var" / "dev"
    path = var_dir / FLEET_FILE
    try:
        before = {n["hostname"]: n for n in json.loads(path.read_text())["nodes"]}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        before = {}
    platform = Provider.objects.get(is_platform=True)
    nodes = []
    for hostname, region, card, count, price in DEMO_NODES:
        node_dir = var_dir / FLEET_DIR / hostname
        state = node_dir / "state"
        join_token = before.get(hostname, {}).get("join_token", "")
        if _node_token_valid(state):
            pass
        elif _join_token_usable(join_token, state):
            (state / _AGENT_TOKEN_FILE).unlink(missing_ok=True)
        else:
            (state / _AGENT_TOKEN_FILE).unlink(missing_ok=True)
            _adopt_seeded_node(platform, hostname)
            price_d = Decimal(price)
            _, join_token = join_token_create(
                provider=platform,
                created_by=platform.owner,
                region=region,
                price_per_gpu_hour=price_d,
                min_bid_per_gpu_hour=(price_d * Decimal("0.4")).quantize(Decimal("0.0001")),
            )
        host = {
            "hostname": hostname,
            "simulate_gpus": f"{card}:{count}",
            "join_token": join_token,
            "dir": str(node_dir.resolve()),
        }
        if hostname in DEMO_CLUSTERS:
            cluster, interconnect, gbps = DEMO_CLUSTERS[hostname]
            host.update(cluster=cluster, interconnect=interconnect, interconnect_gbps=gbps)
        nodes.append(host)
    text = json.dumps({"server": server_url, "nodes": nodes}, indent=1) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)
    return path


def _node_token_valid(state: Path) -> bool:
    try:
        stored = json.loads((state / _AGENT_TOKEN_FILE).read_text())
        raw, node_id = str(stored["node_token"]), int(stored["node_id"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False
    return NodeCredential.objects.filter(
        node_id=node_id, key_hash=token_hash(raw), revoked_at__isnull=True
    ).exists()


def _join_token_usable(raw: str, state: Path) -> bool:
    """Unspent and unexpired; or spent by this very host, which may repeat its join."""
    token = JoinToken.objects.filter(key_hash=token_hash(raw)).first() if raw else None
    if token is None or token.expires_at <= timezone.now():
        return False
    if token.used_at is None:
        return True
    try:
        key = (state / _AGENT_HOST_KEY_FILE).read_text().strip()
    except FileNotFoundError:
        return False
    mine = bool(token.host_key_hash) and secrets.compare_digest(
        token.host_key_hash, token_hash(key)
    )
    # As the join service decides: only while the node token that join gave is still valid.
    return (
        mine
        and NodeCredential.objects.filter(node_id=token.node_id, revoked_at__isnull=True).exists()
    )


def _adopt_seeded_node(platform: Provider, hostname: str) -> None:
    """A demo node listed by an earlier seed (before demo hosts had agents) takes the GPU UUIDs
    its simulated agent reports, so that agent's join finds it (a rejoin) instead of being
    refused for a name already listed."""
    node = Node.objects.filter(provider=platform, hostname=hostname).first()
    if node is None:
        return
    for gpu in Gpu.objects.filter(node=node).order_by("index"):
        wanted = simulated_gpu_uuid(hostname, gpu.index)
        if gpu.uuid != wanted:
            Gpu.objects.filter(pk=gpu.pk).update(uuid=wanted)
