"""Several simulated hosts' agents in one process: the dev stack's demo inventory.

    python -m nodeagent.fleet FLEET_JSON [AGENT FLAGS]

FLEET_JSON names the server and, per host, its hostname, simulated GPUs (`SLUG:COUNT`), join
token and a folder of its own (state, volumes, run records). Each host is a whole `Agent` in a
thread of its own, on the local-process runtime: it joins, heartbeats, benchmarks and runs
rentals exactly as a provider's agent would; only the hardware is simulated. AGENT FLAGS apply
to every host (`--interval 1`, `--request-timeout 3`).

The hosts start one after another, spread over one heartbeat interval, as hosts booted at
different moments would: a fleet's heartbeats reach the server spread out, not in bursts.

When one agent ends for any reason but a stop, the others are stopped too and the process exits
with that agent's status: whoever started it (the dev stack's supervisor) starts it again, after
preparing fresh join tokens where the stored ones cannot work.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from nodeagent.agent import EXIT_ERROR, EXIT_OK, Agent
from nodeagent.config import AgentConfig, ConfigError, load_config
from nodeagent.logs import configure_logging

logger = logging.getLogger("nodeagent.fleet")


def _cluster_args(host: dict) -> list[str]:
    """The host's cluster flags, where the fleet file gives its cluster."""
    if not host.get("cluster"):
        return []
    args = ["--cluster", str(host["cluster"])]
    if host.get("interconnect"):
        args += ["--interconnect", str(host["interconnect"])]
        args += ["--interconnect-gbps", str(host["interconnect_gbps"])]
    return args


def fleet_configs(spec: dict, agent_args: Sequence[str] = ()) -> list[AgentConfig]:
    """One configuration per host of a fleet file's contents (ConfigError if unusable)."""
    try:
        server, hosts = str(spec["server"]), list(spec["nodes"])
        configs = []
        for host in hosts:
            folder = str(host["dir"])
            argv = [
                "--server", server, "--join-token", str(host["join_token"]),
                "--hostname", str(host["hostname"]),
                "--simulate-gpus", str(host["simulate_gpus"]),
                "--runtime", "process", "--gpu-mode", "none", "--telemetry", "simulated",
                "--state-dir", os.path.join(folder, "state"),
                "--volume-root", os.path.join(folder, "volumes"),
                "--process-dir", os.path.join(folder, "runs"),
                "--publish-ports", "off",
                *_cluster_args(host),
                *agent_args,
            ]  # fmt: skip
            configs.append(load_config(argv))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a fleet file: {exc!r}") from None
    if not configs:
        raise ConfigError("the fleet file lists no host")
    return configs


class Fleet:
    """The agents of a fleet, each running in its own thread."""

    def __init__(self, configs: Sequence[AgentConfig]) -> None:
        self.agents = [Agent(config) for config in configs]
        self.status: dict[str, int] = {}
        self._ended = threading.Event()
        self._stop = threading.Event()
        self._stopping = False

    def run(self) -> int:
        spacing = self.agents[0].config.interval_s / len(self.agents) if self.agents else 0.0
        threads = [
            threading.Thread(
                target=self._run_one,
                args=(agent, i * spacing),
                name=agent.config.hostname,
                daemon=True,
            )
            for i, agent in enumerate(self.agents)
        ]
        for thread in threads:
            thread.start()
        logger.info("fleet started", extra={"hosts": len(threads)})
        # Woken by the first agent to end, or by a stop.
        self._ended.wait()
        self.stop()
        for thread in threads:
            thread.join()
        failed = [code for code in self.status.values() if code != EXIT_OK]
        return failed[0] if failed else EXIT_OK

    def stop(self) -> None:
        self._stopping = True
        self._stop.set()
        for agent in self.agents:
            agent.stop()
        self._ended.set()

    def _run_one(self, agent: Agent, delay_s: float) -> None:
        if self._stop.wait(delay_s):
            self.status[agent.config.hostname] = EXIT_OK
            return
        try:
            code = agent.run()
        except Exception:  # one host's bug must not leave the others running unwatched
            logger.exception("agent crashed", extra={"host": agent.config.hostname})
            code = EXIT_ERROR
        self.status[agent.config.hostname] = code
        if not self._stopping:
            logger.error(
                "an agent ended: stopping the fleet",
                extra={"host": agent.config.hostname, "status": code},
            )
        self._ended.set()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    if not args:
        logger.error("usage: python -m nodeagent.fleet FLEET_JSON [AGENT FLAGS]")
        return EXIT_ERROR
    try:
        with open(args[0]) as f:
            configs = fleet_configs(json.load(f), args[1:])
    except (OSError, ValueError, ConfigError) as exc:
        logger.error("bad fleet file", extra={"path": args[0], "error": str(exc)})
        return EXIT_ERROR
    configure_logging(configs[0].log_level, log_format=configs[0].log_format)
    fleet = Fleet(configs)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: fleet.stop())
    return fleet.run()


if __name__ == "__main__":
    sys.exit(main())
