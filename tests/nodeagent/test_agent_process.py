"""The agent end to end: the real CLI, the LocalProcessDriver, a stdlib fake server.

The fake server answers join and heartbeat like the real one (node token check, ack of the
highest usage seq received, a scripted desired state); the agent runs as a subprocess with
--once, so every invocation is also an agent restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentprotocol import (
    HEARTBEAT_PATH,
    JOIN_PATH,
    DesiredRun,
    HeartbeatAnswer,
    HeartbeatRefusal,
    JoinAnswer,
    SecretValue,
)
from nodeagent.runtime.process import LocalProcessDriver, ProcessDriverConfig
from nodeagent.telemetry.simulated import simulated_gpu_uuid

REPO = Path(__file__).resolve().parents[2]
NODE_ID = 7
NODE_TOKEN = "gpn_test-node-token"
JOIN_TOKEN = "gpj_test_join"
METRIC_LINE = '{"event": "step", "step": 1}'
SCRIPT = f"print({METRIC_LINE!r}); import time; time.sleep(30)"


class Server:
    """The scripted server side: desired state, token, acks."""

    def __init__(self, fake_server: Any) -> None:
        self.fake = fake_server
        self.desired: list[DesiredRun] = []
        self.token = NODE_TOKEN
        self.run_benchmark = False
        self.heartbeat_status = 200
        self.interval = 1
        # Heartbeats still to refuse as a server at its bound does (503 with Retry-After).
        self.refusals: list[HeartbeatRefusal] = []
        self.acked = 0
        # Whether answers name the desired state with a digest, as the real server does.
        self.digests = False
        self.interval = 1
        fake_server.on(JOIN_PATH, self.join)
        fake_server.on(HEARTBEAT_PATH, self.heartbeat)

    def join(self, request: Any) -> tuple[int, Any]:
        if request.body.get("join_token") != JOIN_TOKEN:
            return 400, {"join_token": ["invalid, used or expired join token"], "code": "invalid"}
        answer = JoinAnswer(node_id=NODE_ID, node_token=NODE_TOKEN, heartbeat_interval_s=1)
        return 201, answer.to_payload()

    def heartbeat(self, request: Any) -> tuple[int, Any]:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return 401, {"detail": "invalid or revoked node token"}
        if self.heartbeat_status != 200:
            return self.heartbeat_status, {"detail": "down for maintenance"}
        if self.refusals:
            refusal = self.refusals.pop(0)
            return 503, refusal.to_payload(), 0.0, {"Retry-After": str(refusal.retry_after_s)}
        self.acked = max([self.acked] + [u["seq"] for u in request.body["usage"]])
        digest = ""
        if self.digests:
            payload = json.dumps([d.to_payload() for d in self.desired], sort_keys=True)
            digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
        unchanged = bool(digest) and request.body.get("desired_digest") == digest
        answer = HeartbeatAnswer(
            desired=() if unchanged else tuple(self.desired),
            ack_usage_seq=self.acked,
            heartbeat_interval_s=self.interval,
            run_benchmark=self.run_benchmark,
            desired_digest=digest,
            desired_unchanged=unchanged,
        )
        return 200, answer.to_payload()

    def heartbeats(self) -> list[dict[str, Any]]:
        return self.fake.bodies(HEARTBEAT_PATH)


def desired_entry(rental_id: str, script: str = SCRIPT, **overrides: Any) -> DesiredRun:
    fields: dict[str, Any] = {
        "rental_id": rental_id,
        "run_id": f"r{uuid.UUID(rental_id).hex}-n{NODE_ID}",
        "image": "gpumarket/harness:dev",
        "command": ("python", "-c", script),
        "env": {"HARNESS_SEED": "3"},
        "gpu_indices": (1,),
        "gpu_uuids": (simulated_gpu_uuid("test-host", 1),),
        "cpu_limit": 1.0,
        "memory_limit_mb": 512,
        "ports": (),
        "stop_grace_s": 5.0,
    }
    return DesiredRun(**{**fields, **overrides})


@pytest.fixture
def server(fake_server: Any) -> Server:
    return Server(fake_server)


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / name for name in ("state", "volumes", "runs")}


@pytest.fixture
def driver(dirs: dict[str, Path]) -> Iterator[LocalProcessDriver]:
    """A driver over the agent's process dir: to look at what the agent did, and clean up."""
    instance = LocalProcessDriver(
        ProcessDriverConfig(state_dir=str(dirs["runs"]), node_id=str(NODE_ID))
    )
    yield instance
    for state in instance.list_managed():
        instance.remove(state.run_id)


