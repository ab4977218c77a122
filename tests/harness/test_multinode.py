"""One job across nodes: each node runs `python -m harness --nproc auto` with the variables the
node agent gives every member of a multi-node rental (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT, NPROC_PER_NODE), and together they train ONE job: the loss curve of the same job on
one node."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from harness.config import ConfigError
from harness.launcher import Gang
from tests.harness.helpers import HarnessProcess, harness_env, losses, of_kind
from tests.harness.test_layouts import BASE_CONFIG, GLOBAL_BATCH, STEPS

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(tmp: Path, layout: dict[str, Any]) -> Path:
    path = tmp / f"config-{abs(hash(json.dumps(layout, sort_keys=True)))}.json"
    path.write_text(json.dumps({**BASE_CONFIG, "layout": layout}))
    return path


def _one_node(tmp: Path, nproc: int, layout: dict[str, Any]) -> list[dict[str, Any]]:
    process = HarnessProcess(["--config", str(_config(tmp, layout)), "--nproc", str(nproc)], tmp)
    try:
        assert process.finish(timeout=240) == 0, process.stderr()
    finally:
        process.kill()
    return process.events


def _gang(tmp: Path, nodes: int, per_node: int, layout: dict[str, Any]) -> list[list[dict]]:
    """Every node's launcher, as the agent starts it on each member: `--nproc auto`."""
    config, port = _config(tmp, layout), _free_port()
    members = []
    for rank in range(nodes):
        env = harness_env(
            NNODES=str(nodes), NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), NPROC_PER_NODE=str(per_node),
            WORLD_SIZE=str(nodes * per_node), GPUMARKET_WORKSPACE=str(tmp / f"node{rank}"),
        )  # fmt: skip
        members.append(HarnessProcess(["--config", str(config), "--nproc", "auto"], tmp, env=env))
    try:
        codes = [member.finish(timeout=240) for member in members]
        assert codes == [0] * nodes, [member.stderr() for member in members]
    finally:
        for member in members:
            member.kill()
    return [member.events for member in members]


@pytest.mark.parametrize(
    "layout",
    [
        {"micro_batch": 2, "grad_accum": 1},  # data parallel over 4 ranks on 2 nodes
        {"pp": 2, "micro_batch": 4, "grad_accum": 1, "pp_microbatches": 2},  # a stage per node
    ],
    ids=["dp4", "pp2xdp2"],
)
def test_two_nodes_of_two_processes_train_one_job(tmp_path, layout):
    # given the same job on one node of 4 processes, and on 2 nodes of 2 processes each
    reference = _one_node(tmp_path, 4, layout)
    node0, node1 = _gang(tmp_path, 2, 2, layout)
    # then rank 0 (on node 0) reports ONE job of world size 4, the global batch unchanged
    start = node0[0]
    assert start["world_size"] == 4 == reference[0]["world_size"]
    assert start["global_batch_size"] == GLOBAL_BATCH
    assert start["layout"]["dp"] * start["layout"]["pp"] == 4
    # and its loss curve is the one-node curve (the same sums over the same ranks)
    assert [e["step"] for e in of_kind(node0, "step")] == list(range(1, STEPS + 1))
    assert losses(node0) == pytest.approx(losses(reference), rel=1e-5, abs=1e-6)
    # and node 1 trained as part of it: no job of its own reports a separate curve
    assert of_kind(node1, "step") == []


