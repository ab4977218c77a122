"""The RuntimeDriver contract, checked on both drivers against a real engine / real processes."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import docker
import pytest

from agentprotocol import SecretValue
from nodeagent.runtime.base import (
    LABEL_MANAGED,
    LABEL_NODE,
    LABEL_RENTAL,
    LABEL_RUN,
    ContainerSpec,
    RunNotFoundError,
    RuntimeDriver,
)
from nodeagent.runtime.docker import container_name
from nodeagent.runtime.process import LocalProcessDriver
from tests.nodeagent.runtime.conftest import REPO, collect_output, wait_exited

TRAP_SIGTERM = """
    import signal, sys, time
    def on_term(signum, frame):
        with open("terminated", "w") as f:
            f.write("graceful")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
"""

IGNORE_SIGTERM = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
"""

SLEEP = """
    import time
    print("ready", flush=True)
    time.sleep(600)
"""


def labels_of(driver: RuntimeDriver, run_id: str) -> dict[str, str]:
    if isinstance(driver, LocalProcessDriver):
        meta = Path(driver.config.state_dir, run_id, "meta.json").read_text()
        return json.loads(meta)["labels"]
    client = docker.from_env(version="auto")
    try:
        return client.containers.get(container_name(run_id)).labels
    finally:
        client.close()


def count_runs(driver: RuntimeDriver, run_id: str) -> int:
    if isinstance(driver, LocalProcessDriver):
        return sum(1 for s in driver.list_managed() if s.run_id == run_id)
    out = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"label={LABEL_RUN}={run_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(out.split())


def test_start_runs_the_command_with_labels_env_and_workspace(driver, make_spec):
    # given a spec that reports its environment and writes into its workspace
    spec = make_spec(
        """
        import os
        for key in ("CUDA_VISIBLE_DEVICES", "GPUMARKET_SIMULATED_GPUS", "GPUMARKET_RUN_ID",
                    "GPUMARKET_GPU_COUNT", "OMP_NUM_THREADS", "CUSTOM"):
            print(f"{key}={os.environ.get(key)}")
        with open(os.path.join(os.environ["GPUMARKET_WORKSPACE"], "out.txt"), "w") as f:
            f.write("written in the run")
        print(f"cwd_is_workspace={os.getcwd() == os.environ['GPUMARKET_WORKSPACE']}")
        """,
        env={"CUSTOM": "value", "GPUMARKET_RUN_ID": "spoofed"},
    )

    # when it starts and finishes
    state = driver.start(spec)
    final = wait_exited(driver, spec.run_id)

    # then it ran with our labels, the simulated GPUs and the workspace as cwd
    assert state.run_id == spec.run_id
    assert state.rental_id == spec.rental_id
    assert state.status in ("running", "exited")
    assert state.started_at is not None
    assert final.exit_code == 0
    assert final.finished_at is not None and final.finished_at >= final.started_at
    ours = {
        LABEL_MANAGED: "1",
        LABEL_RENTAL: spec.rental_id,
        LABEL_RUN: spec.run_id,
        LABEL_NODE: spec.node_id,
    }
    assert labels_of(driver, spec.run_id).items() >= ours.items()  # images add their own
    lines, _ = driver.output_since(spec.run_id, None)
    assert lines == [
        "CUDA_VISIBLE_DEVICES=",
        "GPUMARKET_SIMULATED_GPUS=0,2",
        f"GPUMARKET_RUN_ID={spec.run_id}",
        "GPUMARKET_GPU_COUNT=2",
        "OMP_NUM_THREADS=1",
        "CUSTOM=value",
        "cwd_is_workspace=True",
    ]
    assert Path(spec.volume_dir, "out.txt").read_text() == "written in the run"


def test_secrets_reach_the_run_as_variables_and_read_only_files_and_leave_with_it(
    driver, make_spec
):
    # given a spec with one secret as a variable and one as a file
    spec = make_spec(
        """
        import os, stat
        print("env", os.environ["API_TOKEN"])
        path = os.path.join(os.environ["GPUMARKET_SECRETS_DIR"], "key")
        print("file", open(path).read())
        print("mode", oct(stat.S_IMODE(os.stat(path).st_mode)))
        print("in workspace", sorted(os.listdir(os.environ["GPUMARKET_WORKSPACE"])))
        """,
        secrets=(
            SecretValue(name="API_TOKEN", value="tok-123456", env="API_TOKEN"),
            SecretValue(name="KEY", value="key-abcdef", file="/run/secrets/key"),
        ),
    )
    # when it runs
    driver.start(spec)
    assert wait_exited(driver, spec.run_id).exit_code == 0
    lines, _ = driver.output_since(spec.run_id, None)
    # then it read both, the file read-only, nothing of them in its synced workspace
    assert lines[:3] == ["env tok-123456", "file key-abcdef", "mode 0o400"]
    assert "key" not in lines[3] and "secret" not in lines[3]
    assert "tok-123456" not in repr(spec)
    if isinstance(driver, LocalProcessDriver):  # its record on disk holds no value
        meta = Path(driver.config.state_dir, spec.run_id, "meta.json").read_text()
        assert "tok-123456" not in meta and "key-abcdef" not in meta
    # and once it is removed, its secrets directory is gone from the host
    assert os.path.isdir(spec.secrets_dir())
    driver.remove(spec.run_id)
    assert not os.path.exists(spec.secrets_dir())


