"""Datasets and the sharded batch order: deterministic, complete, and equal across world sizes."""

from __future__ import annotations

import pytest
import torch

from harness.config import ConfigError, load_config_dict
from harness.datasets import (
    ByteTokenizer,
    ShardedBatches,
    TokenWindows,
    build_datasets,
    eval_batches,
    load_text_corpus,
)

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def batches(length: int, *, batch: int, world: int, rank: int, accum: int = 1, seed: int = 0):
    return ShardedBatches(
        length,
        batch_size=batch,
        world_size=world,
        rank=rank,
        grad_accum=accum,
        seed=seed,
        device=CPU,
    )


@pytest.mark.parametrize(("world", "accum"), [(2, 1), (3, 1), (2, 2)])
def test_ranks_together_see_exactly_the_single_process_batch(world, accum):
    # given one process with the global batch, and `world` ranks with a share of it each
    single = batches(1000, batch=8 * world * accum, world=1, rank=0)
    ranks = [batches(1000, batch=8, world=world, rank=r, accum=accum) for r in range(world)]
    for step in range(30):  # crosses several epoch boundaries
        # then each optimizer step covers the same samples, none twice
        shares = [r.indices(step, m) for r in ranks for m in range(accum)]
        together = torch.cat(shares)
        assert len(set(together.tolist())) == together.numel()
        assert sorted(together.tolist()) == sorted(single.indices(step, 0).tolist())


def test_each_epoch_visits_every_sample_once_and_reshuffles():
    sampler = batches(64, batch=8, world=2, rank=0)
    other = batches(64, batch=8, world=2, rank=1)
    assert sampler.steps_per_epoch == 4
    epoch0 = torch.cat([s.indices(step, 0) for step in range(4) for s in (sampler, other)]).tolist()
    epoch1 = torch.cat(
        [s.indices(step, 0) for step in range(4, 8) for s in (sampler, other)]
    ).tolist()
    assert sorted(epoch0) == list(range(64)) == sorted(epoch1)
    assert epoch0 != epoch1


def test_order_is_a_function_of_seed_and_step_only():
    first = [batches(100, batch=4, world=1, rank=0, seed=7).indices(s, 0) for s in range(10)]
    again = batches(100, batch=4, world=1, rank=0, seed=7)
    # asked out of order, the answers are the same
    for step in reversed(range(10)):
        assert torch.equal(again.indices(step, 0), first[step])
    other_seed = batches(100, batch=4, world=1, rank=0, seed=8)
    assert not torch.equal(other_seed.indices(0, 0), first[0])


def test_resume_with_the_same_geometry_continues_the_order():
    straight = batches(100, batch=4, world=1, rank=0)
    saved = straight.state_dict(step=13)
    resumed = batches(100, batch=4, world=1, rank=0)
    assert resumed.load_state_dict(saved, step=13)
    assert torch.equal(resumed.indices(13, 0), straight.indices(13, 0))


def test_resume_with_another_batch_size_stays_in_the_same_epoch():
    # given a checkpoint at step 10 of 25 steps per epoch with 4 samples a step (40 samples in)
    saved = batches(100, batch=4, world=1, rank=0).state_dict(step=10)
    # when resumed with 8 samples a step
    resumed = batches(100, batch=8, world=1, rank=0)
    assert not resumed.load_state_dict(saved, step=10)
    # then it continues from sample 40 of the same epoch's permutation
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(resumed.indices(10, 0), perm[40:48])


def test_a_global_batch_larger_than_the_data_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data\.batch_size"):
        batches(10, batch=8, world=2, rank=0)


def test_eval_shards_cover_the_eval_set_once():
    per_rank = [
        list(eval_batches(103, batch_size=10, world_size=3, rank=r, device=CPU)) for r in range(3)
    ]
    counted = [
        index
        for batches in per_rank
        for indices, weights in batches
        for index, weight in zip(indices.tolist(), weights.tolist(), strict=True)
        if weight == 1
    ]
    assert sorted(counted) == list(range(103))
    # every rank runs the same batches (a sharded model's forward is collective)
    assert {tuple(len(i) for i, _ in batches) for batches in per_rank} == {(10, 10, 10, 5)}