def test_a_member_with_a_broken_job_description_is_refused_naming_the_variable(tmp_path):
    # given the agent's variables with rank 1 of 2 but no master address
    env = harness_env(NNODES="2", NODE_RANK="1", MASTER_PORT="29500", NPROC_PER_NODE="1")
    process = HarnessProcess(
        ["--config", str(_config(tmp_path, {"micro_batch": 4})), "--nproc", "auto"],
        tmp_path,
        env=env,
    )
    # then it exits with the config-error status before starting any rank, naming the variable
    assert process.finish(timeout=120) == 2
    assert "MASTER_ADDR is required when NNODES > 1" in process.stderr()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "NODE_RANK=2"),
        ({"NNODES": "x"}, "NNODES='x'"),
        ({"NNODES": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_the_job_description_is_checked(env, message):
    with pytest.raises(ConfigError, match=message):
        Gang.from_env(env)


def test_one_node_needs_no_description():
    gang = Gang.from_env({})
    assert (gang.nnodes, gang.node_rank) == (1, 0)


def _gang_config(steps: int) -> dict[str, Any]:
    train = {**BASE_CONFIG["train"], "steps": steps}
    return {
        **BASE_CONFIG, "train": train,
        "checkpoint": {"enabled": True, "every_steps": 2, "keep": 3},
        "layout": {"pp": 2, "micro_batch": 4, "grad_accum": 1, "pp_microbatches": 2},
    }  # fmt: skip


def _run_gang(tmp: Path, config: dict[str, Any]) -> list[list[dict]]:
    path = tmp / "gang.json"
    path.write_text(json.dumps(config))
    port = _free_port()
    members = []
    for rank in range(2):
        env = harness_env(
            NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            NPROC_PER_NODE="2", GPUMARKET_WORKSPACE=str(tmp / f"node{rank}"),
        )  # fmt: skip
        members.append(HarnessProcess(["--config", str(path), "--nproc", "auto"], tmp, env=env))
    try:
        codes = [member.finish(timeout=240) for member in members]
        assert codes == [0, 0], [member.stderr() for member in members]
    finally:
        for member in members:
            member.kill()
    return [member.events for member in members]


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


def test_two_nodes_write_one_sharded_checkpoint_in_parts_and_resume_from_a_step_both_have(
    tmp_path,
):
    # given a job of 2 nodes x 2 processes, a pipeline stage per node, each node with an
    # output directory of its own, checkpointing every 2 steps
    node0, node1 = _run_gang(tmp_path, _gang_config(6))
    ckpt0, ckpt1 = tmp_path / "node0" / "checkpoints", tmp_path / "node1" / "checkpoints"
    # then each node holds its own part of one checkpoint under each step, the files named by
    # global rank: rank 0's node the metadata, the harness state and ranks 0-1's shards, the
    # other node ranks 2-3's shards, nothing half-written left behind
    for step in (2, 4, 6):
        name = f"step_{step:09d}"
        assert _names(ckpt0 / name) == {".metadata", "harness.pt", "__0_0.distcp", "__1_0.distcp"}
        assert _names(ckpt1 / name) == {"__2_0.distcp", "__3_0.distcp"}
    assert not [p for p in (*ckpt0.iterdir(), *ckpt1.iterdir()) if p.name.endswith(".tmp")]
    # and the other node announced its parts (its agent syncs them at once), and each node
    # wrote its own log
    assert [e["step"] for e in of_kind(node1, "checkpoint")] == [2, 4, 6]
    assert all(e["part"] for e in of_kind(node1, "checkpoint"))
    assert [e["step"] for e in of_kind(node0, "checkpoint")] == [2, 4, 6]
    for rank in range(2):
        assert (tmp_path / f"node{rank}" / "logs" / "harness.log").stat().st_size > 0

    # when the job is resumed with the whole of step 2 on both nodes (what a re-queued gang's
    # members are staged), while node 0 still holds steps 4 and 6 whose other part is lost
    for step in (4, 6):
        shutil.rmtree(ckpt1 / f"step_{step:09d}")
    for target in (ckpt0, ckpt1):
        for source in (ckpt0, ckpt1):
            for file in (source / "step_000000002").iterdir():
                dest = target / "step_000000002" / file.name
                if not dest.exists():
                    shutil.copyfile(file, dest)
    resumed0, _ = _run_gang(tmp_path, _gang_config(6))
    # then every rank resumed from step 2, the newest step every node has whole
    [start] = of_kind(resumed0, "start")
    assert start["start_step"] == 2
    assert start["resumed_from"].endswith("step_000000002")
    # and the loss goes on as in the run that was never interrupted
    assert [e["step"] for e in of_kind(resumed0, "step")] == [3, 4, 5, 6]
    assert losses(resumed0) == pytest.approx(losses(node0)[2:], rel=1e-5, abs=1e-6)
