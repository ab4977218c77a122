"""The physics of the step-time model: what each kind of parallelism costs, on which link."""

import pytest

from advisor.engine.comm import LINK_EFFICIENCY, NETWORK_EFFICIENCY, Links, ring_seconds
from advisor.engine.compute import Card, Topology, step_time
from advisor.engine.layouts import Run, estimate
from advisor.engine.memory import Checkpointing, Layout, Precision
from advisor.engine.presets import PRESETS, ModelShape

A100_80 = Card(
    slug="a100-sxm4-80gb", memory_gb=80, tensor_tflops=312, fp32_tflops=19.5, nvlink_gbs=600
)
GPT2_124M = ModelShape(
    name="gpt2-124m",
    params=124e6,
    layers=12,
    hidden=768,
    heads=12,
    seq_len=1024,
    vocab=50257,
    global_batch=512,
    micro_batch=8,
)
LLAMA2_70B = ModelShape(
    name="llama2-70b",
    params=68.98e9,
    layers=80,
    hidden=8192,
    heads=64,
    seq_len=4096,
    vocab=32000,
    global_batch=1024,
    micro_batch=1,
)


def step(shape, layout, topology, **kwargs):
    return step_time(
        shape=shape,
        layout=layout,
        card=A100_80,
        topology=topology,
        precision=Precision.BF16,
        **kwargs,
    )


def seconds_per_flop(shape, layout):
    """GPU-seconds per model FLOP on one NVLink node."""
    found = step(shape, layout, Topology(gpus_per_node=layout.gpus, nvlink=True))
    return found.total * layout.gpus / found.model_flops


def test_tensor_parallelism_costs_a_small_model_far_more_per_flop_than_a_large_one():
    # Given tp 4 against one GPU, for GPT-2 124M (192 columns per GPU, small activations per
    # FLOP) and for Llama 2 70B (2,048 columns per GPU)
    small = seconds_per_flop(GPT2_124M, Layout(tp=4, micro_batch=8)) / seconds_per_flop(
        GPT2_124M, Layout(micro_batch=8)
    )
    large = seconds_per_flop(LLAMA2_70B, Layout(tp=4)) / seconds_per_flop(LLAMA2_70B, Layout())
    # Then tp 4 costs the small model two thirds more per FLOP, the large one a few per cent:
    # its overhead is more than five times the large model's.
    assert small > 1.5
    assert large < 1.1
    assert small - 1 > 5 * (large - 1)


def test_a_pipeline_over_a_10_gbit_link_is_slower_than_no_pipeline_for_gpt2_small():
    # Given two nodes of 8 NVLink A100s joined by 10 Gb/s Ethernet
    slow = Topology(gpus_per_node=8, nodes=2, nvlink=True, network_gbits=10)
    # When GPT-2 124M runs as 2 pipeline stages (one per node) or as 16 data-parallel replicas
    piped = step(GPT2_124M, Layout(dp=8, pp=2, micro_batch=8), slow)
    flat = step(GPT2_124M, Layout(dp=16, micro_batch=8), slow)
    # Then the activations crossing the node boundary every micro-batch cost more than the one
    # gradient all-reduce, and far more than the step's compute.
    assert piped.pp_comm > 5 * piped.compute
    assert piped.total > flat.total


def test_the_pipeline_traffic_is_cheap_inside_an_nvlink_node():
    piped = step(
        GPT2_124M, Layout(dp=4, pp=2, micro_batch=8), Topology(gpus_per_node=8, nvlink=True)
    )
    assert piped.pp_comm < 0.1 * piped.compute


@pytest.mark.parametrize("global_batch", [4, 16, 64])
def test_the_bubble_shrinks_with_more_micro_batches(global_batch):
    shape = ModelShape(
        name="1b",
        params=1e9,
        layers=24,
        hidden=2048,
        heads=16,
        seq_len=2048,
        vocab=32000,
        global_batch=global_batch,
    )
    layout = Layout(pp=4, micro_batch=1, checkpointing=Checkpointing.FULL)
    found = step(shape, layout, Topology(gpus_per_node=4, nvlink=True))
    # m = global_batch micro-batches, p = 4: (p - 1) / (m + p - 1) of compute and bubble.
    assert found.micro_batches == global_batch
    assert found.bubble / (found.compute + found.bubble) == pytest.approx(3 / (global_batch + 3))


