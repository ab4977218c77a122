"""DockerDriver specifics: the container's security and resource policy, GPUs, typed errors."""

from __future__ import annotations

import os
import subprocess
import sys

import docker
import pytest

from agentprotocol import Network
from nodeagent.runtime.base import (
    LABEL_RUN,
    ImageNotFoundError,
    PermanentRuntimeError,
    RetryableRuntimeError,
)
from nodeagent.runtime.docker import (
    DockerDriver,
    DockerDriverConfig,
    classify_docker_error,
    container_name,
    internet_filter_unavailable,
    network_name,
    parse_docker_time_ns,
)
from tests.nodeagent.runtime.conftest import REPO, collect_output, wait_exited

MiB = 1024 * 1024

pytestmark = pytest.mark.docker


def containers_of_run(run_id: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"label={LABEL_RUN}={run_id}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()


def test_container_is_unprivileged_and_limited(docker_driver, docker_client, make_spec):
    # given a rental asking for 1.5 cores, 256 MiB and a published port
    spec = make_spec(
        """
        import os
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        print(os.getuid(), os.getgid(), status["CapEff"].strip(), status["NoNewPrivs"].strip(), flush=True)
        import time; time.sleep(600)
        """,  # noqa: E501
        ports=(8888,),
    )

    # when it runs
    state = docker_driver.start(spec)
    lines, _ = collect_output(docker_driver, spec.run_id, None, 1)
    attrs = docker_client.containers.get(container_name(spec.run_id)).attrs
    host = attrs["HostConfig"]

    # then it has no privileges, its own namespaces and exactly the asked resources
    assert lines == ["1000 1000 0000000000000000 1"]  # non-root, no capabilities
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["NetworkMode"] == network_name(spec.rental_id)  # the rental's own network
    assert host["PidMode"] == ""
    assert host["IpcMode"] != "host"
    assert host["UsernsMode"] == ""
    assert host["NanoCpus"] == 1_500_000_000
    assert host["Memory"] == 256 * MiB
    assert host["MemorySwap"] == 256 * MiB
    assert host["PidsLimit"] == 8192
    assert host["ShmSize"] == 128 * MiB
    assert host["Init"] is True
    assert host["AutoRemove"] is False
    assert host["ReadonlyRootfs"] is True
    assert host["Tmpfs"] == {"/tmp": "rw,nosuid,nodev,size=1024m"}
    assert host["Sysctls"] == {
        "net.ipv6.conf.all.disable_ipv6": "1",
        "net.ipv6.conf.default.disable_ipv6": "1",
    }
    assert attrs["Config"]["User"] == "1000:1000"
    assert not host.get("DeviceRequests")
    assert attrs["Config"]["StopSignal"] == "SIGTERM"
    assert [(m["Type"], m["Source"], m["Target"]) for m in host["Mounts"]] == [
        ("bind", spec.volume_dir, "/workspace")
    ]
    # an internal network: the port cannot be published, and none is reported
    assert not host["PortBindings"]
    assert state.ports == {}
    assert os.stat(spec.volume_dir).st_uid == 1000


def test_internet_is_refused_where_the_engine_does_not_manage_iptables(
    docker_driver, docker_client, make_spec
):
    # given an engine started with --iptables=false (deploy/docker-engine.sh): no DOCKER-USER
    # (tests/e2e/test_rental_network.py runs one that has it)
    assert "DOCKER-USER" in (internet_filter_unavailable() or "")
    spec = make_spec("import time; time.sleep(600)", ports=(8888,), network=Network.INTERNET)

    # when a rental with internet is started: refused for good, saying why, nothing was made
    with pytest.raises(PermanentRuntimeError, match="DOCKER-USER"):
        docker_driver.start(spec)
    assert containers_of_run(spec.run_id) == []
    assert docker_client.networks.list(names=[network_name(spec.rental_id)]) == []


def test_internet_is_refused_where_the_operator_allows_internal_only(
    harness_image, docker_client, make_spec, node_id
):
    # given an agent configured with network_policy internal
    driver = DockerDriver(
        DockerDriverConfig(gpu_mode="none", node_id=node_id, internet_allowed=False)
    )
    spec = make_spec("import time; time.sleep(600)", network=Network.INTERNET)

    # when a rental with internet is started: refused for good, nothing was made
    with pytest.raises(PermanentRuntimeError, match="internal networks only"):
        driver.start(spec)
    assert containers_of_run(spec.run_id) == []
    assert docker_client.networks.list(names=[network_name(spec.rental_id)]) == []


def test_egress_rules_are_installed_once_and_atomically(tmp_path):
    # given a network namespace of its own (its own netfilter tables) with Docker's chain
    script = """
import subprocess
from nodeagent.runtime.docker import ensure_egress_rules
subprocess.run(["iptables", "-N", "DOCKER-USER"], check=True)
ensure_egress_rules()
ensure_egress_rules()
print(subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=True).stdout)
"""
    # when the rules are installed twice
    proc = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )

    # then each rule is there once: jumps from Docker's chain and INPUT, private ranges dropped
    assert proc.returncode == 0, proc.stderr
    rules = proc.stdout.splitlines()
    assert rules.count("-A DOCKER-USER -i gpm-+ -j GPUMARKET-EGRESS") == 1
    assert rules.count("-A INPUT -i gpm-+ -j GPUMARKET-HOST") == 1
    egress = [r for r in rules if r.startswith("-A GPUMARKET-EGRESS")]
    assert egress[0] == ("-A GPUMARKET-EGRESS -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN")
    dropped = {r.split(" -d ")[1].split()[0] for r in egress if r.endswith("-j DROP")}
    assert {
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
    } <= dropped
    assert egress[-1] == "-A GPUMARKET-EGRESS -j RETURN"
    assert [r for r in rules if r.startswith("-A GPUMARKET-HOST")][-1] == (
        "-A GPUMARKET-HOST -j DROP"
    )


