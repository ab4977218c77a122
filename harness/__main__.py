"""Command line: ``python -m harness --config FILE`` and ``python -m harness benchmark``.

Training writes into the output directory (harness.paths: $GPUMARKET_WORKSPACE, else the working
directory): checkpoints/, final/ (model.pt and config.json, when the run completes) and logs/
(metrics.jsonl, the JSON lines also printed on stdout, and harness.log, rank 0's log).

Exit status: 0 when training completed or stopped cleanly on SIGTERM/SIGINT (a checkpoint was
written), 2 for an invalid config or command line (a layout that does not fit the number of
processes started, or a model that does not fit the memory of the GPUs the node agent gave it
(``HARNESS_GPU_MEMORY_GB``), included), anything else for a failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from harness.config import (
    CONFIG_ERROR_EXIT_CODE,
    ConfigError,
    HarnessConfig,
    apply_overrides,
    load_config,
    load_config_dict,
    resolve_layout,
)
from harness.memory import fit_problem
from harness.paths import HUMAN_LOG, LOG_SUBDIR, METRICS_LOG, output_dir


def _nproc(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a positive integer or 'auto'") from None
    if count < 1:
        raise argparse.ArgumentTypeError("must be a positive integer or 'auto'")
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness",
        description="Train a built-in model (JSON-line metrics on stdout), or benchmark the card.",
    )
    parser.add_argument("--config", help="JSON (.json) or YAML config file")
    parser.add_argument(
        "--config-env",
        metavar="NAME",
        help="read the config as JSON from environment variable NAME (how the node agent passes"
        " a rental's config into its container)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.steps=500 (repeatable)",
    )
    parser.add_argument(
        "--nproc",
        type=_nproc,
        default=1,
        help="start this many local ranks; 'auto' = NPROC_PER_NODE, else one per visible GPU",
    )
    commands = parser.add_subparsers(dest="command", metavar="{benchmark}")
    bench = commands.add_parser("benchmark", help="measure matmul, memory and training speed")
    bench.add_argument("--precision", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument("--quick", action="store_true", help="a few seconds, small sizes")
    return parser


def _configure_logging() -> None:
    rank = os.environ.get("RANK", "0")
    # Each node's first rank tells its node's story (a job across nodes has one per node).
    leader = os.environ.get("LOCAL_RANK", rank) == "0"
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if leader else logging.WARNING,
        format=f"%(asctime)s %(levelname)s harness[rank {rank}]: %(message)s",
    )


def _log_to_output(output: Path) -> None:
    """Also write the human log of each node's first rank (rank 0 alone on one node) into the
    output directory, which is synced out with the checkpoints (stderr reaches the rental's log
    view, but only its tail is kept). In a job across nodes each node's output directory is its
    own, and the platform stores each node's logs under a prefix of its own."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) != "0":
        return
    path = output / LOG_SUBDIR / HUMAN_LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as exc:
        logging.getLogger("harness").warning("no log file in %s: %s", output, exc)
        return
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)


def _env_json(name: str) -> object:
    text = os.environ.get(name)
    if text is None:
        raise ConfigError([("", f"environment variable {name} is not set")])
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([("", f"{name} is not valid JSON: {exc}")]) from exc


def _visible_gpus() -> int:
    import torch

    return max(torch.cuda.device_count(), 1)


def _auto_nproc(device: str) -> int:
    """`--nproc auto`: the node agent's NPROC_PER_NODE (the GPUs it gave the run) when set, else
    every visible GPU, else one process on the CPU."""
    given = os.environ.get("NPROC_PER_NODE", "").strip()
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return _visible_gpus() if device != "cpu" else 1


def _check_fits(config: HarnessConfig, *, dp: int) -> None:
    """ConfigError when the node agent says how much memory each GPU has
    (``HARNESS_GPU_MEMORY_GB``) and the config needs more than that."""
    raw = os.environ.get("HARNESS_GPU_MEMORY_GB", "").strip()
    try:
        gpu_memory_gb = float(raw)
    except ValueError:
        return
    if not gpu_memory_gb > 0:
        return
    problem = fit_problem(config, dp=dp, device=config.train.device, gpu_memory_gb=gpu_memory_gb)
    if problem is not None:
        raise ConfigError([problem])


def _report(error: ConfigError) -> int:
    for line in error.lines():
        print(line, file=sys.stderr)
    return CONFIG_ERROR_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging()
    if args.command == "benchmark":
        from harness.benchmark import run
        from harness.metrics import JsonLines

        try:
            JsonLines()(run(precision=args.precision, quick=args.quick, device=args.device))
        except ConfigError as error:
            return _report(error)
        return 0

    # A stop can come while torch still loads (a rental stopped right after it started): note it
    # now and act on it once the trainer or the launcher is ready, instead of dying with 143.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early.append(signum))

    if not args.config and not args.config_env:
        print("config error: --config FILE or --config-env NAME is required", file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    try:
        if args.config_env:
            config = load_config_dict(apply_overrides(_env_json(args.config_env), args.set))
        else:
            config = load_config(args.config, args.set)
    except ConfigError as error:
        return _report(error)

    from harness.launcher import Gang, launch_local

    output = output_dir()
    _log_to_output(output)

    try:
        # A rank of a launched job trains; otherwise this node's share of the job across
        # nodes the node agent describes (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), if any.
        worker = "RANK" in os.environ
        gang = Gang() if worker else Gang.from_env()
        nproc = args.nproc
        if nproc == "auto":
            nproc = 1 if worker else _auto_nproc(config.train.device)
        world = nproc * gang.nnodes
        if not worker:
            # A layout that cannot split over the job, or a config that cannot fit the GPUs
            # it got, is refused before any rank starts, with the reason.
            resolved = resolve_layout(config.layout, world, nproc)
            _check_fits(config, dp=resolved.dp)
        if world > 1:
            worker_args = (
                ["--config-env", args.config_env] if args.config_env else ["--config", args.config]
            )
            for override in args.set:
                worker_args += ["--set", override]
            if early:
                return 0  # stopped before any rank started: nothing to checkpoint
            return launch_local(worker_args, nproc, gang)
        # torch loads only now, so a bad config fails fast and the launcher stays light.
        from harness.metrics import JsonLines
        from harness.trainer import Trainer

        # The run's output directory gets its final model and its metrics log: the artifacts
        # of a rental are its checkpoints, final model and logs.
        trainer = Trainer(
            config,
            emit=JsonLines(log_path=output / LOG_SUBDIR / METRICS_LOG),
            output_dir=output,
        )
        if early:
            trainer.request_stop("sigint" if early[0] == signal.SIGINT else "sigterm")
        trainer.run()
    except ConfigError as error:
        return _report(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
