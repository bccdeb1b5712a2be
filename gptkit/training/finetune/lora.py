"""finetune=lora (Hu et al., arXiv:2106.09685): low-rank adapters on a frozen model, a training decision
applied from outside the model (like activation checkpointing in training/module.py). LoRA is the row of
the fine-tune table (gptkit/training/finetune/__init__.py); the layers below are also QLoRA's (qlora.py).

    LoRA                         the fine-tune: checks, plan facts, the adapters-only checkpoints
    apply_lora(model, lora)      adapters on the chosen projections, everything else frozen
    adapters_disabled(model)     the base model's exact outputs, without a second copy of the weights
                                 (DPO's reference model)
    merged_state_dict(model)     a plain GPT state dict, adapters folded in: W + (alpha / rank) * B @ A
    is_lora(model)

Each adapted nn.Linear stays where it is, under its own name (its class becomes LoRALinear, a subclass), and
gets its adapter tensors beside its weight: parameter names, FSDP2 units, torch.compile and model.kernels
see the same model plus a few small matrices. The tensor names, shapes and the merge are gptkit.adapters'.
PEFT's LoraLayer was not used: it renames every adapted layer (`<name>.base_layer`), so a LoRA checkpoint
would no longer name the model's weights, and it adapts whole layers, not the q, k and v rows of our fused
qkv_proj; the PEFT export (`gptkit export adapters=true`) writes PEFT's own layout instead.

As PEFT's lora.Linear: A is kaiming-uniform (a=sqrt(5), nn.Linear's init), B zeros (training starts at
the base model), dropout on the input of A, the update scaled by alpha / rank.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from gptkit import adapters
from gptkit.checkpoints import STATE_PREFIX, load_checkpoint, lora_base, read_sharded_checkpoint
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.model.moe import Experts, grouped_linear
from gptkit.training.finetune.base import Finetune, check_needs_weights
from gptkit.training.objectives import FrozenModel


class LoRALinear(nn.Linear):
    """An nn.Linear with low-rank adapters on some of its output rows (parts):

        y = x W^T + b  +  scale * [0 | (dropout(x) A_p^T) B_p^T | 0 ...]   over each part p's rows

    `lora_parts` lists (target, its row segments ((start, end), ...)): B_p's rows go to those segments in
    order (one segment, or a linear-attention layer's per key head: gptkit.adapters.target_shape); the
    adapters are the parameters lora_<target>_A [rank, in_features] and lora_<target>_B [rows, rank].
    `lora_enabled` False: the plain Linear."""

    lora_parts: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool

    def _segments(self) -> list[tuple[str, int, int, int]]:
        """Every part's segments in row order: (target, first row of B, start, end)."""
        out = []
        for target, segments in self.lora_parts:
            row = 0
            for start, end in segments:
                out.append((target, row, start, end))
                row += end - start
        return sorted(out, key=lambda s: s[2])

    def _place(self, updates: dict[str, torch.Tensor], like: torch.Tensor, n: int) -> torch.Tensor:
        """The parts' updates [..., rows of each] laid out over the n output rows (zeros between) [..., n]."""
        pieces, row = [], 0
        for target, first, start, end in self._segments():
            if start > row:
                pieces.append(like.new_zeros(*like.shape[:-1], start - row))
            u = updates[target]
            pieces.append(u if end - start == u.shape[-1] else u[..., first : first + end - start])
            row = end
        if row < n:
            pieces.append(like.new_zeros(*like.shape[:-1], n - row))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], the adapters' update added where enabled."""
        y = F.linear(x, self.weight, self.bias)  # [..., out_features]
        if not self.lora_enabled:
            return y
        h = F.dropout(x, self.lora_dropout, self.training)  # [..., in_features]
        updates = {
            target: F.linear(
                F.linear(h, getattr(self, f"lora_{target}_A")), getattr(self, f"lora_{target}_B")
            )
            for target, _ in self.lora_parts
        }  # [..., rank] -> [..., rows]
        return y + self.lora_scale * self._place(updates, y, y.shape[-1])

    def lora_update(self) -> Optional[torch.Tensor]:
        """The adapters' update of the weight, scale * B @ A on each part's rows (zeros elsewhere) [out, in],
        or None when they are off: what a caller that reads the weight instead of calling the layer adds
        (multi-head latent attention's absorbed decoding, gptkit.model.mla.dense_weight). No dropout."""
        if not self.lora_enabled:
            return None
        updates = {
            target: (getattr(self, f"lora_{target}_B") @ getattr(self, f"lora_{target}_A")).T
            for target, _ in self.lora_parts
        }  # [in_features, rows]
        return self.lora_scale * self._place(updates, updates[self.lora_parts[0][0]], self.out_features).T


