"""Static feasibility: which GPUs and nodes a request may use at all, ignoring current load.

`never_fits` answers at create time whether a request could be placed even on an empty cluster,
so hopeless requests are refused with a reason instead of waiting forever. The planner uses the
same predicates, so "never fits" and "not placed on an empty cluster" cannot disagree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from agentprotocol.images import image_allowed
from scheduler.engine.types import Gpu, Node, Request


def gpu_matches(request: Request, gpu: Gpu) -> bool:
    """Whether one GPU satisfies the request's hardware constraints (all given ones must hold)."""
    return (
        (request.gpu_models is None or gpu.model in request.gpu_models)
        and (request.gpu_families is None or gpu.family in request.gpu_families)
        and gpu.memory_gb >= request.min_memory_gb
        and gpu.tensor_tflops >= request.min_tensor_tflops
    )


def location_ok(request: Request, node: Node) -> bool:
    """Whether the node is in the request's pool and region; region `eu` covers `eu-*`."""
    return node.pool == request.pool and (
        request.region is None
        or node.region == request.region
        or node.region.startswith(request.region + "-")
    )


def price_ok(request: Request, node: Node) -> bool:
    """On-demand pays the node's price, at most `max_price`; interruptible pays its bid, which must
    reach the node's minimum bid and stay within `max_price`."""
    if request.interruptible:
        return (
            request.bid is not None
            and request.bid >= node.min_bid
            and (request.max_price is None or request.bid <= request.max_price)
        )
    return request.max_price is None or node.price_per_gpu_hour <= request.max_price


def runtime_ok(request: Request, node: Node) -> bool:
    """Whether the node's agent can give the rental what it asks of the runtime: an sshd whose
    port it publishes, for a rental with SSH; the filtered internet, for a rental with it; and
    its image."""
    return (
        (node.ssh_capable or not request.ssh)
        and (node.internet_capable or not request.internet)
        and image_ok(request, node)
    )


def image_ok(request: Request, node: Node) -> bool:
    """Whether the node's agent accepts the request's image (its allow-list, as it reported
    it; a node that never reported one accepts any)."""
    return not request.image or image_allowed(node.image_allow, request.image)


def node_capacity(request: Request, node: Node) -> int:
    """How many matching GPUs one placement can take on this node when it is empty.

    With `same_group` that is the largest topology group of matching GPUs; a GPU without a group
    is a group of its own.
    """
    matching = [gpu for gpu in node.gpus if gpu_matches(request, gpu)]
    if not request.same_group:
        return len(matching)
    groups = Counter(gpu.group for gpu in matching if gpu.group)
    if groups:
        return max(groups.values())
    return 1 if matching else 0


def describe_hardware(request: Request) -> str:
    parts = []
    if request.gpu_models is not None:
        parts.append("model " + "/".join(sorted(request.gpu_models)))
    if request.gpu_families is not None:
        parts.append("family " + "/".join(sorted(request.gpu_families)))
    if request.min_memory_gb:
        parts.append(f">= {request.min_memory_gb} GB")
    if request.min_tensor_tflops:
        parts.append(f">= {request.min_tensor_tflops:g} TFLOPS")
    return f" ({', '.join(parts)})" if parts else ""


def describe_location(request: Request) -> str:
    if request.region is None:
        return f"pool {request.pool}"
    return f"region {request.region} (pool {request.pool})"


def never_fits(request: Request, nodes: Iterable[Node]) -> str | None:
    """Why the request could not be placed even if every node were idle, or None if it could."""
    k, m = request.gpus_per_node, request.node_count
    if k < 1 or m < 1:
        return "gpus_per_node and node_count must be at least 1"
    if request.duration <= 0:
        return "duration must be positive"
    if request.start_deadline is not None and request.start_deadline < request.start:
        return "start_deadline is before start"
    if request.interruptible:
        if request.bid is None or request.bid <= 0:
            return "an interruptible request needs a positive bid"
        if request.max_price is not None and request.bid > request.max_price:
            return f"bid ${request.bid:.2f} is above max price ${request.max_price:.2f}"
    located = [node for node in nodes if location_ok(request, node)]
    if not located:
        return f"no node in {describe_location(request)}"
    sized = [node for node in located if node_capacity(request, node) >= k]
    if not sized:
        hardware = describe_hardware(request)
        if request.same_group and any(
            sum(gpu_matches(request, gpu) for gpu in node.gpus) >= k for node in located
        ):
            return f"no node has {k} matching GPUs{hardware} in one topology group"
        return f"no node in {describe_location(request)} has {k} matching GPUs{hardware}"
    priced = [node for node in sized if price_ok(request, node)]
    if not priced:
        if request.interruptible:
            lowest = min(node.min_bid for node in sized)
            return (
                f"bid: ${request.bid:.2f} is below every matching node's minimum bid "
                f"(lowest ${lowest:.2f})"
            )
        cheapest = min(node.price_per_gpu_hour for node in sized)
        return f"price: cheapest matching node is ${cheapest:.2f} > max ${request.max_price:.2f}"
    if len(priced) < m:
        return f"only {len(priced)} matching nodes, the request needs {m}"
    # Last, so that a refusal naming the network, SSH or the image means that it alone stands
    # in the way.
    networked = [node for node in priced if node.internet_capable or not request.internet]
    if len(networked) < m:
        return (
            f"network: only {len(networked)} matching nodes can keep a rental's internet to "
            f"public addresses, the request needs {m}; network internal runs anywhere"
        )
    capable = [node for node in networked if node.ssh_capable or not request.ssh]
    if not capable:
        return "ssh: no matching node can run an sshd with a published port"
    if len(capable) < m:
        return f"ssh: only {len(capable)} matching nodes can run an sshd, the request needs {m}"
    accepting = [node for node in capable if image_ok(request, node)]
    if not accepting:
        return f"image: no matching node accepts the image {request.image!r}"
    if len(accepting) < m:
        return (
            f"image: only {len(accepting)} matching nodes accept the image {request.image!r}, "
            f"the request needs {m}"
        )
    capable = accepting
    if m > 1:
        return _no_cluster(request, capable)
    return None


def _no_cluster(request: Request, nodes: list[Node]) -> str | None:
    """Why no cluster can host the gang: its members all sit in one cluster."""
    m, gbps = request.node_count, request.min_interconnect_gbps
    clustered = [node for node in nodes if node.cluster is not None]
    sizes = Counter(node.cluster for node in clustered if node.interconnect_gbps >= gbps)
    largest = max(sizes.values(), default=0)
    if largest >= m:
        return None
    if clustered and not sizes:
        fastest = max(node.interconnect_gbps for node in clustered)
        return (
            f"min_interconnect_gbps: no matching cluster is that fast (the fastest has "
            f"{fastest} Gb/s, {gbps} asked)"
        )
    if not sizes:
        return (
            "node_count: no matching node is in a cluster; a multi-node rental runs inside "
            "one cluster (nodes a provider declared on one fabric)"
        )
    return (
        f"node_count: the largest cluster has {largest} matching nodes, the request needs {m} "
        "in one cluster"
    )
