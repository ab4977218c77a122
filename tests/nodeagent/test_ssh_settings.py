"""The agent's SSH settings: where published ports listen, and which key lines reach sshd."""

from __future__ import annotations

import pytest

from nodeagent.config import ConfigError, load_config
from nodeagent.publish import PublishConfig
from nodeagent.runtime.sshd import authorized_keys, launch_environment

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"


def test_ports_are_published_on_the_hostname_from_the_default_range():
    config = load_config(["--server", "https://m.example", "--hostname", "gpu-1"], environ={})
    assert config.publish == PublishConfig(
        address="0.0.0.0", host="gpu-1", first_port=42000, last_port=42999
    )


def test_publish_settings_from_the_environment_and_off():
    env = {
        "GPUMARKET_PUBLISH_PORTS": "50000-50009",
        "GPUMARKET_PUBLISH_ADDRESS": "203.0.113.7",
        "GPUMARKET_PUBLIC_HOST": "gpu-1.example.com",
    }
    config = load_config(["--server", "https://m.example"], environ=env)
    assert config.publish == PublishConfig(
        address="203.0.113.7", host="gpu-1.example.com", first_port=50000, last_port=50009
    )
    off = load_config(["--server", "https://m.example", "--publish-ports", "off"], environ={})
    assert off.publish is None


@pytest.mark.parametrize("ports", ["42000-", "a-b", "0-10", "50010-50000", "60000-70000"])
def test_a_bad_port_range_is_refused_saying_so(ports):
    with pytest.raises(ConfigError, match="--publish-ports"):
        load_config(["--server", "https://m.example", "--publish-ports", ports], environ={})


def test_only_plain_key_lines_reach_sshd():
    keys = [
        f"  {ED25519}  ",
        f'command="/bin/sh" {ED25519}',  # an authorized_keys option
        f"{ED25519} ok\nssh-ed25519 AAAA injected",  # a line break
        "ssh-dss AAAAB3NzaC1kc3M=",
        f"{ED25519} laptop",
    ]
    assert authorized_keys(keys) == [ED25519, f"{ED25519} laptop"]
    env = launch_environment(keys)
    assert env == {
        "GPUMARKET_SSH_AUTHORIZED_KEYS": f"{ED25519}\n{ED25519} laptop",
        "GPUMARKET_SSH_PORT": "22",
    }
