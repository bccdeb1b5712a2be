"""The optimizers (optim=adamw, optim=muon) with their parameter groups, and learning-rate schedules
(torch LambdaLR).

optim=muon: torch.optim.Muon for the 2-D weights inside the transformer blocks (the attention and MLP
projections), AdamW (the optim=adamw settings) for everything else: the embeddings, the LM head, norms and
biases. Muon's step is lr * 0.2 * sqrt(max(A, B)) times the orthogonalized momentum of an A x B matrix
(adjust_lr_fn="match_rms_adamw", Moonlight, arXiv:2502.16982): an update of AdamW's RMS, so optim.lr, the
schedule and optim.weight_decay (decoupled: w -= lr * weight_decay * w) mean what they mean with AdamW.
Lightning steps one optimizer: MuonWithAdamW holds the two and shows their groups and state as its own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from gptkit.errors import ConfigError

SCHEDULES = ("cosine", "linear", "wsd", "constant")


OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn
MUON_TORCH = "2.9"  # the first torch with torch.optim.Muon


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False,
                 decay_norms_and_biases: bool = False, named: list | None = None) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only; norms, biases and embeddings undecayed unless asked.

    Tied weights appear once (named_parameters de-duplicates them under their first name). `named`: only
    these (name, parameter) pairs (AdamW's share under optim=muon) instead of every trainable one.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters() if named is None else named:
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


def muon_split(model: nn.Module) -> tuple[list, list]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs: Muon takes the 2-D weights inside the transformer
    blocks (attention and MLP projections; the fused q/k/v projection is one matrix, as torch.optim.Muon
    sees it), AdamW the rest: token and position embeddings, the LM head (tied or not), norms and biases."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if name.startswith("blocks.") and p.ndim == 2 else adamw).append((name, p))
    return muon, adamw


def check_muon_split(model: nn.Module) -> None:
    """optim=muon on a model without a trainable 2-D weight inside its blocks is a one-line error."""
    muon, _ = muon_split(model)
    if not muon:
        raise ConfigError("optim=muon: the model has no trainable 2-D weight inside its blocks for Muon "
                          "(attention and MLP projections); use optim=adamw")


def check_optim_config(cfg: Any) -> None:
    """One-line errors for the `optim` group, before any data is prepared or anything is written."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.name!r} is not supported; use optim=adamw or optim=muon")
    if cfg.name == "muon":
        check_muon_config(cfg)
    if not float(cfg.lr) > 0:
        raise ConfigError(f"optim.lr={cfg.lr} must be > 0")
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.get("min_lr") is not None:
        if isinstance(cfg.min_lr, bool) or not isinstance(cfg.min_lr, (int, float)):
            raise ConfigError(f"optim.min_lr={cfg.min_lr} is not a number (null: optim.lr / 10)")
        if not 0 <= float(cfg.min_lr) <= float(cfg.lr):
            raise ConfigError(f"optim.min_lr={cfg.min_lr} must be in [0, optim.lr={cfg.lr}] (or null: "
                              "optim.lr / 10)")
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
            raise ConfigError(f"optim.fused=true needs a CUDA GPU or the CPU, not {device_type}; use "
                              "optim.fused=auto")
        return "fused"
    if fused is False:
        return "foreach"
    raise ConfigError(f"optim.fused={fused!r} must be auto, true or false")


def check_muon_config(cfg: Any) -> None:
    """optim.muon.*: torch.optim.Muon present, momentum in [0, 1), ns_steps a positive integer (< 100, torch's
    limit), nesterov a boolean, adjust_lr one of MUON_ADJUST_LR."""
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(f"optim=muon needs torch >= {MUON_TORCH} (torch.optim.Muon); this is torch "
                          f"{torch.__version__}: upgrade torch or use optim=adamw")
    m = cfg.muon
    momentum = m.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ConfigError(f"optim.muon.momentum={momentum} must be a number in [0, 1)")
    steps = m.ns_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise ConfigError(f"optim.muon.ns_steps={steps} must be an integer in [1, 99] (Newton-Schulz "
                          f"iterations)")
    if not isinstance(m.nesterov, bool):
        raise ConfigError(f"optim.muon.nesterov={m.nesterov} must be true or false")
    if m.adjust_lr not in MUON_ADJUST_LR:
        raise ConfigError(f"optim.muon.adjust_lr={m.adjust_lr!r} must be one of {', '.join(MUON_ADJUST_LR)} "
                          f"(match_rms_adamw: optim.lr means what it means with AdamW)")


