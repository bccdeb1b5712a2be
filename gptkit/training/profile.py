"""trainer.profile=<first>-<last>: those optimizer steps recorded by torch.profiler (CPU, on a GPU CUDA too).

    gptkit train ... trainer.profile=10-12      steps 10, 11 and 12 (trainer.profile=10: step 10 alone)

Into the run folder, profile/:

    trace.json                      the Chrome trace (chrome://tracing, https://ui.perfetto.dev); one per rank
                                    (trace-rank<r>.json) on several processes
    tensorboard/<host>_<rank>.pt.trace.json
                                    the same trace where TensorBoard's PyTorch profiler plugin looks for it:
                                    `tensorboard --logdir <run>/profile/tensorboard`
    top.txt                         the operators by self time (what the end of the profile prints)

and one block on stderr (rank 0): the operators with the most self time (on a GPU: device time), and on a GPU
the share of the profiled steps' time in which the device ran nothing (no kernel, no copy): time the GPU
waited for the host. The steps are counted as everywhere in gptkit: step N is the one whose batches make
the N-th optimizer step (row N of metrics.csv), all its micro-batches included.
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from gptkit.errors import ConfigError

# operators listed
TOP = 12
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_profile(value: Any) -> tuple[int, int] | None:
    """trainer.profile as (first, last) steps (null: none); a value that is not N or N-M is one line."""
    if value is None or value is False:
        return None
    m = _RANGE.match(str(value)) if not isinstance(value, bool) else None
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or first < 1 or last < first:
        raise ConfigError(
            f"trainer.profile={value!r} must be a step or a range of steps, e.g. trainer.profile=10-12 "
            "(steps 1 .. trainer.max_steps)"
        )
    return first, last


def check_profile(value: Any, max_steps: int, resume_step: int | None = None) -> tuple[int, int] | None:
    """trainer.profile within the steps this invocation trains (resume_step + 1 .. max_steps)."""
    steps = parse_profile(value)
    if steps is None:
        return None
    low = int(resume_step or 0) + 1
    if steps[1] > max_steps or steps[0] < low:
        trains = f"steps {low}..{max_steps}" if low <= max_steps else "no steps"
        raise ConfigError(
            f"trainer.profile={value} is outside the run: this invocation trains {trains} "
            f"(trainer.max_steps={max_steps}" + (f", resumed at step {low - 1}" if low > 1 else "") + ")"
        )
    return steps


def busy_intervals(events) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every device-side event of a profile (kernels, copies): what the GPU
    was doing."""
    from torch.autograd import DeviceType

    return [
        (float(e.time_range.start), float(e.time_range.end))
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]


def idle_share(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of [start, end) covered by none of the busy intervals (overlaps counted once)."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for a, b in sorted(busy):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return 1.0 - covered / (end - start)


def top_operators(averages, on_device: bool, n: int = TOP) -> list[dict[str, Any]]:
    """The operators with the most self time (device time on a GPU), as rows: name, calls, self CPU ms,
    self device ms, share of all self time."""
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    rows = [a for a in averages if getattr(a, key, 0) > 0]
    total = sum(getattr(a, key) for a in rows) or 1.0
    rows.sort(key=lambda a: getattr(a, key), reverse=True)
    return [
        {
            "name": a.key,
            "calls": int(a.count),
            "self_cpu_ms": a.self_cpu_time_total / 1e3,
            "self_device_ms": getattr(a, "self_device_time_total", 0.0) / 1e3,
            "share": getattr(a, key) / total,
        }
        for a in rows[:n]
    ]


def report(rows: list[dict[str, Any]], steps: tuple[int, int], idle: float | None) -> str:
    """What the end of a profile prints: the operators table, and the device's idle share."""
    on = "device" if idle is not None else "CPU"
    which = f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}"
    width = max([len(r["name"]) for r in rows] + [8])
    lines = [f"profile of {which}: operators by self {on} time"]
    lines.append(
        f"  {'operator':<{width}}  {'calls':>7}  {'self CPU ms':>11}  {'self GPU ms':>11}  {'share':>6}"
    )
    for r in rows:
        lines.append(
            f"  {r['name']:<{width}}  {r['calls']:>7,}  {r['self_cpu_ms']:>11.2f}  "
            f"{r['self_device_ms']:>11.2f}  {r['share']:>6.1%}"
        )
    if idle is not None:
        lines.append(
            f"  the GPU ran nothing for {idle:.1%} of the profiled steps' time (waiting for the host)"
        )
    return "\n".join(lines)


class ProfileSteps(Callback):
    """Records optimizer steps first..last of trainer.profile with torch.profiler, then writes the traces and
    the report (module docstring)."""

    def __init__(self, steps: tuple[int, int], run_dir: Path, accumulation: int) -> None:
        self.first, self.last = steps
        self.dir = Path(run_dir) / "profile"
        self.accumulation = accumulation
        self.profiler = None
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """The first micro-batch of step `first`: start recording."""
        if self.profiler is not None or self.done or batch_idx % self.accumulation:
            return
        if trainer.global_step + 1 != self.first:
            return
        from torch.profiler import ProfilerActivity, profile

        on_gpu = trainer.strategy.root_device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        self.on_gpu = on_gpu
        self.profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After the last micro-batch of step `last`: stop, write, report."""
        if self.profiler is None or (batch_idx + 1) % self.accumulation:
            return
        self.profiler.step()
        if trainer.global_step < self.last:
            return
        if self.on_gpu:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        prof, self.profiler, self.done = self.profiler, None, True
        self._write(trainer, prof)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None

    def _write(self, trainer, prof) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        name = "trace.json" if world == 1 else f"trace-rank{rank}.json"
        trace = self.dir / name
        prof.export_chrome_trace(str(trace))
        board = self.dir / "tensorboard"
        board.mkdir(exist_ok=True)
        shutil.copyfile(trace, board / f"{socket.gethostname()}_{rank}.pt.trace.json")
        rows = top_operators(prof.key_averages(), self.on_gpu)
        idle = None
        if self.on_gpu:
            events = prof.events()
            spans = [(float(e.time_range.start), float(e.time_range.end)) for e in events]
            if spans:
                idle = idle_share(busy_intervals(events), min(a for a, _ in spans), max(b for _, b in spans))
        text = report(rows, (self.first, self.last), idle)
        (self.dir / ("top.txt" if world == 1 else f"top-rank{rank}.txt")).write_text(text + "\n")
        if trainer.is_global_zero:
            print(
                f"{text}\n  traces: {trace} (chrome://tracing or ui.perfetto.dev), TensorBoard: "
                f"tensorboard --logdir {board}",
                file=sys.stderr,
                flush=True,
            )
