"""Cluster writes: a provider declares which of its nodes share a fabric, and what it is.

Every lookup is scoped to the owner: another provider's cluster or node is as absent as one that
never existed (NotFound). A node joins only a cluster of its own provider; the database holds
the same rule (a composite foreign key, migration 0021), so nothing else can write it either.
Placement reads the result: a multi-node rental is placed inside one cluster only.
"""

from __future__ import annotations

import re
from decimal import Decimal

from django.db import IntegrityError, transaction

from core.errors import NotFound, ValidationFailed
from marketplace.models import CLUSTER_GBPS_MAX, Cluster, Interconnect, Node, Provider, User
from marketplace.services.inventory import provider_node_price

CLUSTER_NAME_MAX = Cluster._meta.get_field("name").max_length
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")


def cluster_name_valid(name: object) -> str:
    """A cluster's name: lower-case letters, digits and inner hyphens (`h100-ib`)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > CLUSTER_NAME_MAX:
        raise ValidationFailed(
            f"lower-case letters, digits and inner hyphens, at most {CLUSTER_NAME_MAX}",
            field="name",
        )
    return name


def interconnect_valid(kind: object, *, field: str = "interconnect") -> str:
    if kind not in Interconnect.values:
        raise ValidationFailed(f"one of {', '.join(Interconnect.values)}", field=field)
    return str(kind)


def bandwidth_valid(gbps: object, *, field: str = "bandwidth_gbps") -> int:
    if isinstance(gbps, bool) or not isinstance(gbps, int) or not 0 < gbps <= CLUSTER_GBPS_MAX:
        raise ValidationFailed(
            f"a whole number of Gb/s per node, 1 to {CLUSTER_GBPS_MAX}", field=field
        )
    return gbps


def _owned_cluster(*, owner: User, cluster_id: int) -> Cluster:
    cluster = (
        Cluster.objects.select_for_update(of=("self",))
        .filter(pk=cluster_id, provider__owner=owner)
        .first()
    )
    if cluster is None:
        raise NotFound("no such cluster")
    return cluster


def _saved(cluster: Cluster, **kwargs) -> Cluster:
    """Save, answering a name taken concurrently as the unique constraint decided it."""
    try:
        with transaction.atomic():
            cluster.save(**kwargs)
    except IntegrityError:
        raise ValidationFailed(
            "this provider has a cluster of this name already", field="name"
        ) from None
    return cluster


def cluster_create(
    *, owner: User, provider_id: int, name: str, interconnect: str, bandwidth_gbps: int
) -> Cluster:
    """Declare a cluster of one of the owner's providers (no nodes yet)."""
    name = cluster_name_valid(name)
    interconnect = interconnect_valid(interconnect)
    bandwidth_gbps = bandwidth_valid(bandwidth_gbps)
    with transaction.atomic():
        provider = Provider.objects.filter(pk=provider_id, owner=owner).first()
        if provider is None:
            raise NotFound("no such provider")
        if Cluster.objects.filter(provider=provider, name=name).exists():
            raise ValidationFailed("this provider has a cluster of this name already", field="name")
        return _saved(
            Cluster(
                provider=provider,
                name=name,
                interconnect=interconnect,
                bandwidth_gbps=bandwidth_gbps,
            )
        )


def cluster_update(
    *,
    owner: User,
    cluster_id: int,
    name: str | None = None,
    interconnect: str | None = None,
    bandwidth_gbps: int | None = None,
) -> Cluster:
    """Rename one of the owner's clusters or say what its fabric is now; rentals placed keep
    running where they are."""
    fields = {}
    if name is not None:
        fields["name"] = cluster_name_valid(name)
    if interconnect is not None:
        fields["interconnect"] = interconnect_valid(interconnect)
    if bandwidth_gbps is not None:
        fields["bandwidth_gbps"] = bandwidth_valid(bandwidth_gbps)
    with transaction.atomic():
        cluster = _owned_cluster(owner=owner, cluster_id=cluster_id)
        if not fields:
            return cluster
        if (
            "name" in fields
            and Cluster.objects.filter(provider_id=cluster.provider_id, name=fields["name"])
            .exclude(pk=cluster.pk)
            .exists()
        ):
            raise ValidationFailed("this provider has a cluster of this name already", field="name")
        for key, value in fields.items():
            setattr(cluster, key, value)
        return _saved(cluster, update_fields=list(fields))


