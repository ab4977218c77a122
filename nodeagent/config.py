"""The agent's configuration: command-line flags, else GPUMARKET_* environment, else defaults.

A host without NVIDIA GPUs (a developer's machine) runs the agent with simulated GPUs on the
local-process runtime: `--runtime process --gpu-mode none --telemetry simulated --simulate-gpus
SLUG:COUNT`, with state, volumes and run records in folders it may write. The one-command dev
stack runs its demo hosts that way (`nodeagent.fleet`).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.benchmark import DEFAULT_COMMAND
from nodeagent.publish import PublishConfig
from nodeagent.telemetry.simulated import parse_simulate_gpus

# dest -> (environment variable, default)
_OPTIONS: dict[str, tuple[str, str | None]] = {
    "server": ("GPUMARKET_SERVER_URL", None),
    "join_token": ("GPUMARKET_JOIN_TOKEN", None),
    "state_dir": ("GPUMARKET_STATE_DIR", "/var/lib/gpumarket-agent"),
    "runtime": ("GPUMARKET_RUNTIME", "docker"),
    "gpu_mode": ("GPUMARKET_GPU_MODE", "nvidia"),
    "telemetry": ("GPUMARKET_TELEMETRY", "nvml"),
    "simulate_gpus": ("GPUMARKET_SIMULATE_GPUS", None),
    "hostname": ("GPUMARKET_HOSTNAME", None),
    "volume_root": ("GPUMARKET_VOLUME_ROOT", "/var/lib/gpumarket-volumes"),
    "process_dir": ("GPUMARKET_PROCESS_DIR", "/var/lib/gpumarket-runs"),
    "interval": ("GPUMARKET_INTERVAL", "5"),
    "request_timeout": ("GPUMARKET_REQUEST_TIMEOUT", "10"),
    "benchmark_command": ("GPUMARKET_BENCHMARK_COMMAND", shlex.join(DEFAULT_COMMAND)),
    "benchmark_timeout": ("GPUMARKET_BENCHMARK_TIMEOUT", "900"),
    "log_level": ("GPUMARKET_LOG_LEVEL", "info"),
    # Docker runtime isolation (see nodeagent/runtime/docker.py)
    "image_allow": ("GPUMARKET_IMAGE_ALLOW", "gpumarket/harness:*"),
    "network_policy": ("GPUMARKET_NETWORK_POLICY", "internet"),
    "disk_quota_gb": ("GPUMARKET_DISK_QUOTA_GB", "50"),
    "container_user": ("GPUMARKET_CONTAINER_USER", "1000:1000"),
    "log_format": ("GPUMARKET_LOG_FORMAT", "logfmt"),
    "metrics_port": ("GPUMARKET_METRICS_PORT", "0"),
    "metrics_address": ("GPUMARKET_METRICS_ADDRESS", "127.0.0.1"),
    "cache_gb": ("GPUMARKET_CACHE_GB", "100"),
    # The images the agent pulls (see nodeagent/imagecache.py); 0: no budget / no limit.
    "image_cache_gb": ("GPUMARKET_IMAGE_CACHE_GB", "200"),
    "max_image_gb": ("GPUMARKET_MAX_IMAGE_GB", "0"),
    "pinned_images": ("GPUMARKET_PINNED_IMAGES", "gpumarket/harness:*"),
    # Published ports of rentals (SSH): see nodeagent/publish.py
    "publish_ports": ("GPUMARKET_PUBLISH_PORTS", "42000-42999"),
    "publish_address": ("GPUMARKET_PUBLISH_ADDRESS", "0.0.0.0"),
    "public_host": ("GPUMARKET_PUBLIC_HOST", None),
    "fabric_address": ("GPUMARKET_FABRIC_ADDRESS", None),
    "cluster": ("GPUMARKET_CLUSTER", None),
    "interconnect": ("GPUMARKET_INTERCONNECT", None),
    "interconnect_gbps": ("GPUMARKET_INTERCONNECT_GBPS", None),
}

# The fabrics a cluster may declare (the server's list, marketplace.models.Interconnect).
INTERCONNECTS = ("infiniband", "roce", "ethernet", "nvlink")


class ConfigError(ValueError):
    """The configuration is incomplete or inconsistent; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything the agent needs, resolved and checked."""

    server_url: str
    join_token: str | None
    state_dir: str
    runtime: str  # "docker" | "process"
    gpu_mode: str  # "nvidia" | "none"
    telemetry: str  # "nvml" | "simulated"
    simulate_gpus: str | None
    hostname: str
    volume_root: str
    process_dir: str  # the process driver's run records
    interval_s: float
    request_timeout_s: float
    benchmark_command: tuple[str, ...]
    benchmark_timeout_s: float
    log_level: str
    once: bool = False
    image_allow: tuple[str, ...] = ("gpumarket/harness:*",)  # PATTERN or PATTERN=USER
    # "internet": rentals may ask for the filtered internet where the engine can enforce it
    # (declared at join); "internal": this node offers internal networks only.
    network_policy: str = "internet"
    disk_quota_mb: int | None = 50 * 1024  # per rental workspace; None: no quota
    container_user: str = "1000:1000"
    log_format: str = "logfmt"  # "logfmt" | "json"
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_address: str = "127.0.0.1"
    # The node's cache of staged files (datasets, resume checkpoints), least recently used out.
    cache_max_bytes: int = 100 * 1024**3
    # The images the agent pulled, least recently used out past this (None: kept forever),
    # and the largest image it pulls at all (None: no limit).
    image_cache_bytes: int | None = 200 * 10**9
    max_image_bytes: int | None = None
    pinned_images: tuple[str, ...] = ("gpumarket/harness:*",)  # patterns never pruned
    publish: PublishConfig | None = None  # None: no port of a rental is published
    # The address the other members of a multi-node rental reach this node on; None: the
    # source address of the agent's route to the server.
    fabric_address: str | None = None
    # The provider's cluster this node joins (None: none), and what its fabric is, which
    # creates the cluster when the provider has none of that name.
    cluster: str | None = None
    interconnect: str | None = None
    interconnect_gbps: int | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpumarket-agent",
        description="GPU marketplace node agent: joins a server, heartbeats, runs the rentals.",
    )
    add = parser.add_argument
    add("--server", help="server base URL [GPUMARKET_SERVER_URL]")
    add("--join-token", help="one-time join token from the provider [GPUMARKET_JOIN_TOKEN]")
    add("--state-dir", help="node token and usage spool [GPUMARKET_STATE_DIR]")
    add("--runtime", choices=["docker", "process"], help="[GPUMARKET_RUNTIME] (docker)")
    add("--gpu-mode", choices=["nvidia", "none"], help="[GPUMARKET_GPU_MODE] (nvidia)")
    add("--telemetry", choices=["nvml", "simulated"], help="[GPUMARKET_TELEMETRY] (nvml)")
    add("--simulate-gpus", metavar="SLUG:COUNT", help="e.g. h100-sxm5-80gb:8 (simulated only)")
    add("--hostname", help="name to join as [GPUMARKET_HOSTNAME] (this host's name)")
    add(
        "--volume-root",
        help="per-rental volume directories, this agent's own: it deletes "
        "what no run of its names [GPUMARKET_VOLUME_ROOT]",
    )
    add("--process-dir", help="run records of the process runtime [GPUMARKET_PROCESS_DIR]")
    add("--interval", help="heartbeat seconds until the server says otherwise (5)")
    add("--request-timeout", help="seconds per server request (10)")
    add(
        "--benchmark-command",
        help="ignored: the platform's benchmark runs as the server names it (kept for old units)",
    )
    add("--benchmark-timeout", help="benchmark seconds (900)")
    add("--log-level", choices=["debug", "info", "warning", "error"], help="(info)")
    add(
        "--image-allow",
        help="comma-separated image patterns the docker runtime runs, each PATTERN or "
        "PATTERN=UID:GID [GPUMARKET_IMAGE_ALLOW] (gpumarket/harness:*)",
    )
    add(
        "--network-policy",
        choices=["internet", "internal", "egress"],
        help="internet: rentals may have the public internet (private ranges, metadata and the "
        "host filtered; needs root and an engine managing iptables); internal: no rental "
        "reaches anything; egress: the old name of internet [GPUMARKET_NETWORK_POLICY] "
        "(internet)",
    )
    add("--disk-quota-gb", help="workspace size per rental, 0: none [GPUMARKET_DISK_QUOTA_GB] (50)")
    add("--container-user", help="UID:GID rentals run as [GPUMARKET_CONTAINER_USER] (1000:1000)")
    add("--log-format", choices=["logfmt", "json"], help="[GPUMARKET_LOG_FORMAT] (logfmt)")
    add("--metrics-port", help="serve Prometheus metrics on this port [GPUMARKET_METRICS_PORT]")
    add("--metrics-address", help="address of the metrics port (127.0.0.1)")
    add(
        "--cache-gb",
        help="size of the node's cache of staged datasets and checkpoints "
        "[GPUMARKET_CACHE_GB] (100)",
    )
    add(
        "--image-cache-gb",
        help="disk budget of the images the agent pulled, least recently used removed past it; "
        "0: no pruning [GPUMARKET_IMAGE_CACHE_GB] (200)",
    )
    add(
        "--pinned-images",
        help="comma-separated image patterns the image cache never prunes (the platform's "
        "harness and benchmark image) [GPUMARKET_PINNED_IMAGES] (gpumarket/harness:*)",
    )
    add(
        "--max-image-gb",
        help="the largest image this node pulls (unpacked); 0: no limit "
        "[GPUMARKET_MAX_IMAGE_GB] (0)",
    )
    add(
        "--publish-ports",
        help="host ports for rentals' published ports (SSH), FIRST-LAST, or 'off' "
        "[GPUMARKET_PUBLISH_PORTS] (42000-42999)",
    )
    add("--publish-address", help="address they listen on [GPUMARKET_PUBLISH_ADDRESS] (0.0.0.0)")
    add(
        "--public-host",
        help="the name or address customers reach this node at [GPUMARKET_PUBLIC_HOST] "
        "(the hostname)",
    )
    add(
        "--fabric-address",
        help="the IP address the other nodes of a multi-node rental reach this node at "
        "[GPUMARKET_FABRIC_ADDRESS] (the source address of the route to the server)",
    )
    add(
        "--cluster",
        help="join this node into the provider's cluster of this name: the nodes a multi-node "
        "rental may span [GPUMARKET_CLUSTER] (none)",
    )
    add(
        "--interconnect",
        help=f"the cluster's fabric, one of {', '.join(INTERCONNECTS)}, to create it if the "
        "provider has none of that name [GPUMARKET_INTERCONNECT]",
    )
    add(
        "--interconnect-gbps",
        help="its bandwidth per node in Gb/s, with --interconnect [GPUMARKET_INTERCONNECT_GBPS]",
    )
    add("--once", action="store_true", help="one heartbeat and reconcile, then exit")
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentConfig:
    """Parse flags and environment into a checked AgentConfig (ConfigError if unusable)."""
    args = build_parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)

    def get(dest: str) -> str | None:
        flag = getattr(args, dest)
        if flag is not None:
            return flag
        variable, default = _OPTIONS[dest]
        return env.get(variable) or default

    server = get("server")
    if not server:
        raise ConfigError("no server: pass --server URL or set GPUMARKET_SERVER_URL")
    runtime, gpu_mode, telemetry = get("runtime"), get("gpu_mode"), get("telemetry")
    for name, value, allowed in (
        ("runtime", runtime, ("docker", "process")),
        ("gpu mode", gpu_mode, ("nvidia", "none")),
        ("telemetry", telemetry, ("nvml", "simulated")),
    ):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    # Real GPUs need real discovery (the UUIDs the runtime selects devices by), and simulated
    # ones must never be handed to the NVIDIA runtime.
    if (gpu_mode == "nvidia") != (telemetry == "nvml"):
        raise ConfigError("--gpu-mode nvidia goes with --telemetry nvml, none with simulated")
    if runtime == "process" and gpu_mode == "nvidia":
        raise ConfigError(
            "the process runtime isolates nothing: it runs simulated GPUs only (--gpu-mode none)"
        )
    network_policy = {"egress": "internet"}.get(get("network_policy"), get("network_policy"))
    if network_policy not in ("internet", "internal"):
        raise ConfigError(f"network policy must be internet or internal, not {network_policy!r}")
    image_allow = tuple(p.strip() for p in (get("image_allow") or "").split(",") if p.strip())
    simulate_gpus = get("simulate_gpus")
    if telemetry == "simulated" and not simulate_gpus:
        raise ConfigError("simulated telemetry needs --simulate-gpus SLUG:COUNT")
    if simulate_gpus:
        try:
            parse_simulate_gpus(simulate_gpus)
        except ValueError as exc:
            raise ConfigError(f"--simulate-gpus: {exc}") from None
    try:
        interval = float(get("interval") or 0)
        request_timeout = float(get("request_timeout") or 0)
        benchmark_timeout = float(get("benchmark_timeout") or 0)
        disk_quota_gb = float(get("disk_quota_gb") or 0)
        cache_gb = float(get("cache_gb") or 0)
        image_cache_gb = float(get("image_cache_gb") or 0)
        max_image_gb = float(get("max_image_gb") or 0)
    except ValueError as exc:
        raise ConfigError(f"not a number: {exc}") from None
    try:
        metrics_port = int(get("metrics_port") or 0)
    except ValueError:
        raise ConfigError("--metrics-port must be a port number") from None
    if not 0 <= metrics_port <= 65535:
        raise ConfigError("--metrics-port must be between 0 (off) and 65535")
    log_format = get("log_format") or "logfmt"
    if log_format not in ("logfmt", "json"):
        raise ConfigError(f"log format must be logfmt or json, not {log_format!r}")
    if interval <= 0 or request_timeout <= 0 or benchmark_timeout <= 0:
        raise ConfigError("interval and timeouts must be positive")
    if disk_quota_gb < 0 or 0 < disk_quota_gb * 1024 < 16:
        raise ConfigError("the disk quota is 0 (none) or at least 16 MiB")
    if cache_gb <= 0:
        raise ConfigError("--cache-gb must be positive")
    if image_cache_gb < 0 or max_image_gb < 0:
        raise ConfigError("--image-cache-gb and --max-image-gb are 0 (none) or positive")
    hostname = get("hostname") or socket.gethostname()
    publish = _publish_config(
        get("publish_ports") or "off",
        address=get("publish_address") or "0.0.0.0",
        host=get("public_host") or hostname,
    )
    fabric_address = get("fabric_address") or None
    if fabric_address is not None:
        try:
            fabric_address = str(ipaddress.ip_address(fabric_address))
        except ValueError:
            raise ConfigError(
                f"--fabric-address must be an IP address, not {fabric_address!r}"
            ) from None
    cluster, interconnect, interconnect_gbps = _cluster_config(
        get("cluster"), get("interconnect"), get("interconnect_gbps")
    )
    benchmark_command = tuple(shlex.split(get("benchmark_command") or ""))
    if not benchmark_command:
        raise ConfigError("the benchmark command is empty")
    return AgentConfig(
        server_url=server,
        join_token=get("join_token"),
        state_dir=os.path.abspath(get("state_dir") or ""),
        runtime=runtime,
        gpu_mode=gpu_mode,
        telemetry=telemetry,
        simulate_gpus=simulate_gpus,
        hostname=hostname,
        volume_root=os.path.abspath(get("volume_root") or ""),
        process_dir=os.path.abspath(get("process_dir") or ""),
        interval_s=interval,
        request_timeout_s=request_timeout,
        benchmark_command=benchmark_command,
        benchmark_timeout_s=benchmark_timeout,
        log_level=get("log_level") or "info",
        once=args.once,
        image_allow=image_allow,
        network_policy=network_policy,
        disk_quota_mb=int(disk_quota_gb * 1024) or None,
        container_user=get("container_user") or "1000:1000",
        log_format=log_format,
        metrics_port=metrics_port,
        metrics_address=get("metrics_address") or "127.0.0.1",
        cache_max_bytes=int(cache_gb * 1024**3),
        image_cache_bytes=int(image_cache_gb * 1e9) or None,
        max_image_bytes=int(max_image_gb * 1e9) or None,
        pinned_images=tuple(
            p.strip() for p in (get("pinned_images") or "").split(",") if p.strip()
        ),
        publish=publish,
        fabric_address=fabric_address,
        cluster=cluster,
        interconnect=interconnect,
        interconnect_gbps=interconnect_gbps,
    )


def _cluster_config(
    cluster: str | None, interconnect: str | None, gbps: str | None
) -> tuple[str | None, str | None, int | None]:
    """--cluster, --interconnect and --interconnect-gbps, checked as the server checks them."""
    cluster = cluster or None
    if cluster is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", cluster):
        raise ConfigError(
            f"--cluster must be lower-case letters, digits and inner hyphens, not {cluster!r}"
        )
    interconnect = interconnect or None
    if interconnect is not None and interconnect not in INTERCONNECTS:
        raise ConfigError(f"--interconnect must be one of {', '.join(INTERCONNECTS)}")
    bandwidth = None
    if gbps:
        try:
            bandwidth = int(gbps)
        except ValueError:
            bandwidth = 0
        if bandwidth <= 0:
            raise ConfigError(f"--interconnect-gbps must be a positive whole number, not {gbps!r}")
    if (interconnect is None) != (bandwidth is None):
        raise ConfigError("give --interconnect and --interconnect-gbps together")
    if interconnect is not None and cluster is None:
        raise ConfigError("--interconnect describes a cluster: give --cluster too")
    return cluster, interconnect, bandwidth


def _publish_config(ports: str, *, address: str, host: str) -> PublishConfig | None:
    if ports.strip().lower() in ("off", "0", "none"):
        return None
    first, sep, last = ports.partition("-")
    try:
        return PublishConfig(
            address=address, host=host, first_port=int(first), last_port=int(last if sep else first)
        )
    except ValueError:
        raise ConfigError(
            f"--publish-ports must be FIRST-LAST within 1-65535 or 'off', not {ports!r}"
        ) from None