def test_digits_split_is_fixed_and_disjoint():
    config = load_config_dict({"data": {"name": "digits"}})
    train, evaluation, info = build_datasets(config.data, config.model, seed=0, device=CPU)
    again, _, _ = build_datasets(config.data, config.model, seed=99, device=CPU)
    assert (len(train), len(evaluation)) == (1437, 360)
    assert torch.equal(train.inputs, again.inputs)  # the split ignores the training seed
    assert train.inputs.shape[1:] == (1, 8, 8) and float(train.inputs.max()) <= 1.0
    assert info.num_classes == 10 and info.image_size == 8
    train_rows = {tuple(row.tolist()) for row in train.inputs.flatten(1)}
    # The 1797 digits images are all distinct, so a shared image would mean a shared sample.
    assert not any(tuple(row.tolist()) in train_rows for row in evaluation.inputs.flatten(1))


def test_synthetic_data_is_generated_from_the_seed():
    config = load_config_dict(
        {"model": {"name": "gpt"}, "data": {"name": "synthetic", "seq_len": 8, "num_samples": 16}}
    )
    a, _, info = build_datasets(config.data, config.model, seed=1, device=CPU)
    b, _, _ = build_datasets(config.data, config.model, seed=1, device=CPU)
    c, _, _ = build_datasets(config.data, config.model, seed=2, device=CPU)
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)
    assert info.task == "lm" and a.inputs.shape == (16, 8)
    # Targets are the inputs shifted by one: an arithmetic progression modulo the vocabulary.
    assert torch.equal(a.targets[:, :-1], a.inputs[:, 1:])


def test_text_windows_pair_each_token_with_the_next():
    windows = TokenWindows(torch.arange(10), seq_len=4)
    inputs, targets = windows.batch(torch.tensor([0, 5]))
    assert len(windows) == 6
    assert inputs.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]]
    assert targets.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]


def test_text_corpus_and_byte_tokenizer():
    text = load_text_corpus()
    assert text.startswith("Four score and seven years ago")
    assert "unalienable Rights" in text
    tokenizer = ByteTokenizer()
    sample = "Liberty — für alle"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    assert max(tokenizer.encode(text)) < tokenizer.vocab_size


def test_text_sequence_longer_than_the_eval_split_is_a_config_error():
    config = load_config_dict({"model": {"name": "gpt"}, "data": {"name": "text", "seq_len": 5000}})
    with pytest.raises(ConfigError, match=r"data\.seq_len"):
        build_datasets(config.data, config.model, seed=0, device=CPU)


def test_text_from_a_dataset_path_under_the_data_dir(tmp_path, monkeypatch):
    # given a mounted dataset directory holding two text files (and something else)
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "b.txt").write_text("bbbb" * 50)
    (corpus / "a.txt").write_text("aaaa" * 50)
    (corpus / "notes.md").write_text("not read")
    monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path / "data"))
    config = load_config_dict(
        {"model": {"name": "gpt"}, "data": {"name": "text", "seq_len": 8, "path": "corpus"}}
    )
    # when the datasets are built, then the tokens are its files' bytes in name order
    train, evaluation, _ = build_datasets(config.data, config.model, seed=0, device=CPU)
    expected = ("aaaa" * 50 + "\n\n" + "bbbb" * 50).encode()
    split = int(len(expected) * 0.9)
    assert bytes(train.tokens.tolist()) == expected[:split]
    assert bytes(evaluation.tokens.tolist()) == expected[split:]
    # and a path that is not there is a config error naming data.path
    missing = load_config_dict({"model": {"name": "gpt"}, "data": {"name": "text", "path": "nope"}})
    with pytest.raises(ConfigError, match=r"data\.path"):
        build_datasets(missing.data, missing.model, seed=0, device=CPU)


# --- pre-tokenized token files ---------------------------------------------------------------


def tokens_config(path: str, **data):
    return load_config_dict(
        {
            "model": {"name": "transformer", "preset": "tiny", "vocab_size": 4096},
            "data": {"name": "tokens", "path": path, "seq_len": 16, **data},
        }
    )