def agent_args(server: Server, dirs: dict[str, Path], *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "nodeagent",
        "--server", server.fake.url,
        "--join-token", JOIN_TOKEN,
        "--state-dir", str(dirs["state"]),
        "--runtime", "process",
        "--gpu-mode", "none",
        "--telemetry", "simulated",
        "--simulate-gpus", "a100-sxm4-80gb:2",
        "--hostname", "test-host",
        "--volume-root", str(dirs["volumes"]),
        "--process-dir", str(dirs["runs"]),
        "--request-timeout", "5",
        *extra,
    ]  # fmt: skip


def agent_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}


@pytest.fixture
def agent(server: Server, dirs: dict[str, Path]) -> Callable[..., subprocess.CompletedProcess]:
    """Run the agent with --once (one round; every call is also a restart)."""

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            agent_args(server, dirs, "--once", *extra),
            cwd=REPO,
            env=agent_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


@pytest.fixture
def agent_loop(server: Server, dirs: dict[str, Path]) -> Callable[..., tuple[int, str]]:
    """Run the agent's loop until `until()` holds, then SIGTERM it; (exit status, stderr)."""

    def run(until: Callable[[], bool], *extra: str) -> tuple[int, str]:
        proc = subprocess.Popen(
            agent_args(server, dirs, "--interval", "0.2", *extra),
            cwd=REPO,
            env=agent_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not until():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the condition never held"
                time.sleep(0.05)
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=30)
        return proc.returncode, stderr

    return run


def wait_for_output(driver: LocalProcessDriver, run_id: str) -> None:
    deadline = time.monotonic() + 15
    while not driver.output_since(run_id, None)[0]:
        assert time.monotonic() < deadline, "the run printed nothing"
        time.sleep(0.05)