def test_images_outside_the_allow_list_are_refused_before_anything_is_made(
    docker_driver, docker_client, make_spec
):
    # given the default allow-list (the harness image only)
    spec = make_spec(image="debian:bookworm")

    # when a rental of another image is started: refused for good, nothing pulled or made
    with pytest.raises(PermanentRuntimeError, match="not allowed on this node"):
        docker_driver.start(spec)
    assert containers_of_run(spec.run_id) == []
    assert docker_client.networks.list(names=[network_name(spec.rental_id)]) == []
    assert not os.path.exists(spec.volume_dir)


def test_allow_list_patterns_and_per_image_users():
    config = DockerDriverConfig(
        image_allow=("gpumarket/harness:*", "nvcr.io/nvidia/pytorch:24.*=0:0", " "),
    )
    driver = DockerDriver(config)

    assert driver.container_user("gpumarket/harness:dev") == "1000:1000"
    assert driver.container_user("nvcr.io/nvidia/pytorch:24.05-py3") == "0:0"
    assert driver.image_rule("gpumarket/harness").pattern == "gpumarket/harness:*"  # :latest
    for refused in (
        "gpumarket/harness-evil:dev",
        "nvcr.io/nvidia/pytorch:23.10-py3",
        "docker.io/gpumarket/harness:dev",
        "evil.example/gpumarket/harness:dev",
    ):
        with pytest.raises(PermanentRuntimeError):
            driver.image_rule(refused)
    with pytest.raises(ValueError, match="PATTERN=USER"):
        DockerDriverConfig(image_allow=("gpumarket/harness:*=",))
    assert DockerDriver(DockerDriverConfig(image_allow=())).config.image_rules == ()


def test_cpu_share_above_the_hosts_cores_gets_the_whole_host(
    docker_driver, docker_client, make_spec
):
    cpus = docker_client.info()["NCPU"]
    spec = make_spec("print('x')", cpu_limit=cpus + 6.0)

    docker_driver.start(spec)

    host = docker_client.containers.get(container_name(spec.run_id)).attrs["HostConfig"]
    assert host["NanoCpus"] == cpus * 1_000_000_000


def test_read_only_root_filesystem_keeps_workspace_and_tmp_writable(
    harness_image, make_spec, node_id
):
    driver = DockerDriver(
        DockerDriverConfig(gpu_mode="none", node_id=node_id, read_only_rootfs=True)
    )
    spec = make_spec(
        """
        import os
        for path in ("/workspace/a", "/tmp/b", "/opt/c"):
            try:
                open(path, "w").write("x")
                print(path, "writable")
            except OSError:
                print(path, "read-only")
        """
    )
    try:
        driver.start(spec)
        wait_exited(driver, spec.run_id)
        lines, _ = driver.output_since(spec.run_id, None)
    finally:
        driver.remove(spec.run_id)
    assert lines == ["/workspace/a writable", "/tmp/b writable", "/opt/c read-only"]


