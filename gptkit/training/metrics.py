"""What training measures, read only at log steps: the hot path has no host sync.

Between two log steps nothing is read from the device: LossWindow keeps the running sum of the train
losses and the first step whose loss was not finite as device tensors. Every trainer.log_every optimizer
steps (and at the last one) StepMetrics synchronizes once and writes one row for that step to every
logger: train/loss (the mean over the window, across ranks), train/grad_norm (the mean over the window's
steps of the total gradient norm the clipping computes, before clipping), train/lr, tokens/s (on the clock,
and per second of the process's CPU time: perf/tokens_per_cpu_s), achieved FLOP/s, MFU, cumulative tokens
and FLOPs. The first non-finite loss stops the run there, and RunCheckpoints
asks LossWindow before every save, so a checkpoint never holds what a NaN step produced.

Loss spikes: LossWindow keeps each optimizer step's loss too (on the device, read in the same one
all-reduce), and SpikeWatch compares each with the median of the steps before it (trainer.spike_window of
them): a step whose loss exceeds trainer.spike_factor x that median is noted once, as one line with the
`gptkit trace` command that lists the documents it trained on, and in metrics.csv (train/spike: the ratio,
train/spike_loss: the step's loss, on the step's own row). The window travels with the checkpoint: a resumed
run notes the spikes an uninterrupted one would.

FLOPs per token are the analytic training FLOPs of `gptkit count-params` by the published convention
(6N + 12·L·T·d_attn, full attention, as PaLM, nanoGPT and torchtitan count: gptkit.accounting); MFU is
per device: global FLOP/s / (world_size * the device's peak). perf/mfu_causal counts the attention term
halved (the work of a kernel that skips the masked half).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from gptkit import accounting as acc
from gptkit.errors import ConfigError, GptkitError
from gptkit.precision import Precision, precision


class NonFiniteLossError(GptkitError):
    """The training loss became NaN or inf."""


def detect_peak_flops(p: Precision | str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for the precision `p` (a run plan's, or its name), from the accelerator
    table.

    None on CPU (and on unknown GPUs) unless the user gives trainer.peak_tflops.
    """
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower().replace(" ", "").replace("-", "")
    dtype = precision(p).compute
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    for key, table in acc.ACCELERATORS.items():
        if key in name and dtype in table:
            return table[dtype] * 1e12
    return None


