"""gptkit bench optim: AdamW against optim=muon on the same recipes, several seeds each
(conf/bench/optim.yaml).

Every run is a `gptkit train` subprocess on one CPU thread, in its own folder <runs_dir>/<recipe>-<optimizer>-
seed<n> (a finished run found there is read instead of rerun). From each run's metrics.csv:

    steps to target   the first validation step at which the run's val loss is <= the target, the median over
                      seeds of AdamW's final val loss; reported for Muon as a fraction of AdamW's steps
    time ratio        a Muon run's training time (validation excluded, summed from the logged tokens/s) over
                      the AdamW run of the same seed
    equal time        the val loss of a Muon run at the last validation within the training time of the AdamW
                      run of the same seed (that AdamW run's final val loss beside it)

The AdamW and Muon runs of one seed are queued one after the other, so with parallel=2 they train side by
side, under the same load: the time ratio and the equal-time loss compare runs made at the same moment.
Medians over seeds with their range (min-max). Steps do not depend on the machine's load; times do.
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

from gptkit.errors import ConfigError, GptkitError

OPTIMIZERS = ("adamw", "muon")


def read_run(run_dir: Path) -> dict[str, Any]:
    """(step, val loss, training seconds after that step) of every validation, and the run's totals."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    seconds, tokens_before, at_step = 0.0, 0.0, {0: 0.0}
    tokens_per_step = None
    for r in rows:
        if not r.get("perf/tokens_per_s"):
            continue
        # after this row's optimizer step: the row's step (steps done)
        tokens = float(r["perf/tokens"])
        tokens_per_step = tokens_per_step or tokens / int(r["step"])
        seconds += (tokens - tokens_before) / float(r["perf/tokens_per_s"])
        tokens_before = tokens
        at_step[round(tokens / tokens_per_step)] = seconds
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]
    if not val:
        raise GptkitError(f"{run_dir}/metrics.csv has no val/loss rows")
    timed = []
    for (
        step,
        loss,
        # validation after `step` optimizer steps; time: the last logged step at or before it
    ) in val:
        known = max(s for s in at_step if s <= step)
        timed.append((step, loss, at_step[known]))
    return {"val": timed, "final_val_loss": val[-1][1], "steps": val[-1][0], "train_seconds": seconds}


def steps_to(run: dict[str, Any], target: float) -> int | None:
    """The first validation step whose val loss is <= target (None: never)."""
    return next((step for step, loss, _ in run["val"] if loss <= target), None)


