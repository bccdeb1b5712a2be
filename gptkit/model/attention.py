"""Causal self-attention: the module, and the attention functions behind one dispatch seam.

Every backend has the same signature:

    fn(q, k, v, *, causal, mask, dropout_p, scale, return_probs, docs) -> (out, probs or None)

    q:    [B, n_heads,    T_q, head_dim]
    k, v: [B, n_kv_heads, T_k, head_dim]   (n_kv_heads divides n_heads: GQA/MQA)
    mask: None, or a bool tensor broadcastable to [B, n_heads, T_q, T_k] (True = may attend);
          when given it replaces `causal`
    docs: None, or the packed documents of the batch (gptkit.model.documents.Documents): causal
          attention inside each document only
    out:  [B, n_heads, T_q, head_dim]

`eager` is the readable reference (explicit fp32 softmax; can return the probabilities),
`sdpa` is torch's fused kernel (packed documents: torch's variable-length FlashAttention on CUDA in
fp16/bf16, else a dense mask), `triton` is our own FlashAttention kernel in kernels/.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model.config import ATTENTIONS, ModelConfig
from gptkit.model.documents import Documents
from gptkit.model.fused import triton_available, warn_once
from gptkit.model.kv_cache import KVCache

# the QK-norms are layers.py norms
from gptkit.model.layers import RotaryEmbedding, make_norm

# gptkit_kernels is imported on use: it needs triton (optional); the model runs without it.

# recent torch: FlashAttention over variable-length sequences (CUDA), for packed documents
try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: packed documents take a dense mask
    varlen_attn = None

AttentionFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def eager_attention(
    q, k, v, *, causal=True, mask=None, dropout_p=0.0, scale=None, return_probs=False, docs=None
):
    """The readable reference: q @ k^T, the mask, an fp32 softmax, @ v; can return the probabilities."""
    B, H, Tq, D = q.shape
    if docs is not None:
        mask = docs.mask()  # [B, 1, T, T]: causal, inside each document
    Hkv, Tk = k.shape[1], k.shape[2]
    # GQA: each group of H // Hkv query heads reads the same K/V head
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, Tk, D]
        v = v.repeat_interleave(H // Hkv, dim=1)
    scale = D**-0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, Tq, Tk]
    if mask is None and causal:
        # query i sits at absolute position (Tk - Tq + i): bottom-right aligned, so it also
        # holds when a KV cache makes Tk > Tq.
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    if mask is not None:
        # a bool mask has no dtype to get wrong
        scores = scores.masked_fill(~mask, float("-inf"))
    # fp32 softmax
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        probs_d = F.dropout(probs, p=dropout_p)
    else:
        probs_d = probs
    out = probs_d @ v  # [B, H, Tq, D]
    return out, (probs if return_probs else None)


def sdpa_attention(
    q, k, v, *, causal=True, mask=None, dropout_p=0.0, scale=None, return_probs=False, docs=None
):
    """torch's scaled_dot_product_attention (GQA without K/V copies). Packed documents: on CUDA in fp16/bf16
    torch's variable-length FlashAttention (no mask, no work across documents); elsewhere a dense mask."""
    if return_probs:
        raise ValueError("the sdpa backend cannot return attention probabilities; use attention=eager")
    Tq, Tk = q.shape[2], k.shape[2]
    if docs is not None:
        if mask is None and dropout_p == 0.0 and Tq == Tk and varlen_usable(q):
            return varlen_documents(q, k, v, docs, scale), None
        if q.is_cuda:
            warn_once(
                "sdpa-docs",
                f"model.attention=sdpa with packed documents in {q.dtype} on CUDA takes a "
                "dense [B, 1, T, T] mask and computes every tile across documents (torch's "
                "variable-length FlashAttention needs fp16/bf16, no dropout, an sm80+ GPU); "
                "precision bf16-mixed or model.attention=triton skips them",
            )
        # On the CPU the dense mask is the right form: SDPA's CPU FlashAttention kernel takes it (measured
        # as fast as the plain causal kernel at T=128, docs/chat.md); built once per forward, additive in
        # the dtype of q, and shared by every layer
        mask = docs.mask(q.dtype)  # [B, 1, T, T]
    if mask is None and causal and Tq != Tk:
        # one new token attends to the whole cache
        if Tq == 1:
            causal = False
        # SDPA's is_causal is top-left aligned; a cached prefix needs bottom-right
        else:
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=scale,
        # no K/V copy per query head where torch allows
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out, None


