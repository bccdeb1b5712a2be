"""Callbacks: throughput/FLOPs/MFU accounting, and the run's checkpoints with a graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from gptkit import accounting as acc
from gptkit.checkpoints import LAST_CHECKPOINT
from gptkit.precision import precision


def detect_peak_flops(precision_name: str, override_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for the active precision, from the accelerator table.

    None on CPU (and on unknown GPUs) unless the user gives trainer.peak_tflops.
    """
    if override_tflops is not None:
        return float(override_tflops) * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower().replace(" ", "").replace("-", "")
    dtype = precision(precision_name).compute
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    for key, table in acc.ACCELERATORS.items():
        if key in name and dtype in table:
            return table[dtype] * 1e12
    return None


class ThroughputMonitor(Callback):
    """Logs tokens/s, achieved FLOP/s, MFU and cumulative tokens and FLOPs every `log_every` steps.

    tokens per optimizer step = batch_size * seq_len * accumulate_grad_batches * world_size (global);
    FLOPs per token are the analytic training FLOPs (6N + causal attention term) of gptkit.accounting;
    MFU is per device: global FLOP/s / (world_size * peak). Validation time is excluded.
    """

    def __init__(self, flops_per_token: float, tokens_per_step: int, peak_flops: float | None, log_every: int) -> None:
        self.flops_per_token = flops_per_token
        self.tokens_per_step = tokens_per_step
        self.peak = peak_flops
        self.log_every = max(1, log_every)
        self._t0: float | None = None
        self._steps = 0
        self.last: dict[str, float] = {}

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_start(self, trainer, pl_module) -> None:
        self._restart(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._restart(trainer)

    def _restart(self, trainer) -> None:
        self._sync(trainer)
        self._t0, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # no optimizer step yet
        self._steps += 1
        step = trainer.global_step
        if step % self.log_every and step != trainer.max_steps:
            return
        self._sync(trainer)
        dt = time.perf_counter() - self._t0
        if dt <= 0 or self._steps == 0:
            return
        tokens_per_s = self._steps * self.tokens_per_step / dt
        flops_per_s = tokens_per_s * self.flops_per_token
        metrics = {
            "step": float(step - 1),  # the same x-axis as train/loss of this batch
            "perf/tokens_per_s": tokens_per_s,
            "perf/flops_per_s": flops_per_s,
            "perf/tokens": float(step * self.tokens_per_step),
            "perf/flops": float(step * self.tokens_per_step * self.flops_per_token),
        }
        if self.peak:
            metrics["perf/mfu"] = acc.mfu(tokens_per_s / trainer.world_size, self.flops_per_token, self.peak)
        self.last = metrics
        for k, v in metrics.items():
            pl_module.log(k, v, prog_bar=k in ("perf/tokens_per_s", "perf/mfu"), on_step=True, on_epoch=False,
                          rank_zero_only=True)
        self._t0, self._steps = time.perf_counter(), 0


class RunCheckpoints(Callback):
    """The one writer of a run's checkpoints, and the graceful stop.

    Every `every` optimizer steps it writes checkpoints/step-NNNNNN.ckpt and points last.ckpt at it
    (a hard link: no second write); at the step that ends this invocation it writes last.ckpt. That
    step is the last one (max_steps), trainer.stop_at_step, or the step during which SIGINT (Ctrl-C)
    or SIGTERM (preemption) arrived: the step is finished first, then saved, then the run stops (with
    several ranks, at the next multiple of sync_every steps, so that all ranks stop together). A second
    Ctrl-C interrupts at once.

    The saves happen inside the training loop (as Lightning's own ModelCheckpoint does), so a resumed
    run continues Lightning's step counters exactly.
    """

    def __init__(self, ckpt_dir: str, every: int, stop_at_step: int | None = None, sync_every: int = 10) -> None:
        self.dir = Path(ckpt_dir)
        self.every = max(1, every)
        self.stop_at_step = stop_at_step
        self.sync_every = max(1, sync_every)  # with several ranks: agree on a signal every N steps
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def last(self) -> Path:
        return self.dir / LAST_CHECKPOINT

    def _handler(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def on_train_start(self, trainer, pl_module) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _stop_requested(self, trainer) -> bool:
        stop = self.signal_name is not None
        if trainer.world_size > 1:
            # every rank stops at the same step, whichever rank got the signal; the vote is a collective
            # with a host sync, so it is taken every sync_every steps rather than every step
            if trainer.global_step % self.sync_every and trainer.global_step < trainer.max_steps:
                return False
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
            self.signal_name = self.signal_name or ("SIGTERM" if stop else None)
        return stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not optimizer_stepped(trainer, batch_idx):
            return
        step = trainer.global_step
        stop = self._stop_requested(trainer)
        early = self.stop_at_step is not None and step >= self.stop_at_step
        final = stop or early or step >= trainer.max_steps
        if step % self.every == 0:
            periodic = self.dir / f"step-{step:06d}.ckpt"
            trainer.save_checkpoint(periodic, weights_only=False)
            if not self._link_last(trainer, periodic):
                trainer.save_checkpoint(self.last, weights_only=False)
        elif final:
            trainer.save_checkpoint(self.last, weights_only=False)
        if stop or early:
            trainer.should_stop = True

    def _link_last(self, trainer, periodic: Path) -> bool:
        """last.ckpt as a hard link to the periodic file just written (atomically replacing the old one).
        False when that cannot be done (a sharded folder, or a filesystem without hard links)."""
        ok = True
        if trainer.is_global_zero:
            ok = periodic.is_file()
            if ok:
                tmp = self.dir / f".{LAST_CHECKPOINT}.link.tmp"
                try:
                    tmp.unlink(missing_ok=True)
                    os.link(periodic, tmp)
                    os.replace(tmp, self.last)
                except OSError:
                    tmp.unlink(missing_ok=True)
                    ok = False
        return trainer.strategy.broadcast(ok)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()


def optimizer_stepped(trainer: L.Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0
