"""The agent protocol's messages: payload round trips, defaults, and errors naming the field."""

from __future__ import annotations

import pytest

from agentprotocol import (
    ContainerReport,
    ContainerStatus,
    DesiredRun,
    Heartbeat,
    HeartbeatAnswer,
    MetricLine,
    ProtocolError,
    UsageReport,
)


def test_desired_entry_parses_the_server_payload():
    entry = {
        "rental_id": "9b2c",
        "run_id": "r9b2c-n1",
        "image": "gpumarket/harness:1",
        "command": ["python", "-m", "harness"],
        "env": {"A": "1"},
        "gpu_indices": [0, 1],
        "gpu_uuids": ["GPU-a", "GPU-b"],
        "cpu_limit": 4.0,
        "memory_limit_mb": 8192,
        "ports": [8888],
        "stop_grace_s": 30.0,
    }
    run = DesiredRun.from_payload(entry)
    assert run == DesiredRun(
        rental_id="9b2c",
        run_id="r9b2c-n1",
        image="gpumarket/harness:1",
        command=("python", "-m", "harness"),
        env={"A": "1"},
        gpu_indices=(0, 1),
        gpu_uuids=("GPU-a", "GPU-b"),
        cpu_limit=4.0,
        memory_limit_mb=8192,
        ports=(8888,),
        stop_grace_s=30.0,
    )
    # and stop_grace_s defaults to 30 s when the server leaves it out
    del entry["stop_grace_s"]
    assert DesiredRun.from_payload(entry).stop_grace_s == 30.0


@pytest.mark.parametrize(
    "broken",
    [
        {"run_id": "x", "cpu_limit": 1, "memory_limit_mb": 1},  # no rental_id
        {"rental_id": "r", "run_id": 5, "cpu_limit": 1, "memory_limit_mb": 1},
        {"rental_id": "r", "run_id": "x", "cpu_limit": "many", "memory_limit_mb": 1},
        {"rental_id": "r", "run_id": "x", "cpu_limit": 1, "memory_limit_mb": 1, "env": ["A=1"]},
    ],
)
def test_desired_entry_rejects_malformed_payloads(broken):
    with pytest.raises(ValueError, match="bad desired entry"):
        DesiredRun.from_payload(broken)


def test_a_bad_field_is_named_with_its_place_in_the_message():
    run = {**DesiredRun(
        rental_id="r", run_id="x", image="i", command=(), env={}, gpu_indices=(0,),
        gpu_uuids=(), cpu_limit=1.0, memory_limit_mb=64, ports=(),
    ).to_payload(), "gpu_indices": [0, "1"]}  # fmt: skip
    answer = {"desired": [run], "ack_usage_seq": 0, "heartbeat_interval_s": 5, "run_benchmark": 0}
    with pytest.raises(ProtocolError) as raised:
        HeartbeatAnswer.from_payload(answer)
    assert raised.value.field == "desired[0].gpu_indices[1]"
    assert (
        str(raised.value)
        == "bad heartbeat answer: desired[0].gpu_indices[1]: expected int, got str"
    )
    # and a bool is not an integer, nor an integer a bool
    with pytest.raises(ProtocolError, match="run_benchmark: expected bool, got int"):
        HeartbeatAnswer.from_payload({**answer, "desired": []})


def test_a_bad_desired_entry_can_be_dropped_without_refusing_the_answer():
    good = {
        "rental_id": "r", "run_id": "good", "image": "i", "command": [], "env": {},
        "gpu_indices": [0], "gpu_uuids": [], "cpu_limit": 1, "memory_limit_mb": 64, "ports": [],
    }  # fmt: skip
    bad = {**good, "run_id": "bad", "env": ["A=1"]}
    payload = {
        "desired": [bad, good], "ack_usage_seq": 7, "heartbeat_interval_s": 5,
        "run_benchmark": False,
    }  # fmt: skip
    dropped: list[ProtocolError] = []
    answer = HeartbeatAnswer.from_payload(payload, on_bad_run=dropped.append)
    assert [run.run_id for run in answer.desired] == ["good"]
    assert answer.ack_usage_seq == 7 and answer.heartbeat_interval_s == 5.0
    assert [error.field for error in dropped] == ["env"]
    # without the callback the whole answer is refused
    with pytest.raises(ProtocolError, match=r"desired\[0\]\.env"):
        HeartbeatAnswer.from_payload(payload)


def test_a_report_says_only_what_it_has_to_say():
    running = ContainerReport(rental_id="r", run_id="x", status=ContainerStatus.RUNNING)
    assert running.to_payload() == {
        "rental_id": "r",
        "run_id": "x",
        "status": "running",
        "exit_code": None,
        "started_at": None,
        "finished_at": None,
    }
    exited = ContainerReport(
        rental_id="r", run_id="x", status=ContainerStatus.EXITED, exit_code=1, log_tail="boom\n"
    )
    assert exited.to_payload()["log_tail"] == "boom\n"
    assert ContainerReport.from_payload(exited.to_payload()) == exited
    with pytest.raises(ProtocolError, match="status: 'paused' is not one of"):
        ContainerReport.from_payload({**running.to_payload(), "status": "paused"})


def test_heartbeat_round_trip_and_unknown_keys_are_ignored():
    heartbeat = Heartbeat(
        agent_version="1.0",
        sent_at=5.0,
        usage=(
            UsageReport(
                seq=1, rental_id="r", run_id="x", gpu_count=2, started_at=1.0, confirmed_at=2.0
            ),
        ),
        metrics=(MetricLine(rental_id="r", run_id="x", line='{"step": 1}'),),
        benchmark={"matmul_tflops": 12.5, "precision": "bf16"},
    )
    payload = heartbeat.to_payload()
    assert payload["usage"] == [
        {
            "seq": 1,
            "rental_id": "r",
            "run_id": "x",
            "gpu_count": 2,
            "started_at": 1.0,
            "confirmed_at": 2.0,
            "final": False,
        }
    ]
    assert Heartbeat.from_payload({**payload, "from_a_newer_agent": 1}) == heartbeat
    # a heartbeat without a benchmark does not carry the key
    assert "benchmark" not in Heartbeat(sent_at=1.0).to_payload()
    with pytest.raises(ProtocolError, match="bad heartbeat: \\(payload\\): must be an object"):
        Heartbeat.from_payload([])
