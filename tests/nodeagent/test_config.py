"""Configuration: flags, then GPUMARKET_* environment, then defaults."""

from __future__ import annotations

import shlex
import sys

import pytest

from nodeagent.config import ConfigError, load_config

SIMULATED = ["--telemetry", "simulated", "--gpu-mode", "none", "--simulate-gpus", "t4-16gb:1"]


def test_defaults_for_a_real_gpu_host():
    config = load_config(["--server", "https://market.example"], environ={})
    assert config.server_url == "https://market.example"
    assert config.join_token is None
    assert (config.runtime, config.gpu_mode, config.telemetry) == ("docker", "nvidia", "nvml")
    assert config.state_dir == "/var/lib/gpumarket-agent"
    assert config.volume_root == "/var/lib/gpumarket-volumes"
    assert config.interval_s == 5.0 and config.request_timeout_s == 10.0
    assert config.benchmark_command == ("python", "-m", "harness", "benchmark", "--quick")
    assert config.once is False
    assert config.hostname  # this host's name
    # isolation: the harness image only, the filtered internet offered, a 50 GiB workspace,
    # never root
    assert config.image_allow == ("gpumarket/harness:*",)
    assert config.network_policy == "internet"
    assert config.disk_quota_mb == 50 * 1024
    assert config.container_user == "1000:1000"
    # the cache of staged datasets and checkpoints: 100 GiB
    assert config.cache_max_bytes == 100 * 1024**3


def test_isolation_settings_from_flags_and_environment():
    environ = {
        "GPUMARKET_IMAGE_ALLOW": "gpumarket/harness:*, nvcr.io/nvidia/pytorch:24.*=0:0 ,",
        "GPUMARKET_DISK_QUOTA_GB": "0",
        "GPUMARKET_CACHE_GB": "2.5",
    }
    config = load_config(
        ["--server", "http://s", "--network-policy", "internal", "--container-user", "2000:2000"],
        environ=environ,
    )
    assert config.image_allow == ("gpumarket/harness:*", "nvcr.io/nvidia/pytorch:24.*=0:0")
    assert config.network_policy == "internal"
    assert config.disk_quota_mb is None  # 0: no quota
    assert config.container_user == "2000:2000"
    assert config.cache_max_bytes == int(2.5 * 1024**3)


def test_egress_is_the_old_name_of_internet():
    config = load_config(["--server", "http://s"], environ={"GPUMARKET_NETWORK_POLICY": "egress"})
    assert config.network_policy == "internet"


def test_environment_fills_in_and_flags_win():
    environ = {
        "GPUMARKET_SERVER_URL": "http://env:8000",
        "GPUMARKET_JOIN_TOKEN": "gpj_env",
        "GPUMARKET_INTERVAL": "2.5",
        "GPUMARKET_HOSTNAME": "env-host",
        "GPUMARKET_RUNTIME": "process",
    }
    config = load_config(["--join-token", "gpj_flag", *SIMULATED, "--once"], environ=environ)
    assert config.server_url == "http://env:8000"
    assert config.join_token == "gpj_flag"
    assert config.interval_s == 2.5
    assert config.hostname == "env-host"
    assert config.runtime == "process"
    assert config.once is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no server"),
        (["--server", "http://s", "--telemetry", "simulated"], "--gpu-mode nvidia goes with"),
        (["--server", "http://s", "--gpu-mode", "none"], "--gpu-mode nvidia goes with"),
        (
            ["--server", "http://s", "--telemetry", "simulated", "--gpu-mode", "none"],
            "--simulate-gpus",
        ),
        (["--server", "http://s", "--interval", "0"], "must be positive"),
        (["--server", "http://s", "--interval", "soon"], "not a number"),
        (["--server", "http://s", "--runtime", "process"], "simulated GPUs only"),
        (["--server", "http://s", "--disk-quota-gb", "0.001"], "at least 16 MiB"),
        (["--server", "http://s", "--disk-quota-gb", "-1"], "at least 16 MiB"),
        (["--server", "http://s", "--cache-gb", "0"], "--cache-gb must be positive"),
        (["--server", "http://s", "--max-image-gb", "-1"], "0 \\(none\\) or positive"),
    ],
)
def test_unusable_configurations_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv, environ={})


def test_the_image_cache_and_size_limit_from_flags_or_environment():
    default = load_config(["--server", "http://s"], environ={})
    assert (default.image_cache_bytes, default.max_image_bytes) == (200 * 10**9, None)
    assert default.pinned_images == ("gpumarket/harness:*",)
    config = load_config(
        ["--server", "http://s", "--max-image-gb", "20", "--pinned-images", "a/*, b:1"],
        environ={"GPUMARKET_IMAGE_CACHE_GB": "0"},
    )
    assert (config.image_cache_bytes, config.max_image_bytes) == (None, 20 * 10**9)
    assert config.pinned_images == ("a/*", "b:1")


def test_benchmark_command_is_split_like_a_shell(tmp_path):
    command = (
        f"docker run --rm --gpus all 'img:1' python -m harness benchmark --quick {sys.executable}"
    )
    config = load_config(["--server", "http://s", "--benchmark-command", command], environ={})
    assert config.benchmark_command == tuple(shlex.split(command))


def test_the_cluster_to_join_from_flags_or_environment():
    base = ["--server", "https://m.example"]
    # None by default: the node joins on its own
    assert load_config(base, environ={}).cluster is None
    config = load_config(
        [
            *base,
            "--cluster",
            "h100-ib",
            "--interconnect",
            "infiniband",
            "--interconnect-gbps",
            "400",
        ],
        environ={},
    )
    assert (config.cluster, config.interconnect, config.interconnect_gbps) == (
        "h100-ib",
        "infiniband",
        400,
    )
    config = load_config(base, environ={"GPUMARKET_CLUSTER": "ib"})
    assert (config.cluster, config.interconnect, config.interconnect_gbps) == ("ib", None, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cluster", "H100 IB"], "--cluster must be lower-case"),
        (["--cluster", "ib", "--interconnect", "token-ring", "--interconnect-gbps", "4"],
         "--interconnect must be one of"),
        (["--cluster", "ib", "--interconnect", "ethernet"], "together"),
        (["--cluster", "ib", "--interconnect", "ethernet", "--interconnect-gbps", "0"],
         "--interconnect-gbps must be a positive"),
        (["--interconnect", "ethernet", "--interconnect-gbps", "25"], "give --cluster too"),
    ],
)  # fmt: skip
def test_a_bad_cluster_flag_is_refused_saying_which(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--server", "https://m.example", *extra], environ={})
