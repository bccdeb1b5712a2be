"""gptkit bench lora: finetune=lora against finetune=full, from the same base weights on the same data.

1. a base run folder: the model of `model` + `model_overrides` at initialization (its weights do not change
   the cost of a step) with a byte tokenizer;
2. `gptkit train init_from=<base> data=shakespeare finetune=full|lora ...`, each its own process, alternated
   `repeats` times (full, lora, full, lora: both see the same machine load);
3. per run: trainable parameters (the model's and apply_lora's count), the size of checkpoints/last.ckpt,
   the process's peak RSS (os.wait4), the medians of its logged perf/tokens_per_s (on the clock) and
   perf/tokens_per_cpu_s (per second of the process's CPU time: what the machine's load changes least)
   after `warmup` steps, the load before and after it;
4. the ratios lora / full of each pair (full i, lora i: trained one after the other, at nearly the same load),
   median (min-max) over the pairs.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit.bench.measure import loadavg
from gptkit.conf_tree import compose
from gptkit.fsio import human_bytes
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder
from gptkit.tokenizer import byte_tokenizer
from gptkit.training.finetune.lora import apply_lora


def _rate(run: Path, warmup: int, key: str = "perf/tokens_per_s") -> float:
    """The median of a run's logged `key` over the steps after `warmup`."""
    with open(run / "metrics.csv", newline="") as f:
        rates = [float(r[key]) for r in csv.DictReader(f) if r.get(key) and int(r["step"]) >= warmup]
    return statistics.median(rates)


def _train(args: list[str]) -> tuple[int, float]:
    """Run `gptkit train args` as a child process; (exit status, its peak RSS in bytes)."""
    proc = subprocess.Popen([sys.executable, "-m", "gptkit", "train", *args])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    # Linux: kilobytes
    return proc.returncode, usage.ru_maxrss * 1024


def run(cfg) -> int:
    """The benchmark of the module docstring, with the `bench` group of conf/bench/lora.yaml."""
    con = Console(stderr=True, highlight=False, markup=False)
    root = Path(str(cfg.dir)).expanduser()
    if root.exists():
        shutil.rmtree(root)
    tok = byte_tokenizer([])
    model_dict = OmegaConf.to_container(compose("train", [f"model={cfg.model}"]).model, resolve=True)
    model_dict.update(OmegaConf.to_container(cfg.model_overrides, resolve=True) or {})
    model_dict["vocab_size"] = tok.get_vocab_size()
    model_cfg = ModelConfig.from_dict(model_dict)
    torch.manual_seed(0)
    tok_cfg = {"tokenizer": {"kind": "byte", "eos_token": None}}
    base = write_run_folder(root / "base", tok_cfg, GPT(model_cfg), tok)
    lora = OmegaConf.to_container(cfg.lora, resolve=True)
    with torch.device("meta"):
        meta = GPT(model_cfg)
    total = sum(p.numel() for p in meta.parameters())
    trainable = {"full": total, "lora": apply_lora(meta, lora)}
    targets = "[" + ",".join(lora["targets"]) + "]"
    per_kind = {
        "full": [],
        "lora": [
            f"lora.rank={lora['rank']}",
            f"lora.alpha={lora['alpha']}",
            f"lora.dropout={lora['dropout']}",
            f"lora.targets={targets}",
        ],
    }
    common = [
        f"init_from={base}",
        "data=shakespeare",
        f"trainer.batch_size={cfg.batch_size}",
        f"trainer.max_steps={cfg.steps}",
        f"trainer.val_every={cfg.steps}",
        "trainer.val_windows=2",
        f"trainer.checkpoint_every={cfg.steps}",
        "trainer.log_every=1",
        "trainer.progress=false",
        f"trainer.threads={cfg.threads}",
        "trainer.accelerator=cpu",
        "optim.warmup_steps=1",
        f"runs_dir={root}",
        *[str(o) for o in cfg.overrides or []],
    ]
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    for i in range(int(cfg.repeats)):
        for kind in ("full", "lora"):
            name = f"{kind}-{i}"
            con.print(f"$ gptkit train finetune={kind} name={name} ... (load {loadavg()})")
            before = loadavg()
            code, peak = _train([*common, f"finetune={kind}", *per_kind[kind], f"name={name}"])
            if code:
                return code
            run = root / name
            results[kind].append(
                {
                    "tokens_per_s": _rate(run, int(cfg.warmup)),
                    "tokens_per_cpu_s": _rate(run, int(cfg.warmup), "perf/tokens_per_cpu_s"),
                    "peak_rss": peak,
                    "checkpoint_bytes": (run / "checkpoints" / "last.ckpt").stat().st_size,
                    "load": [before, loadavg()],
                }
            )
    measures = ("tokens_per_s", "tokens_per_cpu_s", "peak_rss", "checkpoint_bytes")
    med = {k: {m: statistics.median(r[m] for r in rs) for m in measures} for k, rs in results.items()}
    # each pair's lora / full: runs made one after the other
    pairs = {
        m: [lo[m] / f[m] for f, lo in zip(results["full"], results["lora"])]
        for m in ("tokens_per_s", "tokens_per_cpu_s")
    }
    load = [results["full"][0]["load"][0], results["lora"][-1]["load"][1]]
    table = Table(
        title=f"finetune=lora vs full: {model_cfg.name} {total:,} parameters, batch "
        f"{cfg.batch_size} x {model_cfg.max_seq_len}, {cfg.steps} steps, median of "
        f"{cfg.repeats}; load {load[0]} before, {load[1]} after"
    )
    for col in ("", "trainable parameters", "checkpoint", "peak RSS", "tokens/s (wall)", "tokens per CPU s"):
        table.add_column(col, justify="right")
    for kind in ("full", "lora"):
        m = med[kind]
        table.add_row(
            kind,
            f"{trainable[kind]:,}",
            human_bytes(m["checkpoint_bytes"]),
            human_bytes(m["peak_rss"]),
            f"{m['tokens_per_s']:,.0f}",
            f"{m['tokens_per_cpu_s']:,.0f}",
        )
    f, lo = med["full"], med["lora"]

    def ratio(m: str) -> str:
        v = pairs[m]
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    table.add_row(
        "lora / full (each pair)",
        f"{trainable['lora'] / total:.2%}",
        f"{lo['checkpoint_bytes'] / f['checkpoint_bytes']:.3f}",
        f"{lo['peak_rss'] / f['peak_rss']:.2f}",
        ratio("tokens_per_s"),
        ratio("tokens_per_cpu_s"),
    )
    Console().print(table)
    out = {
        "model": model_dict,
        "lora": lora,
        "trainable": trainable,
        "median": med,
        "pair_ratios": pairs,
        "runs": results,
        "loadavg": load,
    }
    (root / "results.json").write_text(json.dumps(out, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(out, indent=2))
    return 0
