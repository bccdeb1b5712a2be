"""gptkit bench train: Lightning's overhead over a bare PyTorch loop, same model, same batches.

Both loops do exactly the same work per optimizer step: the stateless sampler's batch, forward,
fp32 loss, backward, gradient clipping at 1.0, AdamW with gptkit's parameter groups, the
cosine LR schedule. The Lightning loop is gptkit's own LitGPT + Trainer (logging every 10 steps, as in
`gptkit train`), without checkpoints or a progress bar. Steps after `warmup` are timed; the loops
alternate `repeats` times and the median is reported.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import yaml


def _model_cfg(cfg, vocab_size: int):
    from gptkit.config import conf_dir
    from gptkit.model import ModelConfig

    d = yaml.safe_load((conf_dir() / "model" / f"{cfg.model}.yaml").read_text())
    d.update(dict(cfg.model_overrides))
    d["vocab_size"] = vocab_size
    return ModelConfig.from_dict(d)


def _optim_cfg():
    from omegaconf import OmegaConf

    from gptkit.config import conf_dir

    o = OmegaConf.load(conf_dir() / "optim" / "adamw.yaml")
    o.warmup_steps = 10
    return o


def bare_loop(model_cfg, sampler, steps: int, warmup: int, compile: bool) -> float:
    """Seconds per optimizer step of a plain PyTorch loop."""
    import torch

    from gptkit.model import GPT
    from gptkit.training.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    model = GPT(model_cfg)
    if compile:
        model.compile()
    opt_cfg = _optim_cfg()
    opt = build_optimizer(model, opt_cfg)
    sched = build_scheduler(opt, opt_cfg, warmup + steps)
    model.train()
    t0 = None
    for step in range(warmup + steps):
        if step == warmup:
            t0 = time.perf_counter()
        x, y = sampler.batch(step)
        loss = model(x, y).loss
        if not torch.isfinite(loss):
            raise RuntimeError("non-finite loss")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / steps


def lightning_loop(model_cfg, prepared, batch_size: int, steps: int, warmup: int, compile: bool) -> float:
    """Seconds per optimizer step of gptkit's LightningModule under a Lightning Trainer."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from gptkit.data import TokenDataModule
    from gptkit.training.module import LitGPT

    class Clock(Callback):
        t0 = t1 = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == warmup and self.t0 is None:
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            self.t1 = time.perf_counter()

    torch.manual_seed(0)
    module = LitGPT(model_cfg, _optim_cfg(), warmup + steps, compile=compile)
    dm = TokenDataModule(prepared, batch_size=batch_size, seq_len=model_cfg.max_seq_len, seed=1337, val_windows=1)
    clock = Clock()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=warmup + steps, max_epochs=-1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0,
                        callbacks=[clock], log_every_n_steps=10)
    trainer.fit(module, datamodule=dm)
    return (clock.t1 - clock.t0) / steps


def run(cfg) -> int:
    import logging
    import warnings

    import torch
    from omegaconf import OmegaConf
    from rich.console import Console
    from rich.table import Table

    from gptkit.data import TokenDataModule, prepare
    from gptkit.errors import GptkitError
    from gptkit.threads import set_threads

    set_threads(cfg.get("threads"), "bench.threads")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    data = {"kind": "shakespeare"}
    if cfg.data_path is not None:
        path = Path(cfg.data_path)
        if not path.is_file():
            raise GptkitError(f"bench.data_path={path} does not exist; point it at a text file")
        data = {"kind": "files", "paths": [str(path)]}
    prepared = prepare(OmegaConf.create(data), OmegaConf.create({"kind": "char"}), progress=False)
    model_cfg = _model_cfg(cfg, prepared.vocab_size)
    sampler = TokenDataModule(prepared, batch_size=int(cfg.batch_size), seq_len=model_cfg.max_seq_len,
                              seed=1337, val_windows=1).sampler
    con = Console()
    rows = []
    for compile in cfg.compile:
        bare, lit = [], []
        for r in range(int(cfg.repeats)):
            bare.append(bare_loop(model_cfg, sampler, int(cfg.steps), int(cfg.warmup), bool(compile)))
            lit.append(lightning_loop(model_cfg, prepared, int(cfg.batch_size), int(cfg.steps), int(cfg.warmup),
                                      bool(compile)))
            con.print(f"compile={compile} repeat {r + 1}: bare {bare[-1] * 1e3:.2f} ms/step, "
                      f"lightning {lit[-1] * 1e3:.2f} ms/step")
        b, lt = statistics.median(bare), statistics.median(lit)
        rows.append({"compile": bool(compile), "bare_ms": b * 1e3, "lightning_ms": lt * 1e3,
                     "overhead_pct": 100 * (lt / b - 1), "bare_all_ms": [x * 1e3 for x in bare],
                     "lightning_all_ms": [x * 1e3 for x in lit]})
    t = Table(title=f"{model_cfg.name}-shaped model (1 process, {torch.get_num_threads()} threads), "
                    f"batch {cfg.batch_size} x {model_cfg.max_seq_len}, {cfg.steps} timed steps, median of {cfg.repeats}")
    for col in ("torch.compile", "bare PyTorch ms/step", "gptkit Lightning ms/step", "overhead"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["compile"]), f"{r['bare_ms']:.2f}", f"{r['lightning_ms']:.2f}", f"{r['overhead_pct']:+.1f}%")
    con.print(t)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(rows, indent=2))
    return 0
