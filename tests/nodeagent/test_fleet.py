"""Several simulated hosts' agents in one process (`nodeagent.fleet`), as the dev stack runs
its demo inventory: each host joins as itself, and one that ends stops the fleet."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentprotocol import HEARTBEAT_PATH, JOIN_PATH, HeartbeatAnswer, JoinAnswer
from nodeagent.config import ConfigError
from nodeagent.fleet import fleet_configs

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path, hosts: dict[str, str]) -> dict[str, Any]:
    return {
        "server": "http://127.0.0.1:9",
        "nodes": [
            {"hostname": h, "simulate_gpus": gpus, "join_token": f"gpj_{h}",
             "dir": str(tmp_path / h)}
            for h, gpus in hosts.items()
        ],
    }  # fmt: skip


def test_each_host_is_a_whole_agent_with_its_own_folders(tmp_path):
    spec = _spec(tmp_path, {"h100-a": "h100-sxm5-80gb:8", "t4-b": "t4-16gb:4"})
    a, b = fleet_configs(spec, ["--interval", "1"])
    assert (a.hostname, a.simulate_gpus, a.join_token) == (
        "h100-a",
        "h100-sxm5-80gb:8",
        "gpj_h100-a",
    )
    assert (a.runtime, a.gpu_mode, a.telemetry, a.publish) == ("process", "none", "simulated", None)
    assert a.state_dir == str(tmp_path / "h100-a" / "state")
    assert b.process_dir == str(tmp_path / "t4-b" / "runs")
    assert a.interval_s == b.interval_s == 1.0


@pytest.mark.parametrize(
    "spec",
    [{}, {"server": "http://s"}, {"server": "http://s", "nodes": []}, {"server": "http://s",
     "nodes": [{"hostname": "x"}]}, {"server": "http://s", "nodes": [{"hostname": "x",
     "simulate_gpus": "nope", "join_token": "t", "dir": "/tmp/x"}]}],
)  # fmt: skip
def test_a_bad_fleet_file_is_refused_with_a_reason(spec):
    with pytest.raises(ConfigError):
        fleet_configs(spec)


def test_the_hosts_join_and_heartbeat_and_one_refused_stops_the_fleet(fake_server, tmp_path):
    # Given a server that accepts one host and refuses the other's join token
    joined: dict[str, int] = {}

    def join(request: Any) -> tuple[int, Any]:
        host = request.body["hostname"]
        if host == "refused":
            return 400, {"join_token": ["invalid, used or expired join token"]}
        joined.setdefault(host, len(joined) + 1)
        answer = JoinAnswer(node_id=joined[host], node_token=f"gpn_{host}", heartbeat_interval_s=1)
        return 201, answer.to_payload()

    fake_server.on(JOIN_PATH, join)
    fake_server.on(
        HEARTBEAT_PATH,
        lambda r: (
            200,
            HeartbeatAnswer(desired=(), ack_usage_seq=0, heartbeat_interval_s=1).to_payload(),
        ),
    )
    spec = _spec(tmp_path, {"good-1": "a100-sxm4-80gb:2", "good-2": "t4-16gb:1"})
    spec["server"] = fake_server.url
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(spec))
    fleet = subprocess.Popen(
        [sys.executable, "-m", "nodeagent.fleet", str(path), "--interval", "0.2"],
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while len(fake_server.bodies(HEARTBEAT_PATH)) < 4:
            assert fleet.poll() is None, fleet.communicate()
            assert time.monotonic() < deadline, "the hosts never heartbeat"
            time.sleep(0.05)
        assert set(joined) == {"good-1", "good-2"}
        tokens = {
            b.headers.get("Authorization") for b in fake_server.requests if b.path == HEARTBEAT_PATH
        }
        assert tokens == {"Bearer gpn_good-1", "Bearer gpn_good-2"}
    finally:
        fleet.terminate()
        _, stderr = fleet.communicate(timeout=30)
    assert fleet.returncode == 0, stderr

    # When one host's join is refused, the fleet stops the others and says which, non-zero
    spec["nodes"].append(
        {"hostname": "refused", "simulate_gpus": "t4-16gb:1", "join_token": "gpj_x",
         "dir": str(tmp_path / "refused")}
    )  # fmt: skip
    path.write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, "-m", "nodeagent.fleet", str(path), "--interval", "0.2"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "an agent ended: stopping the fleet" in done.stderr and "host=refused" in done.stderr
