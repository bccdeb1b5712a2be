"""gptkit bench train: `gptkit train`'s loop against a plain PyTorch loop, same model, same batches, same
device and precision, eager and compiled.

The plain loop is a good one, not a straw man: the stateless sampler's batch from pinned memory copied
with non_blocking, forward under autocast (mixed precision) or in the model's dtype ("true" precision),
fp32 loss, backward (through torch's GradScaler for 16-mixed), gradient clipping at bench.clip, AdamW with
gptkit's parameter groups and the same fused/foreach choice, the cosine schedule, and the loss read only
every bench.log_every steps. The gptkit loop is the trainer `gptkit train` builds (trainer factory,
LitGPT, StepMetrics, RunCheckpoints with no checkpoint due, no logger, no progress display).

Steps after bench.warmup are timed (compilation happens in the warm-up, whose time is reported as the
first-steps time); the two loops alternate bench.repeats times and the median is reported, one row as
soon as each setting is measured. MFU uses the count-params FLOPs (6N + 12·L·T·d_attn, full attention, the
published convention) and the device's peak for the precision (trainer.peak_tflops overrides it).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from gptkit import accounting as acc
from gptkit.conf_tree import compose, conf_dir
from gptkit.data import TokenDataModule, prepare
from gptkit.errors import ConfigError, GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.precision import precision, torch_dtype
from gptkit.runs import resolve_device
from gptkit.threads import set_threads
from gptkit.training.config_checks import compile_mode
from gptkit.training.metrics import detect_peak_flops
from gptkit.training.module import LitGPT, apply_compile
from gptkit.training.optim import build_optimizer, build_scheduler
from gptkit.training.plan import make_plan
from gptkit.training.trainer import build_trainer, check_trainer_config


def _model_cfg(cfg, vocab_size: int | None):
    d = yaml.safe_load((conf_dir() / "model" / f"{cfg.model}.yaml").read_text())
    d.update(dict(cfg.model_overrides or {}))
    if vocab_size is not None:
        d["vocab_size"] = vocab_size
    return ModelConfig.from_dict(d)


def _optim_cfg():
    o = OmegaConf.load(conf_dir() / "optim" / "adamw.yaml")
    o.warmup_steps = 10
    return o


# cpu: this process's CPU time (1 thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bare_loop(
    model_cfg, sampler, cfg, device: str, compile_mode: str | None, clock=time.perf_counter
) -> tuple[float, float]:
    """(seconds per timed optimizer step, seconds of the warm-up steps) of a plain PyTorch loop."""
    steps, warmup, log_every = int(cfg.steps), int(cfg.warmup), int(cfg.log_every)
    p = precision(cfg.precision, "bench.precision")
    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    if not p.mixed and p.compute != "fp32":
        model = model.to(torch_dtype(p.compute))
    if compile_mode:
        apply_compile(model, compile_mode, str(cfg.compile_backend))
    opt_cfg = _optim_cfg()
    opt = build_optimizer(model, opt_cfg)
    sched = build_scheduler(opt, opt_cfg, warmup + steps)
    scaler = torch.amp.GradScaler(device) if p.name == "16-mixed" else None
    autocast = torch.autocast(device, dtype=torch_dtype(p.compute)) if p.mixed else None
    model.train()
    pin = device == "cuda"
    t0 = t_start = clock()
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            t0 = clock()
            warm = t0 - t_start
        x, y = sampler.batch(step)
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if autocast is not None:
            with autocast:
                loss = model(x, y).loss
        else:
            loss = model(x, y).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if cfg.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg.clip))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        # what a training loop reads
        if (step + 1) % log_every == 0 and not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss at step {step}")
    _sync(device)
    return (clock() - t0) / steps, warm


def gptkit_loop(
    model_cfg, prepared, cfg, device: str, compile_mode: str | None, clock=time.perf_counter
) -> tuple[float, float]:
    """(seconds per timed optimizer step, seconds of the warm-up steps) of the trainer `gptkit train`
    builds."""
    steps, warmup = int(cfg.steps), int(cfg.warmup)

    class Clock(Callback):
        t_start = t0 = t1 = None

        def on_train_start(self, trainer, pl_module):
            self.t_start = clock()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == warmup and self.t0 is None:
                _sync(device)
                self.t0 = clock()

        def on_train_end(self, trainer, pl_module):
            _sync(device)
            self.t1 = clock()

    run_cfg = compose(
        "train",
        [
            f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
            f"trainer.precision={cfg.precision}",
            f"trainer.batch_size={cfg.batch_size}",
            f"trainer.gradient_clip_val={cfg.clip or 'null'}",
            f"trainer.log_every={cfg.log_every}",
            "trainer.progress=off",
            "trainer.val_every=1000000",
            "trainer.checkpoint_every=1000000",
            f"trainer.compile={compile_mode or 'none'}",
            f"trainer.compile_backend={cfg.compile_backend}",
            "logger=[]",
        ],
    )
    run_cfg = OmegaConf.create(OmegaConf.to_container(run_cfg, resolve=True))
    run_cfg.optim = _optim_cfg()
    run_cfg.trainer.max_steps = warmup + steps
    checked = check_trainer_config(run_cfg.trainer)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gptkit-bench-") as run_dir:
        # the plan `gptkit train` would make
        plan = make_plan(run_cfg, Path(run_dir), model_cfg, checked=checked)
        module = LitGPT(plan)
        dm = TokenDataModule(
            prepared, batch_size=plan.batch_size, seq_len=plan.seq_len, seed=1337, val_windows=1
        )
        trainer, _, _ = build_trainer(plan, [])
        timer = Clock()
        trainer.callbacks.append(timer)
        trainer.fit(module, datamodule=dm)
    return (timer.t1 - timer.t0) / steps, timer.t0 - timer.t_start


def run(cfg) -> int:
    set_threads(cfg.get("threads"), "bench.threads")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    device = resolve_device(str(cfg.device))
    if cfg.clock not in CLOCKS or (cfg.clock == "cpu" and device == "cuda"):
        raise ConfigError(f"bench.clock={cfg.clock} must be wall, or cpu on the CPU")
    clock = CLOCKS[cfg.clock]
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"bench.device={cfg.device} must be auto, cpu or cuda")
    data = {"kind": "shakespeare"}
    if cfg.data_path is not None:
        path = Path(cfg.data_path)
        if not path.is_file():
            raise GptkitError(f"bench.data_path={path} does not exist; point it at a text file")
        data = {"kind": "files", "paths": [str(path)]}
    prepared = prepare(OmegaConf.create(data), OmegaConf.create({"kind": "char"}), progress=False)
    model_cfg = _model_cfg(
        cfg, None if cfg.model_overrides and "vocab_size" in cfg.model_overrides else prepared.vocab_size
    )
    if model_cfg.vocab_size < prepared.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} < the corpus's {prepared.vocab_size} tokens"
        )
    sampler = TokenDataModule(
        prepared, batch_size=int(cfg.batch_size), seq_len=model_cfg.max_seq_len, seed=1337, val_windows=1
    ).sampler
    # the MFU convention
    flops = acc.flops_per_token(model_cfg).train_dense
    peak = detect_peak_flops(str(cfg.precision), cfg.peak_tflops) if device == "cuda" else None
    tokens_per_step = int(cfg.batch_size) * model_cfg.max_seq_len
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    con = Console(width=None if sys.stdout.isatty() else 160)
    con.print(
        f"{model_cfg.name}: {acc.count_params(model_cfg).total:,} parameters, {where}, "
        f"{cfg.precision}, batch {cfg.batch_size} x {model_cfg.max_seq_len} tokens, clip {cfg.clip}, "
        f"{cfg.steps} timed steps after {cfg.warmup}, median of {cfg.repeats}; MFU: count-params FLOPs "
        f"(6N + 12·L·T·d_attn) / peak"
    )
    rows = []
    for setting in cfg.compile:
        mode = compile_mode(setting)
        bare, ours, bare_warm, ours_warm = [], [], [], []
        for _ in range(int(cfg.repeats)):
            s, w = bare_loop(model_cfg, sampler, cfg, device, mode, clock)
            bare.append(s)
            bare_warm.append(w)
            s, w = gptkit_loop(model_cfg, prepared, cfg, device, mode, clock)
            ours.append(s)
            ours_warm.append(w)
        b, g = statistics.median(bare), statistics.median(ours)
        row = {
            "compile": mode or "off",
            "bare_ms": b * 1e3,
            "gptkit_ms": g * 1e3,
            "bare_tokens_per_s": tokens_per_step / b,
            "gptkit_tokens_per_s": tokens_per_step / g,
            # the first loop compiles
            "speed_vs_bare": b / g,
            "first_steps_s": max(bare_warm[0], ours_warm[0]),
            "bare_all_ms": [x * 1e3 for x in bare],
            "gptkit_all_ms": [x * 1e3 for x in ours],
        }
        if peak:
            row["gptkit_mfu"] = acc.mfu(row["gptkit_tokens_per_s"], flops, peak)
            row["bare_mfu"] = acc.mfu(row["bare_tokens_per_s"], flops, peak)
        rows.append(row)
        mfu = f", MFU {row['gptkit_mfu']:.1%} vs {row['bare_mfu']:.1%}" if peak else ""
        con.print(
            f"compile={row['compile']}: gptkit {row['gptkit_ms']:.2f} ms/step "
            f"({row['gptkit_tokens_per_s']:,.0f} tokens/s), plain PyTorch {row['bare_ms']:.2f} ms/step "
            f"({row['bare_tokens_per_s']:,.0f} tokens/s): {row['speed_vs_bare']:.3f}x{mfu}; first "
            f"{cfg.warmup} steps (with compilation) {row['first_steps_s']:.1f} s",
            highlight=False,
        )
    t = Table(title=f"gptkit train vs a plain PyTorch loop ({where}, {cfg.precision})")
    for col in (
        "torch.compile",
        "plain ms/step",
        "gptkit ms/step",
        "gptkit tokens/s",
        "speed vs plain",
        "first steps (s)",
    ) + (("MFU",) if peak else ()):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["compile"],
            f"{r['bare_ms']:.2f}",
            f"{r['gptkit_ms']:.2f}",
            f"{r['gptkit_tokens_per_s']:,.0f}",
            f"{r['speed_vs_bare']:.3f}x",
            f"{r['first_steps_s']:.1f}",
            *((f"{r['gptkit_mfu']:.1%}",) if peak else ()),
        )
    con.print(t)
    if cfg.out:
        from gptkit.fsio import atomic_write_text

        atomic_write_text(
            cfg.out,
            json.dumps(
                {
                    "device": where,
                    "precision": str(cfg.precision),
                    "model": model_cfg.to_dict(),
                    "rows": rows,
                },
                indent=2,
            ),
        )
    return 0
