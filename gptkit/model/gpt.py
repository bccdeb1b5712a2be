"""The pre-norm decoder-only transformer (GPT-2 and Llama style), as one torch.nn.Module.

    idx [B, T] -> tok_emb (+ pos_emb) -> n_layers x Block -> final_norm -> lm_head -> logits [B, T, V]
    Block: x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))

Labels are NOT shifted inside: pass `targets` already aligned with the logits
(targets[:, t] is the token that follows idx[:, t]).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model.attention import CausalSelfAttention
from gptkit.model.config import ModelConfig
from gptkit.model.kv_cache import KVCache
from gptkit.model.layers import GeluMLP, RotaryEmbedding, SwiGLUMLP, make_norm


class GPTOutput(NamedTuple):
    logits: torch.Tensor  # [B, T_kept, vocab_size]
    loss: Optional[torch.Tensor]  # scalar fp32 mean cross-entropy, when targets are given
    attentions: Optional[list[torch.Tensor]]  # per layer [B, n_heads, T, T], when asked for


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer)
        self.mlp_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)  # the MLP's pre-norm
        mlp_cls = GeluMLP if cfg.mlp == "gelu" else SwiGLUMLP
        self.mlp = mlp_cls(cfg.d_model, cfg.d_ff, cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x, rope=None, cache=None, return_probs=False):
        a, probs = self.attn(self.attn_norm(x), rope, cache, return_probs)
        x = x + a
        x = x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)
        return x, probs


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta) if cfg.position == "rope" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.final_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std) for weights, zero biases, residual projections scaled
        by 1/sqrt(2 * n_layers) (two residual adds per block)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def forward(
        self,
        idx: torch.Tensor,  # [B, T] token ids
        targets: Optional[torch.Tensor] = None,  # [B, T], already shifted; -100 = ignore
        *,
        cache: Optional[KVCache] = None,
        logits_to_keep: int = 0,  # 0: every position; k: only the last k (decoding needs 1)
        return_attention: bool = False,
    ) -> GPTOutput:
        B, T = idx.shape
        start = cache.position if cache is not None else 0  # an int, or [T] positions (a StaticKVCache)
        if isinstance(start, int) and start + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.tok_emb(idx)  # [B, T, d_model]
        if self.pos_emb is not None:
            pos = torch.arange(start, start + T, device=idx.device) if isinstance(start, int) else start  # [T]
            x = x + self.pos_emb(pos)  # [T, d_model] broadcast
        x = self.drop(x)
        attentions = [] if return_attention else None
        for block in self.blocks:
            x, probs = block(x, self.rope, cache, return_attention)
            if attentions is not None:
                attentions.append(probs)
        if cache is not None:
            cache.advance(T)
        x = self.final_norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # [B, k, d_model]: project only what is needed
        logits = self.lm_head(x)  # [B, T_kept, vocab_size]
        loss = None
        if targets is not None:
            if logits_to_keep:
                targets = targets[:, -logits_to_keep:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-100)  # loss in fp32
        return GPTOutput(logits, loss, attentions)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n
