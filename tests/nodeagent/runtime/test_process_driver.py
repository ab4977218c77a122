"""LocalProcessDriver specifics: runs outlive the agent, exit codes survive it, pids are checked."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nodeagent.runtime.base import ContainerSpec, PermanentRuntimeError
from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig
from tests.nodeagent.runtime.conftest import REPO, collect_output, wait_exited

AGENT = """
import sys
from nodeagent.runtime.base import ContainerSpec
from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig

state_dir, run_id, volume_dir, script = sys.argv[1:5]
driver = LocalProcessDriver(ProcessDriverConfig(state_dir=state_dir, node_id="n1"))
driver.start(ContainerSpec(
    rental_id="r1", run_id=run_id, node_id="n1", image="-", command=("python", "-c", script),
    env={}, gpu_indices=(), gpu_uuids=(), cpu_limit=1, memory_limit_mb=64, ports=(),
    volume_dir=volume_dir,
))
"""


def start_in_short_lived_agent(tmp_path: Path, run_id: str, script: str) -> None:
    """Start a run from another process that exits right after: an agent that went away."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            AGENT,
            str(tmp_path / "state"),
            run_id,
            str(tmp_path / f"vol-{run_id}"),
            textwrap.dedent(script),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        timeout=60,
    )


def make_driver(tmp_path: Path) -> LocalProcessDriver:
    return LocalProcessDriver(ProcessDriverConfig(state_dir=str(tmp_path / "state"), node_id="n1"))


def test_a_run_outlives_its_agent_and_is_adopted_and_stopped(tmp_path):
    # given a run started by an agent process that has since exited
    start_in_short_lived_agent(
        tmp_path, "orphan", "import time; print('ready', flush=True); time.sleep(600)"
    )

    # when a new agent looks
    driver = make_driver(tmp_path)
    [state] = driver.list_managed()
    collect_output(driver, "orphan", None, 1)

    # then the run is still running, and stopping it works (no SIGTERM handler: 128 + 15)
    assert (state.run_id, state.rental_id, state.status) == ("orphan", "r1", "running")
    driver.stop("orphan", grace_s=5)
    assert driver.state("orphan").exit_code == 143


def test_exit_code_is_recorded_while_no_agent_watches(tmp_path):
    start_in_short_lived_agent(tmp_path, "fails", "import sys; sys.exit(3)")

    state = wait_exited(make_driver(tmp_path), "fails")

    assert state.exit_code == 3


def test_a_recycled_pid_is_never_adopted(tmp_path):
    # given a run whose recorded pid now belongs to another process (this test's own pid)
    driver = make_driver(tmp_path)
    run_dir = tmp_path / "state" / "recycled"
    run_dir.mkdir(parents=True)
    meta = {
        "rental_id": "r1",
        "run_id": "recycled",
        "node_id": "n1",
        "labels": {"gpumarket.managed": "1", "gpumarket.run": "recycled"},
        "spec": {"ports": []},
        "supervisor_pid": os.getpid(),
    }
    (run_dir / "meta.json").write_text(json.dumps(meta))
    (run_dir / "child.json").write_text(
        json.dumps({"pid": os.getpid(), "start_ticks": 1, "started_at": 0.0})
    )

    # when the driver looks at it and is asked to stop it
    state = driver.state("recycled")
    driver.stop("recycled", grace_s=0)

    # then it is a finished run with an unknown exit code, and we were not signalled
    assert state.status == "exited"
    assert state.exit_code is None
    assert driver.state("recycled").status == "exited"


