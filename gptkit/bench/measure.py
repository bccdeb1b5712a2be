"""What every benchmark reports beside its figures: the machine's load, and wall seconds beside CPU seconds.

A shared CPU machine makes wall-clock figures swing with the other jobs on it; CPU seconds (what this process
and the processes it started ran) change much less, and a ratio of two things measured side by side or
interleaved (A, B, A, B) sees the same load on both. `gptkit bench` prints the load before and after every
benchmark and the wall and CPU seconds it took (gptkit/commands/bench.py); the benchmarks that compare
report their ratios from interleaved runs.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path


def loadavg() -> str:
    """The 1, 5 and 15-minute load averages ("?" where the system does not say)."""
    f = Path("/proc/loadavg")
    if f.is_file():
        return " ".join(f.read_text().split()[:3])
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Usage:
    """Wall and CPU seconds from start() to stop(), and the load at both ends."""

    wall: float = 0.0
    cpu: float = 0.0
    load_start: str = ""
    load_end: str = ""

    def start(self) -> "Usage":
        self.load_start, self._t, self._c = loadavg(), time.perf_counter(), cpu_seconds()
        return self

    def stop(self) -> "Usage":
        self.wall, self.cpu = time.perf_counter() - self._t, cpu_seconds() - self._c
        self.load_end = loadavg()
        return self

    def line(self, what: str) -> str:
        return (
            f"{what}: {self.wall:,.1f} s wall, {self.cpu:,.1f} s CPU (this process and the ones it started); "
            f"load {self.load_start} before, {self.load_end} after"
        )