def test_lifecycle_start_adopt_metrics_usage_stop_remove(server, agent, driver, dirs):
    rental_id = str(uuid.uuid4())
    entry = desired_entry(rental_id)
    run_id = entry.run_id
    server.desired = [entry]

    # 1. first start: join, one heartbeat, then the desired run is started
    first = agent()
    assert first.returncode == 0, first.stderr
    (join,) = server.fake.bodies(JOIN_PATH)
    assert join["join_token"] == JOIN_TOKEN
    assert join["hostname"] == "test-host"
    assert join["simulated"] is True
    assert set(join["host"]) == {"cpu_cores", "ram_gb", "disk_gb", "driver_version", "cuda_version"}
    # Two simulated A100s declare a host sized like a GPU server, not like this machine.
    assert (join["host"]["cpu_cores"], join["host"]["ram_gb"], join["host"]["disk_gb"]) == (
        32,
        256,
        2000,
    )
    assert join["gpus"] == [
        {
            "index": i,
            "uuid": simulated_gpu_uuid("test-host", i),
            "name": "a100-sxm4-80gb",
            "memory_mb": 81920,
            "topology_group": "nvl0",
        }
        for i in range(2)
    ]
    token_file = dirs["state"] / "node_token.json"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert json.loads(token_file.read_text())["node_token"] == NODE_TOKEN
    (hb1,) = server.heartbeats()
    assert (hb1["containers"], hb1["usage"], hb1["metrics"]) == ([], [], [])
    assert [t["gpu_index"] for t in hb1["telemetry"]] == [0, 1]
    assert hb1["agent_version"] and hb1["sent_at"] > 0
    (state,) = driver.list_managed()
    assert (state.run_id, state.rental_id, state.status) == (run_id, rental_id, "running")
    # the run's environment: checkpoints in its volume dir, its simulated GPU, the rental id
    with open(dirs["runs"] / run_id / "child.json") as f:
        pid = json.load(f)["pid"]
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item
    )
    volume = dirs["volumes"] / rental_id
    assert environ["HARNESS_CHECKPOINT_DIR"] == str(volume / "checkpoints")
    assert environ["GPUMARKET_RENTAL_ID"] == rental_id
    assert environ["GPUMARKET_SIMULATED_GPUS"] == "1"
    assert environ["CUDA_VISIBLE_DEVICES"] == ""
    assert environ["HARNESS_SEED"] == "3"
    assert os.readlink(f"/proc/{pid}/cwd") == str(volume)
    wait_for_output(driver, run_id)

    # 2. restart, still desired: adopted (not started again), metrics and usage forwarded
    second = agent()
    assert second.returncode == 0, second.stderr
    hb2 = server.heartbeats()[-1]
    (again,) = driver.list_managed()
    assert again.status == "running" and again.started_at == state.started_at
    assert json.loads((dirs["runs"] / run_id / "child.json").read_text())["pid"] == pid
    assert hb2["containers"] == [
        {
            "rental_id": rental_id,
            "run_id": run_id,
            "status": "running",
            "exit_code": None,
            "started_at": state.started_at,
            "finished_at": None,
        }
    ]
    assert hb2["metrics"] == [{"rental_id": rental_id, "run_id": run_id, "line": METRIC_LINE}]
    (usage,) = hb2["usage"]
    assert usage["seq"] == 1
    assert usage["rental_id"] == rental_id and usage["run_id"] == run_id
    assert usage["gpu_count"] == 1 and usage["final"] is False
    assert usage["started_at"] == state.started_at
    assert state.started_at <= usage["confirmed_at"] <= hb2["sent_at"]
    busy = {t["gpu_index"]: t["util_pct"] for t in hb2["telemetry"]}
    assert busy[0] == 0.0 and busy[1] > 50  # the rented GPU looks busy

    # 3. the server drops the run: the acknowledged report and the delivered line are not
    # resent, a new report is made, and the run is stopped (SIGTERM: exit code 143)
    server.desired = []
    third = agent()
    assert third.returncode == 0, third.stderr
    hb3 = server.heartbeats()[-1]
    assert hb3["metrics"] == []
    assert [(u["seq"], u["final"]) for u in hb3["usage"]] == [(2, False)]
    assert hb3["usage"][0]["confirmed_at"] > usage["confirmed_at"]
    stopped = driver.state(run_id)
    assert (stopped.status, stopped.exit_code) == ("exited", 143)

    # 4. its final state and final usage report go up, then it is removed
    fourth = agent()
    assert fourth.returncode == 0, fourth.stderr
    hb4 = server.heartbeats()[-1]
    (exited,) = hb4["containers"]
    assert (exited["status"], exited["exit_code"]) == ("exited", 143)
    assert exited["finished_at"] >= exited["started_at"] == state.started_at
    assert METRIC_LINE in exited["log_tail"]
    assert [(u["seq"], u["final"]) for u in hb4["usage"]] == [(3, True)]
    assert driver.list_managed() == []
    assert not volume.exists()  # its workspace left the host with the run

    # 5. nothing left to report; the run's records are gone
    fifth = agent()
    assert fifth.returncode == 0, fifth.stderr
    hb5 = server.heartbeats()[-1]
    assert (hb5["containers"], hb5["usage"], hb5["metrics"]) == ([], [], [])
    assert json.loads((dirs["state"] / "spool" / "runs.json").read_text()) == {}


