"""Memory measured, next to the estimate: at the first log step after the first steps of each invocation
(its second optimizer step, or the next trainer.log_every step; the last one at the latest), the peak memory
of every process against count-params' estimate by part (training/memory.py: weights, gradients, optimizer
state, an objective's reference, activations, logits; on the CPU the runtime's share too), in one line on
stderr and in metrics.csv on that step's row (perf/, as the timings: a measurement of the machine, which a
resumed run measures again):

    perf/memory_peak            what the estimate counts, the largest over the ranks: on a GPU
                                torch.cuda.max_memory_allocated (the tensors); on the CPU the process's peak
                                RSS above its RSS before the model was built (what host_estimate counts: the
                                tensors, the allocator's slack, the trainer's set-up); on Linux the peak
                                is reset there (reset_peak_rss), so an earlier peak of the same process
                                (a test worker, a bench in one process) is not counted
    perf/memory_peak_rss        the CPU: the process's whole peak RSS since then (Python, torch, the data's
                                pages too)
    perf/memory_estimate        what count-params estimates per process (on the CPU: host_estimate)
    perf/memory_estimate_<part> each part of it

The measurement reads the device once (a max over the ranks) at a step that logs anyway: no host sync
between log steps.

On a GPU the allocator's history of those steps is also written as a memory snapshot,
<run>/memory_snapshot.pickle, which https://pytorch.org/memory_viz draws.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from gptkit.fsio import human_bytes
from gptkit.training.memory import estimate, host_estimate

# the optimizer step of an invocation after which memory is measured (the first has allocated the optimizer
# state; the second runs with everything in place)
AFTER_STEPS = 2
SNAPSHOT = "memory_snapshot.pickle"
# allocations the GPU memory history keeps
HISTORY = 200_000


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _status_kib(field: str) -> int | None:
    """A `VmXxx:  N kB` line of /proc/self/status in KiB, or None where there is none (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> int:
    """The process's resident memory now, in bytes, with its peak reset to it where the kernel allows (Linux:
    `5` to /proc/self/clear_refs sets VmHWM to the RSS now), so that peak_rss() counts from here: a process
    that trains after other work (a test worker, `gptkit bench` in one process) would otherwise measure the
    earlier work's peak, or less than its RSS before."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return current_rss()


def peak_rss() -> int:
    """This process's peak resident memory in bytes: since reset_peak_rss() on Linux (VmHWM); elsewhere the
    process's lifetime peak (getrusage: kilobytes on Linux, bytes on macOS)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def memory_line(step: int, peak: float, mem: dict[str, float], how: str) -> str:
    """The log line: the peak measured, the estimate by part, their ratio."""
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if k != "total")
    return (
        f"memory after step {step}: peak {human_bytes(peak)} measured ({how}) against "
        f"{human_bytes(mem['total'])} estimated by count-params ({parts}): {peak / mem['total']:.2f}x"
    )


class MeasuredMemory(Callback):
    """Measures the peak memory once, after this invocation's AFTER_STEPS-th optimizer step (module
    docstring)."""

    def __init__(self, plan: Any, rss_before: int | None = None) -> None:
        """rss_before: the process's RSS before the model was built (what the CPU estimate leaves out)."""
        self.plan, self.rss_before = plan, rss_before
        start, every = int(plan.resume_step or 0), int(plan.trainer.log_every)
        # the first log step (a multiple of log_every) at or after the AFTER_STEPS-th step, or the last
        self.at = min(-(-(start + AFTER_STEPS) // every) * every, plan.max_steps)
        self.run_dir = Path(plan.run_dir) if plan.run_dir is not None else None
        self.recording = False

    def on_train_start(self, trainer, pl_module) -> None:
        """On a GPU: the peak counted from here, and the allocator's history recorded for the snapshot."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=HISTORY)
            self.recording = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches or trainer.global_step != self.at:
            return
        on_gpu = trainer.strategy.root_device.type == "cuda"
        if on_gpu:
            peak = torch.cuda.max_memory_allocated()
            mem = estimate(self.plan)
            how = "torch.cuda.max_memory_allocated, the largest of the ranks"
            if trainer.is_global_zero and self.run_dir is not None:
                torch.cuda.memory._dump_snapshot(str(self.run_dir / SNAPSHOT))
                how += f"; allocations: {self.run_dir / SNAPSHOT}, drawn by pytorch.org/memory_viz"
        else:
            whole = peak_rss()
            before = self.rss_before or 0
            peak = whole - before
            mem = host_estimate(self.plan)
            ranks = ", the largest of the ranks" if trainer.world_size > 1 else ""
            how = (
                f"the process's peak RSS {human_bytes(whole)} less its {human_bytes(before)} before the "
                f"model was built{ranks}"
            )
        self.stop()
        device = trainer.strategy.root_device
        peak = float(trainer.strategy.reduce(torch.tensor(float(peak), device=device), reduce_op="max"))
        metrics = {"perf/memory_peak": peak, "perf/memory_estimate": mem["total"]}
        if not on_gpu:
            metrics["perf/memory_peak_rss"] = float(whole)
        metrics.update({f"perf/memory_estimate_{k}": v for k, v in mem.items() if k != "total"})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if trainer.is_global_zero:
            print(memory_line(trainer.global_step, peak, mem, how), file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.stop()
