"""The multi-head attention kind (model.attention_kind=mha): GPT-2's and Llama's, with grouped K/V heads.

    x [B, T, d_model] -> qkv_proj -> q [B, n_heads, T, head_dim], k, v [B, n_kv_heads, T, head_dim]
      -> (QK-norm) -> (RoPE at `positions`) -> (the cache: k, v of the earlier positions)
      -> the attention function of model.attention (gptkit/model/attention.py: eager, sdpa, triton), causal,
         within a layer's window (model.layer_types), inside packed documents
      -> [B, T, d_attn] -> o_proj -> [B, T, d_model]

n_kv_heads < n_heads is GQA (1: MQA). The cache keeps K and V of n_kv_heads x head_dim per position (its row
in gptkit/model/attention_kinds.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model.attention import eager_attention, get_attention
from gptkit.model.config import ModelConfig
from gptkit.model.documents import Documents
from gptkit.model.kv_cache import KVCache

# the QK-norms are layers.py norms
from gptkit.model.layers import RotaryEmbedding, make_norm

# a tensor-parallel run's q/k/v projection: three Linear modules under qkv_proj (training/tensor_parallel.py)
QKV_PARTS = ("q", "k", "v")


def fuse_qkv_state(state: dict) -> dict:
    """`state` with a tensor-parallel run's ...qkv_proj.{q,k,v}.weight (and .bias) fused back into the one
    ...qkv_proj.weight (bias) every other reader expects, rows q, k, v; the state itself when it has none."""
    parts = [k for k in state if k.endswith(".qkv_proj.q.weight") or k.endswith(".qkv_proj.q.bias")]
    if not parts:
        return state
    out = dict(state)
    for key in parts:
        head, kind = key.rsplit(".q.", 1)
        out[f"{head}.{kind}"] = torch.cat([out.pop(f"{head}.{p}.{kind}") for p in QKV_PARTS])
    return out


def _qkv_part(name: str) -> tuple[str, str] | None:
    """("...qkv_proj.weight", "q" | "k" | "v") for a tensor-parallel run's part name, else None."""
    head, _, leaf = name.rpartition(".")
    base, _, part = head.rpartition(".")
    if part in QKV_PARTS and base.endswith(".qkv_proj") and leaf in ("weight", "bias"):
        return f"{base}.{leaf}", part
    return None


def is_fused_qkv(name: str) -> bool:
    """Whether `name` is a fused ...attn.qkv_proj.weight (bias): the one a tensor-parallel run splits."""
    head, _, leaf = name.rpartition(".")
    return head.endswith(".qkv_proj") and leaf in ("weight", "bias")


def fuse_qkv_names(names: list[str]) -> list[str]:
    """Parameter names of a tensor-parallel run in the one-process layout: each q part's name becomes its
    fused qkv_proj's (in its place), k and v are dropped."""
    out = []
    for name in names:
        part = _qkv_part(name)
        if part is None or part[1] == "q":
            out.append(name if part is None else part[0])
    return out


def split_qkv_names(names: list[str]) -> list[str]:
    """The inverse of fuse_qkv_names: each fused qkv_proj name becomes its q, k, v parts' (in its place)."""
    out = []
    for name in names:
        if is_fused_qkv(name):
            head, _, leaf = name.rpartition(".")
            out.extend(f"{head}.{p}.{leaf}" for p in QKV_PARTS)
        else:
            out.append(name)
    return out


