"""gptkit bench grpo: experiment=grpo-tiny end to end, with the exact match on held-out prompts before and
after GRPO, the steps, the wall time and the share of it spent sampling.

1. gptkit.data.tasks writes sft.jsonl (prompt/response), prompts.jsonl (prompt/answer, the same training
   prompts) and heldout.jsonl (prompts never trained on);
2. the start: `gptkit train experiment=sft-tiny` for bench.sft_steps steps (stopped early, so that it answers
   few held-out prompts exactly), or the run bench.start names;
3. "before": the start answers every held-out prompt greedily through its chat template (bench sft's
   exact_match);
4. `gptkit train experiment=grpo-tiny init_from=<start>` as its own process, timed;
5. "after": the GRPO run answers the same prompts; the sampling time is the sum of its metrics.csv's
   time/generation_s, a step's time that and time/training_s over its steps (validations left out).

samplers=[groups,engine] runs step 4-5 once per grpo.rollouts (one prompt's group per batch, the engine's
continuous batch), for each of seeds (the runs' seed=) and train_threads (trainer.threads), and prints per
thread count each one's step time, sampling time and share, held-out exact match per seed, and the first
one's times over the others' (the speed-up).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gptkit.bench.sft import by_task, exact_match
from gptkit.chat_templates import template_in_folder
from gptkit.data.tasks import string_tasks, write_jsonl
from gptkit.errors import GptkitError
from gptkit.runs import load_run
from gptkit.threads import set_threads


def _train(con, args: list[str]) -> float:
    """One `gptkit train` as its own process; its wall time in seconds (a failure ends the bench)."""
    con.print("$ gptkit train " + " ".join(args))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gptkit", "train", *args])
    if proc.returncode:
        raise SystemExit(proc.returncode)
    return time.perf_counter() - t


def _metrics(run: Path) -> tuple[int, float, float]:
    """(optimizer steps, seconds spent sampling, the rest of the steps' wall time: scoring, forward, backward,
    optimizer) of a GRPO run's metrics.csv (time/generation_s and time/training_s: validations left out)."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = max((int(r["step"]) for r in rows if r.get("train/loss")), default=0)
    sampling = sum(float(r.get("time/generation_s") or 0.0) for r in rows)
    return steps, sampling, sum(float(r.get("time/training_s") or 0.0) for r in rows)


def compare(runs: list[dict], samplers: list[str]) -> list[dict]:
    """Per trainer.threads: each sampler's mean step time, sampling time per step and share (over the seeds),
    its held-out exact match per seed, and the first sampler's step and sampling times over each other's
    (how many times faster the other is)."""
    out = []
    for threads in dict.fromkeys(r["threads"] for r in runs):
        mine = [r for r in runs if r["threads"] == threads]
        by = {}
        for sampler in samplers:
            rs = [r for r in mine if r["sampler"] == sampler]
            steps = sum(r["steps"] for r in rs)
            sampling, rest = sum(r["sampling_s"] for r in rs), sum(r["training_s"] for r in rs)
            after = [r["after"] for r in rs]
            by[sampler] = {
                "step_ms": 1000 * (sampling + rest) / max(1, steps),
                "sampling_ms": 1000 * sampling / max(1, steps),
                "sampling_share": sampling / max(1e-9, sampling + rest),
                "after": after,
                "after_mean": sum(after) / max(1, len(after)),
                "after_spread": max(after) - min(after) if after else 0.0,
            }
        base = by[samplers[0]]
        for sampler in samplers[1:]:
            b = by[sampler]
            b["step_speedup"] = base["step_ms"] / max(1e-9, b["step_ms"])
            b["sampling_speedup"] = base["sampling_ms"] / max(1e-9, b["sampling_ms"])
        out.append({"threads": threads, "samplers": by})
    return out


def _exact(run: Path, held: list[dict]) -> tuple[float, list[str]]:
    r = load_run(run)
    return exact_match(r.model, r.tokenizer, template_in_folder(r.dir), held)