def loss_at(run: dict[str, Any], seconds: float) -> float:
    """The val loss of the last validation done within `seconds` of training."""
    within = [loss for _, loss, t in run["val"] if t <= seconds]
    return within[-1] if within else run["val"][0][1]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def train_args(cfg, recipe: str, optimizer: str, seed: int) -> tuple[str, list[str]]:
    name = f"{recipe}-{optimizer}-seed{seed}"
    extra = list(cfg.muon.get(recipe) or []) if optimizer == "muon" else []
    return name, [
        *cfg.recipes[recipe],
        *extra,
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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GPTKIT_VERB", None)
    with open(log, "w") as out:
        code = subprocess.run(
            [sys.executable, "-m", "gptkit", "train", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    if code != 0:
        raise GptkitError(f"gptkit train {' '.join(args)} failed (exit {code}); see {log}")


def run(cfg) -> int:
    if not cfg.recipes or not cfg.seeds:
        raise ConfigError("bench.recipes and bench.seeds must not be empty")
    unknown = set(cfg.muon) - set(cfg.recipes)
    if unknown:
        raise ConfigError(f"bench.muon names recipes that bench.recipes lacks: {', '.join(sorted(unknown))}")
    if int(cfg.parallel) < 1:
        raise ConfigError(f"bench.parallel={cfg.parallel} must be >= 1")
    runs_dir = Path(cfg.runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    con = Console(width=None if sys.stdout.isatty() else 160, highlight=False)
    jobs = []
    for recipe in cfg.recipes:
        # AdamW and Muon of one seed side by side (parallel=2): the same load
        for seed in cfg.seeds:
            for optimizer in OPTIMIZERS:
                name, args = train_args(cfg, recipe, optimizer, int(seed))
                if not finished(runs_dir / name):
                    jobs.append((name, resume_args(runs_dir / name, args)))
    with open("/proc/loadavg") if Path("/proc/loadavg").exists() else open(os.devnull) as f:
        load = f.read().strip()
    con.print(
        f"{len(jobs)} run(s) to train, {int(cfg.parallel)} at a time, one thread each (load: {load or '?'})"
    )
    with ThreadPoolExecutor(int(cfg.parallel)) as pool:
        for name, future in [(n, pool.submit(run_one, a, runs_dir / f"{n}.log")) for n, a in jobs]:
            future.result()
            con.print(f"  trained {runs_dir / name}")
    results = {}
    for recipe in cfg.recipes:
        runs = {
            o: [read_run(runs_dir / train_args(cfg, recipe, o, int(s))[0]) for s in cfg.seeds]
            for o in OPTIMIZERS
        }
        adamw, muon = runs["adamw"], runs["muon"]
        target = statistics.median(r["final_val_loss"] for r in adamw)
        adamw_steps = statistics.median(r["steps"] for r in adamw)
        reached = [steps_to(r, target) for r in muon]
        results[recipe] = {
            "target_val_loss": target,
            "adamw_steps": adamw_steps,
            "adamw_final_val_loss": spread([r["final_val_loss"] for r in adamw]),
            "muon_final_val_loss": spread([r["final_val_loss"] for r in muon]),
            "muon_steps_to_target": reached,
            "muon_steps_fraction": (
                spread([s / adamw_steps for s in reached]) if None not in reached else None
            ),
            "adamw_train_seconds": spread([r["train_seconds"] for r in adamw]),
            "muon_train_seconds": spread([r["train_seconds"] for r in muon]),
            "muon_time_ratio": spread([m["train_seconds"] / a["train_seconds"] for a, m in zip(adamw, muon)]),
            # each Muon run at the training time of the AdamW run of its seed
            "val_loss_at_adamw_time": {
                "adamw": spread([r["final_val_loss"] for r in adamw]),
                "muon": spread([loss_at(m, a["train_seconds"]) for a, m in zip(adamw, muon)]),
            },
        }
    with open("/proc/loadavg") if Path("/proc/loadavg").exists() else open(os.devnull) as f:
        load_end = f.read().strip()
    t = Table(
        title=f"AdamW vs Muon, median (min-max) over seeds {list(cfg.seeds)}; load at the end: {load_end}"
    )
    for col in (
        "recipe",
        "AdamW final val loss",
        "Muon final val loss",
        "Muon steps to AdamW's final",
        "AdamW / Muon train s",
        "Muon / AdamW time, same seed",
        "val loss at AdamW's time, same seed: AdamW / Muon",
    ):
        t.add_column(col, justify="right")

    def fmt(s, f="{:.4f}"):
        return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"

    for recipe, r in results.items():
        frac = r["muon_steps_fraction"]
        steps = (
            f"{fmt(frac, '{:.2f}')}x of {r['adamw_steps']:.0f}"
            if frac
            else f"not reached by every seed: {r['muon_steps_to_target']}"
        )
        t.add_row(
            recipe,
            fmt(r["adamw_final_val_loss"]),
            fmt(r["muon_final_val_loss"]),
            steps,
            f"{r['adamw_train_seconds']['median']:.0f} / {r['muon_train_seconds']['median']:.0f}",
            f"{fmt(r['muon_time_ratio'], '{:.2f}')}x",
            f"{fmt(r['val_loss_at_adamw_time']['adamw'])} / {fmt(r['val_loss_at_adamw_time']['muon'])}",
        )
    con.print(t)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(
            cfg.out, json.dumps({"load_start": load, "load_end": load_end, "results": results}, indent=2)
        )
    return 0
