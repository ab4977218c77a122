"""The agent's metrics port, its flags and its JSON log lines."""

from __future__ import annotations

import json
import logging
import socket

import pytest
import requests
import structlog

from agentprotocol import ContainerStatus
from nodeagent import metrics
from nodeagent.config import ConfigError, load_config
from nodeagent.logs import configure_logging

BASE = ["--server", "http://127.0.0.1:1", "--runtime", "process", "--gpu-mode", "none",
        "--telemetry", "simulated", "--simulate-gpus", "rtx4090-24gb:1"]  # fmt: skip


def test_metrics_flags_default_off_and_on_loopback():
    config = load_config(BASE, environ={})
    assert (config.metrics_port, config.metrics_address, config.log_format) == (
        0,
        "127.0.0.1",
        "logfmt",
    )
    config = load_config([*BASE, "--metrics-port", "9101", "--log-format", "json"], environ={})
    assert (config.metrics_port, config.log_format) == (9101, "json")
    with pytest.raises(ConfigError, match="metrics-port"):
        load_config([*BASE, "--metrics-port", "http"], environ={})


def test_metrics_port_serves_the_agent_metrics():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve(port=port, address="127.0.0.1")
    metrics.containers_observe([ContainerStatus.RUNNING, ContainerStatus.RUNNING])
    metrics.SPOOL_DEPTH.set(3)
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert 'gpumarket_agent_containers{state="running"} 2.0' in text
    assert 'gpumarket_agent_containers{state="exited"} 0.0' in text
    assert "gpumarket_agent_spool_depth 3.0" in text


def test_json_log_lines_carry_extras_and_the_bound_node_id(capsys):
    configure_logging("info", log_format="json")
    structlog.contextvars.bind_contextvars(node_id=7)
    try:
        logging.getLogger("nodeagent.test").info("starting run", extra={"rental_id": "r-1"})
    finally:
        structlog.contextvars.clear_contextvars()
        configure_logging("info")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "starting run"
    assert (line["rental_id"], line["node_id"], line["level"]) == ("r-1", 7, "info")
