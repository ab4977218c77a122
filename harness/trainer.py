"""The training loop: every layout, mixed precision, gradient accumulation, checkpoints, stops.

The built-in image models and the small GPT run plain DDP; the transformer runs any layout
(``harness.parallel``: DDP, FSDP2, tensor and pipeline parallelism, recomputation) and writes
sharded checkpoints (``harness.sharded_checkpoint``).

One ``Trainer.run()`` trains ``train.steps`` optimizer steps, resuming from the newest checkpoint
in ``checkpoint.dir`` if there is one. SIGTERM (or SIGINT) on any rank makes every rank finish the
step in flight, agree to stop, write one checkpoint (rank 0) and return a summary with
``exit_reason`` ``"sigterm"``: a stopped or preempted rental loses at most one checkpoint
interval of work.

The hot loop stays free of host-device synchronisation: step losses stay on the device and are
read (``.item()``) only when a step event is due, and stop/checkpoint decisions travel over a CPU
gloo group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from harness import sharded_checkpoint
from harness.benchmark import cpu_matmul_tflops
from harness.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    load_latest,
    remove_stale_temporaries,
    save_final_model,
)
from harness.checkpoint import save_checkpoint as write_checkpoint_file
from harness.config import (
    ConfigError,
    HarnessConfig,
    ResolvedLayout,
    TrainConfig,
    TransformerConfig,
    resolve_layout,
)
from harness.datasets import Dataset, DatasetInfo, ShardedBatches, build_datasets, eval_batches
from harness.distributed import (
    DistContext,
    agree_any,
    broadcast_from_primary,
    gather_to_primary,
    init_distributed,
    shutdown_distributed,
)
from harness.metrics import (
    Emit,
    JsonLines,
    flops_per_sample,
    mfu,
    on_simulated_node,
    peak_memory_bytes,
    peak_tflops_from_env,
)
from harness.models import build_model
from harness.parallel import (
    ParallelModel,
    build_parallel_model,
    build_schedule,
    clip_grad_norm,
    lm_loss,
)
from harness.paths import FINAL_SUBDIR
from harness.precision import PrecisionPlan, resolve_precision

log = logging.getLogger("harness")

# Why a run stops early, in the order reported when several apply at once.
STOP_REASONS = ("sigterm", "sigint", "requested")
_SIGNAL_REASONS = {signal.SIGTERM: "sigterm", signal.SIGINT: "sigint"}


def lr_factor_fn(train: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``train.lr`` for optimizer step ``step`` (0-based): linear warmup, then
    constant or cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        if train.lr_schedule == "constant":
            return 1.0
        progress = min((step - train.warmup_steps) / max(1, train.steps - train.warmup_steps), 1)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * cosine

    return factor


def build_optimizer(
    model: nn.Module, train: TrainConfig, device: torch.device, *, fused: bool = True
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and embeddings only (not on biases or norm gains);
    the fused kernel on CUDA unless ``fused`` is false."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.lr, fused=fused and device.type == "cuda")


class Trainer:
    """Trains one config; ``run()`` returns the summary event (also emitted on rank 0)."""

    def __init__(
        self,
        config: HarnessConfig,
        *,
        emit: Emit | None = None,
        peak_tflops: float | None = None,
        output_dir: Path | None = None,
    ) -> None:
        """``emit`` receives rank 0's events (default: JSON lines on stdout); ``peak_tflops``
        replaces ``HARNESS_PEAK_TFLOPS`` as the per-GPU peak for MFU; with ``output_dir`` (the
        command line passes harness.paths.output_dir()), a completed run writes its final model
        to ``final/`` there."""
        self.config = config
        self._emit = emit if emit is not None else JsonLines()
        self._stop_reason: str | None = None
        self.peak_given = peak_tflops is not None
        self.peak_tflops = peak_tflops if peak_tflops is not None else peak_tflops_from_env()
        self.output_dir = output_dir

    def request_stop(self, reason: str = "requested") -> None:
        """Stop after the current step, checkpoint and return (what SIGTERM does)."""
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {reason!r}")
        if self._stop_reason is None:
            self._stop_reason = reason

    def run(self) -> dict[str, Any]:
        if self.config.train.deterministic:
            # cuBLAS needs this before its first handle exists to give reproducible results.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Refused before joining the process group: every rank fails alike, none waits.
        local = os.environ.get("LOCAL_WORLD_SIZE")
        layout = resolve_layout(
            self.config.layout,
            int(os.environ.get("WORLD_SIZE", "1")),
            int(local) if local else None,
        )
        ctx = init_distributed(self.config.train.device)
        completed = False
        try:
            with self._signal_handlers():
                summary = _Run(self.config, ctx, self, layout).execute()
            completed = True
            return summary
        finally:
            # The run's DDP reducer and optimizer sit in reference cycles; left to the garbage
            # collector, they can outlive the process group and die during interpreter shutdown,
            # where gloo aborts the process ("terminate called without an active exception").
            gc.collect()
            shutdown_distributed(ctx, synchronize=completed)

    def emit(self, ctx: DistContext, event: dict[str, Any]) -> None:
        if ctx.is_primary:
            self._emit(event)

    def emit_local(self, event: dict[str, Any]) -> None:
        """An event of this rank's node alone (a node's part of a sharded checkpoint)."""
        self._emit(event)

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        # Python only allows handlers in the main thread; elsewhere request_stop() is the way.
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(signum: int, _frame: FrameType | None) -> None:
            if self._stop_reason is None:
                name = signal.Signals(signum).name
                log.info("%s received: finishing this step, then checkpointing", name)
            self.request_stop(_SIGNAL_REASONS[signal.Signals(signum)])

        previous = {sig: signal.signal(sig, handle) for sig in _SIGNAL_REASONS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _Run:
    """The state of one training run in one process."""

    def __init__(
        self, config: HarnessConfig, ctx: DistContext, trainer: Trainer, layout: ResolvedLayout
    ) -> None:
        # The effective config names the resolved data-parallel degree.
        self.config = dataclasses.replace(
            config, layout=dataclasses.replace(config.layout, dp=layout.dp)
        )
        config = self.config
        self.layout = layout
        self.sharded = isinstance(config.model, TransformerConfig)
        self.ctx = ctx
        self.trainer = trainer
        self.train_cfg = config.train
        self.ckpt_cfg = config.checkpoint
        self.ckpt_dir = Path(config.checkpoint.dir)

    # --- setup ---------------------------------------------------------------------------

    def _setup(self) -> None:
        train, ctx = self.train_cfg, self.ctx
        if ctx.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = train.tf32
            torch.backends.cudnn.allow_tf32 = train.tf32
        if train.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.precision: PrecisionPlan = resolve_precision(train.precision, ctx.device)
        self.train_set: Dataset
        self.eval_set: Dataset
        self.info: DatasetInfo
        self.train_set, self.eval_set, self.info = build_datasets(
            self.config.data, self.config.model, seed=train.seed, device=ctx.device
        )
        self.parallel: ParallelModel | None = None
        self.schedule: Any = None
        self.peak_tflops, self.peak_source = self._peak()
        if isinstance(self.config.model, TransformerConfig):
            self._build_transformer(self.config.model)
        else:
            self._build_model()
        # Per-rank stream for dropout and anything else random in the step; tensor-parallel
        # peers share one, since they must drop the same elements of their replicated
        # activations.
        torch.manual_seed(train.seed + ctx.rank // self.layout.tp)
        self.optimizer = build_optimizer(
            self.model, train, ctx.device, fused=self.parallel is None or not self.layout_parallel
        )
        self.scheduler = LambdaLR(self.optimizer, lr_factor_fn(train))
        self.scaler = self.precision.grad_scaler()
        # Ranks of one data-parallel group position (its tp and pp peers) read the same data.
        self.batches = ShardedBatches(
            len(self.train_set),
            batch_size=self.config.data.batch_size,
            world_size=self.layout.dp,
            rank=self.data_rank,
            grad_accum=train.grad_accum,
            seed=train.seed,
            device=ctx.device,
        )
        self.start_step = 0
        self.elapsed_before = 0.0
        self.last_loss: float | None = None
        self.resumed_from: str | None = None
        if self.sharded:
            self._resume_sharded()
        else:
            self._resume()
        if self.parallel is not None:
            self.ddp = self.parallel.ddp
            self.train_model: nn.Module = self.parallel.train_model
        else:
            self.ddp = (
                DistributedDataParallel(
                    self.model,
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                )
                if ctx.distributed
                else None
            )
            self.train_model = self.ddp if self.ddp is not None else self.model
        if train.compile:
            # Imported here so that only compiling runs pay for loading the compiler.
            from torch._inductor import list_mode_options

            options = dict(list_mode_options(train.compile_mode))
            if not getattr(self.model, "inductor_layout_optimization", True):
                options["layout_optimization"] = False
            self.train_model = torch.compile(self.train_model, options=options)

    @property
    def layout_parallel(self) -> bool:
        """Whether the model's parameters are DTensors or split over pipeline stages."""
        return self.layout.tp > 1 or self.layout.pp > 1 or self.config.layout.shard != "none"

    def _build_model(self) -> None:
        train = self.train_cfg
        # Same seed on every rank, so all start from identical weights (DDP also broadcasts them).
        torch.manual_seed(train.seed)
        self.model = build_model(
            self.config.model,
            num_classes=self.info.num_classes,
            in_channels=self.info.in_channels,
            image_size=self.info.image_size,
            vocab_size=self.info.vocab_size,
            seq_len=self.info.seq_len,
        ).to(self.ctx.device)
        self.model.activation_checkpointing = train.activation_checkpointing
        self.params = sum(p.numel() for p in self.model.parameters())
        # FLOPs only serve MFU, and counting them costs a second of imports at start.
        self.flops_per_sample = (
            flops_per_sample(self.config.model, self.info, self.model) if self.peak_tflops else None
        )
        self.data_rank = self.ctx.rank
        self.stage_is_last = True

    def _build_transformer(self, model_config: TransformerConfig) -> None:
        shape = model_config.shape()
        self.parallel = build_parallel_model(
            shape=shape,
            dropout=model_config.dropout,
            config=self.config.layout,
            layout=self.layout,
            device=self.ctx.device,
            seed=self.train_cfg.seed,
        )
        self.model = self.parallel.model
        self.params = shape.param_count()
        # Known from the shape, so it is always reported (it also sizes the advisor's plans).
        self.flops_per_sample = shape.train_flops_per_token(self.info.seq_len) * self.info.seq_len
        self.data_rank = self.parallel.dp_rank
        self.stage_is_last = self.parallel.last_stage
        if self.layout.pp > 1:
            self.schedule = build_schedule(self.parallel, self.ctx.device, self._pipeline_loss)

    def _pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        # The schedule sums the gradients of its micro-batches and micro-steps add theirs: the
        # division makes the sum the mean over the optimizer step's samples.
        return lm_loss(logits, targets) / (
            self.config.layout.pp_microbatches * self.train_cfg.grad_accum
        )

    def _peak(self) -> tuple[float | None, str | None]:
        """The per-rank peak MFU is measured against, and where it comes from.

        A rental on a simulated node runs on the host's CPU, not on the card it booked: its
        model FLOPs/s over that card's datasheet peak would be a meaningless 0.0 %. There the
        peak is the dense matmul rate this CPU measures now, in the run's precision, so the MFU
        says how well the run uses the hardware it really has (the card's figure is kept in
        the start event as ``simulated_card_peak_tflops``)."""
        trainer = self.trainer
        if trainer.peak_given:
            return trainer.peak_tflops, "argument"
        if self.ctx.device.type == "cpu" and on_simulated_node():
            return cpu_matmul_tflops(self.precision.dtype), "cpu-measured"
        return trainer.peak_tflops, "env" if trainer.peak_tflops else None

    def _resume(self) -> None:
        if not self.ckpt_cfg.enabled:
            return
        state: dict[str, Any] | None = None
        chosen: str | None = None
        if self.ctx.is_primary:
            remove_stale_temporaries(self.ckpt_dir)
        everywhere = self._steps_on_every_rank([s for s, _ in list_checkpoints(self.ckpt_dir)])
        if self.ctx.is_primary:
            found = load_latest(self.ckpt_dir, among=everywhere) if self.ckpt_cfg.resume else None
            if found is not None:
                state, chosen = found[0], str(found[1])
        # Rank 0 picks the file so that every rank resumes from the same one.
        chosen = broadcast_from_primary(self.ctx, chosen)
        if chosen is None:
            return
        if state is None:
            state = load_checkpoint(Path(chosen))
        self._check_saved_model(state, chosen)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_common(state, chosen)

    def _resume_sharded(self) -> None:
        if not self.ckpt_cfg.enabled:
            return
        chosen: str | None = None
        if self.ctx.is_primary or self.node_leader:
            sharded_checkpoint.remove_stale_temporaries(self.ckpt_dir)
        everywhere = self._steps_on_every_rank(
            [s for s, _ in sharded_checkpoint.list_steps(self.ckpt_dir)]
        )
        if self.ctx.is_primary:
            found = (
                sharded_checkpoint.latest_readable(self.ckpt_dir, among=everywhere)
                if self.ckpt_cfg.resume
                else None
            )
            chosen = str(found) if found is not None else None
        # Rank 0 picks the step so that every rank resumes from the same one.
        chosen = broadcast_from_primary(self.ctx, chosen)
        if chosen is None:
            return
        path = Path(chosen)
        state = sharded_checkpoint.load_extra(path)
        self._check_saved_model(state, chosen)
        sharded_checkpoint.load_sharded(path, self.model, self.optimizer)
        self._restore_common(state, chosen)

    @property
    def node_leader(self) -> bool:
        """The first rank of a node other than rank 0's, in a job across nodes."""
        return self.multi_node and self.ctx.local_rank == 0 and not self.ctx.is_primary

    @property
    def multi_node(self) -> bool:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))
        return local < self.ctx.world_size

    def _steps_on_every_rank(self, steps: list[int]) -> set[int] | None:
        """On rank 0: the checkpoint steps every rank finds in its checkpoint directory (one
        job's nodes may hold different ones: a node of a resumed job keeps what it wrote in an
        earlier placement, which the others never had); None elsewhere. Collective."""
        gathered = gather_to_primary(self.ctx, steps)
        if gathered is None:
            return None
        common = set(gathered[0])
        for other in gathered[1:]:
            common &= set(other)
        return common

    def _check_saved_model(self, state: dict[str, Any], chosen: str) -> None:
        saved_model = state["config"]["model"]
        if saved_model != self.config.to_dict()["model"]:
            raise ConfigError(
                [
                    (
                        "checkpoint.dir",
                        f"{chosen} was written for model {saved_model}, not "
                        f"{self.config.to_dict()['model']}; use another checkpoint.dir",
                    )
                ]
            )

    def _restore_common(self, state: dict[str, Any], chosen: str) -> None:
        """What file and sharded checkpoints restore alike, beyond model and optimizer."""
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.start_step = int(state["step"])
        self.elapsed_before = float(state["elapsed_s"])
        self.last_loss = state["last_loss"]
        rng_states = state["rng"]
        if len(rng_states) == self.ctx.world_size:
            mine = rng_states[self.ctx.rank]
            torch.set_rng_state(mine["torch"])
            if self.ctx.device.type == "cuda" and mine["cuda"] is not None:
                torch.cuda.set_rng_state(mine["cuda"], self.ctx.device)
        else:
            log.warning(
                "checkpoint has %d ranks, this run %d: reseeding random streams",
                len(rng_states),
                self.ctx.world_size,
            )
            torch.manual_seed(self.train_cfg.seed + self.ctx.rank + self.start_step)
        if not self.batches.load_state_dict(state["data"], self.start_step):
            log.warning("global batch size changed since the checkpoint: data order differs")
        self.resumed_from = chosen
        log.info("resumed from %s at step %d", chosen, self.start_step)

    # --- the loop ------------------------------------------------------------------------

    def _train_step(self, step: int) -> Tensor:
        accum = self.train_cfg.grad_accum
        total: Tensor | None = None
        for micro in range(accum):
            inputs, targets = self.train_set.batch(self.batches.indices(step, micro))
            if self.schedule is not None:
                detached = self._pipeline_step(inputs, targets)
                total = detached if total is None else total + detached
                continue
            # Gradients are all-reduced on the last micro-step only.
            sync = self.ddp.no_sync() if self.ddp is not None and micro < accum - 1 else None
            with sync or contextlib.nullcontext():
                with self.precision.autocast():
                    logits = self.train_model(inputs)
                # The loss in fp32 whatever the autocast dtype of the logits.
                loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
                )
                scaled = loss / accum if accum > 1 else loss
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            detached = loss.detach()
            total = detached if total is None else total + detached
        if self.parallel is not None:
            self.parallel.after_backward()
        if self.train_cfg.grad_clip > 0:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.parallel is not None:
                self.grad_norm = clip_grad_norm(
                    list(self.model.parameters()),
                    self.train_cfg.grad_clip,
                    self.parallel.group("pp") if self.layout.pp > 1 else None,
                )
            else:
                self.grad_norm = nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.train_cfg.grad_clip
                )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        assert total is not None
        return total / accum if accum > 1 else total

    def _pipeline_step(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One micro-step through the pipeline (forward and backward of all its micro-batches);
        the micro-step's mean loss on the last stage, zero on the others."""
        assert self.parallel is not None
        losses: list[Tensor] = []
        with self.precision.autocast():
            if self.parallel.first_stage:
                self.schedule.step(inputs)
            elif self.parallel.last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
        if not losses:
            return torch.zeros((), device=self.ctx.device)
        return torch.stack(losses).detach().sum() * self.train_cfg.grad_accum

    def execute(self) -> dict[str, Any]:
        self._setup()
        ctx, train = self.ctx, self.train_cfg
        self.grad_norm: Tensor | None = None
        peak = self.peak_tflops
        self.trainer.emit(ctx, self._start_event(peak))

        step = self.start_step
        loop_start = time.perf_counter()
        interval_start, interval_paused = loop_start, 0.0
        # Step losses stay on the device until a step event reads them, so the loop queues work
        # without waiting for it.
        interval_losses: list[Tensor] = []
        last_checkpoint_time = time.monotonic()
        last_checkpoint: str | None = self.resumed_from
        last_eval: dict[str, Any] | None = None
        stop_reason: str | None = None
        self.model.train()

        while step < train.steps:
            interval_losses.append(self._train_step(step))
            step += 1
            stop_reason, time_due = self._poll(last_checkpoint_time)
            finished = step == train.steps

            if step % train.log_every == 0 or finished or stop_reason:
                # Reading the loss waits for the queued device work, so the time after it is
                # the true end of the interval.
                self.last_loss = self._global_mean(torch.stack(interval_losses).mean())
                elapsed = time.perf_counter() - interval_start - interval_paused
                event = self._step_event(step, len(interval_losses), elapsed, peak)
                self.trainer.emit(ctx, event)
                interval_start, interval_paused = time.perf_counter(), 0.0
                interval_losses = []

            eval_due = (
                train.eval_every and not stop_reason and (step % train.eval_every == 0 or finished)
            )
            checkpoint_due = self.ckpt_cfg.enabled and (
                (self.ckpt_cfg.every_steps and step % self.ckpt_cfg.every_steps == 0)
                or time_due
                or finished
                or stop_reason is not None
            )
            if eval_due or checkpoint_due:
                pause_start = time.perf_counter()
                if eval_due:
                    last_eval = self._evaluate(step)
                    self.trainer.emit(ctx, {"event": "eval", **last_eval})
                if checkpoint_due:
                    elapsed_total = self.elapsed_before + time.perf_counter() - loop_start
                    last_checkpoint = self._save(step, elapsed_total) or last_checkpoint
                    last_checkpoint_time = time.monotonic()
                interval_paused += time.perf_counter() - pause_start
            if stop_reason:
                break

        run_seconds = time.perf_counter() - loop_start
        steps_this_run = step - self.start_step
        samples_per_s = steps_this_run * self.batches.global_batch / run_seconds
        summary: dict[str, Any] = {
            "event": "summary",
            "steps": step,
            "steps_this_run": steps_this_run,
            "final_loss": self.last_loss,
            "exit_reason": stop_reason or "completed",
            "elapsed_s": round(run_seconds, 3),
            "total_elapsed_s": round(self.elapsed_before + run_seconds, 3),
            "samples_per_s": samples_per_s,
        }
        if self.info.task == "lm":
            summary["tokens_per_s"] = samples_per_s * self.info.seq_len
        final_model = None
        if stop_reason is None and self.trainer.output_dir is not None:
            final_model = self._save_final(step, summary, last_eval)
        summary.update(
            peak_mem_bytes=peak_memory_bytes(ctx.device),
            checkpoint=last_checkpoint,
            eval=last_eval,
            final_model=final_model,
        )
        self.trainer.emit(ctx, summary)
        return summary

    def _save_final(
        self, step: int, summary: dict[str, Any], last_eval: dict[str, Any] | None
    ) -> str | None:
        """The completed run's model and what it is, in ``final/`` of the output directory (a
        stopped run's weights are in its checkpoint: a stop is a pause, not the end). Every
        rank calls it (a sharded model is gathered collectively); rank 0 writes. Under pipeline
        parallelism no rank holds the whole model: its weights are the last sharded
        checkpoint's."""
        assert self.trainer.output_dir is not None
        if self.parallel is not None:
            if self.layout.pp > 1:
                log.info("pipeline-parallel run: the final weights are in its last checkpoint")
                return None
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            # Collective: gathers sharded parameters; with cpu_offload only rank 0 keeps them.
            full = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if not self.ctx.is_primary:
            return None
        if self.parallel is None:
            full = self.model.state_dict()
        directory = self.trainer.output_dir / FINAL_SUBDIR
        description = {
            "config": self.config.to_dict(),
            "step": step,
            "params": self.params,
            "final_loss": summary["final_loss"],
            "eval": last_eval,
            "torch_version": torch.__version__,
        }
        state = {name: tensor.detach().cpu() for name, tensor in full.items()}
        path = save_final_model(state, description, directory)
        log.info("final model written to %s", path)
        return str(path)

    def _poll(self, last_checkpoint_time: float) -> tuple[str | None, bool]:
        """(why to stop now, or None; whether a time-based checkpoint is due), the same on every
        rank: a signal may reach one rank only, and only rank 0's clock decides the time."""
        ctx, every = self.ctx, self.ckpt_cfg.every_seconds
        time_due = ctx.is_primary and every > 0 and time.monotonic() - last_checkpoint_time >= every
        local_stop = self.trainer.stop_reason
        if not ctx.distributed:
            return local_stop, time_due
        *stops, time_due = agree_any(
            ctx, [local_stop == reason for reason in STOP_REASONS] + [time_due]
        )
        return next((r for r, s in zip(STOP_REASONS, stops, strict=True) if s), None), time_due

    # --- events --------------------------------------------------------------------------

    def _start_event(self, peak: float | None) -> dict[str, Any]:
        device = self.ctx.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return {
            "event": "start",
            "world_size": self.ctx.world_size,
            "device": device.type,
            "device_name": name,
            "precision": self.precision.name,
            "params": self.params,
            "global_batch_size": self.batches.global_batch,
            "steps": self.train_cfg.steps,
            "start_step": self.start_step,
            "resumed_from": self.resumed_from,
            "flops_per_sample": self.flops_per_sample,
            "peak_tflops": peak,
            "peak_tflops_source": self.peak_source,
            "simulated_card_peak_tflops": (
                self.trainer.peak_tflops if self.peak_source == "cpu-measured" else None
            ),
            "torch_version": torch.__version__,
            "layout": {
                "dp": self.layout.dp,
                "tp": self.layout.tp,
                "pp": self.layout.pp,
                **{
                    key: value
                    for key, value in dataclasses.asdict(self.config.layout).items()
                    if key not in ("dp", "tp", "pp")
                },
            },
            "config": self.config.to_dict(),
        }

    def _step_event(
        self, step: int, steps: int, elapsed: float, peak: float | None
    ) -> dict[str, Any]:
        samples_per_s = steps * self.batches.global_batch / elapsed
        event: dict[str, Any] = {
            "event": "step",
            "step": step,
            "loss": self.last_loss,
            "lr": self.train_cfg.lr * lr_factor_fn(self.train_cfg)(step - 1),
            "samples_per_s": samples_per_s,
        }
        if self.info.task == "lm":
            event["tokens_per_s"] = samples_per_s * self.info.seq_len
        event.update(
            peak_mem_bytes=peak_memory_bytes(self.ctx.device),
            mfu=mfu(self.flops_per_sample, samples_per_s, self.ctx.world_size, peak),
            grad_norm=float(self.grad_norm) if self.grad_norm is not None else None,
        )
        if self.scaler is not None:
            event["loss_scale"] = float(self.scaler.get_scale())
        return event

    def _global_mean(self, value: Tensor) -> float:
        """The mean over ranks of a loss; under pipeline parallelism only the last stage's
        ranks hold it (the others contribute zero)."""
        if self.ctx.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.ctx.world_size // self.layout.pp
        return float(value.item())

    @torch.no_grad()
    def _evaluate(self, step: int) -> dict[str, Any]:
        # The plain module: eval shapes differ from training ones and must not trigger compiles.
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for indices, valid in eval_batches(
            len(self.eval_set),
            batch_size=self.config.data.eval_batch_size,
            world_size=self.layout.dp,
            rank=self.data_rank,
            device=self.ctx.device,
        ):
            inputs, targets = self.eval_set.batch(indices)
            with self.precision.autocast():
                logits = self.model(inputs)
            logits = logits.float().reshape(-1, logits.shape[-1])
            weights = valid.repeat_interleave(targets[0].numel())
            targets = targets.reshape(-1)
            losses = F.cross_entropy(logits, targets, reduction="none")
            totals[0] += (losses * weights).sum()
            totals[1] += ((logits.argmax(dim=1) == targets) * weights).sum()
            totals[2] += weights.sum()
        if self.ctx.distributed:
            # Tensor-parallel peers computed the same sums: count each data-parallel rank once.
            group = self.parallel.group("dp") if self.parallel is not None else None
            dist.all_reduce(totals, group=group)
        self.model.train()
        loss_sum, correct, count = totals.tolist()
        return {
            "step": step,
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "samples": len(self.eval_set),
        }

    def _save(self, step: int, elapsed_total: float) -> str | None:
        device = self.ctx.device
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        }
        rng_states = gather_to_primary(self.ctx, rng)
        if self.sharded:
            return self._save_sharded(step, elapsed_total, rng_states)
        if not self.ctx.is_primary:
            return None
        started = time.perf_counter()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self._common_state(step, elapsed_total, rng_states),
        }
        path = write_checkpoint_file(state, self.ckpt_dir, step, self.ckpt_cfg.keep)
        self._emit_checkpoint(step, path, path.stat().st_size, started)
        return str(path)

    def _common_state(
        self, step: int, elapsed_total: float, rng_states: list[Any] | None
    ) -> dict[str, Any]:
        """What file and sharded checkpoints hold alike, beyond model and optimizer."""
        return {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_states,
            "data": self.batches.state_dict(step),
            "elapsed_s": elapsed_total,
            "last_loss": self.last_loss,
            "world_size": self.ctx.world_size,
            "config": self.config.to_dict(),
        }

    def _save_sharded(self, step: int, elapsed_total: float, rng_states: list[Any] | None) -> str:
        started = time.perf_counter()
        extra = self._common_state(step, elapsed_total, rng_states) if self.ctx.is_primary else None
        path = sharded_checkpoint.save_sharded(
            directory=self.ckpt_dir,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            extra=extra,
            keep=self.ckpt_cfg.keep,
        )
        if self.ctx.is_primary:
            size = sharded_checkpoint.directory_bytes(path)
            self._emit_checkpoint(step, path, size, started)
        if self.multi_node:
            # Rank 0 has completed the step (on a shared file system that renamed every
            # node's shards); each other node now completes its own part.
            dist.barrier(group=self.ctx.control_group)
            if self.node_leader:
                part = sharded_checkpoint.finish_node_part(
                    directory=self.ckpt_dir, step=step, keep=self.ckpt_cfg.keep
                )
                if part is not None:
                    # Announced on this node's output, so that its agent syncs the part now.
                    self.trainer.emit_local(
                        {
                            "event": "checkpoint",
                            "step": step,
                            "path": str(part),
                            "bytes": sharded_checkpoint.directory_bytes(part),
                            "part": True,
                        }
                    )
        return str(path)

    def _emit_checkpoint(self, step: int, path: Path, size: int, started: float) -> None:
        self.trainer.emit(
            self.ctx,
            {
                "event": "checkpoint",
                "step": step,
                "path": str(path),
                "bytes": size,
                "seconds": round(time.perf_counter() - started, 3),
            },
        )