class LoRAExperts(Experts):
    """A mixture's experts (gptkit/model/moe.py) with a low-rank adapter on each expert's matrix of some of
    gate_proj, up_proj, down_proj:

        rows of expert e:  x W_e^T  +  scale * (dropout(x) A_e^T) B_e^T

    through the same grouped matmuls as the weights (one per adapter factor). `lora_targets` lists the
    adapted ones (gate, up, down); the adapters are lora_<target>_A [E, rank, in] and lora_<target>_B
    [E, out, rank]. `lora_enabled` False: the plain experts."""

    lora_targets: tuple[str, ...]
    lora_scale: float
    lora_dropout: float
    lora_enabled: bool

    def project(self, x, name, offsets, counts):
        """x [M, in] sorted by expert through each expert's `name` weight and its adapter -> [M, out]."""
        y = super().project(x, name, offsets, counts)  # [M, out]
        target = name.removesuffix("_proj")
        if not self.lora_enabled or target not in self.lora_targets:
            return y
        h = F.dropout(x, self.lora_dropout, self.training)  # [M, in]
        a, b = getattr(self, f"lora_{target}_A"), getattr(self, f"lora_{target}_B")
        low = grouped_linear(h, a, offsets, counts, self.impl)  # [M, rank]
        return y + self.lora_scale * grouped_linear(low, b, offsets, counts, self.impl)


def _adapt_experts(experts: Experts, targets: list[str], rank: int, scale: float, dropout: float) -> None:
    """Turn an MoE layer's Experts into LoRAExperts with adapters of `targets` (A kaiming-uniform per expert,
    as an nn.Linear of that expert's shape; B zeros)."""
    experts.__class__ = LoRAExperts
    experts.lora_targets = tuple(targets)
    experts.lora_scale, experts.lora_enabled, experts.lora_dropout = scale, True, dropout
    for t in targets:
        weight = getattr(experts, f"{t}_proj")  # [E, out, in]
        n_experts, out, n_in = weight.shape
        like = dict(device=weight.device, dtype=weight.dtype)
        a = nn.Parameter(torch.empty(n_experts, rank, n_in, **like))  # [E, rank, in]
        for e in range(n_experts):
            nn.init.kaiming_uniform_(a.data[e], a=math.sqrt(5))
        b = nn.Parameter(torch.zeros(n_experts, out, rank, **like))  # [E, out, rank]
        experts.register_parameter(f"lora_{t}_A", a)
        experts.register_parameter(f"lora_{t}_B", b)


def apply_lora(model: GPT, lora: Any) -> int:
    """Add adapters (the `lora` settings: rank, alpha, dropout, targets) to `model`, in place, and freeze
    every other parameter but a reward model's score head (adapters.whole_keys: it is new, so it trains in
    full, as PEFT's modules_to_save); returns the number of trainable parameters. The settings are checked
    first (gptkit.adapters.check_lora: one-line ConfigErrors). Works on a model on the meta device too (FSDP's
    ranks other than 0): its adapters are allocated and receive rank 0's values with the other weights."""
    settings = adapters.settings(lora)
    targets = adapters.check_lora(settings, model.cfg)
    rank, scale = int(settings["rank"]), float(settings["alpha"]) / int(settings["rank"])
    for p in model.parameters():
        p.requires_grad_(False)
    for name in adapters.whole_keys(model.cfg):
        model.get_parameter(name).requires_grad_(True)
    for i, block in enumerate(model.blocks):
        by_module: dict[str, list[tuple[str, tuple[tuple[int, int], ...]]]] = {}
        here = adapters.layer_targets(model.cfg, i)
        for t in targets:
            if t in here:
                segments, _ = adapters.target_shape(model.cfg, t, i)
                by_module.setdefault(adapters.module_of(model.cfg, i, t), []).append((t, segments))
        experts = by_module.pop(adapters.EXPERTS, None)
        if experts is not None:
            targets_here = [t for t, _ in experts]
            _adapt_experts(block.mlp.experts, targets_here, rank, scale, float(settings["dropout"]))
        for path, parts in by_module.items():
            linear = block.get_submodule(path)
            linear.__class__ = LoRALinear
            linear.lora_parts = tuple(parts)
            linear.lora_scale, linear.lora_enabled = scale, True
            linear.lora_dropout = float(settings["dropout"])
            like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
            for t, segments in parts:
                a = nn.Parameter(torch.empty(rank, linear.in_features, **like))  # [rank, in_features]
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                b = nn.Parameter(torch.zeros(adapters.rows_of(segments), rank, **like))  # [rows, rank]
                linear.register_parameter(f"lora_{t}_A", a)
                linear.register_parameter(f"lora_{t}_B", b)
    model._gptkit_lora = dict(settings, targets=list(targets))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_lora(model: nn.Module) -> bool:
    """Whether apply_lora added adapters to `model`."""
    return getattr(model, "_gptkit_lora", None) is not None