def test_real_gpus_are_refused(tmp_path, make_spec):
    # given the process runtime (no isolation: development with simulated GPUs only) on a host
    # whose NVIDIA driver lists a GPU (the driver's /proc layout, in a directory of our own)
    with pytest.raises(ValueError, match="simulated GPUs only"):
        ProcessDriverConfig(state_dir=str(tmp_path / "state"), gpu_mode="nvidia")
    gpu_dir = tmp_path / "nvidia" / "0000:3b:00.0"
    gpu_dir.mkdir(parents=True)
    (gpu_dir / "information").write_text(
        "Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t GPU-1f2e3d4c-0000-1111-2222-333344445555\n"
    )
    driver = LocalProcessDriver(
        ProcessDriverConfig(
            state_dir=str(tmp_path / "state"), node_id="n1", nvidia_proc_dir=str(gpu_dir.parent)
        )
    )
    host_gpu, simulated_gpu = (
        "GPU-1f2e3d4c-0000-1111-2222-333344445555",
        "GPU-0a0a0a0a-5555-5555-5555-555555555555",
    )
    real = make_spec(gpu_indices=(0, 1), gpu_uuids=(simulated_gpu, host_gpu), node_id="n1")

    # when a run naming that GPU is started: refused for good, and nothing was made
    with pytest.raises(PermanentRuntimeError, match=host_gpu):
        driver.start(real)
    assert driver.list_managed() == []
    assert not os.path.exists(real.volume_dir)

    # while simulated GPUs (UUIDs the host does not have) still run
    simulated = make_spec(gpu_uuids=(simulated_gpu, simulated_gpu), node_id="n1")
    driver.start(simulated)
    assert wait_exited(driver, simulated.run_id).exit_code == 0


def test_the_command_cannot_read_the_agents_secrets(tmp_path, make_spec, monkeypatch):
    # given an agent (root here) with a node token in its 0700 state dir and a secret in its env
    state_dir = tmp_path / "agent-state"
    state_dir.mkdir(mode=0o700)
    token = state_dir / "node_token.json"
    token.write_text('{"node_token": "secret"}')
    token.chmod(0o600)
    monkeypatch.setenv("GPUMARKET_JOIN_TOKEN", "join-secret")
    driver = make_driver(tmp_path)
    spec = make_spec(
        f"""
        import os
        print(os.getuid(), os.getgid(), os.getgroups(), flush=True)
        print(sorted(k for k in os.environ if "TOKEN" in k), flush=True)
        try:
            open({str(token)!r}).read()
            print("read the token")
        except OSError as exc:
            print(type(exc).__name__)
        """,
        node_id="n1",
    )

    # when the run executes
    driver.start(spec)
    state = wait_exited(driver, spec.run_id)
    lines, _ = driver.output_since(spec.run_id, None)

    # then it ran without the agent's environment and, under a root agent, as nobody
    assert state.exit_code == 0
    assert lines[1] == "[]"
    if os.geteuid() == 0:
        assert lines[0] == "65534 65534 []"
        assert lines[2] == "PermissionError"


def test_ports_map_to_themselves_while_running(tmp_path, make_spec):
    driver = make_driver(tmp_path)
    spec = make_spec("import time; time.sleep(600)", ports=(8888,), node_id="n1")

    state = driver.start(spec)
    driver.remove(spec.run_id)

    assert state.ports == {8888: 8888}


