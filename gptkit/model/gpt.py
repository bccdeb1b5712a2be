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
from torch.utils.checkpoint import checkpoint

from gptkit.model.attention import eager_attention, get_attention
from gptkit.model.config import ModelConfig
from gptkit.model.kv_cache import KVCache
from gptkit.model.layers import GeluMLP, RotaryEmbedding, SwiGLUMLP, make_norm


class GPTOutput(NamedTuple):
    logits: torch.Tensor  # [B, T_kept, vocab_size]
    loss: Optional[torch.Tensor]  # scalar fp32 mean cross-entropy, when targets are given
    attentions: Optional[list[torch.Tensor]]  # per layer [B, n_heads, T, T], when asked for


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # one fused projection for q, k and v: [d_model] -> [d_attn + 2 * d_kv]
        self.qkv_proj = nn.Linear(cfg.d_model, cfg.d_attn + 2 * cfg.d_kv, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_attn, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attend = get_attention(cfg.attention)

    def forward(self, x, rope: Optional[RotaryEmbedding], cache: Optional[KVCache], return_probs: bool):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim,
                                          self.n_kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, n_heads, T, head_dim]
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv_heads, T, head_dim]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv_heads, T, head_dim]
        start = cache.length if cache is not None else 0
        if rope is not None:
            q, k = rope(q, k, start)  # rotate before caching: the cache holds rotated keys
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # [B, n_kv_heads, start + T, head_dim]
        attend = eager_attention if return_probs else self.attend
        y, probs = attend(q, k, v, causal=True, dropout_p=self.dropout if self.training else 0.0,
                          return_probs=return_probs)  # y: [B, n_heads, T, head_dim]
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, d_attn]
        return F.dropout(self.o_proj(y), self.dropout, self.training), probs


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
        self.activation_checkpointing = False  # recompute each block in backward (set by training)
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
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}"
            )
        x = self.tok_emb(idx)  # [B, T, d_model]
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(start, start + T, device=idx.device))  # [T, d_model] broadcast
        x = self.drop(x)
        attentions = [] if return_attention else None
        for block in self.blocks:
            if self.activation_checkpointing and self.training and cache is None:
                x, probs = checkpoint(block, x, self.rope, None, False, use_reentrant=False)
            else:
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