def test_a_restarted_agent_sweeps_what_an_earlier_one_left_and_keeps_the_live(
    server, agent, driver, dirs
):
    # given a running run of one rental
    live = desired_entry(str(uuid.uuid4()), script="import time; time.sleep(60)")
    server.desired = [live]
    assert agent().returncode == 0
    assert driver.state(live.run_id).status == "running"
    # and what an earlier agent left of rentals that are gone: a workspace, a quota image, a
    # stage dir with a sealed (read-only) directory, and the dataset cache's blobs
    volumes = dirs["volumes"]
    gone = volumes / str(uuid.uuid4())
    (gone / "checkpoints").mkdir(parents=True)
    (gone / "checkpoints" / "step_1.pt").write_bytes(b"weights")
    image = volumes / f"{uuid.uuid4()}.ext4"
    image.write_bytes(b"\0" * 16)
    stale = volumes / ".staging" / "r-stale-run" / "data" / "corpus"
    stale.mkdir(parents=True)
    stale.chmod(0o555)
    blob = dirs["state"] / "cache" / "blobs" / "ab" / ("ab" * 32)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(b"dataset")

    # when the agent starts again
    again = agent()
    assert again.returncode == 0, again.stderr

    # then the leftovers are gone, the live run's workspace stays, and so does the cache
    assert sorted(p.name for p in volumes.iterdir() if not p.name.startswith(".")) == [
        live.rental_id
    ]
    assert not (volumes / ".staging" / "r-stale-run").exists()
    assert blob.read_bytes() == b"dataset"
    assert driver.state(live.run_id).status == "running"


def test_metrics_beyond_one_heartbeat_are_delivered_once_in_order_across_restarts(
    server, agent, driver
):
    # given a run that prints 1200 metrics lines (and noise, which is not forwarded)
    script = (
        "import json, time\n"
        "for i in range(1200):\n"
        "    print(json.dumps({'step': i}))\n"
        "    print('plain text')\n"
        "time.sleep(30)\n"
    )
    entry = desired_entry(str(uuid.uuid4()), script=script)
    server.desired = [entry]
    assert agent().returncode == 0
    deadline = time.monotonic() + 15
    while len(driver.output_since(entry.run_id, None)[0]) < 2400:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # when the agent restarts for every heartbeat
    for _ in range(4):
        assert agent().returncode == 0
    # then each heartbeat carries at most 500 lines, and all arrive exactly once, in order
    sent = [[m["line"] for m in hb["metrics"]] for hb in server.heartbeats()]
    assert [len(lines) for lines in sent] == [0, 500, 500, 200, 0]
    assert [json.loads(line)["step"] for lines in sent for line in lines] == list(range(1200))


def test_every_output_line_reaches_the_live_log_once_numbered_across_restarts(
    server, agent, driver
):
    # given a run that prints 600 metrics and 600 plain lines, with a NUL among them
    script = (
        "import json, time\n"
        "for i in range(600):\n"
        "    print(json.dumps({'step': i}))\n"
        "    print(f'plain {i}' + ('\\x00' if i == 7 else ''))\n"
        "time.sleep(30)\n"
    )
    entry = desired_entry(str(uuid.uuid4()), script=script)
    server.desired = [entry]
    assert agent().returncode == 0
    # A wait, not a timing check: a busy machine takes long to start the run's interpreter.
    deadline = time.monotonic() + 90
    while len(driver.output_since(entry.run_id, None)[0]) < 1200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # when the agent restarts for every heartbeat
    for _ in range(4):
        assert agent().returncode == 0
    # then each heartbeat carries at most 400 lines, and every line arrives once, in order,
    # numbered by its place in the output, cleaned of control characters
    sent = [hb.get("logs", []) for hb in server.heartbeats()]
    assert [len(lines) for lines in sent] == [0, 400, 400, 400, 0]
    lines = [line for batch in sent for line in batch]
    assert [line["line_no"] for line in lines] == list(range(1200))
    assert {line["run_id"] for line in lines} == {entry.run_id}
    assert lines[1]["line"] == "plain 0" and json.loads(lines[2]["line"]) == {"step": 1}
    assert "\x00" not in lines[15]["line"] and lines[15]["line"].startswith("plain 7")
    # and the metrics went as before, all once
    steps = [json.loads(m["line"])["step"] for hb in server.heartbeats() for m in hb["metrics"]]
    assert steps == list(range(600))