class LossWindow:
    """The train losses since the last log step, and the first non-finite one, kept on the device."""

    def __init__(self) -> None:
        # fp32 scalar: the losses, each times its weight
        self.sum: torch.Tensor | None = None
        # fp32 scalar: the weights (loss tokens, or 1 per loss)
        self.weight: torch.Tensor | None = None
        # losses added (micro-batches)
        self.count = 0
        # int64 scalar: the step of the first non-finite loss, or -1
        self.first_bad: torch.Tensor | None = None
        # fp32 scalar: the gradient norms of the window's steps
        self.norm_sum: torch.Tensor | None = None
        # optimizer steps whose gradient norm was added
        self.norm_count = 0
        # each optimizer step's (sum, weight) in the window: (its 0-based index, fp32 [2]), the open one last
        self.steps: list[tuple[int, torch.Tensor]] = []
        # (the step it made, its loss over all ranks) of the steps of the window last read
        self.step_losses: list[tuple[int, float]] = []

    def add(self, loss: torch.Tensor, step: int, tokens: torch.Tensor | None = None) -> None:
        """Record the loss of a micro-batch of optimizer step `step` (no host sync). With `tokens` (its loss
        tokens: loss is their mean) the window's loss is the mean over every token (a micro-batch without
        one adds nothing); without, the mean over the micro-batches."""
        loss = loss.detach().float()
        if self.sum is None:
            self.sum = torch.zeros((), device=loss.device)
            self.weight = torch.zeros((), device=loss.device)
            self.first_bad = torch.full((), -1, dtype=torch.long, device=loss.device)
        if tokens is None:
            counted, weight = torch.ones((), dtype=torch.bool, device=loss.device), 1.0
        else:
            counted, weight = tokens > 0, tokens.float()
        part = torch.where(counted, loss * weight, 0.0)
        self.sum += part
        self.weight += weight
        self.count += 1
        # this micro-batch's share of its optimizer step (a new step opens a new entry)
        if not self.steps or self.steps[-1][0] != step:
            self.steps.append((step, torch.zeros(2, device=loss.device)))
        # a weight of 1 made on the device: a tensor from a Python number would be a copy to it (a sync)
        w = weight if tokens is not None else torch.ones((), device=loss.device)
        self.steps[-1][1].add_(torch.stack([part, w]))
        bad = ~torch.isfinite(loss) & counted & (self.first_bad < 0)
        self.first_bad = torch.where(bad, step, self.first_bad)

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """Record the total gradient norm of one optimizer step, before clipping (no host sync)."""
        norm = norm.detach().float()
        self.norm_sum = norm.clone() if self.norm_sum is None else self.norm_sum + norm
        self.norm_count += 1

    def read_grad_norm(self) -> float | None:
        """The mean gradient norm of the window's optimizer steps (read at a log step), then start afresh.

        The norm is the same on every rank (DDP all-reduces the gradients first; FSDP's is the full one)."""
        if self.norm_sum is None or self.norm_count == 0:
            return None
        mean = float(self.norm_sum) / self.norm_count
        self.norm_sum = None
        self.norm_count = 0
        return mean

    def check_finite(self, strategy) -> None:
        """Raise NonFiniteLossError on every rank if any rank saw a non-finite loss (a host sync)."""
        if self.first_bad is None:
            return
        bad = int(strategy.reduce(self.first_bad.clone(), reduce_op="max"))
        if bad >= 0:
            raise NonFiniteLossError(
                f"training loss became non-finite at step {bad}; the run stopped and kept its last good "
                f"checkpoint; lower optim.lr, raise optim.warmup_steps, or check the data"
            )

    def read(self, strategy) -> float | None:
        """The mean loss of the window over all ranks (per loss token when add had them; a host sync),
        then start a new window. Each step's own loss over all ranks goes to step_losses (the same
        all-reduce)."""
        self.check_finite(strategy)
        if self.sum is None or self.count == 0:
            return None
        # [2 + 2 * steps]: the window's sum and weight, then each step's, all ranks
        totals = strategy.reduce(
            torch.cat([torch.stack([self.sum, self.weight]), *(t for _, t in self.steps)]), reduce_op="sum"
        )
        per_step = totals[2:].view(-1, 2).tolist()
        self.step_losses = [
            (s + 1, total / weight) for (s, _), (total, weight) in zip(self.steps, per_step) if weight > 0
        ]
        self.steps = []
        self.sum.zero_()
        self.weight.zero_()
        self.count = 0
        return float(totals[0] / totals[1])