def _adamw(groups: list[dict[str, Any]], cfg: Any, device_type: str) -> torch.optim.AdamW:
    impl = adamw_implementation(cfg.fused, device_type)
    return torch.optim.AdamW(groups, lr=float(cfg.lr), betas=tuple(float(b) for b in cfg.betas),
                             eps=float(cfg.eps), fused=impl == "fused", foreach=impl == "foreach" or None)


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """AdamW over param_groups, or (optim=muon) MuonWithAdamW; cfg as check_optim_config accepts it."""
    device_type = next(model.parameters()).device.type
    decay = (float(cfg.weight_decay), bool(cfg.decay_embeddings), bool(cfg.decay_norms_and_biases))
    if cfg.name != "muon":
        return _adamw(param_groups(model, *decay), cfg, device_type)
    check_muon_split(model)
    muon_named, adamw_named = muon_split(model)
    m = cfg.muon
    muon = torch.optim.Muon([p for _, p in muon_named], lr=float(cfg.lr), weight_decay=decay[0],
                            momentum=float(m.momentum), nesterov=bool(m.nesterov), ns_steps=int(m.ns_steps),
                            adjust_lr_fn=str(m.adjust_lr))
    groups = [g for g in param_groups(model, *decay, named=adamw_named) if g["params"]]
    adamw = _adamw(groups, cfg, device_type)
    return MuonWithAdamW(muon, adamw)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon and torch.optim.AdamW as the one optimizer Lightning steps.

    Its param_groups are the two optimizers' groups (the same dicts: Muon's first) and its state is theirs
    (one dict), so the lr scheduler, gradient clipping, the grad scaler and checkpoints (state_dict /
    load_state_dict, FSDP's get/set_optimizer_state_dict) see every parameter once, with its own settings.

    Under FSDP2 a Muon parameter is a DTensor sharded by rows, but Newton-Schulz needs the whole matrix: the
    momentum is kept and updated on the shards, each parameter's update is gathered whole (full_tensor),
    orthogonalized by torch's own Newton-Schulz and applied to the local rows (sharded_muon_step).
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, {})
        self._link()

    def _link(self) -> None:
        """Point the two optimizers at this one's groups and state (after __init__ and load_state_dict, which
        replace them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(is_dtensor(p) for g in self.muon.param_groups for p in g["params"]):
            sharded_muon_step(self.muon)
        else:
            self.muon.step()
        self.adamw.step()
        return loss


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def sharded_muon_step(muon: torch.optim.Optimizer) -> None:
    """torch.optim.Muon's step for FSDP2's row-sharded DTensor parameters, gathering one matrix at a time.

    The same arithmetic as torch's _single_tensor_muon, with torch's own Newton-Schulz and lr adjustment:
    momentum (elementwise, on the local shards), Nesterov, then the update gathered whole and orthogonalized
    (every rank the same full matrix: the same result), and decoupled weight decay and the step applied to
    the local rows. Collective: every rank calls it, for the same parameters in the same order.
    """
    from torch.distributed.tensor import distribute_tensor

    for group in muon.param_groups:
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = muon.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            full = update.full_tensor() if is_dtensor(update) else update  # [A, B]: all-gather the rows
            extra = {"use_addmm": group["use_addmm"]} if "use_addmm" in group else {}  # newer torch
            ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                                group["eps"], **extra)
            if is_dtensor(p):  # every rank keeps its own rows (no communication)
                ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def describe_optimizer(cfg: Any, model: nn.Module, device_type: str) -> str:
    """The start-up line's optimizer part: which optimizer trains how many parameters (tied weights once)."""
    adamw = f"AdamW ({adamw_implementation(cfg.fused, device_type)})"
    if cfg.name != "muon":
        return adamw
    muon, rest = muon_split(model)
    n = lambda named: sum(p.numel() for _, p in named)  # noqa: E731
    m = cfg.muon
    return (f"Muon (torch.optim.Muon: {n(muon):,} parameters in {len(muon)} block matrices; momentum "
            f"{m.momentum}{' nesterov' if m.nesterov else ''}, {m.ns_steps} Newton-Schulz steps, lr x "
            f"{'0.2·sqrt(max(A, B))' if m.adjust_lr == 'match_rms_adamw' else 'sqrt(max(1, A/B))'}) + "
            f"{adamw} for {n(rest):,} parameters in {len(rest)} tensors (embeddings, head, norms, biases)")


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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any,
                    max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR of optim.schedule (warmup, then cosine / linear / WSD to optim.min_lr)."""
    kw = dict(schedule=cfg.schedule, max_steps=max_steps, warmup_steps=int(cfg.warmup_steps),
              lr=float(cfg.lr), min_lr=min_lr(cfg), decay_fraction=float(cfg.decay_fraction))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kw))
