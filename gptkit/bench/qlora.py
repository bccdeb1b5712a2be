"""gptkit bench qlora: finetune=qlora's base memory against a bf16 base, its loss and speed against
finetune=lora from the same base, and NF4's round-trip error against the QLoRA paper's code book
(conf/bench/qlora.yaml says what each part runs).

Memory is measured in a fresh process per row (`python -c`, this module's `_child`): the base checkpoint is
memory-mapped (its pages are the file's, shared, not counted), and a thread samples the process's anonymous
resident memory (RssAnon) every millisecond while the base is built: the peak above the level before is
what loading it allocated. "live": with glibc returning every freed block of 64 KiB or more at once (LIVE),
so that the peak follows the live tensors; "glibc": its defaults, which keep some freed blocks. `qlora`
runs QLoRA's own materialize() (meta build, each projection quantized from the checkpoint on its own);
`bf16` puts the same base in bf16 the same way without quantizing (the least a bf16 base costs); `lora` is
what finetune=lora does today at trainer.precision=bf16-true (the model built and initialized in fp32, the
base copied in, then cast). Not measured on a GPU (torch.cuda.max_memory_allocated would be the measure
there).
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit import accounting, quant
from gptkit.conf_tree import compose
from gptkit.fsio import human_bytes
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder
from gptkit.tokenizer import byte_tokenizer


def _model_config(spec: dict, vocab: int) -> ModelConfig:
    spec = dict(spec)
    preset = spec.pop("preset")
    model = OmegaConf.to_container(compose("train", [f"model={preset}"]).model, resolve=True)
    model.update({"vocab_size": vocab, "name": preset, **spec})
    return ModelConfig.from_dict(model)


def _rss_anon() -> int:
    """This process's anonymous resident memory in bytes (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_while(fn) -> tuple[int, object]:
    """(the peak of RssAnon above its level before, sampled every ms while fn() runs; fn's result)."""
    before, peak, done = _rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], _rss_anon())
    return peak[0] - before, result