def varlen_usable(q: torch.Tensor) -> bool:
    """Whether torch's variable-length FlashAttention (torch.nn.attention.varlen) runs q: fp16/bf16 on a CUDA
    GPU of compute capability >= 8.0 (FlashAttention 2's), head_dim a multiple of 8 up to 256."""
    if varlen_attn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    D = q.shape[-1]
    return D % 8 == 0 and D <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)


def varlen_documents(q, k, v, docs: Documents, scale=None) -> torch.Tensor:
    """Causal attention inside each packed document with torch's varlen_attn: the B rows of T tokens are one
    sequence of B*T tokens cut at docs.cu_seqlens(); q [B, n_heads, T, D], k, v [B, n_kv_heads, T, D] ->
    [B, n_heads, T, D]. No mask is built and no tile across two documents is computed."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    cu = docs.cu_seqlens()  # [n_docs + 1] int32
    q_flat = q.transpose(1, 2).reshape(B * T, H, D)  # [B*T, n_heads, D]
    k_flat = k.transpose(1, 2).reshape(B * T, Hkv, D)  # [B*T, n_kv_heads, D]
    v_flat = v.transpose(1, 2).reshape(B * T, Hkv, D)
    # T bounds every document's length (no host sync for the longest); window (-1, 0) is causal
    out = varlen_attn(
        q_flat, k_flat, v_flat, cu, cu, T, T, scale=scale, window_size=(-1, 0), enable_gqa=Hkv != H
    )  # [B*T, n_heads, D]
    return out.view(B, T, H, D).transpose(1, 2)  # [B, n_heads, T, D]


def triton_attention(
    q, k, v, *, causal=True, mask=None, dropout_p=0.0, scale=None, return_probs=False, docs=None
):
    """Our FlashAttention kernels (documents included); cases they do not cover go to sdpa.

    Falls back to sdpa (with one warning per process) when triton is missing or no CUDA device is
    present and TRITON_INTERPRET=1 is not set, and per call for masks, dropout, or a KV cache (T_q != T_k).
    """
    if not triton_available(q.device):
        warn_once(
            "triton",
            "model.attention=triton needs triton and CUDA tensors (or TRITON_INTERPRET=1); "
            "falling back to sdpa",
        )
        return sdpa_attention(
            q,
            k,
            v,
            causal=causal,
            mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            return_probs=return_probs,
            docs=docs,
        )
    if mask is not None or dropout_p > 0.0 or return_probs or q.shape[2] != k.shape[2]:
        return sdpa_attention(
            q,
            k,
            v,
            causal=causal,
            mask=mask,
            dropout_p=dropout_p,
            scale=scale,
            return_probs=return_probs,
            docs=docs,
        )
    from gptkit_kernels import flash_attention

    bounds = None if docs is None else (docs.start, docs.end)
    return flash_attention(q, k, v, causal=causal, scale=scale, doc_bounds=bounds), None


# model.attention=<name> runs <name>_attention: the names are model/config.py's ATTENTIONS (one list)
ATTENTION_BACKENDS: dict[str, AttentionFn] = {name: globals()[f"{name}_attention"] for name in ATTENTIONS}


def get_attention(name: str) -> AttentionFn:
    """The attention function of model.attention=<name>."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(ATTENTION_BACKENDS)
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None


class CausalSelfAttention(nn.Module):
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
        q, k, v = self.qkv_proj(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            dim=-1,
        )
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # [B, T, d_attn], [B, T, d_kv]
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, n_heads, head_dim]
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # [B, T, n_kv_heads, head_dim]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, n_heads, T, head_dim], [B, n_kv_heads, T, head_dim]
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, n_kv_heads, T, head_dim]
        if rope is not None:
            # rotate before caching: the cache holds rotated keys
            q, k = rope(q, k, positions)
        mask = None
        if cache is not None:
            # [B, n_kv_heads, cached + T (static: max_len), head_dim]
            k, v = cache.update(self.layer, k, v)
            # None: causal over the prefix; static: [T, max_len] from the positions
            mask = cache.mask
        attend = eager_attention if return_probs else self.attend
        y, probs = attend(
            q,
            k,
            v,
            causal=True,
            mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            return_probs=return_probs,
            docs=docs,
            # y: [B, n_heads, T, head_dim]
        )
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, d_attn]
        return F.dropout(self.o_proj(y), self.dropout, self.training), probs