def test_start_twice_with_the_same_run_id_gives_one_run(driver, make_spec):
    # given a command that appends to a file each time it is started
    spec = make_spec(
        """
        import time
        with open("starts", "a") as f:
            f.write("started\\n")
        print("ready", flush=True)
        time.sleep(600)
        """
    )

    # when it is started three times, two of them concurrently
    first = driver.start(spec)
    results = []
    threads = [threading.Thread(target=lambda: results.append(driver.start(spec))) for _ in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    collect_output(driver, spec.run_id, None, 1)

    # then exactly one run exists and it was started once
    assert [s.started_at for s in results] == [first.started_at, first.started_at]
    assert count_runs(driver, spec.run_id) == 1
    assert Path(spec.volume_dir, "starts").read_text() == "started\n"


def test_a_new_driver_instance_adopts_what_runs(make_driver, driver, make_spec):
    # given a run started by one driver (the agent before its restart)
    spec = make_spec(TRAP_SIGTERM)
    started = driver.start(spec)
    collect_output(driver, spec.run_id, None, 1)

    # when a new driver instance looks (the restarted agent)
    restarted = make_driver()
    listed = {s.run_id: s for s in restarted.list_managed()}

    # then it sees the run, a start returns it, and it can stop it
    assert listed[spec.run_id].status == "running"
    assert listed[spec.run_id].rental_id == spec.rental_id
    assert listed[spec.run_id].started_at == started.started_at
    assert restarted.start(spec).started_at == started.started_at
    restarted.stop(spec.run_id, grace_s=10)
    assert restarted.state(spec.run_id).exit_code == 0
    assert count_runs(restarted, spec.run_id) == 1


def test_list_managed_only_shows_this_nodes_runs(make_driver, driver, make_spec):
    spec = make_spec(SLEEP)
    driver.start(spec)

    other_node = make_driver(node_id="some-other-node")

    assert spec.run_id in {s.run_id for s in driver.list_managed()}
    assert spec.run_id not in {s.run_id for s in other_node.list_managed()}


def test_stop_sends_sigterm_and_waits_for_a_graceful_exit(driver, make_spec):
    # given a program that checkpoints (writes a file) and exits 0 on SIGTERM
    spec = make_spec(TRAP_SIGTERM)
    driver.start(spec)
    collect_output(driver, spec.run_id, None, 1)

    # when it is stopped with a generous grace period
    began = time.monotonic()
    driver.stop(spec.run_id, grace_s=20)
    elapsed = time.monotonic() - began

    # then it handled SIGTERM itself: file written, exit 0, well before the grace period ended
    state = driver.state(spec.run_id)
    assert state.status == "exited"
    assert state.exit_code == 0
    assert Path(spec.volume_dir, "terminated").read_text() == "graceful"
    assert elapsed < 20


def test_stop_kills_after_the_grace_period_when_sigterm_is_ignored(driver, make_spec):
    # given a program that ignores SIGTERM
    spec = make_spec(IGNORE_SIGTERM)
    driver.start(spec)
    collect_output(driver, spec.run_id, None, 1)

    # when it is stopped with a 1 s grace period
    began = time.monotonic()
    driver.stop(spec.run_id, grace_s=1)
    elapsed = time.monotonic() - began

    # then it was SIGKILLed once the grace period was over (128 + 9)
    state = driver.state(spec.run_id)
    assert state.status == "exited"
    assert state.exit_code == 137
    assert elapsed >= 1


def test_stop_of_an_exited_run_changes_nothing(driver, make_spec):
    spec = make_spec("import sys; sys.exit(5)")
    driver.start(spec)
    before = wait_exited(driver, spec.run_id)

    driver.stop(spec.run_id, grace_s=1)

    assert driver.state(spec.run_id) == before


def test_failing_command_reports_its_exit_code_and_logs(driver, make_spec):
    # given a command that writes to both streams and exits 3
    spec = make_spec(
        """
        import sys
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.exit(3)
        """
    )

    # when it has run
    driver.start(spec)
    state = wait_exited(driver, spec.run_id)

    # then the exit code and both streams are available
    assert state.exit_code == 3
    tail = driver.logs_tail(spec.run_id, lines=50)
    assert sorted(tail.splitlines()) == ["to stderr", "to stdout"]
    assert driver.logs_tail(spec.run_id, lines=1).count("\n") == 1
    assert driver.output_since(spec.run_id, None)[0] == ["to stdout"]


def test_output_since_returns_only_new_lines(driver, make_spec):
    # given a program that prints two lines, waits for a file, prints two more and exits
    spec = make_spec(
        """
        import os, sys, time
        print('{"step": 1}', flush=True)
        print('{"step": 2}', flush=True)
        print("noise on stderr", file=sys.stderr, flush=True)
        while not os.path.exists("go"):
            time.sleep(0.05)
        print('{"step": 3}', flush=True)
        print('{"step": 4}', flush=True)
        """
    )
    driver.start(spec)

    # when output is read, read again with nothing new, then read after more was printed
    first, cursor = collect_output(driver, spec.run_id, None, 2)
    nothing_new, cursor = driver.output_since(spec.run_id, cursor)
    Path(spec.volume_dir, "go").write_text("")
    wait_exited(driver, spec.run_id)
    second, cursor = collect_output(driver, spec.run_id, cursor, 2)
    after_exit, _ = driver.output_since(spec.run_id, cursor)

    # then every stdout line came exactly once, in order, and stderr never
    assert first == ['{"step": 1}', '{"step": 2}']
    assert nothing_new == []
    assert second == ['{"step": 3}', '{"step": 4}']
    assert after_exit == []


def test_missing_program_exits_127_like_a_shell(driver, make_spec):
    # Docker's init (tini) and the process supervisor both report exec failures as 127
    spec = make_spec(command=("/no/such/program",))

    driver.start(spec)
    state = wait_exited(driver, spec.run_id)

    assert state.exit_code == 127
    assert "/no/such/program" in driver.logs_tail(spec.run_id)


def test_remove_leaves_nothing_but_the_volume(driver, make_spec):
    # given a running run that wrote into its workspace
    spec = make_spec(
        """
        import time
        open("checkpoint.pt", "w").write("weights")
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    driver.start(spec)
    collect_output(driver, spec.run_id, None, 1)

    # when it is removed while running
    driver.remove(spec.run_id)

    # then no trace of the run is left, except the rental's volume
    assert driver.state(spec.run_id).status == "missing"
    assert spec.run_id not in {s.run_id for s in driver.list_managed()}
    assert count_runs(driver, spec.run_id) == 0
    if isinstance(driver, LocalProcessDriver):
        assert not Path(driver.config.state_dir, spec.run_id).exists()
    assert Path(spec.volume_dir, "checkpoint.pt").read_text() == "weights"
    driver.remove(spec.run_id)  # removing again is a no-op


def test_unknown_run_is_missing_and_stop_remove_are_noops(driver):
    assert driver.state("never-started").status == "missing"
    driver.stop("never-started", grace_s=1)
    driver.remove("never-started")
    with pytest.raises(RunNotFoundError):
        driver.logs_tail("never-started")
    with pytest.raises(RunNotFoundError):
        driver.output_since("never-started", None)


def test_cpu_share_sets_the_thread_counts(driver: RuntimeDriver, make_spec: Callable):
    # the process driver cannot enforce limits; both pass the CPU share on as thread counts
    spec: ContainerSpec = make_spec(
        "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])",
        cpu_limit=2.0,
    )
    driver.start(spec)
    wait_exited(driver, spec.run_id)
    assert driver.output_since(spec.run_id, None)[0] == ["2 2"]


def test_spec_rejects_unsafe_run_ids(make_spec):
    for bad in ("../escape", "a/b", "", "-starts-with-dash"):
        with pytest.raises(ValueError):
            make_spec(run_id=bad)


@pytest.mark.harness
def test_the_harness_trains_reports_metrics_and_checkpoints_on_stop(
    driver_kind, make_driver, make_spec
):
    # given the real harness (in the image, or from this checkout for the process driver) with
    # a config in the rental's volume; its contract: JSON-line metrics on stdout, and SIGTERM
    # means checkpoint and exit 0
    options = {"extra_env": {"PYTHONPATH": str(REPO)}} if driver_kind == "process" else {}
    driver = make_driver(**options)
    spec = make_spec(
        command=("python", "-m", "harness", "--config", "harness.json"), memory_limit_mb=2048
    )
    os.makedirs(spec.volume_dir)
    Path(spec.volume_dir, "harness.json").write_text(
        json.dumps({"train": {"steps": 1_000_000, "log_every": 1}})
    )

    # when it has trained a few steps and is stopped
    driver.start(spec)
    try:
        steps, cursor = [], None
        deadline = time.monotonic() + 120
        while len(steps) < 2 and time.monotonic() < deadline:
            if driver.state(spec.run_id).status == "exited":
                break
            lines, cursor = driver.output_since(spec.run_id, cursor)
            steps += [json.loads(x) for x in lines if x.startswith('{"event": "step"')]
            time.sleep(0.2)
        driver.stop(spec.run_id, grace_s=60)
        state = driver.state(spec.run_id)
        rest, _ = driver.output_since(spec.run_id, cursor)
        logs = driver.logs_tail(spec.run_id, 20)
    finally:
        driver.remove(spec.run_id)

    # then metrics came through, and it checkpointed into the volume and exited 0
    assert len(steps) >= 2, logs
    assert state.exit_code == 0, logs
    assert any(json.loads(x).get("exit_reason") == "sigterm" for x in rest if x.startswith("{"))
    assert list(Path(spec.volume_dir, "checkpoints").iterdir())


def test_staged_datasets_are_read_only_and_resume_files_land_in_the_workspace(
    driver, make_spec, volume_root
):
    # given a staged dataset (sealed read-only, as nodeagent.staging leaves it) and a resume
    # checkpoint to seed into the workspace
    stage = volume_root / f"stage-{os.urandom(4).hex()}"
    (stage / "data" / "corpus").mkdir(parents=True)
    (stage / "data" / "corpus" / "train.txt").write_text("corpus text")
    (stage / "resume" / "checkpoints").mkdir(parents=True)
    (stage / "resume" / "checkpoints" / "step_000000003.pt").write_text("three")
    for path in (
        stage / "data" / "corpus" / "train.txt",
        stage / "resume" / "checkpoints" / "step_000000003.pt",
    ):
        path.chmod(0o444)
    for path in (
        stage / "data" / "corpus",
        stage / "data",
        stage / "resume" / "checkpoints",
        stage / "resume",
        stage,
    ):
        path.chmod(0o555)
    spec = make_spec(
        """
        import os, pathlib
        data = pathlib.Path(os.environ["GPUMARKET_DATA_DIR"])
        print((data / "corpus" / "train.txt").read_text())
        try:
            (data / "corpus" / "new.txt").write_text("x")
            print("dataset writable")
        except OSError:
            print("dataset read-only")
        ckpt = pathlib.Path(os.environ["GPUMARKET_WORKSPACE"]) / "checkpoints"
        print((ckpt / "step_000000003.pt").read_text())
        (ckpt / "step_000000004.pt").write_text("four")
        print("checkpoint dir writable")
        """,
        data_dir=str(stage / "data"),
        seed_dir=str(stage / "resume"),
    )
    try:
        # when the run starts and ends
        driver.start(spec)
        wait_exited(driver, spec.run_id)
        lines, _ = driver.output_since(spec.run_id, None)
    finally:
        driver.remove(spec.run_id)
        for parent, dirs, _ in os.walk(stage):
            for name in dirs:
                os.chmod(os.path.join(parent, name), 0o755)
        stage.chmod(0o755)
    # then it read its dataset but could not write it, and resumed in a workspace it owns
    assert lines == ["corpus text", "dataset read-only", "three", "checkpoint dir writable"]
    assert (Path(spec.volume_dir) / "checkpoints" / "step_000000004.pt").read_text() == "four"


def test_every_runtime_names_its_workspace_and_data_dir_and_runs_in_the_workspace(
    driver, driver_kind, make_spec, volume_root
):
    # given a run without datasets that reports where its files are
    spec = make_spec(
        """
        import os
        workspace, data = os.environ["GPUMARKET_WORKSPACE"], os.environ["GPUMARKET_DATA_DIR"]
        print(f"workspace={workspace}")
        print(f"data={data}")
        print(f"cwd_is_workspace={os.getcwd() == workspace}")
        print(f"datasets={sorted(os.listdir(data)) if os.path.isdir(data) else None}")
        """
    )
    # when it runs
    driver.start(spec)
    wait_exited(driver, spec.run_id)
    lines, _ = driver.output_since(spec.run_id, None)
    # then both variables are set on either runtime: the container's mount points, or the host
    # directories of a host process (an empty read-only data dir when nothing is staged)
    if driver_kind == "docker":
        assert lines == ["workspace=/workspace", "data=/data", "cwd_is_workspace=True",
                         "datasets=None"]  # fmt: skip
    else:
        empty = volume_root / ".no-datasets"
        assert lines == [f"workspace={spec.volume_dir}", f"data={empty}",
                         "cwd_is_workspace=True", "datasets=[]"]  # fmt: skip
        assert not os.access(empty, os.W_OK) or os.geteuid() == 0
        assert oct(empty.stat().st_mode & 0o777) == "0o555"