def test_usage_waits_in_the_spool_while_the_server_is_down(server, agent, driver):
    server.desired = [desired_entry(str(uuid.uuid4()))]
    assert agent().returncode == 0
    # given the server answers 503
    server.heartbeat_status = 503
    down = agent()
    # then the round fails (non-zero with --once), after retrying
    assert down.returncode == 1
    assert "HTTP 503" in down.stderr
    failed = server.heartbeats()[-1]
    assert [u["seq"] for u in failed["usage"]] == [1]
    # when it is back, the spooled report is replayed with the new one, oldest first
    server.heartbeat_status = 200
    assert agent().returncode == 0
    assert [u["seq"] for u in server.heartbeats()[-1]["usage"]] == [1, 2]
    assert server.acked == 2
    # and the run was never touched meanwhile
    (state,) = driver.list_managed()
    assert state.status == "running"


def test_a_run_that_exits_on_its_own_is_reported_not_restarted(server, agent, driver):
    entry = desired_entry(str(uuid.uuid4()), script="print('{\"loss\": 0.5}'); raise SystemExit(3)")
    server.desired = [entry]
    assert agent().returncode == 0
    deadline = time.monotonic() + 15
    while driver.state(entry.run_id).status != "exited":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # still desired (the server has not seen the exit yet)
    assert agent().returncode == 0
    hb = server.heartbeats()[-1]
    (report,) = hb["containers"]
    assert (report["status"], report["exit_code"]) == ("exited", 3)
    assert hb["metrics"] == [
        {"rental_id": entry.rental_id, "run_id": entry.run_id, "line": '{"loss": 0.5}'}
    ]
    assert [u["final"] for u in hb["usage"]] == [True]
    # not restarted, and not removed while the server still lists it
    (state,) = driver.list_managed()
    assert (state.status, state.exit_code) == ("exited", 3)


def test_an_unchanged_desired_state_keeps_its_runs_and_a_changed_one_is_followed(
    server, agent_loop, driver
):
    """The server answers "unchanged" to the digest the agent sends back: the agent keeps
    running what it holds, starts nothing twice, and follows the next state that differs; a
    restarted agent sends no digest and gets the whole state."""
    server.digests = True
    entry = desired_entry(str(uuid.uuid4()))
    server.desired = [entry]

    def rounds(n: int) -> Callable[[], bool]:
        start = len(server.heartbeats())
        return lambda: len(server.heartbeats()) >= start + n

    status, stderr = agent_loop(rounds(6))
    assert status == 0, stderr
    sent = [hb.get("desired_digest", "") for hb in server.heartbeats()]
    assert sent[0] == "" and len(set(sent[1:])) == 1 and sent[1]
    (state,) = driver.list_managed()
    assert (state.run_id, state.status) == (entry.run_id, "running")
    started_at = state.started_at

    # A restart: no digest first, the whole state again, the run adopted (not started again);
    # then the state changes (nothing is desired): the agent follows the new digest's state.
    before = len(server.heartbeats())

    def changed_then_stopped() -> bool:
        if len(server.heartbeats()) >= before + 3:
            server.desired = []
        return not server.desired and driver.state(entry.run_id).status != "running"

    status, stderr = agent_loop(changed_then_stopped)
    assert status == 0, stderr
    sent = [hb.get("desired_digest", "") for hb in server.heartbeats()[before:]]
    assert sent[0] == "" and sent[1] == sent[2] != ""
    assert server.heartbeats()[before + 2]["containers"][0]["started_at"] == started_at


