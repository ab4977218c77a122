"""The memory and time models against published figures (no database, no offers)."""

import pytest

from advisor.engine.compute import Card, Topology
from advisor.engine.layouts import Run, candidates, default_topology, estimate
from advisor.engine.memory import (
    Checkpointing,
    Layout,
    Optimizer,
    Precision,
    fits,
    model_states,
    per_gpu,
)
from advisor.engine.presets import PRESETS, decoder_shape
from harness.memory import decoder_activation_bytes

A100_80 = Card(
    slug="a100-sxm4-80gb", memory_gb=80, tensor_tflops=312, fp32_tflops=19.5, nvlink_gbs=600
)
V100_32 = Card(
    slug="v100-sxm2-32gb",
    memory_gb=32,
    tensor_tflops=125,
    fp32_tflops=15.7,
    bf16=False,
    nvlink_gbs=300,
)


# Rajbhandari et al. 2020 (ZeRO), Figure 1: 7.5 B parameters, 64-way data parallelism, mixed
# precision Adam (K = 12): 120 GB baseline, 31.4 GB with P_os, 16.6 GB with P_os+g and 1.9 GB
# with P_os+g+p of model states per GPU.
@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states_per_gpu(stage, gb):
    states = model_states(
        params=7.5e9,
        precision=Precision.FP16,
        optimizer=Optimizer.ADAMW,
        layout=Layout(dp=64, zero_stage=stage),
    )
    assert sum(states) / 1e9 == pytest.approx(gb, abs=0.1)


# Rajbhandari et al. 2020, Section 3.2: GPT-2 1.5 B at sequence 1024 and batch 32 needs about
# 60 GB of activations, about 8 GB with activation checkpointing; the model does not train on a
# 32 GB V100 without checkpointing (whatever the layout on 8 NVLink V100s), and does with it.
# The V100 has no bf16, and the harness runs fp16 (loss scaling) with plain data parallelism
# only: no ZeRO to shard the 25 GB of model states, so it fits at micro-batch 4, not 32.
def test_gpt2_xl_needs_checkpointing_on_a_32gb_v100():
    shape = PRESETS["gpt2-1.5b"]
    shape = decoder_shape(
        params=shape.params,
        layers=48,
        hidden=1600,
        heads=25,
        seq_len=1024,
        vocab=50257,
        global_batch=256,
        micro_batch=4,
    )
    topology = default_topology(V100_32, 8)
    without = estimate(
        Run(shape=shape, tokens=1e9, checkpointing=Checkpointing.NONE), V100_32, topology
    )
    with_it = estimate(
        Run(shape=shape, tokens=1e9, checkpointing=Checkpointing.FULL), V100_32, topology
    )
    assert not without.fits and with_it.fits
    assert with_it.layout.micro_batch == 4
    assert (with_it.layout.zero_stage, with_it.layout.tp, with_it.layout.pp) == (0, 1, 1)


# Llama 2 7B at its 4096-token context, data parallel with ZeRO-3 (no tensor parallelism), with
# fused attention (the harness's): 34 sbh per layer, 18 GB of activations per GPU at micro-batch
# 1, which fits an 80 GB card without recomputation; at micro-batch 4 (73 GB) it needs it.
@pytest.mark.parametrize("dp", [8, 64, 2048])
def test_llama2_7b_needs_checkpointing_on_80gb_cards_beyond_one_sequence(dp):
    def memory(checkpointing, micro_batch):
        layout = Layout(dp=dp, zero_stage=3, micro_batch=micro_batch, checkpointing=checkpointing)
        return per_gpu(
            shape=PRESETS["llama2-7b"],
            precision=Precision.BF16,
            optimizer=Optimizer.ADAMW,
            layout=layout,
        )

    assert fits(memory(Checkpointing.NONE, 1), 80)
    assert not fits(memory(Checkpointing.NONE, 4), 80)
    assert not fits(memory(Checkpointing.SELECTIVE, 4), 80)
    assert fits(memory(Checkpointing.FULL, 4), 80)


