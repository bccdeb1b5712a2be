"""gptkit bench lora: finetune=lora against finetune=full, from the same base weights on the same data.

1. a base run folder: the model of `model` + `model_overrides` at initialization (its weights do not change
   the cost of a step) with a byte tokenizer;
2. `gptkit train init_from=<base> data=shakespeare finetune=full|lora ...`, each its own process, alternated
   `repeats` times (full, lora, full, lora: both see the same machine load);
3. per run: trainable parameters (the model's and apply_lora's count), the size of checkpoints/last.ckpt,
   the process's peak RSS (os.wait4) and the median of its logged perf/tokens_per_s after `warmup` steps.
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

from gptkit.conf_tree import compose
from gptkit.fsio import human_bytes
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder
from gptkit.tokenizer import byte_tokenizer
from gptkit.training.finetune.lora import apply_lora


def _tokens_per_s(run: Path, warmup: int) -> float:
    with open(run / "metrics.csv", newline="") as f:
        rates = [
            float(r["perf/tokens_per_s"])
            for r in csv.DictReader(f)
            if r.get("perf/tokens_per_s") and int(r["step"]) >= warmup
        ]
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
            con.print(f"$ gptkit train finetune={kind} name={name} ...")
            code, peak = _train([*common, f"finetune={kind}", *per_kind[kind], f"name={name}"])
            if code:
                return code
            run = root / name
            results[kind].append(
                {
                    "tokens_per_s": _tokens_per_s(run, int(cfg.warmup)),
                    "peak_rss": peak,
                    "checkpoint_bytes": (run / "checkpoints" / "last.ckpt").stat().st_size,
                }
            )
    med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in results.items()}
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").is_file() else []
    table = Table(
        title=f"finetune=lora vs full: {model_cfg.name} {total:,} parameters, batch "
        f"{cfg.batch_size} x {model_cfg.max_seq_len}, {cfg.steps} steps, median of "
        f"{cfg.repeats}; load {' '.join(load)}"
    )
    for col in ("", "trainable parameters", "checkpoint", "peak RSS", "tokens/s"):
        table.add_column(col, justify="right")
    for kind in ("full", "lora"):
        m = med[kind]
        table.add_row(
            kind,
            f"{trainable[kind]:,}",
            human_bytes(m["checkpoint_bytes"]),
            human_bytes(m["peak_rss"]),
            f"{m['tokens_per_s']:,.0f}",
        )
    f, lo = med["full"], med["lora"]
    table.add_row(
        "lora / full",
        f"{trainable['lora'] / total:.2%}",
        f"{lo['checkpoint_bytes'] / f['checkpoint_bytes']:.3f}",
        f"{lo['peak_rss'] / f['peak_rss']:.2f}",
        f"{lo['tokens_per_s'] / f['tokens_per_s']:.2f}",
    )
    Console().print(table)
    out = {
        "model": model_dict,
        "lora": lora,
        "trainable": trainable,
        "median": med,
        "runs": results,
        "loadavg": load,
    }
    (root / "results.json").write_text(json.dumps(out, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(out, indent=2))
    return 0
