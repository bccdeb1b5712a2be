"""AdamW with parameter groups, and learning-rate schedules (torch LambdaLR)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gptkit.errors import ConfigError

SCHEDULES = ("cosine", "linear", "wsd", "constant")


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False,
                 decay_norms_and_biases: bool = False) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only; norms, biases and embeddings undecayed unless asked.

    Tied weights appear once (named_parameters de-duplicates them under their first name).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.startswith(("tok_emb.", "pos_emb."))
        is_matrix = p.ndim >= 2 and not is_embedding
        if is_matrix or (is_embedding and decay_embeddings) or (p.ndim < 2 and decay_norms_and_biases):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def check_optim_config(cfg: Any) -> None:
    """One-line errors for the `optim` group, before any data is prepared or anything is written."""
    if cfg.name != "adamw":
        raise ConfigError(f"optim.name={cfg.name!r} is not supported; use optim=adamw")
    if not float(cfg.lr) > 0:
        raise ConfigError(f"optim.lr={cfg.lr} must be > 0")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.get("min_lr") is not None:
        if isinstance(cfg.min_lr, bool) or not isinstance(cfg.min_lr, (int, float)):
            raise ConfigError(f"optim.min_lr={cfg.min_lr} is not a number (null: optim.lr / 10)")
        if not 0 <= float(cfg.min_lr) <= float(cfg.lr):
            raise ConfigError(f"optim.min_lr={cfg.min_lr} must be in [0, optim.lr={cfg.lr}] (or null: optim.lr / 10)")
    if int(cfg.warmup_steps) < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.warmup_steps} must be >= 0")
    adamw_implementation(cfg.fused, "cpu")


def min_lr(cfg: Any) -> float:
    """The lr the schedule decays to: optim.min_lr, or optim.lr / 10 when it is null (the default, so that
    optim.lr=3e-5 alone gives a schedule to 3e-6)."""
    return float(cfg.lr) / 10 if cfg.get("min_lr") is None else float(cfg.min_lr)


FUSED_DEVICES = ("cuda", "cpu")  # where torch's fused AdamW kernel runs (torch >= 2.4 on the CPU)


def adamw_implementation(fused: Any, device_type: str) -> str:
    """"fused" (one kernel for every parameter update) or "foreach" (torch's default) for optim.fused
    (auto | true | false) on `device_type`. Clipping works with both: gptkit's mixed-precision plugin
    unscales before clipping (training/trainer.py)."""
    if fused == "auto":
        return "fused" if device_type in FUSED_DEVICES else "foreach"
    if fused is True:
        if device_type not in FUSED_DEVICES:
            raise ConfigError(f"optim.fused=true needs a CUDA GPU or the CPU, not {device_type}; use optim.fused=auto")
        return "fused"
    if fused is False:
        return "foreach"
    raise ConfigError(f"optim.fused={fused!r} must be auto, true or false")


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """AdamW over param_groups (cfg as check_optim_config accepts it)."""
    groups = param_groups(model, float(cfg.weight_decay), bool(cfg.decay_embeddings), bool(cfg.decay_norms_and_biases))
    impl = adamw_implementation(cfg.fused, next(model.parameters()).device.type)
    return torch.optim.AdamW(groups, lr=float(cfg.lr), betas=tuple(float(b) for b in cfg.betas),
                             eps=float(cfg.eps), fused=impl == "fused", foreach=impl == "foreach" or None)


def lr_factor(step: int, *, schedule: str, max_steps: int, warmup_steps: int, lr: float, min_lr: float,
              decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based).

    warmup: linear from lr/warmup to lr over `warmup_steps`; then
      cosine:   cosine decay to min_lr at max_steps
      linear:   linear decay to min_lr at max_steps
      wsd:      warmup-stable-decay: flat at lr, then linear to min_lr over the last decay_fraction of steps
      constant: flat at lr
    """
    floor = min_lr / lr
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if step >= max_steps:
        return floor
    if schedule == "wsd":
        decay_start = max(warmup_steps, int(max_steps * (1 - decay_fraction)))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, max_steps - decay_start)
        return 1.0 - (1.0 - floor) * progress
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR of optim.schedule (warmup, then cosine / linear / WSD to optim.min_lr)."""
    kw = dict(schedule=cfg.schedule, max_steps=max_steps, warmup_steps=int(cfg.warmup_steps), lr=float(cfg.lr),
              min_lr=min_lr(cfg), decay_fraction=float(cfg.decay_fraction))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kw))