class SpikeWatch:
    """Loss spikes: a step whose loss exceeds `factor` x the median loss of the `window` steps before it
    (once at least min(10, window) are known) is a spike; every step's loss joins the window after it is
    judged."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor, self.window = float(factor), int(window)
        self.history: deque[float] = deque(maxlen=self.window)
        self.least = min(10, self.window)

    def observe(self, loss: float) -> float | None:
        """loss / the median of the window when that is above the factor, else None."""
        ratio = None
        if len(self.history) >= self.least and loss == loss:
            median = statistics.median(self.history)
            if median > 0 and loss > self.factor * median:
                ratio = loss / median
        self.history.append(loss)
        return ratio

    def median(self) -> float:
        return statistics.median(self.history)


def check_spikes(t: Any) -> SpikeWatch | None:
    """trainer.spike_factor (> 1, or null: off) and trainer.spike_window (>= 1): one-line errors."""
    factor, window = t.get("spike_factor"), t.get("spike_window", 50)
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ConfigError(f"trainer.spike_factor={factor!r} must be a number > 1 (or null: no spike notes)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"trainer.spike_window={window!r} must be an integer >= 1")
    return SpikeWatch(float(factor), window)


def optimizer_stepped(trainer, batch_idx: int) -> bool:
    """Whether micro-batch batch_idx ended an optimizer step (the last of its accumulation)."""
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


class StepMetrics(Callback):
    """Every log_every optimizer steps (and at the last): one row of metrics to every logger and to the
    progress reporter. Timing excludes validation; the run's totals give the final average."""

    def __init__(
        self,
        flops_per_token: float,
        tokens_per_step: int,
        peak_flops: float | None,
        log_every: int,
        reporter=None,
        causal_flops_per_token: float | None = None,
        spikes: SpikeWatch | None = None,
        run_dir: Path | None = None,
    ) -> None:
        # the full-attention convention: perf/flops_per_s, perf/mfu
        self.flops_per_token = flops_per_token
        # perf/mfu_causal
        self.causal_flops_per_token = causal_flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak = peak_flops
        self.log_every = max(1, log_every)
        self.reporter = reporter
        self._t0: float | None = None
        # the process's CPU time when the window started (time.process_time: every thread of this process)
        self._c0 = 0.0
        # optimizer steps in the current timing window
        self._steps = 0
        # this invocation's training time, validation excluded, on the clock and in this process's CPU time
        self.train_seconds = 0.0
        self.train_cpu_seconds = 0.0
        # optimizer steps this invocation
        self.steps_done = 0
        self.last: dict[str, float] = {}
        # trainer.spike_factor: loss spikes noted (None: off); the run folder their trace command names
        self.spikes, self.run_dir = spikes, run_dir

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_start(self, trainer, pl_module) -> None:
        """Start the clock and the progress reporter."""
        self._restart(trainer)
        if self.reporter is not None:
            self.reporter.start(trainer.global_step, trainer.max_steps)

    def on_validation_start(self, trainer, pl_module) -> None:
        """Stop the clock: validation time is not training time."""
        self._pause(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        """Show the val loss, then restart the clock."""
        if self.reporter is not None and trainer.is_global_zero:
            val = trainer.callback_metrics.get("val/loss")
            if val is not None:
                objective = getattr(pl_module, "objective", None)
                extra = objective.val_progress(trainer.callback_metrics) if objective is not None else ""
                self.reporter.validation(trainer.global_step, float(val), extra)
        self._restart(trainer)

    def _pause(self, trainer) -> None:
        self._sync(trainer)
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self.train_cpu_seconds += time.process_time() - self._c0
            self._t0 = None

    def _restart(self, trainer) -> None:
        self._sync(trainer)
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self._steps = 0

    def pause(self, trainer) -> None:
        """Stop the training clock while something else runs (the task evals); resume() restarts it, and the
        time between is in neither this window's tokens/s nor the training time."""
        self._sync(trainer)
        self._paused_at, self._paused_cpu = time.perf_counter(), time.process_time()

    def resume(self, trainer) -> None:
        if self._t0 is not None:
            self._t0 += time.perf_counter() - self._paused_at
            self._c0 += time.process_time() - self._paused_cpu

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """At a log step: read the loss window (the one host sync), log one row of metrics."""
        if not optimizer_stepped(trainer, batch_idx):
            return
        self._steps += 1
        self.steps_done += 1
        step = trainer.global_step
        if self.reporter is not None:
            self.reporter.advance(step)
        if step % self.log_every and step != trainer.max_steps:
            return
        # the one host sync of this window
        loss = pl_module.loss_window.read(trainer.strategy)
        grad_norm = pl_module.loss_window.read_grad_norm()
        self._note_spikes(trainer, pl_module.loss_window.step_losses)
        # the objective's own figures (DPO: train/rewards/*)
        extra = getattr(pl_module, "train_metrics", lambda _: {})(trainer.strategy)
        self._sync(trainer)
        now, cpu = time.perf_counter(), time.process_time()
        dt, dt_cpu = now - self._t0, cpu - self._c0
        self.train_seconds += dt
        self.train_cpu_seconds += dt_cpu
        self._t0, self._c0 = now, cpu
        tokens_per_s = self._steps * self.tokens_per_step / dt if dt > 0 else 0.0
        tokens = self._steps * self.tokens_per_step
        self._steps = 0
        metrics = {
            "train/lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
            "perf/tokens_per_s": tokens_per_s,
            # per second of this process's CPU time (all its threads): what a busy machine changes least
            "perf/tokens_per_cpu_s": tokens / dt_cpu if dt_cpu > 0 else 0.0,
            "perf/flops_per_s": tokens_per_s * self.flops_per_token,
            "perf/tokens": float(step * self.tokens_per_step),
            "perf/flops": float(step * self.tokens_per_step * self.flops_per_token),
        }
        if loss is not None:
            metrics["train/loss"] = loss
        if grad_norm is not None:
            metrics["train/grad_norm"] = grad_norm
        metrics.update(extra)
        # data=mix sources
        metrics.update(getattr(trainer.datamodule, "source_tokens", lambda _: {})(step))
        if self.peak:
            metrics["perf/mfu"] = acc.mfu(tokens_per_s / trainer.world_size, self.flops_per_token, self.peak)
            if self.causal_flops_per_token is not None:
                per_device = tokens_per_s / trainer.world_size
                metrics["perf/mfu_causal"] = acc.mfu(per_device, self.causal_flops_per_token, self.peak)
        self.last = metrics
        # x-axis: the optimizer steps done, this one included (as everywhere)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if self.reporter is not None and trainer.is_global_zero:
            parts = getattr(pl_module, "progress_parts", None)
            self.reporter.log(step, metrics, parts(metrics) if parts is not None else [])

    def _note_spikes(self, trainer, step_losses: list[tuple[int, float]]) -> None:
        """Judge each step of the window read (SpikeWatch); note a spike once: its row in every logger
        (train/spike, train/spike_loss) and one line with the trace command (rank 0)."""
        if self.spikes is None:
            return
        for step, loss in step_losses:
            median = self.spikes.median() if self.spikes.history else None
            # the steps that median is over
            known = len(self.spikes.history)
            ratio = self.spikes.observe(loss)
            if ratio is None:
                continue
            for logger in trainer.loggers:
                logger.log_metrics({"train/spike": ratio, "train/spike_loss": loss}, step=step)
            if trainer.is_global_zero:
                line = (
                    f"loss spike at step {step}: {loss:.4f} is {ratio:.2f}x the median {median:.4f} of the "
                    f"{known} steps before it (trainer.spike_factor="
                    f"{self.spikes.factor:g}); the documents it trained on: gptkit trace run={self.run_dir} "
                    f"step={step}"
                )
                if self.reporter is not None:
                    self.reporter.note(line)
                else:
                    print(line, file=sys.stderr, flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        """Stop the clock and close the progress reporter."""
        self._pause(trainer)
        if self.reporter is not None:
            self.reporter.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Close the progress reporter when training fails."""
        if self.reporter is not None:
            self.reporter.close()

    @property
    def average_tokens_per_s(self) -> float | None:
        """This invocation's tokens per second over its whole training time (validation excluded)."""
        if not self.train_seconds:
            return None
        return self.steps_done * self.tokens_per_step / self.train_seconds

    def state_dict(self) -> dict[str, Any]:
        """The losses the spike watch judges by (a resumed run notes the spikes an uninterrupted one notes);
        the other figures start afresh on resume."""
        return {"spike_history": list(self.spikes.history)} if self.spikes is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.spikes is not None:
            self.spikes.history.extend(state.get("spike_history", []))