def test_nvidia_mode_requests_exactly_the_allocated_gpus(harness_image, make_spec, node_id):
    # given GPUs 3 and 5 of the host, by UUID
    driver = DockerDriver(DockerDriverConfig(gpu_mode="nvidia", node_id=node_id))
    spec = make_spec(gpu_indices=(3, 5), gpu_uuids=("GPU-aaa", "GPU-bbb"))

    options = driver.create_options(spec)

    # then the device request names them and CUDA numbers them 0..n-1 inside the container
    [request] = options["device_requests"]
    assert request["DeviceIDs"] == ["GPU-aaa", "GPU-bbb"]
    assert request["Capabilities"] == [["gpu"]]
    assert options["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "GPUMARKET_SIMULATED_GPUS" not in options["environment"]


def test_nvidia_mode_without_the_nvidia_runtime_fails_permanently_and_cleanly(
    harness_image, make_spec, node_id
):
    # given an engine without the NVIDIA Container Toolkit (this one)
    driver = DockerDriver(DockerDriverConfig(gpu_mode="nvidia", node_id=node_id))
    spec = make_spec(gpu_indices=(0,), gpu_uuids=("GPU-aaa",))

    # when a GPU container is started: a permanent error, and no half-made container
    with pytest.raises(PermanentRuntimeError):
        driver.start(spec)
    assert containers_of_run(spec.run_id) == []


def test_running_out_of_memory_is_reported(docker_driver, make_spec):
    # given a program that allocates past its 64 MiB limit
    spec = make_spec("x = bytearray(512 * 1024 * 1024)", memory_limit_mb=64)

    docker_driver.start(spec)
    state = wait_exited(docker_driver, spec.run_id)

    assert (state.exit_code, state.oom_killed) == (137, True)


def test_missing_image_is_a_permanent_error(harness_image, make_spec, node_id):
    driver = DockerDriver(
        DockerDriverConfig(
            gpu_mode="none", node_id=node_id, image_allow=("gpumarket/*",), pull_policy="never"
        )
    )
    spec = make_spec(image="gpumarket/no-such-image:never-built")

    with pytest.raises(ImageNotFoundError):
        driver.start(spec)

    assert containers_of_run(spec.run_id) == []


def test_unreachable_engine_is_a_retryable_error(tmp_path):
    driver = DockerDriver(
        DockerDriverConfig(
            base_url=f"unix://{tmp_path}/no-engine.sock",
            timeout_s=2,
            retry_attempts=2,
            retry_base_s=0.01,
        )
    )

    with pytest.raises(RetryableRuntimeError):
        driver.list_managed()


def test_a_foreign_container_with_our_name_is_not_adopted(
    docker_driver, docker_client, harness_image, make_spec
):
    # given a container that merely has the name a run would get
    spec = make_spec()
    foreign = docker_client.containers.create(
        harness_image, ["true"], name=container_name(spec.run_id), network_mode="none"
    )
    try:
        # when the run is started: refused, and the foreign container is left alone
        with pytest.raises(PermanentRuntimeError):
            docker_driver.start(spec)
        foreign.reload()
        assert foreign.status == "created"
    finally:
        foreign.remove(force=True)


def test_half_started_container_is_started_by_the_next_start(
    docker_driver, docker_client, make_spec
):
    # given a container created but never started (agent died between create and start)
    spec = make_spec("print('finally ran', flush=True)")
    os.makedirs(spec.volume_dir)
    os.chown(spec.volume_dir, 1000, 1000)
    docker_driver.ensure_network(spec)
    docker_client.containers.create(**docker_driver.create_options(spec))
    assert docker_driver.state(spec.run_id).status == "created"

    # when the agent starts the run again
    docker_driver.start(spec)
    state = wait_exited(docker_driver, spec.run_id)

    # then that container ran, and no second one was made
    assert state.exit_code == 0
    assert docker_driver.output_since(spec.run_id, None)[0] == ["finally ran"]
    assert len(containers_of_run(spec.run_id)) == 1


def test_output_cursor_is_exact_within_one_second(docker_driver, make_spec):
    # given many lines printed within the same second as the cursor
    spec = make_spec(
        """
        import os, time
        for i in range(50):
            print(i, flush=True)
        while not os.path.exists("go"):
            time.sleep(0.01)
        for i in range(50, 100):
            print(i, flush=True)
        """
    )
    docker_driver.start(spec)
    first, cursor = collect_output(docker_driver, spec.run_id, None, 50)
    open(os.path.join(spec.volume_dir, "go"), "w").close()
    second, _ = collect_output(docker_driver, spec.run_id, cursor, 50)

    assert first + second == [str(i) for i in range(100)]


def test_a_line_longer_than_dockers_16_kib_chunks_comes_back_whole(docker_driver, make_spec):
    # given a container printing lines Docker stores in 16 KiB partial chunks (each with its
    # own timestamp), around short ones
    spec = make_spec(
        """
        print("before", flush=True)
        print("x" * 40000 + "end", flush=True)
        print("y" * 16384, flush=True)
        print("after", flush=True)
        """
    )
    docker_driver.start(spec)
    lines, _ = collect_output(docker_driver, spec.run_id, None, 4)
    # then every line is whole, with no timestamp spliced into it
    assert lines == ["before", "x" * 40000 + "end", "y" * 16384, "after"]


def test_error_classification():
    assert isinstance(
        classify_docker_error(docker.errors.APIError("boom", explanation="daemon busy")),
        RetryableRuntimeError,
    )
    assert isinstance(
        classify_docker_error(docker.errors.ImageNotFound("nope")), ImageNotFoundError
    )
    assert parse_docker_time_ns("2024-05-01T10:00:00.5Z") == 1714557600_500000000
    assert parse_docker_time_ns("0001-01-01T00:00:00Z") is None
