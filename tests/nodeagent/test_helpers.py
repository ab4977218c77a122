"""Small pieces of the agent: host facts, benchmark parsing, log format, payload limits."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from agentprotocol import BenchmarkSpec
from nodeagent import hostinfo
from nodeagent.agent import (
    LOG_TAIL_MAX_BYTES,
    Agent,
    Credentials,
    load_credentials,
    metric_lines,
    save_credentials,
    trim_log_tail,
)
from nodeagent.benchmark import (
    DEFAULT_COMMAND,
    BenchmarkRunner,
    benchmark_command,
    benchmark_env,
    parse_result,
)
from nodeagent.config import ConfigError, load_config
from nodeagent.logs import KeyValueFormatter


def test_host_facts(tmp_path):
    assert hostinfo.cpu_cores() >= 1
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  1000 kB\nMemTotal:       65843212 kB\n")
    assert hostinfo.ram_gb(str(meminfo)) == 62
    assert hostinfo.ram_gb() >= 1
    # a volume root that does not exist yet: the filesystem it will be created on
    assert hostinfo.disk_gb(str(tmp_path / "not" / "yet")) == hostinfo.disk_gb(str(tmp_path))


def test_credentials_round_trip_and_damage(tmp_path):
    assert load_credentials(str(tmp_path)) is None
    save_credentials(str(tmp_path), Credentials(3, "gpn_x"), server_url="http://s")
    assert load_credentials(str(tmp_path)) == Credentials(3, "gpn_x")
    (tmp_path / "node_token.json").write_text("{}")
    with pytest.raises(ConfigError, match="damaged"):
        load_credentials(str(tmp_path))


def is_metric_line(line: str) -> bool:
    return metric_lines([line])[0] == [line]


def test_metric_lines_are_json_objects_of_at_most_4_kb():
    assert is_metric_line('{"event": "step", "loss": 1.5}')
    assert not is_metric_line("epoch 1 done")
    assert not is_metric_line("[1, 2]")
    assert not is_metric_line('{"broken": ')
    big = json.dumps({"blob": "x" * 4096})
    assert not is_metric_line(big)
    # the limit counts bytes, not characters
    assert is_metric_line(json.dumps({"b": "é" * 2000}, ensure_ascii=False))
    assert not is_metric_line(json.dumps({"b": "é" * 2100}, ensure_ascii=False))


def test_output_that_looks_like_a_metric_and_is_not_one_is_counted_never_raised():
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    hostile = [
        deep,
        '{"a": ' + "[" * 1100,  # unterminated
        '{"step": 3000000000}',
        '{"step": -1}',
        '{"step": 1.5}',
        '{"loss": NaN}',
        '{"loss": Infinity}',
        '{"loss": 1e999}',
        '{"event": "x\u0000y"}',
        '{"event": "\ud800"}',
        "{" + "x" * 1_000_000,
        '{"a": {"b": {"c": {"d": {"e": 1}}}}}',
    ]
    plain = ["epoch 1 done", "\ufffd\ufffd invalid utf-8 replaced", "[1, 2]"]
    good = '{"event": "step", "step": 2147483647, "loss": 2.5, "config": {"model": {"w": [1]}}}'
    assert metric_lines([*hostile, *plain, good]) == ([good], len(hostile))


def test_log_tail_has_no_control_characters():
    assert trim_log_tail("a\x00b\x1bc\n\tok\r\n") == "a\ufffdb\ufffdc\n\tok\r\n"


def test_log_tail_keeps_the_last_50_lines_within_8_kb():
    text = "".join(f"line {i}\n" for i in range(200))
    assert trim_log_tail(text) == "".join(f"line {i}\n" for i in range(150, 200))
    wide = "".join("é" * 300 + "\n" for _ in range(50))
    trimmed = trim_log_tail(wide)
    assert len(trimmed.encode()) <= LOG_TAIL_MAX_BYTES
    assert wide.endswith(trimmed)


def test_benchmark_result_is_the_last_json_object_with_tflops():
    out = 'warming up\n{"event": "benchmark", "matmul_tflops": 19.5, "precision": "bf16"}\n'
    assert parse_result(out) == {"event": "benchmark", "matmul_tflops": 19.5, "precision": "bf16"}
    with pytest.raises(ValueError, match="no JSON result"):
        parse_result("Traceback ...\n")
    with pytest.raises(ValueError, match="positive matmul_tflops"):
        parse_result('{"matmul_tflops": 0}\n')


def test_benchmark_env_hides_gpus_in_simulated_mode():
    env = benchmark_env(gpu_mode="none", base={"PYTHONPATH": "/x"})
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"].endswith(":/x")
    assert "CUDA_VISIBLE_DEVICES" not in benchmark_env(gpu_mode="nvidia", base={})


def test_failed_benchmark_is_not_sent_and_cools_down():
    now = [0.0]
    failing = BenchmarkSpec(image="img", command=("python", "-c", "raise SystemExit(4)"))
    runner = BenchmarkRunner(
        runtime="process",
        env=benchmark_env(gpu_mode="none"),
        retry_after_s=60,
        clock=lambda: now[0],
    )
    assert runner.request(failing) is True
    assert runner.command[0] == sys.executable
    runner.wait(30)
    assert runner.result() is None
    # asked again at once: not rerun; after the cool-down: rerun
    assert runner.request(failing) is False
    now[0] = 61.0
    assert runner.request(failing) is True
    runner.wait(30)


def test_the_benchmark_command_is_the_server_s_spec():
    # given the server's spec naming the harness image, its command and GPU 2
    spec = BenchmarkSpec(
        image="gpumarket/harness@sha256:abc",
        command=("python", "-m", "harness", "benchmark", "--quick"),
        gpu_indices=(2,),
    )
    # then on Docker the pinned image runs on that GPU, without network
    assert benchmark_command(spec, runtime="docker") == (
        ["docker", "run", "--rm", "--network", "none", "--gpus", "device=2",
         "gpumarket/harness@sha256:abc", "python", "-m", "harness", "benchmark", "--quick"],
        {},
    )  # fmt: skip
    # and on the local-process runtime the command runs with the agent's interpreter there
    command, env = benchmark_command(spec, runtime="process")
    assert command == [sys.executable, "-m", "harness", "benchmark", "--quick"]
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    # an older server that names no spec gets the harness the agent ships with
    assert benchmark_command(None, runtime="docker")[0][1:] == ["-m", "harness", "benchmark",
                                                                "--quick"]  # fmt: skip


def test_key_value_log_lines():
    record = logging.LogRecord("nodeagent", logging.INFO, "", 0, "stopping run", (), None)
    record.run_id = "r1-n2"
    record.error = 'bad "quote"\nnext'
    line = KeyValueFormatter().format(record)
    assert line.startswith("ts=")
    assert ' level=info logger=nodeagent msg="stopping run" run_id=r1-n2 ' in line
    assert line.endswith(r'error="bad \"quote\"\nnext"')


def test_a_provider_s_benchmark_command_cannot_change_the_measured_score(tmp_path):
    # given a simulated H100 host that overrides the benchmark command with one printing a
    # huge score
    forged = 'python -c \'print("{\\"matmul_tflops\\": 99999.0}")\''
    config = load_config(
        ["--server", "http://s", "--runtime", "process", "--gpu-mode", "none",
         "--telemetry", "simulated", "--simulate-gpus", "h100-sxm5-80gb:2",
         "--hostname", "sim-9", "--state-dir", str(tmp_path / "state"),
         "--volume-root", str(tmp_path / "vol"), "--process-dir", str(tmp_path / "runs"),
         "--benchmark-command", forged],
        environ={},
    )  # fmt: skip
    assert config.benchmark_command[-1].endswith('99999.0}")')
    agent = Agent(config)
    # when the server asks for the platform's benchmark
    spec = BenchmarkSpec(image="gpumarket/harness:dev", command=DEFAULT_COMMAND)
    runner = agent._benchmark
    assert runner.request(spec) is True
    runner.wait(30)
    # then the score is the platform's figure for the card (62-78 % of its 989 TFLOPS), not the
    # host's, and the host's command never ran
    result = runner.result()
    assert result is not None and result["simulated"] is True
    assert 0.6 * 989 <= result["matmul_tflops"] <= 0.8 * 989
    assert "99999" not in " ".join(runner.command)


@pytest.mark.parametrize(
    ("status", "explanation", "kind", "says"),
    [
        (500, "Head ...: no basic auth credentials", "PermanentRuntimeError", "asked for"),
        (500, "unauthorized: authentication required", "PermanentRuntimeError", "secret REG"),
        (404, "manifest for r/x:1 not found: manifest unknown", "ImageNotFoundError", "not found"),
        (500, "connection reset by peer", "RetryableRuntimeError", "reset"),
        (403, "Forbidden", "PermanentRuntimeError", "asked for"),
        # digits of a digest are no status: the reset stays worth a retry
        (500, "sha256:a404b: connection reset", "RetryableRuntimeError", "a404b"),
    ],
)
def test_a_refused_pull_says_why_and_is_permanent(status, explanation, kind, says):
    import docker.errors
    import requests

    from agentprotocol import RegistryAuth
    from nodeagent.runtime.docker import classify_docker_error, pull_error

    response = requests.Response()
    response.status_code = status
    api_error = docker.errors.APIError("pull", response=response, explanation=explanation)
    classified = classify_docker_error(api_error)
    classified.__cause__ = api_error
    auth = RegistryAuth(secret="REG", username="me", password="pw") if "REG" in says else None
    error = pull_error("r/x:1", auth, classified)
    assert type(error).__name__ == kind
    assert says in str(error) and "pw" not in str(error)


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("pull access denied for r/x, repository does not exist", "ImageNotFoundError"),
        ("invalid reference format", "ImageNotFoundError"),
        ("unauthorized: authentication required", "ImageNotFoundError"),
        ("read sha256:404404: connection reset by peer", "RetryableRuntimeError"),
    ],
)
def test_an_error_in_a_pull_stream_is_read_with_the_same_table(message, kind):
    from nodeagent.runtime.docker import classify_pull_error

    error = classify_pull_error("r/x:1", message)
    assert type(error).__name__ == kind and message in str(error)
