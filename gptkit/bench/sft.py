"""gptkit bench sft: experiment=sft-tiny end to end, with the exact match on held-out prompts before and
after.

1. gptkit.data.tasks writes train.jsonl and heldout.jsonl (string tasks with one right answer each);
2. "before": a model of the recipe's shape at initialization (as training starts: seed 1337) answers every
   held-out prompt greedily through the chat template (gptkit.inference.generate.ChatSession);
3. `gptkit train experiment=sft-tiny data.paths=[train.jsonl]` runs as its own process;
4. "after": the trained run answers the same prompts. An answer counts when it equals the response exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit.chat_templates import resolve_template, template_in_folder
from gptkit.conf_tree import compose
from gptkit.data.tasks import string_tasks, write_jsonl
from gptkit.inference.generate import ChatSession
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.runs import load_run
from gptkit.threads import set_threads
from gptkit.tokenizer import byte_tokenizer


def exact_match(model, tokenizer, template, rows: list[dict]) -> tuple[float, list[str]]:
    """(share of rows answered exactly, the answers): greedy, one fresh conversation per row."""
    end = template.end_of_turn().strip()
    stop = tuple(i for i in (tokenizer.token_to_id(end) if end else None,) if i is not None)
    longest = max(len(tokenizer.encode(r["response"], add_special_tokens=False).ids) for r in rows)
    opts = SampleOptions(max_new_tokens=longest + 4, temperature=0.0)
    session = ChatSession(model, tokenizer, template, opts, stop_ids=stop)
    answers = []
    for r in rows:
        session.reset()
        answers.append(session.reply(r["prompt"]).text)
    return sum(a == r["response"] for a, r in zip(answers, rows)) / len(rows), answers


def by_task(rows: list[dict], answers: list[str]) -> dict[str, float]:
    """The exact match of each task (the first word of the prompt: upper, reverse)."""
    hits: dict[str, list[bool]] = {}
    for r, a in zip(rows, answers):
        hits.setdefault(r["prompt"].split()[0], []).append(a == r["response"])
    return {task: sum(h) / len(h) for task, h in sorted(hits.items())}


def run(cfg) -> int:
    set_threads(cfg.threads, "bench.threads")
    con = Console(stderr=True, highlight=False, markup=False)
    root = Path(str(cfg.dir)).expanduser()
    if root.exists():
        shutil.rmtree(root)
    train_rows, held = string_tasks(int(cfg.n_train), int(cfg.n_heldout), int(cfg.seed))
    train_file = write_jsonl(root / "train.jsonl", train_rows)
    write_jsonl(root / "heldout.jsonl", held)
    con.print(f"wrote {len(train_rows):,} training and {len(held):,} held-out prompts to {root}")

    # before: the recipe's model at initialization, with the tokenizer training will use (byte + chatml)
    t0 = time.perf_counter()
    template = resolve_template("chatml", None)
    tok = byte_tokenizer([])
    tok.add_special_tokens(template.special_tokens)
    recipe = compose("train", ["experiment=sft-tiny", "data.paths=[x]"])
    model_dict = OmegaConf.to_container(recipe.model, resolve=True)
    model_dict["vocab_size"] = tok.get_vocab_size()
    torch.manual_seed(int(recipe.seed))
    before, _ = exact_match(GPT(ModelConfig.from_dict(model_dict)).eval(), tok, template, held)
    before_s = time.perf_counter() - t0

    # train, as a user would
    t1 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "gptkit",
        "train",
        "experiment=sft-tiny",
        f"data.paths=[{train_file}]",
        f"runs_dir={root}",
        "name=run",
        "trainer.progress=false",
        *[str(o) for o in cfg.overrides or []],
    ]
    con.print("$ " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd)
    if proc.returncode:
        return proc.returncode
    train_s = time.perf_counter() - t1

    t2 = time.perf_counter()
    r = load_run(root / "run")
    after, answers = exact_match(r.model, r.tokenizer, template_in_folder(r.dir), held)
    after_s = time.perf_counter() - t2

    table = Table(title="experiment=sft-tiny: exact match on the held-out prompts")
    for col in ("", "exact match", "wall time"):
        table.add_column(col)
    table.add_row("before (initialization)", f"{before:.1%}", f"{before_s:.1f} s")
    table.add_row("training", "", f"{train_s:.1f} s")
    table.add_row("after", f"{after:.1%}", f"{after_s:.1f} s")
    Console().print(table)
    tasks = by_task(held, answers)
    print("  after, by task: " + ", ".join(f"{t} {share:.1%}" for t, share in tasks.items()))
    for row, a in list(zip(held, answers))[:3]:
        print(f"  {row['prompt']!r} -> {a!r} (want {row['response']!r})")
    result = {
        "before": before,
        "after": after,
        "after_by_task": tasks,
        "train_s": train_s,
        "held_out": len(held),
        "train": len(train_rows),
        "run": str(r.dir),
    }
    (root / "results.json").write_text(json.dumps(result, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(result, indent=2))
    return 0