@pytest.fixture
def token_dir(tmp_path, monkeypatch):
    """Two uint16 token files under a dataset directory of GPUMARKET_DATA_DIR."""
    import numpy as np

    directory = tmp_path / "data" / "corpus"
    directory.mkdir(parents=True)
    (directory / "a.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (directory / "b.bin").write_bytes((np.arange(500, dtype=np.uint16) + 2000).tobytes())
    monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path / "data"))
    return directory


def test_token_files_are_read_in_contiguous_windows(token_dir):
    # given two files of 1000 and 500 tokens, seq_len 16: 62 and 31 windows, 10 % held out
    config = tokens_config("corpus")
    train, evaluation, info = build_datasets(config.data, config.model, seed=0, device=CPU)
    assert (len(train), len(evaluation)) == (56 + 28, 6 + 3)
    assert info.vocab_size == 4096 and info.seq_len == 16
    # when windows of both files are read
    inputs, targets = train.batch(torch.tensor([0, 1, 56, 83]))
    # then each is seq_len + 1 consecutive tokens of one file, targets shifted by one
    assert inputs[:, 0].tolist() == [0, 16, 2000, 2000 + 27 * 16]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[:, -1], inputs[:, 0] + 16)
    held_out, _ = evaluation.batch(torch.tensor([0, 8]))
    assert held_out[:, 0].tolist() == [56 * 16, 2000 + 30 * 16]


def test_a_single_uint32_token_file(tmp_path, monkeypatch):
    import numpy as np

    (tmp_path / "big.tok").write_bytes(np.arange(70000, 70400, dtype=np.uint32).tobytes())
    monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
    config = load_config_dict(
        {
            "model": {"name": "transformer", "preset": "tiny", "vocab_size": 80000},
            "data": {"name": "tokens", "path": "big.tok", "dtype": "uint32", "seq_len": 16},
        }
    )
    train, _, _ = build_datasets(config.data, config.model, seed=0, device=CPU)
    assert train.batch(torch.tensor([1]))[0][0, 0].item() == 70016


def test_token_ids_beyond_the_vocabulary_are_refused(token_dir):
    config = load_config_dict(
        {
            "model": {"name": "transformer", "preset": "tiny"},
            "data": {"name": "tokens", "path": "corpus", "seq_len": 16},
        }
    )
    train, _, _ = build_datasets(config.data, config.model, seed=0, device=CPU)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        train.batch(torch.tensor([56]))


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: (d / "x.bin").write_bytes(b"abc"), "is not a flat uint16 array"),
        (lambda d: (d / "x.txt").write_text("no tokens"), "holds no .bin token file"),
    ],
)
def test_unusable_token_paths_are_config_errors(tmp_path, monkeypatch, setup, expected):
    directory = tmp_path / "corpus"
    if expected != "does not exist":
        directory.mkdir()
        setup(directory)
    monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
    config = tokens_config("corpus")
    with pytest.raises(ConfigError, match=expected):
        build_datasets(config.data, config.model, seed=0, device=CPU)


def test_without_a_path_tokens_are_the_bundled_texts_bytes():
    config = load_config_dict(
        {"model": {"name": "transformer", "preset": "tiny"}, "data": {"name": "tokens"}}
    )
    train, _, _ = build_datasets(config.data, config.model, seed=0, device=CPU)
    inputs, _ = train.batch(torch.tensor([0]))
    assert ByteTokenizer().decode(inputs[0].tolist()) == load_text_corpus()[:128]


def test_the_transformer_trains_on_token_files(token_dir, run_trainer):
    events = run_trainer(
        {
            "model": {"name": "transformer", "preset": "tiny", "vocab_size": 4096},
            "data": {"name": "tokens", "path": "corpus", "seq_len": 16, "batch_size": 4},
            "train": {"steps": 2, "log_every": 1, "eval_every": 2},
        }
    )
    assert [e["event"] for e in events] == ["start", "step", "step", "eval", "summary"]
    assert events[-2]["samples"] == 9