def test_descendants_die_with_the_main_process(tmp_path, make_spec):
    # given a program that leaves a child behind in its process group when it exits
    driver = make_driver(tmp_path)
    spec = make_spec(
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        """,
        node_id="n1",
    )

    driver.start(spec)
    [pid], _ = collect_output(driver, spec.run_id, None, 1)
    wait_exited(driver, spec.run_id)

    # then the leftover was killed, as the end of a container would kill it
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_starts_on_one_node_from_many_threads_each_run_their_own_command(tmp_path, make_spec):
    # given eight runs started at once from the agent's worker threads (starts overlap)
    driver = make_driver(tmp_path)
    specs = [make_spec(f"import time; print({i}, flush=True); time.sleep(600)") for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        states = list(pool.map(driver.start, specs))

    # then each start returned its own running command, with its own output
    outputs = [collect_output(driver, spec.run_id, None, 1)[0] for spec in specs]
    for spec in specs:
        driver.remove(spec.run_id)
    assert [state.status for state in states] == ["running"] * 8
    assert all(state.started_at is not None for state in states)
    assert outputs == [[str(i)] for i in range(8)]


def test_the_command_inherits_neither_the_runs_lock_nor_ignored_signals(tmp_path, make_spec):
    # given a command that lists its open descriptors and its ignored signals
    driver = make_driver(tmp_path)
    spec = make_spec(
        node_id="n1", command=("sh", "-c", "ls /proc/$$/fd; grep SigIgn /proc/$$/status")
    )

    driver.start(spec)
    state = wait_exited(driver, spec.run_id)
    lines = driver.logs_tail(spec.run_id).split()

    # then it has stdin, stdout and stderr only (the supervisor alone holds the run's lock, so
    # an orphaned command never looks like a live supervisor), and SIGPIPE is not ignored
    assert state.exit_code == 0
    fds, ignored = lines[: lines.index("SigIgn:")], int(lines[lines.index("SigIgn:") + 1], 16)
    assert sorted(fds) == ["0", "1", "2"]
    assert not ignored & (1 << (signal.SIGPIPE - 1))


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root agent runs commands as another uid")
def test_a_workspace_the_unprivileged_uid_cannot_reach_is_refused_with_the_reason(
    tmp_path, make_spec
):
    # given a volume dir under a directory closed to others (pytest's own are 0700)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    driver = make_driver(tmp_path)
    spec = make_spec(node_id="n1", volume_dir=str(closed / "vol"))

    # when the run is started: refused for good, naming the directory, instead of a command
    # that dies unable to find its workspace
    with pytest.raises(PermanentRuntimeError, match=f"{closed} is closed to uid 65534"):
        driver.start(spec)


def test_a_run_with_ssh_is_refused_saying_why(tmp_path, make_spec):
    driver = make_driver(tmp_path)
    spec = make_spec(ports=(22,), ssh_authorized_keys=("ssh-ed25519 AAAA",), node_id="n1")

    with pytest.raises(PermanentRuntimeError, match="cannot give SSH access"):
        driver.start(spec)
    assert driver.state(spec.run_id).status == "missing"


@pytest.mark.harness
def test_the_default_harness_run_reads_its_dataset_and_writes_its_output_to_the_workspace(
    tmp_path, volume_root
):
    # given a staged text dataset (sealed read-only as staging leaves it) and the harness
    # started as the server starts it, with no path but the runtime's variables
    stage = volume_root / f"stage-{os.urandom(4).hex()}"
    corpus = stage / "data" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "train.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    for path in (corpus, stage / "data", stage):
        path.chmod(0o555)
    config = {
        "model": {"name": "gpt", "layers": 1, "width": 16, "heads": 2},
        "data": {"name": "text", "path": "corpus", "seq_len": 16, "batch_size": 4},
        "train": {"steps": 3, "device": "cpu", "log_every": 1},
    }
    driver = LocalProcessDriver(
        ProcessDriverConfig(state_dir=str(tmp_path / "state"), extra_env={"PYTHONPATH": str(REPO)})
    )
    spec = ContainerSpec(
        rental_id="r-harness", run_id=f"h-{os.urandom(4).hex()}", node_id="n", image="",
        command=("python", "-m", "harness", "--config-env", "HARNESS_CONFIG_JSON"),
        env={"HARNESS_CONFIG_JSON": json.dumps(config)}, gpu_indices=(0,), gpu_uuids=(),
        cpu_limit=1, memory_limit_mb=2048, ports=(),
        volume_dir=str(volume_root / f"vol-{os.urandom(4).hex()}"),
        data_dir=str(stage / "data"),
    )  # fmt: skip
    try:
        # when it runs to completion
        driver.start(spec)
        state = wait_exited(driver, spec.run_id, timeout_s=180)
        lines, _ = driver.output_since(spec.run_id, None)
        logs = driver.logs_tail(spec.run_id, 30)
    finally:
        driver.remove(spec.run_id)
        for path in (stage, stage / "data", corpus):
            path.chmod(0o755)
    # then it trained on the dataset and left checkpoint, final model and logs in its workspace
    assert state.exit_code == 0, logs
    events = [json.loads(x) for x in lines]
    start = next(e for e in events if e["event"] == "start")
    assert start["config"]["data"]["path"] == "corpus"
    workspace = Path(spec.volume_dir)
    summary = events[-1]
    assert summary["event"] == "summary" and summary["exit_reason"] == "completed"
    assert summary["checkpoint"] == str(workspace / "checkpoints" / "step_000000003.pt")
    assert summary["final_model"] == str(workspace / "final" / "model.pt")
    assert sorted(str(p.relative_to(workspace)) for p in workspace.rglob("*") if p.is_file()) == [
        "checkpoints/step_000000003.pt",
        "final/config.json",
        "final/model.pt",
        "logs/harness.log",
        "logs/metrics.jsonl",
    ]
    logged = (workspace / "logs" / "metrics.jsonl").read_text().splitlines()
    assert logged == lines
