"""Multi-token prediction (model.mtp): DeepSeek-V3's sequential MTP modules, a part of the GPT that only a
training objective runs (gptkit/training/objectives/mtp.py); sampling, serving and evaluation never do.

    h_0 = final_norm(the main model's last hidden state)        the hidden state the main lm_head reads
    for depth k = 1..D (module k):
        e_k  = Emb(token i + k)                                  the shared embedding, the input ids rolled
        x    = proj([e_norm(e_k); h_norm(h_{k-1})])              [2 d_model -> d_model], no bias
        h_k  = out_norm(block(x))                                a block like the model's last layer
        logits_k = lm_head(h_k)                                  the shared head, predicting token i + k + 1

The order of the concatenation (embedding first), each module's own output norm and h_0 taken after the main
final norm are Megatron-LM's (megatron/core/transformer/multi_token_prediction.py), which DeepSeek-V3's
released weights follow (per MTP layer: enorm, hnorm, eh_proj, its block, shared_head.norm; the head and the
embedding shared). The block attends within the same packed documents and positions as the main model.

Targets of depth k at position i: the main targets rolled k places left (targets[:, i + k]); the last k
positions have none (-100), and with packed documents (doc_ids) a position whose token i + k lies in another
document than token i has none either: its MTP target crosses a document boundary. Each depth's loss is the
fp32 mean over its targets (0 when it has none); an MoE block returns its auxiliary terms like the main
layers do (they join GPTOutput.aux after the main layers').
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model.config import ModelConfig
from gptkit.model.layers import LayerAux, make_norm


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection, a block, the output norm."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        norm = dict(dim=cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, fused="norm" in cfg.kernels)
        self.e_norm = make_norm(cfg.norm, **norm)
        self.h_norm = make_norm(cfg.norm, **norm)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        # a block of the model's kind: its last layer's attention, window and feed-forward
        self.block = make_block(cfg, cfg.n_layers - 1)
        self.out_norm = make_norm(cfg.norm, **norm)


def mtp_targets(targets: torch.Tensor, k: int, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """targets [B, T] (already shifted: targets[:, i] follows token i) -> depth k's [B, T]: targets[:, i + k],
    -100 for the last k positions and where token i + k lies in another document than token i."""
    out = torch.full_like(targets, -100)
    T = targets.shape[1]
    if k >= T:
        return out
    out[:, : T - k] = targets[:, k:]
    if doc_ids is not None:
        crosses = doc_ids[:, k:] != doc_ids[:, : T - k]  # [B, T - k]
        out[:, : T - k] = out[:, : T - k].masked_fill(crosses, -100)
    return out


def shifted_ids(idx: torch.Tensor, k: int) -> torch.Tensor:
    """idx [B, T] rolled k places left: token i + k at position i (the last k positions repeat the last
    token; their targets are -100, and causal attention keeps them from every earlier position)."""
    T = idx.shape[1]
    take = torch.clamp(torch.arange(T, device=idx.device) + k, max=T - 1)  # [T]
    return idx[:, take]


class MultiTokenPrediction(nn.Module):
    """model.mtp.depth MTPModules (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MTPModule(cfg, make_block) for _ in range(cfg.mtp_depth))

    def forward(
        self,
        h: torch.Tensor,  # [B, T, d_model]: the main model's final-normed hidden state
        idx: torch.Tensor,  # [B, T] the input ids
        targets: torch.Tensor,  # [B, T] the main (next-token) targets
        *,
        embed: Callable[[torch.Tensor], torch.Tensor],
        lm_head: nn.Linear,
        rope: Any = None,
        positions: Any = 0,
        docs: Any = None,
        doc_ids: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], list[LayerAux]]:
        """(each depth's fp32 mean cross-entropy, the blocks' LayerAux)."""
        softcap = self.cfg.logit_softcap
        losses, auxes = [], []
        for k, layer in enumerate(self.layers, start=1):
            e = embed(shifted_ids(idx, k))  # [B, T, d_model]
            x = layer.proj(torch.cat([layer.e_norm(e), layer.h_norm(h)], dim=-1))  # [B, T, d_model]
            x, _, aux = layer.block(x, rope=rope, positions=positions, docs=docs)
            if aux is not None:
                auxes.append(aux)
            h = layer.out_norm(x)
            losses.append(_loss(h, lm_head, mtp_targets(targets, k, doc_ids), softcap))
        return tuple(losses), auxes


def _loss(h, lm_head: nn.Linear, targets: torch.Tensor, softcap) -> torch.Tensor:
    """The fp32 mean cross-entropy of lm_head(h) over the targets that are not -100 (0 when none is; no host
    sync). model.kernels=[loss] is the main head's: a depth's logits are made whole."""
    logits = lm_head(h)  # [B, T, vocab_size]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    flat = targets.reshape(-1)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), flat, ignore_index=-100, reduction="sum"
    )
    return total / (flat != -100).sum().clamp(min=1)
