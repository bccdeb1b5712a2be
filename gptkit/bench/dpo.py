"""gptkit bench dpo: experiment=dpo-tiny end to end, with the preference accuracy on held-out pairs before and
after DPO, full fine-tuning and LoRA.

1. gptkit.data.tasks writes sft.jsonl (prompt/response), pairs.jsonl and heldout.jsonl (chosen: the right
   response, rejected: an off-by-one corruption of it; held-out prompts are in neither training file);
2. the start: `gptkit train experiment=sft-tiny` for bench.sft_steps steps (or the run bench.start names);
3. "before": the start's preference on every held-out pair, by log-prob: log p(chosen) > log p(rejected)
   (its implicit reward is 0 for every answer: the policy is the reference);
4. `gptkit train experiment=dpo-tiny init_from=<start>` (and again with finetune=lora), each its own process;
5. "after": each DPO run's preference by log-prob and by implicit reward (log-ratio to the start of the
   chosen answer > that of the rejected one: DPO's rewards/accuracy), on the same held-out pairs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from gptkit.data import prepare
from gptkit.data.preference import make_pair_rows
from gptkit.data.tasks import preference_pairs, string_tasks, write_jsonl
from gptkit.errors import GptkitError
from gptkit.runs import load_model
from gptkit.threads import set_threads
from gptkit.training.objectives.dpo import answer_logps


def answer_logps_of(model, rows, batch_pairs: int = 64):
    """[P, 2] summed answer log-probs (chosen, rejected) of the pairs of `rows` (a PairRows) under `model`."""
    out = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_pairs):
            x, y = rows.batch(torch.arange(start, min(start + batch_pairs, len(rows))))  # [2p, T]
            out.append(answer_logps(model(x).logits, y).view(-1, 2))
    return torch.cat(out)  # [P, 2]


def preference(policy, reference) -> dict[str, float]:
    """Preference accuracy (by log-prob; by implicit reward when the policy is not the reference) and the mean
    implicit reward margin (in units of beta) from [P, 2] answer log-probs."""
    by_logp = float((policy[:, 0] > policy[:, 1]).float().mean())
    ratio = policy - reference  # [P, 2]
    margin = ratio[:, 0] - ratio[:, 1]  # [P]
    return {
        "logp_accuracy": by_logp,
        "reward_accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
    }


def _train(con, args: list[str]) -> float:
    """One `gptkit train` as its own process; its wall time in seconds (a failure ends the bench)."""
    cmd = [sys.executable, "-m", "gptkit", "train", *args]
    con.print("$ gptkit train " + " ".join(args))
    t = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode:
        raise SystemExit(proc.returncode)
    return time.perf_counter() - t


def run(cfg) -> int:
    set_threads(cfg.threads, "bench.threads")
    con = Console(stderr=True, highlight=False, markup=False)
    root = Path(str(cfg.dir)).expanduser()
    if root.exists():
        shutil.rmtree(root)
    train_rows, held = string_tasks(int(cfg.n_train), int(cfg.n_heldout), int(cfg.seed))
    sft_file = write_jsonl(root / "sft.jsonl", train_rows)
    pairs_file = write_jsonl(root / "pairs.jsonl", preference_pairs(train_rows, int(cfg.seed) + 1))
    held_file = write_jsonl(root / "heldout.jsonl", preference_pairs(held, int(cfg.seed) + 2))
    con.print(
        f"wrote {len(train_rows):,} SFT prompts, {len(train_rows):,} training pairs and {len(held):,} "
        f"held-out pairs to {root}"
    )
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
            ],
        )

    common = [
        "experiment=dpo-tiny",
        f"init_from={start}",
        f"data.paths=[{pairs_file}]",
        f"runs_dir={root}",
        "trainer.progress=false",
        *[str(o) for o in cfg.overrides or []],
    ]
    runs = {"DPO, full fine-tune": ("dpo-full", [])}
    if cfg.lora:
        runs["DPO, LoRA"] = ("dpo-lora", ["finetune=lora", *[str(o) for o in cfg.lora_overrides or []]])
    for label, (name, extra) in runs.items():
        times[label] = _train(con, [*common, f"name={name}", *extra])

    # the held-out pairs in the start's tokenizer and template, rows as DPO trains on them
    data = prepare(
        {"kind": "preference", "paths": [str(held_file)], "val_paths": [str(held_file)], "template": "auto"},
        {"kind": "file", "path": str(start / "tokenizer.json")},
        cache_dir=root / "cache",
    )
    *_, ref_model = load_model(start)
    rows = make_pair_rows(data.train, ref_model.cfg.max_seq_len, "error", data.pad_id)
    reference = answer_logps_of(ref_model.eval(), rows)
    results = {"start (SFT)": preference(reference, reference)}
    for label, (name, _) in runs.items():
        # LoRA: the adapters merged into the base
        *_, model = load_model(root / name)
        results[label] = preference(answer_logps_of(model.eval(), rows), reference)

    table = Table(
        title=f"experiment=dpo-tiny: preference on {len(rows)} held-out pairs (chosen right, "
        "rejected off by one letter)"
    )
    columns = ("", "prefers chosen by log-prob", "by implicit reward", "mean log-ratio margin", "train wall")
    for col in columns:
        table.add_column(col)
    for label, r in results.items():
        before = label.startswith("start")
        wall = times.get("sft" if before else label)
        table.add_row(
            label,
            f"{r['logp_accuracy']:.1%}",
            "- (policy = reference)" if before else f"{r['reward_accuracy']:.1%}",
            "0" if before else f"{r['margin']:.3f}",
            f"{wall:.0f} s" if wall is not None else "(reused)",
        )
    Console().print(table)
    end = os.getloadavg()
    con.print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    out = {
        "results": results,
        "wall_s": times,
        "held_out": len(rows),
        "train_pairs": len(train_rows),
        "start": str(start),
        "loadavg_start": list(load),
        "loadavg_end": list(end),
    }
    (root / "results.json").write_text(json.dumps(out, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(out, indent=2))
    return 0