def test_interleaved_stages_divide_the_bubble():
    layout = Layout(pp=8, micro_batch=1)
    topology = Topology(gpus_per_node=8, nvlink=True)
    plain = step(LLAMA2_70B, layout, topology)
    interleaved = step(LLAMA2_70B, layout, topology, virtual_stages=5)
    assert interleaved.bubble == pytest.approx(plain.bubble / 5)
    assert interleaved.pp_comm > plain.pp_comm


def test_a_ring_all_reduce_across_nodes_runs_at_the_fabric_speed():
    # 1 GB per rank over 16 ranks on 2 nodes of 8 joined by 100 Gb/s: each ring edge carries
    # 2 x 15/16 GB; the one crossing the nodes sets the pace.
    links = Links(gpus_per_node=8, nodes=2, intra_gbs=300.0, node_gbs=100 / 8)
    seconds = ring_seconds(links, nbytes=1e9, group=16, stride=1, factor=2.0)
    assert seconds == pytest.approx(2 * 15 / 16 * 1e9 / (12.5e9 * NETWORK_EFFICIENCY))
    # Inside one node, NVLink.
    one_node = Links(gpus_per_node=8, nodes=1, intra_gbs=300.0, node_gbs=100 / 8)
    inside = ring_seconds(one_node, nbytes=1e9, group=8, stride=1, factor=2.0)
    assert inside == pytest.approx(2 * 7 / 8 * 1e9 / (300e9 * LINK_EFFICIENCY))


def test_data_parallel_groups_one_rank_per_node_share_the_node_fabric():
    # tp 8 leaves one rank of each data-parallel group on a node: the 8 groups of a node send
    # their gradients through its fabric at once.
    links = Links(gpus_per_node=8, nodes=4, intra_gbs=300.0, node_gbs=200.0)
    shared = ring_seconds(links, nbytes=1e9, group=4, stride=8, factor=2.0)
    assert shared == pytest.approx(8 * 2 * 3 / 4 * 1e9 / (200e9 * NETWORK_EFFICIENCY))


def test_sharding_traffic_grows_from_ddp_to_zero2_to_zero3_and_with_a_slower_fabric():
    shape = LLAMA2_70B
    fast = Topology(gpus_per_node=8, nodes=16, nvlink=True, network_gbits=1600)
    slow = Topology(gpus_per_node=8, nodes=16, nvlink=True, network_gbits=100)

    def dp_comm(zero, topology):
        layout = Layout(dp=16, tp=8, zero_stage=zero, checkpointing=Checkpointing.FULL)
        return step(shape, layout, topology).dp_comm

    assert dp_comm(0, fast) < dp_comm(2, fast) < dp_comm(3, fast)
    assert dp_comm(0, slow) > dp_comm(0, fast)
    assert dp_comm(3, slow) > 10 * dp_comm(3, fast)


def test_small_matrices_reach_less_of_the_peak():
    one = Topology(gpus_per_node=8, nvlink=True)
    narrow = step(GPT2_124M, Layout(tp=8, micro_batch=8), one)
    wide = step(LLAMA2_70B, Layout(tp=8), one)
    assert narrow.matmul_share == pytest.approx(96 / (96 + 96))
    assert wide.matmul_share == pytest.approx(1024 / (1024 + 96))


H100 = Card(slug="h100-sxm5-80gb", memory_gb=80, tensor_tflops=989, fp32_tflops=67, nvlink_gbs=900)
TWO_NODES_10G = Topology(gpus_per_node=8, nodes=2, nvlink=True, network_gbits=10)
ONE_NODE = Topology(gpus_per_node=8, nvlink=True)


def test_sixteen_h100s_over_10_gbit_train_gpt2_small_slower_than_eight_in_one_node():
    # The planner's best layout on each: a second node behind 10 Gb/s costs more in traffic
    # than its GPUs bring.
    run = Run(shape=PRESETS["gpt2-124m"], tokens=10e9)
    split = estimate(run, H100, TWO_NODES_10G)
    single = estimate(run, H100, ONE_NODE)
    assert split.fits and single.fits
    assert split.layout.pp == 1
    assert split.hours > single.hours


def test_llama2_7b_over_two_10_gbit_nodes_misses_a_7_day_deadline_for_100b_tokens():
    found = estimate(Run(shape=PRESETS["llama2-7b"], tokens=100e9), H100, TWO_NODES_10G)
    assert found.fits
    assert found.hours > 7 * 24