def cluster_delete(*, owner: User, cluster_id: int) -> None:
    """Remove one of the owner's clusters: its nodes stay listed, on their own (they host
    single-node rentals only from now on; rentals placed keep running)."""
    with transaction.atomic():
        cluster = _owned_cluster(owner=owner, cluster_id=cluster_id)
        Node.objects.filter(cluster=cluster).update(cluster=None)
        cluster.delete()


def node_cluster_set(*, owner: User, node_id: int, cluster_id: int | None) -> Node:
    """Put one of the owner's nodes in one of its provider's clusters, or take it out (None)."""
    with transaction.atomic():
        node = (
            Node.objects.select_for_update(of=("self",))
            .filter(pk=node_id, provider__owner=owner)
            .first()
        )
        if node is None:
            raise NotFound("no such node")
        if (
            cluster_id is not None
            and not Cluster.objects.filter(pk=cluster_id, provider_id=node.provider_id).exists()
        ):
            # Another provider's cluster is as absent as one that never existed.
            raise ValidationFailed("no such cluster of this node's provider", field="cluster")
        if node.cluster_id != cluster_id:
            node.cluster_id = cluster_id
            node.save(update_fields=["cluster"])
        return node


def cluster_for_join(
    *,
    provider: Provider,
    name: str,
    interconnect: str | None = None,
    bandwidth_gbps: int | None = None,
) -> Cluster:
    """The provider's cluster an agent joins its node into, by name; created when the agent
    also says what the fabric is (both `interconnect` and `bandwidth_gbps`), else it must
    exist. An existing cluster keeps what it was declared with."""
    name = cluster_name_valid(name)
    if (interconnect is None) != (bandwidth_gbps is None):
        raise ValidationFailed(
            "give interconnect and interconnect_gbps together, or neither",
            field="interconnect" if interconnect is None else "interconnect_gbps",
        )
    if interconnect is not None:
        interconnect = interconnect_valid(interconnect)
        bandwidth_gbps = bandwidth_valid(bandwidth_gbps, field="interconnect_gbps")
    with transaction.atomic():
        cluster = Cluster.objects.filter(provider=provider, name=name).first()
        if cluster is not None:
            return cluster
        if interconnect is None:
            raise ValidationFailed(
                f"the provider has no cluster {name!r}: create it first, or give interconnect "
                "and interconnect_gbps to create it",
                field="cluster",
            )
        try:
            with transaction.atomic():
                return Cluster.objects.create(
                    provider=provider,
                    name=name,
                    interconnect=interconnect,
                    bandwidth_gbps=bandwidth_gbps,
                )
        except IntegrityError:
            # Created concurrently by another node of the same cluster joining: use it.
            return Cluster.objects.get(provider=provider, name=name)


_KEEP = object()


def provider_node_update(
    *,
    owner: User,
    node_id: int,
    price_per_gpu_hour: Decimal | None = None,
    min_bid_per_gpu_hour: Decimal | None = None,
    cluster: int | object | None = _KEEP,
) -> Node:
    """Change one of the owner's nodes (prices for new bookings, cluster) in one transaction:
    a refusal of any part writes nothing."""
    with transaction.atomic():
        if price_per_gpu_hour is not None or min_bid_per_gpu_hour is not None:
            provider_node_price(
                owner=owner,
                node_id=node_id,
                price_per_gpu_hour=price_per_gpu_hour,
                min_bid_per_gpu_hour=min_bid_per_gpu_hour,
            )
        node = None
        if cluster is not _KEEP:
            node = node_cluster_set(owner=owner, node_id=node_id, cluster_id=cluster)
        if node is None:
            node = Node.objects.filter(pk=node_id, provider__owner=owner).first()
        if node is None:
            raise NotFound("no such node")
        return node
