"""gptkit bench compare: variants of one model trained side by side at equal steps (conf/bench/compare.yaml).

Every variant trains on every seed the same steps; the variants of a seed are queued together, so with
parallel=2 they train side by side under the same load. From each run's metrics.csv (one `gptkit train` on one
CPU thread, in <runs_dir>/<variant>-seed<n>; a finished run found there is read, not rerun, through
gptkit.bench.optim's reader):

    final val loss    the val loss after the last step, median (min-max) over the seeds, and seed by seed
    train s           the training seconds on the clock and in CPU (validation excluded)
    / baseline        each run's seconds over the baseline variant's run of the same seed, trained beside it:
                      the step-time ratio at equal steps (median, min-max)
    peak memory       what each run measured after its first steps (perf/memory_peak, training/peak_memory.py:
                      on the CPU its peak RSS above its RSS before the model was built)

The load is recorded before and after every run. Losses do not depend on the machine's load; seconds do, CPU
seconds much less than wall seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gptkit.bench.measure import loadavg
from gptkit.bench.optim import read_run, spread, train_all
from gptkit.errors import ConfigError


def run_name(variant: str, seed: int) -> str:
    return f"{variant}-seed{seed}"


def train_args(cfg, variant: str, seed: int) -> tuple[str, list[str]]:
    name = run_name(variant, seed)
    return name, [
        *cfg.model,
        *cfg.variants[variant],
        *cfg.common,
        f"seed={seed}",
        f"name={name}",
        f"runs_dir={cfg.runs_dir}",
        "trainer.threads=1",
        "trainer.progress=off",
        "logger=[csv]",
    ]


def check(cfg) -> None:
    if not cfg.variants or not cfg.seeds:
        raise ConfigError("bench.variants and bench.seeds must not be empty")
    if cfg.baseline not in cfg.variants:
        raise ConfigError(f"bench.baseline={cfg.baseline!r} is not one of bench.variants")
    if isinstance(cfg.parallel, bool) or not isinstance(cfg.parallel, int) or cfg.parallel < 1:
        raise ConfigError(f"bench.parallel={cfg.parallel} must be an integer >= 1")


def ratios(runs: list[dict], base: list[dict], key: str) -> dict | None:
    """Each run's `key` over the baseline's run of the same seed: median (min-max)."""
    pairs = [(x[key], b[key]) for x, b in zip(runs, base)]
    return spread([x / b if x and b else None for x, b in pairs])


def load_of(runs_dir: Path, name: str) -> dict | None:
    """The load before and after a run trained here (optim.run_one's <name>.load; None: read, not trained)."""
    f = runs_dir / f"{name}.load"
    return json.loads(f.read_text()) if f.is_file() else None


def measure(cfg, con: Console) -> dict:
    """Train the runs not finished yet and read them all: {variant: its figures} (the module docstring)."""
    check(cfg)
    runs_dir = Path(cfg.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    variants, seeds = list(cfg.variants), [int(s) for s in cfg.seeds]
    train_all(cfg, [train_args(cfg, v, s) for s in seeds for v in variants], con)
    runs = {v: [read_run(runs_dir / run_name(v, s)) for s in seeds] for v in variants}
    base = runs[cfg.baseline]
    results = {
        v: {
            "steps": runs[v][0]["steps"],
            "final_val_loss": spread([x["final_val_loss"] for x in runs[v]]),
            "final_val_loss_by_seed": {s: x["final_val_loss"] for s, x in zip(seeds, runs[v])},
            "train_seconds": spread([x["train_seconds"] for x in runs[v]]),
            "train_cpu_seconds": spread([x["train_cpu_seconds"] for x in runs[v]]),
            "wall_ratio": ratios(runs[v], base, "train_seconds"),
            "cpu_ratio": ratios(runs[v], base, "train_cpu_seconds"),
            "memory_peak": spread([x["memory_peak"] for x in runs[v]]),
            "memory_peak_rss": spread([x["memory_peak_rss"] for x in runs[v]]),
            "load_by_seed": {s: load_of(runs_dir, run_name(v, s)) for s in seeds},
        }
        for v in variants
    }
    return results


def run(cfg) -> int:
    con = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    seeds = [int(s) for s in cfg.seeds]
    load_start = loadavg()
    results = measure(cfg, con)
    load_end = loadavg()
    report(con, cfg, results, seeds, load_start, load_end)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        out = {"load_start": load_start, "load_end": load_end, "seeds": seeds, "results": results}
        atomic_write_text(cfg.out, json.dumps(out, indent=2))
    return 0


def mib(s: dict | None) -> dict | None:
    """A spread of bytes in MiB."""
    return None if s is None else {k: v / 2**20 for k, v in s.items()}


def report(con: Console, cfg, results: dict, seeds: list[int], load_start, load_end) -> None:
    def fmt(s, f="{:.4f}"):
        return "-" if s is None else f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"

    steps = results[cfg.baseline]["steps"]
    t = Table(
        title=f"{escape(' '.join(cfg.model))}: median (min-max) over seeds {seeds} at {steps} steps; load "
        f"{load_start} at the start, {load_end} at the end"
    )
    for col in (
        "variant",
        "final val loss",
        "by seed",
        "train s (wall)",
        "train s (CPU)",
        f"wall / {cfg.baseline} (same seed, side by side)",
        f"CPU / {cfg.baseline}",
        "peak memory MiB",
    ):
        t.add_column(col, justify="right")
    for v, x in results.items():
        t.add_row(
            v,
            fmt(x["final_val_loss"]),
            " ".join(f"{loss:.4f}" for loss in x["final_val_loss_by_seed"].values()),
            fmt(x["train_seconds"], "{:.1f}"),
            fmt(x["train_cpu_seconds"], "{:.1f}"),
            fmt(x["wall_ratio"], "{:.3f}"),
            fmt(x["cpu_ratio"], "{:.3f}"),
            fmt(mib(x["memory_peak"]), "{:.0f}"),
        )
    con.print(t)