def fuse_qkv_optim_state(osd: dict) -> dict:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's: {"state": {name: {..}},
    "param_groups": [{"params": [names], ..}]}) of a tensor-parallel run in the one-process layout: the
    per-parameter tensors of q, k, v (AdamW's exp_avg, exp_avg_sq; Muon's momentum_buffer) concatenated by
    rows, as the weights are (fuse_qkv_state); a scalar (AdamW's step) is q's. The state itself when it
    has no part."""
    state = osd.get("state", {})
    if not any(_qkv_part(n) for g in osd["param_groups"] for n in g["params"]):
        return osd
    fused_state = {}
    for name, s in state.items():
        part = _qkv_part(name)
        if part is None:
            fused_state[name] = s
        elif part[1] == "q":
            head, _, leaf = part[0].rpartition(".")
            parts = [state[f"{head}.{p}.{leaf}"] for p in QKV_PARTS]
            fused_state[part[0]] = {
                key: torch.cat([p[key] for p in parts]) if _is_rows(value) else value
                for key, value in s.items()
            }
    groups = [dict(g, params=fuse_qkv_names(list(g["params"]))) for g in osd["param_groups"]]
    return dict(osd, state=fused_state, param_groups=groups)


def split_qkv_optim_state(osd: dict, sizes: list[int]) -> dict:
    """The inverse of fuse_qkv_optim_state, for a tensor-parallel run: each fused qkv_proj's per-parameter
    tensors split into q, k, v by `sizes` (their rows: n_heads x head_dim, n_kv_heads x head_dim twice); a
    scalar is copied to each part."""
    state = {}
    for name, s in osd.get("state", {}).items():
        if not is_fused_qkv(name):
            state[name] = s
            continue
        head, _, leaf = name.rpartition(".")
        for i, p in enumerate(QKV_PARTS):
            state[f"{head}.{p}.{leaf}"] = {
                key: torch.split(value, sizes)[i].clone() if _is_rows(value) else _copy(value)
                for key, value in s.items()
            }
    groups = [dict(g, params=split_qkv_names(list(g["params"]))) for g in osd["param_groups"]]
    return dict(osd, state=state, param_groups=groups)


def _is_rows(value) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 1


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped K/V heads (model.attention_kind=mha): the layout of
    gptkit/model/attention_kinds.py's row, K and V [n_kv_heads, head_dim] per cached position."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # one fused projection for q, k and v: [d_model] -> [d_attn + 2 * d_kv]
        self.qkv_proj = nn.Linear(cfg.d_model, cfg.d_attn + 2 * cfg.d_kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.d_attn, cfg.d_model, bias=cfg.bias)
        # QK-norm (model.qk_norm), before RoPE: "head" normalizes each head over head_dim with one weight
        # shared by the heads (Qwen3); "full" normalizes all query (key) heads together (OLMo-2)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            q_dim, k_dim = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (cfg.d_attn, cfg.d_kv)
            fused_norm = "norm" in cfg.kernels
            self.q_norm = make_norm(cfg.norm, dim=q_dim, eps=cfg.norm_eps, bias=cfg.bias, fused=fused_norm)
            self.k_norm = make_norm(cfg.norm, dim=k_dim, eps=cfg.norm_eps, bias=cfg.bias, fused=fused_norm)
        self.dropout = cfg.dropout
        self.attend = get_attention(cfg.attention)
        # None: every earlier position; W: the last W (a local layer, model.layer_types)
        self.window = cfg.window(layer)
        # None: head_dim^-0.5 (the backends' default)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.attn_scale
        self.softcap = cfg.attn_softcap
        # model.attn_sinks: a logit per head in each softmax's denominator (gpt-oss: transformers'
        # self_attn.sinks); the backends take it as sinks=
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        # model.attn_output_gate: y * sigmoid(x W_g), per query head and feature, before o_proj (Qwen3-Next)
        self.gate_proj = (
            nn.Linear(cfg.d_model, cfg.d_attn, bias=cfg.qkv_bias) if cfg.attn_output_gate else None
        )

    def forward(
        self,
        x,
        *,
        rope: Optional[RotaryEmbedding] = None,
        cache: Optional[KVCache] = None,
        positions: int | torch.Tensor = 0,
        docs: Optional[Documents] = None,
        return_probs: bool = False,
    ):
        """x [B, T, d_model] at `positions` (see GPT.forward) -> ([B, T, d_model], probs or None)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) D]
        if self.qk_norm is None and (rope is None or not rope.fused):
            # q and k side by side as one tensor of H + Hkv heads: one RoPE pass for both (the same numbers as
            # two; a decode step of one token runs ~20 small ops a layer, half of them RoPE's)
            qk, v = qkv.split_with_sizes([(H + Hkv) * D, Hkv * D], dim=-1)
            qk = qk.view(B, T, H + Hkv, D).transpose(1, 2)  # [B, H + Hkv, T, D]
            if rope is not None:
                qk = rope.rotate(qk, positions)
            q, k = qk.split_with_sizes([H, Hkv], dim=1)  # [B, H, T, D], [B, Hkv, T, D]
        else:
            q, k, v = qkv.split_with_sizes([H * D, Hkv * D, Hkv * D], dim=-1)
            if self.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)  # [B, T, d_attn], [B, T, d_kv]
            q = q.view(B, T, H, D)  # [B, T, n_heads, head_dim]
            k = k.view(B, T, Hkv, D)  # [B, T, n_kv_heads, head_dim]
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
            if rope is not None:
                # rotate before caching: the cache holds rotated keys
                q, k = rope(q, k, positions)
        v = v.view(B, T, Hkv, D).transpose(1, 2)  # [B, n_kv_heads, T, head_dim]
        mask = None
        if cache is not None:
            # [B, n_kv_heads, keys, head_dim]: the cached prefix and these T (a local layer's rolling cache:
            # its window's; static: every slot)
            k, v = cache.update(self.layer, k, v)
            # None: causal (and the window) over the prefix; static: [T, slots] from the positions
            mask = cache.mask_for(self.layer)
        attend = eager_attention if return_probs else self.attend
        y, probs = attend(
            q,
            k,
            v,
            causal=True,
            mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            return_probs=return_probs,
            docs=docs,
            window=self.window,
            softcap=self.softcap,
            sinks=self.sinks,
            # y: [B, n_heads, T, head_dim]
        )
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, d_attn]
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))  # [B, T, d_attn]
        y = self.o_proj(y)
        return (F.dropout(y, self.dropout, True) if self.training and self.dropout else y), probs