def test_a_run_that_cannot_start_is_reported_missing(server, agent_loop, driver):
    entry = desired_entry(str(uuid.uuid4()), command=())  # the process driver needs a command
    server.desired = [entry]

    def missing_reported() -> bool:
        reports = [c for hb in server.heartbeats() for c in hb["containers"]]
        return any(c["status"] == "missing" for c in reports)

    status, stderr = agent_loop(missing_reported)
    assert status == 0, stderr
    # the next round tells the server, with the reason in the log tail
    report = next(
        c for hb in server.heartbeats() for c in hb["containers"] if c["status"] == "missing"
    )
    assert report["run_id"] == entry.run_id and report["rental_id"] == entry.rental_id
    assert "needs a command" in report["log_tail"]


def test_a_refused_heartbeat_is_sent_again_after_the_retry_after_not_within_the_call(
    server, agent_loop
):
    # given a server that refuses the first heartbeat: come back in 2 s, then every 3 s
    server.refusals = [HeartbeatRefusal(detail="busy", retry_after_s=2, heartbeat_interval_s=3)]
    status, stderr = agent_loop(lambda: len(server.heartbeats()) >= 2)
    assert status == 0, stderr
    # then the refused heartbeat was not resent within the call: the next one is the next
    # round's, sent once the Retry-After had passed (the loop's own interval is 0.2 s)
    first, second = [r for r in server.fake.requests if r.path == HEARTBEAT_PATH][:2]
    assert second.at - first.at >= 2.0
    assert "heartbeat refused: server busy" in stderr


def test_a_run_that_exits_between_rounds_is_reported_at_once_whatever_the_interval(
    server, agent_loop
):
    # given a server asking for a heartbeat a minute, and a run that exits after a second
    server.interval = 60
    entry = desired_entry(
        str(uuid.uuid4()), script="import time; time.sleep(1); raise SystemExit(4)"
    )
    server.desired = [entry]

    def reported(status: str) -> Callable[[], bool]:
        return lambda: any(
            c["status"] == status for hb in server.heartbeats() for c in hb["containers"]
        )

    # then its start and its exit each reach the server at once, not a minute later
    status, stderr = agent_loop(reported("exited"))
    assert status == 0, stderr
    assert reported("running")()
    exit_report = next(
        c for hb in server.heartbeats() for c in hb["containers"] if c["status"] == "exited"
    )
    assert exit_report["exit_code"] == 4


def test_runs_handed_over_together_are_reported_running_in_one_heartbeat(
    server, agent_loop, driver
):
    # Given an answer that hands over two runs, and no regular round for a minute
    entries = [desired_entry(str(uuid.uuid4()), gpu_indices=(gpu,)) for gpu in (0, 1)]
    server.desired = entries
    server.interval = 60

    def reported() -> list[set[str]]:
        return [
            {c["run_id"] for c in hb["containers"] if c["status"] == "running"}
            for hb in server.heartbeats()
        ]

    # When both start
    status, stderr = agent_loop(lambda: any(reported()))
    assert status == 0, stderr
    # Then the heartbeat their starts bring reports both RUNNING at once
    first = next(runs for runs in reported() if runs)
    assert first == {entry.run_id for entry in entries}


def test_revoked_token_exits_non_zero_without_retrying(server, agent):
    assert agent().returncode == 0
    server.token = "gpn_other"  # the stored token was revoked
    before = len(server.heartbeats())
    revoked = agent()
    assert revoked.returncode == 3
    assert "node token rejected" in revoked.stderr
    assert len(server.heartbeats()) == before + 1


def test_refused_join_exits_with_the_servers_message(server, agent, dirs):
    refused = agent("--join-token", "gpj_wrong")
    assert refused.returncode == 3
    assert "invalid, used or expired join token" in refused.stderr
    assert not (dirs["state"] / "node_token.json").exists()