def run(cfg) -> int:
    set_threads(cfg.threads, "bench.threads")
    con = Console(stderr=True, highlight=False, markup=False)
    root = Path(str(cfg.dir)).expanduser()
    if root.exists():
        shutil.rmtree(root)
    train_rows, held = string_tasks(int(cfg.n_train), int(cfg.n_heldout), int(cfg.seed))
    sft_file = write_jsonl(root / "sft.jsonl", train_rows)
    prompts = [{"prompt": r["prompt"], "answer": r["response"]} for r in train_rows]
    prompts_file = write_jsonl(root / "prompts.jsonl", prompts)
    write_jsonl(root / "heldout.jsonl", held)
    con.print(f"wrote {len(train_rows):,} training prompts and {len(held):,} held-out prompts to {root}")
    load = os.getloadavg()
    con.print(f"load average at the start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    times: dict[str, float] = {}
    if cfg.start:
        start = Path(str(cfg.start)).expanduser()
        if not start.is_dir():
            raise GptkitError(f"bench.start={cfg.start} is not a run folder")
    else:
        start = root / "sft"
        times["sft"] = _train(
            con,
            [
                "experiment=sft-tiny",
                f"data.paths=[{sft_file}]",
                f"runs_dir={root}",
                "name=sft",
                f"trainer.max_steps={int(cfg.sft_steps)}",
                f"trainer.val_every={int(cfg.sft_steps)}",
                "trainer.progress=false",
                *[str(o) for o in cfg.sft_overrides or []],
            ],
        )
    t = time.perf_counter()
    before, before_answers = _exact(start, held)
    before_s = time.perf_counter() - t

    samplers = [str(x) for x in (cfg.samplers or ["engine"])]
    seeds = list(cfg.seeds or [None])
    threads_list = list(cfg.train_threads or [None])
    single = len(samplers) * len(seeds) * len(threads_list) == 1
    runs: list[dict] = []
    # the samplers alternate inside each (threads, seed): a drift of the machine's load hits both alike
    for threads in threads_list:
        for seed in seeds:
            for sampler in samplers:
                name = (
                    "grpo"
                    if single
                    else f"grpo-{sampler}-t{threads or 'r'}-s{seed if seed is not None else 'r'}"
                )
                load_before = os.getloadavg()[0]
                wall = _train(
                    con,
                    [
                        "experiment=grpo-tiny",
                        f"init_from={start}",
                        f"data.paths=[{prompts_file}]",
                        f"runs_dir={root}",
                        f"name={name}",
                        "trainer.progress=lines",
                        f"grpo.rollouts={sampler}",
                        *([f"trainer.threads={int(threads)}"] if threads is not None else []),
                        *([f"seed={int(seed)}"] if seed is not None else []),
                        *[str(o) for o in cfg.overrides or []],
                    ],
                )
                steps, sampling, training = _metrics(root / name)
                t = time.perf_counter()
                after, answers = _exact(root / name, held)
                runs.append(
                    {
                        "name": name,
                        "sampler": sampler,
                        "threads": threads,
                        "seed": seed,
                        "steps": steps,
                        "wall_s": wall,
                        "sampling_s": sampling,
                        "training_s": training,
                        "after": after,
                        "after_by_task": by_task(held, answers),
                        "answers": answers,
                        "exact_s": time.perf_counter() - t,
                        "load": [load_before, os.getloadavg()[0]],
                    }
                )
                con.print(
                    f"{name}: {steps} steps, {1000 * (sampling + training) / max(1, steps):.1f} ms a step, "
                    f"sampling {sampling / max(1e-9, sampling + training):.0%}, exact match {after:.1%} "
                    f"(load {load_before:.2f} -> {os.getloadavg()[0]:.2f})"
                )

    table = Table(title=f"experiment=grpo-tiny: exact match on {len(held)} held-out prompts")
    for col in ("", "exact match", "by task", "step (sampling)", "wall time"):
        table.add_column(col)
    tasks_before = by_task(held, before_answers)
    fmt = lambda tasks: ", ".join(f"{k} {v:.1%}" for k, v in tasks.items())  # noqa: E731
    table.add_row("before (the SFT start)", f"{before:.1%}", fmt(tasks_before), "", f"{before_s:.1f} s")
    for r in runs:
        step_ms = 1000 * (r["sampling_s"] + r["training_s"]) / max(1, r["steps"])
        share = r["sampling_s"] / max(1e-9, r["sampling_s"] + r["training_s"])
        table.add_row(
            f"after {r['steps']} steps, grpo.rollouts={r['sampler']}"
            + (f", {r['threads']} thread(s)" if r["threads"] else "")
            + (f", seed {r['seed']}" if r["seed"] is not None else ""),
            f"{r['after']:.1%}",
            fmt(r["after_by_task"]),
            f"{step_ms:.1f} ms (sampling {share:.0%})",
            f"{r['wall_s']:.0f} s",
        )
    Console().print(table)
    comparison = compare(runs, samplers)
    for c in comparison:
        for sampler, b in c["samplers"].items():
            line = (
                f"  {c['threads'] or 'recipe'} thread(s), {sampler}: {b['step_ms']:.1f} ms a step, sampling "
                f"{b['sampling_ms']:.1f} ms ({b['sampling_share']:.0%}); exact match "
                + " ".join(f"{a:.1%}" for a in b["after"])
                + f" (mean {b['after_mean']:.1%}, spread {100 * b['after_spread']:.1f} points)"
            )
            if "step_speedup" in b:
                line += (
                    f"; {samplers[0]}/{sampler}: step {b['step_speedup']:.2f}x, sampling "
                    f"{b['sampling_speedup']:.2f}x"
                )
            print(line)
    first = runs[0]
    print(
        f"  exact match {before:.1%} -> {first['after']:.1%} ({100 * (first['after'] - before):+.1f} points)"
    )
    for row, a in list(zip(held, first["answers"]))[:3]:
        print(f"  {row['prompt']!r} -> {a!r} (want {row['response']!r})")
    end = os.getloadavg()
    con.print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    out = {
        "before": before,
        "after": first["after"],
        "before_by_task": tasks_before,
        "after_by_task": first["after_by_task"],
        "steps": first["steps"],
        "wall_s": {**times, "grpo": first["wall_s"]},
        "sampling_s": first["sampling_s"],
        "runs": [{k: v for k, v in r.items() if k != "answers"} for r in runs],
        "comparison": comparison,
        "held_out": len(held),
        "train_prompts": len(train_rows),
        "start": str(start),
        "loadavg_start": list(load),
        "loadavg_end": list(end),
    }
    (root / "results.json").write_text(json.dumps(out, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(out, indent=2))
    return 0
