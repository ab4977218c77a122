"""The engine and image scripts: idempotent, and the image is what the drivers expect."""

from __future__ import annotations

import subprocess

import pytest

from tests.nodeagent.runtime.conftest import REPO

pytestmark = pytest.mark.docker


def run_script(*path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO.joinpath(*path))], capture_output=True, text=True, timeout=600, check=False
    )


def test_engine_script_is_idempotent(docker_host):
    # given an engine that answers (the fixture made sure), when the script runs again
    again = run_script("deploy", "docker-engine.sh")

    # then it changes nothing and prints the same address
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == docker_host
    assert "already answers" in again.stderr


def test_image_build_is_idempotent_and_registry_free(harness_image, docker_client):
    # given the built image, when the build runs again
    before = docker_client.images.get(harness_image)
    again = run_script("deploy", "harness", "build-offline.sh")

    # then the base is reused, the image is unchanged, and it never came from a registry
    assert again.returncode == 0, again.stderr
    assert "is current" in again.stderr
    after = docker_client.images.get(harness_image)
    assert after.id == before.id
    assert after.attrs["RepoDigests"] == []
    assert after.attrs["Config"]["User"] == "harness"
    assert after.attrs["Config"]["WorkingDir"] == "/workspace"


def test_image_runs_the_harness_stack_as_a_non_root_user(harness_image, docker_client):
    output = docker_client.containers.run(
        harness_image,
        [
            "python",
            "-c",
            "import os, sys, torch, numpy, sklearn, scipy, yaml, harness; "
            "print(os.getuid(), sys.version_info[:2], torch.__version__, harness.__file__)",
        ],
        network_mode="none",
        remove=True,
    )

    assert output.decode().split() == [
        "1000",
        "(3,",
        "11)",
        "2.13.0+cpu",
        "/opt/harness/harness/__init__.py",
    ]


def test_image_carries_an_sshd_the_container_user_can_start(harness_image, docker_client):
    # sshd and ssh-keygen from Debian's packages, with the merged /usr the base has kept
    output = docker_client.containers.run(
        harness_image,
        ["sh", "-c", "command -v sshd; command -v ssh-keygen; readlink /bin; sshd -V 2>&1"],
        network_mode="none",
        remove=True,
    )
    lines = output.decode().split("\n")
    assert lines[:3] == ["/usr/sbin/sshd", "/usr/bin/ssh-keygen", "usr/bin"]
    assert lines[3].startswith("OpenSSH_")


def test_image_carries_jupyterlab_for_the_agent_to_start(harness_image, docker_client):
    # the agent starts it as `python3 -m jupyterlab` (nodeagent/runtime/jupyter.py), as the
    # container's user, with its data where JupyterLab looks for it
    output = docker_client.containers.run(
        harness_image,
        ["python3", "-c", "import jupyterlab, jupyterlab.commands as c; "
         "print(jupyterlab.__version__.split('.')[0], c.get_app_dir())"],
        network_mode="none", remove=True,
    )  # fmt: skip
    assert output.decode().split() == ["4", "/usr/local/share/jupyter/lab"]