def test_loop_runs_the_requested_benchmark_and_stops_on_sigterm(server, agent_loop, tmp_path):
    server.run_benchmark = True
    ran = tmp_path / "ran"
    command = f"python -c 'open({str(ran)!r}, \"w\")'"

    def benchmarks() -> list[dict[str, Any]]:
        return [hb["benchmark"] for hb in server.heartbeats() if "benchmark" in hb]

    status, stderr = agent_loop(benchmarks, "--benchmark-command", command)
    # A host of simulated A100s has no card to measure: it reports the simulated card's figure
    # (62-78 % of the A100's 312 dense TFLOPS), marked as such, and runs no command.
    result = benchmarks()[0]
    assert result["simulated"] is True
    assert 0.6 * 312 <= result["matmul_tflops"] <= 0.8 * 312
    assert not ran.exists()
    assert status == 0, stderr
    assert "agent stopping" in stderr
    # structured logs: key=value lines
    assert any(line.startswith("ts=") and " level=" in line for line in stderr.splitlines())


def test_a_join_whose_answer_is_lost_is_repeated_with_the_hosts_own_key(server, agent_loop, dirs):
    # Given a server that answers the first join only after the agent gave up waiting
    answered = server.join
    calls: list[dict[str, Any]] = []

    def slow_first(request: Any) -> tuple:
        calls.append(request.body)
        return (*answered(request), 3.0) if len(calls) == 1 else answered(request)

    server.fake.on(JOIN_PATH, slow_first)
    code, stderr = agent_loop(
        lambda: (dirs["state"] / "node_token.json").exists(), "--request-timeout", "1"
    )
    # Then the agent tried again with the same token and the same key, and joined
    assert code == 0, stderr
    assert len(calls) == 2 and "retrying" in stderr
    first, second = calls
    assert first == second
    assert len(first["host_key"]) >= 32
    assert (dirs["state"] / "host_key").read_text().strip() == first["host_key"]
    # and said what it can run: local processes, so no SSH and no filtered internet
    assert (first["runtime"], first["ssh"], first["internet_filtered"]) == (
        "process",
        False,
        False,
    )
    assert json.loads((dirs["state"] / "node_token.json").read_text())["node_id"] == NODE_ID


def test_the_host_key_survives_a_restart(server, agent, dirs):
    assert agent().returncode == 0
    key = (dirs["state"] / "host_key").read_text()
    (dirs["state"] / "node_token.json").unlink()  # lost its node token: joins again
    assert agent().returncode == 0
    joins = server.fake.bodies(JOIN_PATH)
    assert [j["host_key"] for j in joins] == [key.strip()] * 2
    assert stat.S_IMODE((dirs["state"] / "host_key").stat().st_mode) == 0o600


def test_the_agent_masks_secret_values_before_sending_even_after_a_restart(
    server, agent_loop, driver
):
    # given a run whose secret it prints, as a plain line, a metric and in its exit
    secret = "s3cret-Value-42"
    script = (
        "import json, os, time\n"
        "v = os.environ['API_TOKEN']\n"
        "print(json.dumps({'event': 'note', 'step': 1, 'msg': v}), flush=True)\n"
        "print('token', v, flush=True)\n"
        "time.sleep(2)\n"
        "raise SystemExit('bad ' + v)\n"
    )
    entry = desired_entry(
        str(uuid.uuid4()),
        script=script,
        secrets=(SecretValue(name="API_TOKEN", value=secret, env="API_TOKEN"),),
    )
    server.desired = [entry]

    def sent() -> str:
        return json.dumps(server.heartbeats())

    # when the agent runs it, and a restarted agent reads its output and reports its exit
    status, stderr = agent_loop(lambda: "token ****" in sent())
    assert status == 0, stderr

    def exited() -> bool:
        return any(c["status"] == "exited" for hb in server.heartbeats() for c in hb["containers"])

    status, stderr = agent_loop(exited)
    assert status == 0, stderr
    # then nothing it sent holds the value: lines, metrics and the log tail are masked
    assert secret not in sent()
    metrics = [json.loads(m["line"]) for hb in server.heartbeats() for m in hb["metrics"]]
    assert {"event": "note", "step": 1, "msg": "****"} in metrics
    tails = [c.get("log_tail", "") for hb in server.heartbeats() for c in hb["containers"]]
    assert any("bad ****" in tail for tail in tails)
