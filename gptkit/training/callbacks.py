"""Callbacks: throughput/FLOPs/MFU accounting. (The run's checkpoints and the graceful stop: checkpointing.py.)"""

from __future__ import annotations

import time

import torch
from lightning.pytorch.callbacks import Callback

from gptkit import accounting as acc
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
