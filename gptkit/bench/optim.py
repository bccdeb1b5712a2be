"""gptkit bench optim: AdamW against Muon, each at its own best learning rate (conf/bench/optim.yaml).

A fair comparison sweeps every optimizer over the same grid and compares the best of each:

1. the sweep: each recipe (gpt2-tiny, llama-tiny) trains with each optimizer at each lr of `lrs`, seed
   `seeds[0]`; the runs of one lr (one per optimizer) are queued together, so with parallel=2 they train side
   by side under the same load;
2. the best lr of each optimizer: its lowest final val loss in the sweep;
3. the seeds: each optimizer at its best lr on every other seed, the optimizers of a seed side by side.

From each run's metrics.csv (one `gptkit train` on one CPU thread, in <runs_dir>/<recipe>-<optimizer>-lr<lr>-
seed<n>; a finished run found there is read, not rerun):

    target            the baseline optimizer's (AdamW's) median final val loss over the seeds, at its best lr:
                      what the baseline reaches in all of its steps
    steps to target   the step at which a run's val loss reaches the target, interpolated linearly between
                      validations (None: not within the run); the median over the seeds, and its ratio to the
                      steps the baseline took to get there (all of them)
    time at equal     every run trains the same steps: its training seconds on the clock and in CPU (the
    steps             process's, validation excluded, from metrics.csv's perf/tokens_per_s and
                      perf/tokens_per_cpu_s), and each optimizer's over the baseline's run of the same seed,
                      trained side by side (the ratio of runs made under the same load)

The load is recorded before and after every run. Steps do not depend on the machine's load; seconds do, CPU
seconds much less than wall seconds.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit.bench.measure import loadavg
from gptkit.errors import ConfigError, GptkitError


def read_run(run_dir: Path) -> dict[str, Any]:
    """(step, val loss, training seconds after that step) of every validation, and the run's totals: its
    training seconds on the clock and in CPU time (validation excluded), its final val loss, and the peak
    memory it measured (training/peak_memory.py: perf/memory_peak, and on the CPU perf/memory_peak_rss, the
    process's whole peak RSS; None where the run logged none)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    seconds, cpu, tokens_before, at_step = 0.0, 0.0, 0.0, {0: 0.0}
    tokens_per_step = None
    for r in rows:
        if not r.get("perf/tokens_per_s"):
            continue
        # after this row's optimizer step: the row's step (steps done)
        tokens = float(r["perf/tokens"])
        tokens_per_step = tokens_per_step or tokens / int(r["step"])
        seconds += (tokens - tokens_before) / float(r["perf/tokens_per_s"])
        if r.get("perf/tokens_per_cpu_s"):
            cpu += (tokens - tokens_before) / float(r["perf/tokens_per_cpu_s"])
        tokens_before = tokens
        at_step[round(tokens / tokens_per_step)] = seconds
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    # the last measurement (a resumed run measures again)
    memory = {k: float(r[k]) for r in rows for k in ("perf/memory_peak", "perf/memory_peak_rss") if r.get(k)}
    if not val:
        raise GptkitError(f"{run_dir}/metrics.csv has no val/loss rows")
    timed = []
    # validation after `step` optimizer steps; time: the last logged step at or before it
    for step, loss in val:
        known = max(s for s in at_step if s <= step)
        timed.append((step, loss, at_step[known]))
    return {
        "val": timed,
        "final_val_loss": val[-1][1],
        "steps": val[-1][0],
        "train_seconds": seconds,
        "train_cpu_seconds": cpu or None,
        "memory_peak": memory.get("perf/memory_peak"),
        "memory_peak_rss": memory.get("perf/memory_peak_rss"),
    }


def steps_to(run: dict[str, Any], target: float) -> float | None:
    """The step at which the val loss reaches `target`, interpolated linearly between the two validations
    around it (the first validation's step when it is there already; None: never within the run)."""
    before = None
    for step, loss, _ in run["val"]:
        if loss <= target:
            if before is None or before[1] == loss:
                return float(step)
            s0, l0 = before
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
        before = (step, loss)
    return None


def spread(values: list[float]) -> dict[str, float] | None:
    """Median (min-max) of the values; None when one is missing."""
    if not values or any(v is None for v in values):
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_name(recipe: str, optimizer: str, lr: float, seed: int) -> str:
    return f"{recipe}-{optimizer}-lr{lr:g}-seed{seed}"


def train_args(cfg, recipe: str, optimizer: str, lr: float, seed: int) -> tuple[str, list[str]]:
    name = run_name(recipe, optimizer, lr, seed)
    return name, [
        *cfg.recipes[recipe],
        *cfg.optimizers[optimizer],
        f"optim.lr={lr}",
        *cfg.common,
        f"seed={seed}",
        f"name={name}",
        f"runs_dir={cfg.runs_dir}",
        "trainer.threads=1",
        "trainer.progress=off",
        "logger=[csv]",
    ]


def finished(run_dir: Path) -> bool:
    """A run that trained all its planned steps: it validates at the end, so its last val/loss row is at
    trainer.max_steps (a run killed after a checkpoint has a last.ckpt too, and is not finished)."""
    if not ((run_dir / "checkpoints" / "last.ckpt").exists() and (run_dir / "metrics.csv").is_file()):
        return False
    trainer = OmegaConf.load(run_dir / "config.yaml").trainer
    # its steps follow from the tokens: trust the checkpoint
    if trainer.get("max_tokens") is not None:
        return True
    with open(run_dir / "metrics.csv", newline="") as f:
        val_steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")]
    return bool(val_steps) and val_steps[-1] >= int(trainer.max_steps)


def resume_args(run_dir: Path, args: list[str]) -> list[str]:
    """The arguments that continue an interrupted run (it has a checkpoint), else `args` (a fresh start)."""
    if (run_dir / "checkpoints" / "last.ckpt").exists():
        return [f"resume={run_dir}", "trainer.threads=1", "trainer.progress=off"]
    return args


def run_one(args: list[str], log: Path) -> None:
    """One `gptkit train` on one thread; the load before and after it go to <log>.load."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GPTKIT_VERB", None)
    before = loadavg()
    with open(log, "w") as out:
        code = subprocess.run(
            [sys.executable, "-m", "gptkit", "train", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    log.with_suffix(".load").write_text(json.dumps({"before": before, "after": loadavg()}))
    if code != 0:
        raise GptkitError(f"gptkit train {' '.join(args)} failed (exit {code}); see {log}")


def train_all(cfg, jobs: list[tuple[str, list[str]]], con: Console) -> None:
    """Train the jobs not finished yet, `parallel` at a time, in order (neighbours side by side)."""
    runs_dir = Path(cfg.runs_dir)
    todo = [(n, resume_args(runs_dir / n, a)) for n, a in jobs if not finished(runs_dir / n)]
    con.print(
        f"{len(todo)} run(s) to train, {int(cfg.parallel)} at a time, one thread each (load {loadavg()})"
    )
    with ThreadPoolExecutor(int(cfg.parallel)) as pool:
        for name, future in [(n, pool.submit(run_one, a, runs_dir / f"{n}.log")) for n, a in todo]:
            future.result()
            con.print(f"  trained {runs_dir / name} (load {loadavg()})")


def check(cfg) -> None:
    if not cfg.recipes or not cfg.seeds or not cfg.lrs or not cfg.optimizers:
        raise ConfigError("bench.recipes, bench.optimizers, bench.lrs and bench.seeds must not be empty")
    if cfg.baseline not in cfg.optimizers:
        raise ConfigError(f"bench.baseline={cfg.baseline!r} is not one of bench.optimizers")
    if int(cfg.parallel) < 1:
        raise ConfigError(f"bench.parallel={cfg.parallel} must be >= 1")
    for lr in cfg.lrs:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ConfigError(f"bench.lrs holds {lr!r}; give learning rates > 0")


def run(cfg) -> int:
    check(cfg)
    runs_dir = Path(cfg.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    con = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    optimizers, lrs, seeds = list(cfg.optimizers), [float(x) for x in cfg.lrs], [int(s) for s in cfg.seeds]
    load_start = loadavg()
    # 1. the sweep, on the first seed: the optimizers of one lr side by side
    train_all(
        cfg,
        [train_args(cfg, r, o, lr, seeds[0]) for r in cfg.recipes for lr in lrs for o in optimizers],
        con,
    )
    sweep = {
        r: {o: {lr: read_run(runs_dir / run_name(r, o, lr, seeds[0])) for lr in lrs} for o in optimizers}
        for r in cfg.recipes
    }
    # 2. each optimizer's best lr; 3. every other seed at it, the optimizers of a seed side by side
    best = {
        r: {o: min(lrs, key=lambda lr: sweep[r][o][lr]["final_val_loss"]) for o in optimizers} for r in sweep
    }
    train_all(
        cfg,
        [train_args(cfg, r, o, best[r][o], s) for r in cfg.recipes for s in seeds[1:] for o in optimizers],
        con,
    )
    results = {}
    for r in cfg.recipes:
        runs = {o: [read_run(runs_dir / run_name(r, o, best[r][o], s)) for s in seeds] for o in optimizers}
        base = runs[cfg.baseline]
        target = statistics.median(x["final_val_loss"] for x in base)
        steps = {o: [steps_to(x, target) for x in runs[o]] for o in optimizers}
        # the baseline reaches its median final val loss in its whole run
        total = base[0]["steps"]
        results[r] = {
            "sweep_final_val_loss": {
                o: {f"{lr:g}": sweep[r][o][lr]["final_val_loss"] for lr in lrs} for o in sweep[r]
            },
            "best_lr": best[r],
            "target_val_loss": target,
            "steps": total,
            "optimizers": {
                o: {
                    "final_val_loss": spread([x["final_val_loss"] for x in runs[o]]),
                    "steps_to_target": steps[o],
                    "steps_to_target_median": spread(steps[o]),
                    "steps_ratio": (
                        1.0
                        if o == cfg.baseline
                        else statistics.median(steps[o]) / total
                        if spread(steps[o])
                        else None
                    ),
                    "train_seconds": spread([x["train_seconds"] for x in runs[o]]),
                    "train_cpu_seconds": spread([x["train_cpu_seconds"] for x in runs[o]]),
                    # the run of the same seed of the baseline trained beside it
                    "wall_ratio": spread(
                        [x["train_seconds"] / b["train_seconds"] for x, b in zip(runs[o], base)]
                    ),
                    "cpu_ratio": spread(
                        [
                            x["train_cpu_seconds"] / b["train_cpu_seconds"]
                            if x["train_cpu_seconds"] and b["train_cpu_seconds"]
                            else None
                            for x, b in zip(runs[o], base)
                        ]
                    ),
                }
                for o in optimizers
            },
        }
    load_end = loadavg()
    report(con, cfg, results, lrs, seeds, load_start, load_end)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(
            cfg.out,
            json.dumps({"load_start": load_start, "load_end": load_end, "results": results}, indent=2),
        )
    return 0


def report(
    con: Console, cfg, results: dict, lrs: list[float], seeds: list[int], load_start, load_end
) -> None:
    """The sweep and the comparison, one table each per recipe."""

    def fmt(s, f="{:.4f}"):
        return "-" if s is None else f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"

    for recipe, r in results.items():
        sweep = Table(title=f"{recipe}: final val loss after {r['steps']} steps, seed {seeds[0]}, by lr")
        sweep.add_column("optimizer")
        for lr in lrs:
            sweep.add_column(f"{lr:g}", justify="right")
        for o, by_lr in r["sweep_final_val_loss"].items():
            sweep.add_row(
                o,
                *[
                    f"[bold]{v:.4f}[/]" if float(k) == r["best_lr"][o] else f"{v:.4f}"
                    for k, v in by_lr.items()
                ],
            )
        con.print(sweep)
        t = Table(
            title=f"{recipe}: each optimizer at its best lr, median (min-max) over seeds {seeds}; target "
            f"{r['target_val_loss']:.4f} ({cfg.baseline}'s median final val loss); load {load_start} at the "
            f"start, {load_end} at the end"
        )
        for col in (
            "optimizer",
            "lr",
            "final val loss",
            "steps to target",
            f"steps / {cfg.baseline}'s {r['steps']}",
            f"train s (wall) for {r['steps']} steps",
            "train s (CPU)",
            f"wall / {cfg.baseline} (same seed, side by side)",
            f"CPU / {cfg.baseline}",
        ):
            t.add_column(col, justify="right")
        for o, x in r["optimizers"].items():
            t.add_row(
                o,
                f"{r['best_lr'][o]:g}",
                fmt(x["final_val_loss"]),
                fmt(x["steps_to_target_median"], "{:.0f}")
                if x["steps_to_target_median"]
                else "not by every seed: "
                + ", ".join("-" if v is None else f"{v:.0f}" for v in x["steps_to_target"]),
                "-" if x["steps_ratio"] is None else f"{x['steps_ratio']:.2f}x",
                fmt(x["train_seconds"], "{:.0f}"),
                fmt(x["train_cpu_seconds"], "{:.0f}"),
                fmt(x["wall_ratio"], "{:.2f}"),
                fmt(x["cpu_ratio"], "{:.2f}"),
            )
        con.print(t)