def _child(kind: str, ckpt: str, lora_json: str) -> None:
    """In a fresh process: load the base of `ckpt` as `kind` (qlora | bf16 | lora) and print the peak RssAnon
    growth and the bytes the base's tensors hold, as JSON."""
    from types import SimpleNamespace

    from gptkit.checkpoints import checked_model_state
    from gptkit.precision import precision
    from gptkit.runs import read_config, run_dir_of
    from gptkit.training.finetune.lora import apply_lora
    from gptkit.training.finetune.qlora import QLoRA
    from gptkit.training.start import load_init_weights

    torch.set_num_threads(1)
    lora = json.loads(lora_json)
    cfg = ModelConfig.from_dict(read_config(run_dir_of(Path(ckpt)))["model"])
    # torchao and the checkpoint reader imported, and the index read, before the level is taken
    quant.torchao()
    checked_model_state(Path(ckpt), cfg)

    def qlora():
        plan = SimpleNamespace(
            lora=lora,
            lora_base=Path(ckpt),
            cfg=OmegaConf.create({"seed": 0, "qlora": {"block_size": 64, "scaler_block_size": "auto"}}),
            precision=precision("bf16-true"),
        )
        finetune = QLoRA(plan)
        with torch.device("meta"):
            model = GPT(cfg)
        finetune.apply(model)
        finetune.materialize(SimpleNamespace(model=model), torch.device("cpu"))
        return model

    def bf16():
        state = checked_model_state(Path(ckpt), cfg)
        with torch.device("meta"):
            model = GPT(cfg)
        model.load_state_dict({k: v.to(torch.bfloat16, copy=True) for k, v in state.items()}, assign=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
        # RoPE's tables, recomputed
        if model.rope is not None:
            model.rope.to_empty(device="cpu")
        return model

    def lora_today():
        model = GPT(cfg)
        apply_lora(model, lora)
        load_init_weights(model, Path(ckpt))
        return model.to(torch.bfloat16)

    peak, model = _peak_while({"qlora": qlora, "bf16": bf16, "lora": lora_today}[kind])
    held = sum(
        quant.weight_bytes(p) for n, p in model.named_parameters() if not n.split(".")[-1].startswith("lora_")
    )
    print(json.dumps({"peak": peak, "held": held}))


# glibc returns every block of 64 KiB or more to the system when it is freed (its default threshold rises to
# the largest block freed, after which freed blocks stay in the process): RSS then follows the live
# allocations, as torch.cuda.max_memory_allocated would on a GPU
LIVE = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _measure(kind: str, ckpt: Path, lora: dict, env: dict | None = None) -> dict:
    code = f"from gptkit.bench.qlora import _child; _child({kind!r}, {str(ckpt)!r}, {json.dumps(lora)!r})"
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env)
    if r.returncode:
        raise RuntimeError(f"bench qlora: measuring {kind} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _train(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "gptkit", "train", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"bench qlora: gptkit train {' '.join(args)} failed:\n{r.stderr[-2000:]}")


def _final(run: Path, warmup: int) -> tuple[float, float]:
    """(the last val/loss, the median perf/tokens_per_s after warmup steps) of a run's metrics.csv."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    rates = [
        float(r["perf/tokens_per_s"]) for r in rows if r.get("perf/tokens_per_s") and int(r["step"]) > warmup
    ]
    return val[-1], statistics.median(rates)


def run(cfg) -> int:
    """The benchmark of the module docstring, with the `bench` group of conf/bench/qlora.yaml."""
    con = Console(stderr=True, highlight=False)
    root = Path(str(cfg.dir)).expanduser()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    tok = byte_tokenizer([])
    lora = OmegaConf.to_container(cfg.lora, resolve=True)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").is_file() else []
    results: dict = {"loadavg_start": load, "date": time.strftime("%Y-%m-%d %H:%M"), "memory": {}, "loss": {}}

    # 1. memory per shape
    shapes = OmegaConf.to_container(cfg.shapes, resolve=True)
    table = Table(title="base memory: NF4 projections (finetune=qlora) against the bf16 base, per shape")
    columns = (
        "shape",
        "parameters",
        "bf16 base (2N)",
        "estimate",
        "held",
        "peak (live)",
        "peak (glibc)",
        "bf16 peak",
        "lora peak",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for name, spec in shapes.items():
        spec = dict(spec)
        vocab = int(spec.pop("vocab_size", tok.get_vocab_size()))
        model_cfg = _model_config(spec, vocab)
        torch.manual_seed(0)
        con.print(f"memory: {name} ...")
        base = write_run_folder(root / f"base-{name}", {"tokenizer": {"kind": "byte"}}, GPT(model_cfg), tok)
        ckpt = base / "checkpoints" / "last.ckpt"
        n = accounting.count_params(model_cfg).total
        full = 2 * n
        estimate = accounting.quantized_weights(model_cfg, "nf4", "bf16")["total"]
        m = {
            "qlora_live": _measure("qlora", ckpt, lora, LIVE),
            "qlora": _measure("qlora", ckpt, lora),
            "bf16": _measure("bf16", ckpt, lora, LIVE),
            "lora": _measure("lora", ckpt, lora, LIVE),
        }
        results["memory"][name] = {"parameters": n, "bf16_base": full, "estimate": estimate, **m}
        ratio = lambda b: f"{human_bytes(b)} ({b / full:.3f}x)"  # noqa: E731
        table.add_row(
            name,
            f"{n:,}",
            human_bytes(full),
            ratio(estimate),
            ratio(m["qlora"]["held"]),
            ratio(m["qlora_live"]["peak"]),
            ratio(m["qlora"]["peak"]),
            ratio(m["bf16"]["peak"]),
            ratio(m["lora"]["peak"]),
        )
        shutil.rmtree(base)
    Console(width=200).print(table)

    # 2. loss and speed from a pretrained base
    spec = dict(shapes[str(cfg.loss_shape)])
    spec.pop("vocab_size", None)
    model_cfg = _model_config(spec, tok.get_vocab_size())
    common = [
        "data=shakespeare",
        "tokenizer=byte",
        f"trainer.batch_size={cfg.batch_size}",
        "trainer.log_every=1",
        "trainer.progress=false",
        f"trainer.threads={cfg.threads}",
        "trainer.accelerator=cpu",
        f"trainer.precision={cfg.precision}",
        "trainer.val_windows=8",
        f"runs_dir={root}",
    ]
    model_args = [f"model={spec['preset']}", *[f"model.{k}={v}" for k, v in spec.items() if k != "preset"]]
    con.print(f"loss: pretraining the {cfg.loss_shape} base for {cfg.base_steps} steps ...")
    _train(
        [
            *model_args,
            *common,
            f"trainer.max_steps={cfg.base_steps}",
            f"trainer.val_every={cfg.base_steps}",
            "optim.lr=3e-3",
            "name=pretrained",
        ]
    )
    targets = "[" + ",".join(lora["targets"]) + "]"
    adapters = [f"lora.rank={lora['rank']}", f"lora.alpha={lora['alpha']}", f"lora.targets={targets}"]
    runs: dict[str, list[dict]] = {"lora": [], "qlora": []}
    for seed in cfg.seeds:
        for kind in ("lora", "qlora"):
            name = f"{kind}-{seed}"
            con.print(f"loss: finetune={kind} seed={seed} ...")
            _train(
                [
                    *common,
                    f"init_from={root / 'pretrained'}",
                    f"finetune={kind}",
                    *adapters,
                    f"seed={seed}",
                    f"trainer.max_steps={cfg.steps}",
                    f"trainer.val_every={cfg.steps}",
                    f"optim.lr={cfg.lr}",
                    "optim.warmup_steps=5",
                    f"name={name}",
                ]
            )
            val, tps = _final(root / name, int(cfg.warmup))
            runs[kind].append({"seed": seed, "val_loss": val, "tokens_per_s": tps})
    lt = Table(
        title=f"finetune=qlora against lora: {cfg.loss_shape} ({model_cfg.n_layers} layers, d_model "
        f"{model_cfg.d_model}), {cfg.steps} steps from a base pretrained {cfg.base_steps} steps, "
        f"batch {cfg.batch_size} x {model_cfg.max_seq_len}, {cfg.precision}"
    )
    for col in (
        "seed",
        "lora val loss",
        "qlora val loss",
        "qlora / lora",
        "lora tokens/s",
        "qlora tokens/s",
        "speed qlora / lora",
    ):
        lt.add_column(col, justify="right")
    ratios, speeds = [], []
    for a, b in zip(runs["lora"], runs["qlora"]):
        ratios.append(b["val_loss"] / a["val_loss"])
        speeds.append(b["tokens_per_s"] / a["tokens_per_s"])
        lt.add_row(
            str(a["seed"]),
            f"{a['val_loss']:.4f}",
            f"{b['val_loss']:.4f}",
            f"{ratios[-1]:.4f}",
            f"{a['tokens_per_s']:,.0f}",
            f"{b['tokens_per_s']:,.0f}",
            f"{speeds[-1]:.2f}",
        )
    lt.add_row("mean", "", "", f"{statistics.mean(ratios):.4f}", "", "", f"{statistics.mean(speeds):.2f}")
    Console(width=200).print(lt)
    results["loss"] = {"runs": runs, "ratio": ratios, "speed": speeds}

    # 3. NF4's round trip on the pretrained base's projections
    from gptkit.runs import load_model

    *_, model = load_model(root / "pretrained")
    errors = {"torchao": 0.0, "paper": 0.0, "paper_with_torchao_scales": 0.0}
    count = 0
    for name in quant.quantized_names(model.cfg):
        w = model.get_parameter(name).detach()
        q = quant.to_nf4(w)
        sq = lambda x: (x.double() - w.double()).pow(2).sum().item()  # noqa: E731
        errors["torchao"] += sq(q.get_original_weight())
        errors["paper"] += sq(quant.reference_nf4(w))
        errors["paper_with_torchao_scales"] += sq(quant.reference_nf4(w, scales=quant.nf4_scales(q)))
        count += w.numel()
    rms = {k: math.sqrt(v / count) for k, v in errors.items()}
    et = Table(
        title=f"NF4 round trip of the pretrained {cfg.loss_shape} base's projections ({count:,} values)"
    )
    et.add_column("code book and scales")
    et.add_column("RMS error", justify="right")
    et.add_column("/ paper's", justify="right")
    for k, label in (
        ("torchao", "torchao NF4Tensor (4-decimal code book, double-quantized scales)"),
        ("paper", "the QLoRA paper's code book, fp64 absmax scales"),
        ("paper_with_torchao_scales", "the paper's code book, torchao's scales"),
    ):
        et.add_row(label, f"{rms[k]:.6g}", f"{rms[k] / rms['paper']:.5f}")
    Console(width=200).print(et)
    results["nf4_rms"] = rms
    results["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3] if load else []
    (root / "results.json").write_text(json.dumps(results, indent=2))
    if cfg.out:
        Path(str(cfg.out)).write_text(json.dumps(results, indent=2))
    con.print(f"results: {root / 'results.json'}")
    return 0
