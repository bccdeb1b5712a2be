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
   time/generation_s.
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


def _metrics(run: Path) -> tuple[int, float]:
    """(optimizer steps, seconds spent sampling) of a GRPO run's metrics.csv."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = max((int(r["step"]) for r in rows if r.get("train/loss")), default=0)
    return steps, sum(float(r.get("time/generation_s") or 0.0) for r in rows)


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

    times["grpo"] = _train(
        con,
        [
            "experiment=grpo-tiny",
            f"init_from={start}",
            f"data.paths=[{prompts_file}]",
            f"runs_dir={root}",
            "name=grpo",
            "trainer.progress=lines",
            *[str(o) for o in cfg.overrides or []],
        ],
    )
    steps, sampling = _metrics(root / "grpo")
    t = time.perf_counter()
    after, answers = _exact(root / "grpo", held)
    after_s = time.perf_counter() - t

    table = Table(title=f"experiment=grpo-tiny: exact match on {len(held)} held-out prompts")
    for col in ("", "exact match", "by task", "wall time"):
        table.add_column(col)
    tasks_before, tasks_after = by_task(held, before_answers), by_task(held, answers)
    fmt = lambda tasks: ", ".join(f"{k} {v:.1%}" for k, v in tasks.items())  # noqa: E731
    table.add_row("before (the SFT start)", f"{before:.1%}", fmt(tasks_before), f"{before_s:.1f} s")
    table.add_row(
        f"GRPO: {steps} steps",
        "",
        f"sampling {sampling:.0f} s = {sampling / times['grpo']:.0%} of the run's wall time",
        f"{times['grpo']:.0f} s",
    )
    table.add_row("after", f"{after:.1%}", fmt(tasks_after), f"{after_s:.1f} s")
    Console().print(table)
    print(f"  exact match {before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points)")
    for row, a in list(zip(held, answers))[:3]:
        print(f"  {row['prompt']!r} -> {a!r} (want {row['response']!r})")
    end = os.getloadavg()
    con.print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    out = {
        "before": before,
        "after": after,
        "before_by_task": tasks_before,
        "after_by_task": tasks_after,
        "steps": steps,
        "wall_s": times,
        "sampling_s": sampling,
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
