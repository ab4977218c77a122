"""Seconds of collective and point-to-point traffic over a node's links.

Ranks are placed as Megatron-LM places them (Narayanan et al. 2021, Section 3; torchtitan's
device mesh does the same): tensor-parallel ranks innermost, then data-parallel, then pipeline
stages outermost, so a tensor-parallel group stays inside a node, a data-parallel group leaves it
only when tp x dp exceeds the node, and a pipeline spreads over every node.

A ring collective over n ranks moves factor x (n - 1) / n of the buffer through every edge of the
ring: factor 2 for an all-reduce, 1 for a reduce-scatter or an all-gather (Patarasuk and Yuan 2009;
NCCL's "bus bandwidth", nccl-tests PERFORMANCE.md). Its speed is its slowest edge's: NVLink or
PCIe inside a node, the node's fabric between nodes, which carries the ring's edge of every group
with members on that node at once (each GPU of the node is in one such group).

Achieved bandwidth is a share of the nominal link: nccl-tests reach about 230 of the 300 GB/s
one-way NVLink of a DGX A100 and about 90 % of InfiniBand line rate, hence the two constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LINK_EFFICIENCY = 0.8
NETWORK_EFFICIENCY = 0.9
# The share of data-parallel traffic that bucketed collectives can hide under the backward pass:
# the last bucket's collective starts when the backward has ended (Li et al. 2020, "PyTorch
# Distributed: Experiences on Accelerating Data Parallel Training", Section 3.2.3; ZeRO-3's first
# gather before the forward likewise).
DP_OVERLAP = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """Bandwidths one direction, GB/s: between GPUs of a node, and a node's fabric."""

    gpus_per_node: int
    nodes: int
    intra_gbs: float
    node_gbs: float


def ring_seconds(links: Links, *, nbytes: float, group: int, stride: int, factor: float) -> float:
    """A ring collective of nbytes per rank over `group` ranks placed `stride` ranks apart."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    per_node = links.gpus_per_node
    nodes_spanned = min(links.nodes, max(1, math.ceil(group * stride / per_node)))
    edge = factor * (group - 1) / group * nbytes
    members_per_node = max(1, group // nodes_spanned)
    seconds = 0.0
    if members_per_node > 1:
        seconds = edge / (links.intra_gbs * LINK_EFFICIENCY * 1e9)
    if nodes_spanned > 1:
        groups_on_node = max(1, per_node // members_per_node)
        inter = edge * groups_on_node / (links.node_gbs * NETWORK_EFFICIENCY * 1e9)
        seconds = max(seconds, inter)
    return seconds


def pipeline_seconds(
    links: Links, *, nbytes: float, stage_gpus: int, micro_batches: int, stages: int
) -> float:
    """Point-to-point traffic on the critical path of a 1F1B pipeline: every one of the
    m + p - 1 micro-batch slots sends activations forward and receives gradients back, nbytes
    per GPU each way, over the slowest link between two stages (the fabric once the pipeline
    spans nodes, shared by the GPUs of a stage on that node)."""
    if stages <= 1 or nbytes <= 0:
        return 0.0
    if links.nodes > 1:
        senders = max(1, min(links.gpus_per_node, stage_gpus))
        gbs = links.node_gbs * NETWORK_EFFICIENCY / senders
    else:
        gbs = links.intra_gbs * LINK_EFFICIENCY
    return 2 * (micro_batches + stages - 1) * nbytes / (gbs * 1e9)


def exposed(seconds: float, *, window: float) -> float:
    """What is left of `seconds` of traffic when up to DP_OVERLAP of it runs under `window`
    seconds of compute."""
    return seconds - min(DP_OVERLAP * seconds, max(0.0, window))