def test_activations_follow_korthikanti_per_layer_terms():
    # One layer, s=2048, b=1, h=4096, a=32, no vocabulary: sbh(34 + 5as/h) bytes unfused, then
    # 34 sbh (selective), then 2 sbh kept plus one layer recomputed (full).
    sbh = 2048 * 4096

    def paper(ckpt, tp=1):
        return decoder_activation_bytes(
            seq_len=2048, micro_batch=1, hidden=4096, heads=32, layers=1, vocab=0, tp=tp,
            recompute=str(ckpt), fp32=False, fused_attention=False,
        )  # fmt: skip

    assert paper(Checkpointing.NONE) == sbh * (34 + 5 * 32 * 2048 / 4096)
    assert paper(Checkpointing.SELECTIVE) == sbh * 34
    assert paper(Checkpointing.FULL) == 2 * sbh + sbh * (34 + 5 * 32 * 2048 / 4096)
    assert paper(Checkpointing.SELECTIVE, tp=8) == sbh * 34 / 8

    # What the advisor plans with: the harness's fused attention keeps no scores.
    shape = decoder_shape(params=1e9, layers=1, hidden=4096, heads=32, seq_len=2048, vocab=0)

    def planned(ckpt):
        layout = Layout(checkpointing=ckpt)
        return per_gpu(
            shape=shape, precision=Precision.BF16, optimizer=Optimizer.ADAMW, layout=layout
        ).activations

    assert planned(Checkpointing.NONE) == planned(Checkpointing.SELECTIVE) == sbh * 34
    assert planned(Checkpointing.FULL) == 2 * sbh + sbh * 34


def test_optimizers_and_fp32_states_per_parameter():
    layout = Layout()
    mixed_sgd = model_states(
        params=1e9, precision=Precision.BF16, optimizer=Optimizer.SGD, layout=layout
    )
    fp32_adam = model_states(
        params=1e9, precision=Precision.FP32, optimizer=Optimizer.ADAMW, layout=layout
    )
    adafactor = model_states(
        params=1e9,
        precision=Precision.FP32,
        optimizer=Optimizer.ADAFACTOR,
        layout=layout,
        hidden=4096,
    )
    assert [x / 1e9 for x in mixed_sgd] == [2, 2, 8]
    assert [x / 1e9 for x in fp32_adam] == [4, 4, 8]
    assert adafactor[2] / 1e9 == pytest.approx(8 / 4096)


def test_full_recomputation_costs_a_third_more_compute_not_a_lower_mfu():
    shape = decoder_shape(
        params=1e9, layers=24, hidden=2048, heads=16, seq_len=2048, global_batch=64
    )
    topology = default_topology(A100_80, 1)
    plain = estimate(
        Run(shape=shape, tokens=1e9, checkpointing=Checkpointing.NONE),
        A100_80,
        topology,
        fixed=Layout(micro_batch=1),
    )
    full = estimate(
        Run(shape=shape, tokens=1e9, checkpointing=Checkpointing.FULL),
        A100_80,
        topology,
        fixed=Layout(micro_batch=1, checkpointing=Checkpointing.FULL),
    )
    assert full.step.compute == pytest.approx(plain.step.compute * 4 / 3)
    # One GPU, no communication: MFU is the prior at this matrix size (2048 wide: 2048 / (2048 +
    # 96) of it) without recomputation, 3/4 of that with.
    assert plain.mfu == pytest.approx(A100_80.prior * 2048 / (2048 + 96))
    assert full.mfu == pytest.approx(plain.mfu * 3 / 4)


def test_pipeline_bubble():
    shape = decoder_shape(
        params=1e9, layers=24, hidden=2048, heads=16, seq_len=2048, global_batch=8
    )
    layout = Layout(dp=1, pp=4, micro_batch=1, checkpointing=Checkpointing.FULL)
    found = estimate(
        Run(shape=shape, tokens=1e9), A100_80, default_topology(A100_80, 4), fixed=layout
    )
    # m = 8 micro-batches, p = 4: the bubble is (p - 1) / (m + p - 1) = 3/11 of compute + bubble.
    step = found.step
    assert step.bubble / (step.compute + step.bubble) == pytest.approx(3 / 11)


def test_tensor_parallelism_stays_inside_nvlink():
    pcie = Card(slug="l40s-48gb", memory_gb=48, tensor_tflops=362, fp32_tflops=91.6)
    run = Run(shape=PRESETS["llama2-13b"], tokens=1e9)
    assert {layout.tp for layout in candidates(run, pcie, default_topology(pcie, 8))} == {1}
    four_per_node = Topology(gpus_per_node=4, nodes=16, nvlink=True)
    assert {layout.tp for layout in candidates(run, A100_80, four_per_node)} == {1, 2, 4}
