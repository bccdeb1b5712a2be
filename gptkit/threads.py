"""CPU threads for torch, one helper for train, sample, eval and bench.

torch's default is one intra-op thread per core this process may run on (under DDP on CPU, Lightning
divides the cores among the processes of a node). On a machine that other jobs keep busy those
threads fight for cores: each torch op waits for its slowest thread, and a small model's step can take
several times longer than with fewer threads, for the same result. So the thread count is an option
(trainer.threads, threads=, bench.threads=), and start-up prints one warning, with the fix, when the
load already on the machine means the chosen threads would oversubscribe its cores.
"""

from __future__ import annotations

import os
import sys
import time

from gptkit.errors import ConfigError

# torch is imported on use: the thread checks run in the CLI before torch is needed.


def cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads, option: str) -> int | None:
    """The option's value: None (torch's default) or an integer >= 1; else a one-line ConfigError."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError(
            f"{option}={threads} must be an integer >= 1 (or null for torch's default: one per core)"
        )
    return threads


def set_threads(threads, option: str, processes: int = 1, warn: bool = True) -> int:
    """Give torch `threads` intra-op threads in this process (None: keep its default, or under several CPU
    processes per node the share Lightning would give each), and return the count. When `warn`, print one
    warning (from the node's first process) if these threads and the machine's other load exceed its cores.
    An explicit count is also exported as OMP_NUM_THREADS, so that processes started from this one keep it."""
    import torch

    threads = check_threads(threads, option)
    # the user's count: kept, with a warning
    chosen = threads is not None or "OMP_NUM_THREADS" in os.environ
    if threads is None and processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        # what Lightning's launcher sets for DDP on CPU
        threads = max(1, cores() // processes)
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    n = torch.get_num_threads()
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    # not set: the count that fits the machine's load now, said on one line
    if warn and not chosen:
        load, fit = fitting(n, processes) or (0.0, n)
        if fit < n:
            torch.set_num_threads(fit)
            os.environ["OMP_NUM_THREADS"] = str(fit)
            if first:
                print(
                    f"note: {fit} torch thread{'s' if fit > 1 else ''} instead of {n}: other work loads "
                    f"{load:.1f} of the {cores()} cores (set {option}={n} to use {n} anyway)",
                    file=sys.stderr,
                )
            return fit
        return n
    message = oversubscribed(n, processes, option)
    if warn and message and first:
        print(f"warning: {message}", file=sys.stderr)
    return n


def _fits(load: float, n_cores: int, processes: int) -> int:
    """The largest thread count per process that fits beside `load` on `n_cores` cores, at least 1."""
    return max(1, int((n_cores - load) / processes + 0.5))


def fitting(threads: int, processes: int = 1, n_cores: int | None = None) -> tuple[float, int] | None:
    """(the other work's load, the largest thread count per process that fits beside it, at most
    `threads`), or None where the load cannot be read. The load is the 1-minute average, confirmed (when it
    says the threads do not fit) by what is busy now (busy_now: the average lags behind work that ended)."""
    n_cores = n_cores or cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    # counting work that just ended (`train`, then `sample`)?
    if threads > _fits(load, n_cores, processes):
        now = busy_now()
        load = load if now is None else min(load, now)
    return load, min(threads, _fits(load, n_cores, processes))


def oversubscribed(
    threads: int, processes: int, option: str, load: float | None = None, n_cores: int | None = None
) -> str | None:
    """The warning for `threads` per process x `processes` on this machine, or None when they fit. The other
    work is `load`, else as `fitting` measures it. The fix names the largest count that fits, at least 1."""
    n_cores = n_cores or cores()
    if load is None:
        measured = fitting(threads, processes, n_cores)
        if measured is None:
            return None
        load = measured[0]
    fit = _fits(load, n_cores, processes)
    if threads <= fit:
        return None
    per = f"{threads} torch threads" + (f" x {processes} processes" if processes > 1 else "")
    return (
        f"{per} on {n_cores} cores that other work already loads ({load:.1f}): the threads will wait for "
        f"each other and steps can be several times slower; set {option}={fit} "
        f"(or OMP_NUM_THREADS={fit})"
    )


def busy_now(seconds: float = 0.2) -> float | None:
    """Cores busy with other work right now: the machine's busy CPU time over `seconds` (/proc/stat) minus
    this process's own, per second of wall time; None where /proc/stat cannot be read."""

    def busy_ticks() -> int:
        with open("/proc/stat") as f:
            # user nice system idle iowait irq softirq steal
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4]

    try:
        b0 = busy_ticks()
        own0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        b1 = busy_ticks()
        own, wall = time.process_time() - own0, time.perf_counter() - t0
        return max(0.0, ((b1 - b0) / os.sysconf("SC_CLK_TCK") - own) / wall)
    except (OSError, ValueError, IndexError):
        return None