def lora_config(model: nn.Module) -> dict[str, Any]:
    """The settings apply_lora used (rank, alpha, dropout, targets)."""
    return dict(model._gptkit_lora)


def _lora_linears(model: nn.Module) -> Iterator[LoRALinear | LoRAExperts]:
    return (m for m in model.modules() if isinstance(m, (LoRALinear, LoRAExperts)))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within this block the model computes exactly the base model's outputs (the adapters are skipped, not
    zeroed: the very same operations as the model without them). The adapters come back on exit."""
    linears = list(_lora_linears(model))
    before = [m.lora_enabled for m in linears]
    for m in linears:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, on in zip(linears, before):
            m.lora_enabled = on


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a plain GPT (the same names and shapes as the model without adapters) with the
    adapters merged: W + (alpha / rank) * B @ A, computed in fp32, stored in W's dtype."""
    state = model.state_dict()
    if not is_lora(model):
        return state
    cfg = lora_config(model)
    return adapters.merge(state, model.cfg, float(cfg["alpha"]) / int(cfg["rank"]))


def adapter_state_dict(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Only the adapter tensors (and the weights that train in full beside them, adapters.WHOLE: a reward
    model's score head) of a state dict whose names carry `prefix` (e.g. "model.")."""
    n = len(prefix)
    return {k: v for k, v in state.items() if k.startswith(prefix) and adapters.is_saved_key(k[n:])}


class LoRA(Finetune):
    """finetune=lora: the adapters of the `lora` group train on frozen weights (init_from=, or the base the
    resumed run's checkpoint records); a checkpoint holds the adapters, their optimizer state and the base's
    path and fingerprint (adapters.CHECKPOINT_KEY)."""

    name = "lora"
    holds = "the adapters only"
    saves_every_weight = False
    trains_base = False
    own_reference = True
    flops_convention = "4N + 6·adapters + 12·L·T·d_attn: no weight gradient for the frozen weights"
    # its words in the start-up line
    title = "LoRA"

    @classmethod
    def check_config(cls, cfg: Any, has_weights: bool) -> None:
        check_needs_weights(cls.name, has_weights)

    @classmethod
    def check_model(cls, cfg: Any, model_cfg: Any) -> None:
        adapters.check_lora(adapters.settings(cfg.lora), model_cfg)

    @classmethod
    def adapters(cls, cfg: Any) -> Optional[dict]:
        return adapters.settings(cfg.lora)

    @classmethod
    def base_checkpoint(
        cls, cfg: Any, model_cfg: Any, init_ckpt: Optional[Path], resume_ckpt: Optional[Path]
    ) -> Optional[Path]:
        """init_from='s checkpoint, or the one the resumed run's checkpoint records (checked unchanged), after
        the settings are checked against the model."""
        cls.check_model(cfg, model_cfg)
        if resume_ckpt is None:
            return init_ckpt
        state = (
            read_sharded_checkpoint(resume_ckpt, weights=False)
            if resume_ckpt.is_dir()
            else load_checkpoint(resume_ckpt)
        )
        return lora_base(state, resume_ckpt)

    # the settings the adapters' tensors (and their scale) depend on: fixed by the run's checkpoint
    FIXED = (("lora", ("rank", "alpha", "targets")),)

    @classmethod
    def check_resume(cls, resume: Any, saved: Any, now: Any) -> None:
        """The adapters' rank, alpha and targets stay the run's (lora.dropout may change)."""
        for group, keys in cls.FIXED:
            for key in keys:
                was, asked = ((c.get(group) or {}).get(key) for c in (saved, now))
                was, asked = (
                    f"[{', '.join(map(str, v))}]" if OmegaConf.is_list(v) or isinstance(v, list) else v
                    for v in (was, asked)
                )
                if was != asked:
                    raise GptkitError(
                        f"resume={resume} continues adapters with {group}.{key}={was}; "
                        f"{group}.{key}={asked} would not fit them (start a new run for other adapters)"
                    )

    @classmethod
    def flops(cls, model_cfg, lora, counts, dense, causal):
        """Frozen weights get no weight gradient (-2N); the adapters train (6 per parameter a token meets)."""
        change = -2.0 * counts.n_matmul + 6.0 * adapters.adapter_params(
            model_cfg, lora["targets"], lora["rank"], active=True
        )
        return dense + change, causal + change

    @classmethod
    def memory(cls, plan: Any, mem: dict[str, float]) -> dict[str, float]:
        """The gradients and optimizer state of the adapters only (all Muon's under optim=muon: one momentum
        buffer each); their weights added to the model's (gptkit.accounting.training_memory's lora=)."""
        from gptkit import accounting as acc

        adapted = acc.training_memory(
            plan.model,
            plan.precision,
            plan.shards,
            expert_shards=getattr(plan, "expert_shards", None),
            optimizer=str(getattr(getattr(plan, "optim", None), "name", "adamw")),
            lora=plan.lora,
        )
        for part in ("weights", "gradients", "optimizer"):
            mem[part] = adapted[part]
        return mem

    @classmethod
    def describe(cls, plan: Any, trainable: int, n: int) -> Optional[str]:
        lora = plan.lora
        return (
            f"{cls.title}: rank {lora['rank']}, alpha {lora['alpha']}, dropout {lora['dropout']} on "
            f"{', '.join(lora['targets'])}: {trainable:,} trainable parameters ({trainable / n:.2%}), the "
            f"rest frozen from {plan.lora_base}{cls.base_words(plan)}; checkpoints hold the adapters only"
        )

    @classmethod
    def base_words(cls, plan: Any) -> str:
        """What the start-up line says of the frozen base after its path."""
        return ""

    @classmethod
    def checkpoint_bytes(cls, plan: Any, trainable: Optional[int]) -> Optional[int]:
        """The adapters and their AdamW moments, in fp32."""
        return 12 * int(trainable or 0)

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        if plan.lora_base is None:
            raise GptkitError(
                f"finetune={self.name}: the plan names no base checkpoint (plan.lora_base); make "
                "the plan with gptkit.plan(cfg): it resolves init_from= (or the resumed run's base)"
            )
        # saved with each checkpoint: the adapters' settings and their base
        self.record = dict(
            plan.lora,
            base=str(Path(plan.lora_base).resolve()),
            base_fingerprint=adapters.fingerprint(plan.lora_base),
        )

    def apply(self, model: GPT) -> int:
        return apply_lora(model, self.plan.lora)

    def reference(self) -> FrozenModel:
        """The policy itself with its adapters off: the frozen base, no second copy."""
        return FrozenModel(None, adapters_disabled)

    def checkpoint_state(self, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        return adapter_state_dict(state, prefix)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The adapters (their optimizer state is all there is) and the record of the base."""
        checkpoint["state_dict"] = adapter_state_dict(checkpoint["state_dict"], STATE_PREFIX)
        checkpoint[adapters.CHECKPOINT_KEY] = dict(self.record)

    def on_load_checkpoint(self, checkpoint: dict[str, Any], model_cfg: Any) -> None:
        """The checkpoint holds exactly the adapters of this run's settings (a sharded one is checked on
        load)."""
        if "state_dict" in checkpoint:
            state = {k[len(STATE_PREFIX) :]: v for k, v in checkpoint["state_dict"].items()}
            adapters.check_adapters(state, model_cfg, self.record, "the checkpoint")
