"""Multi-head latent attention (model.attention_kind=mla): DeepSeek-V2/V3's, Kimi K2's, Moonlight's.

    x [B, T, d_model]
      -> q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (model.mla.q_lora_rank)
         -> q [B, n_heads, T, nope + rope]: each head's nope features (no position) and rope features
      -> kv_a_proj_with_mqa -> [B, T, kv_lora_rank + rope]: the latent c (-> kv_a_layernorm) and one rotated
         key k_pe shared by the heads
      -> RoPE on q's rope part and on k_pe (model.mla.rope_interleave: the pairs read as two halves first)
    training, no cache (the uncompressed path):
      -> kv_b_proj(c) -> per head k_nope [nope] and v [v_head_dim]; k = [k_nope, k_pe]
      -> the attention function of model.attention (eager, sdpa, triton): q, k [nope + rope], v [v_head_dim]
    decoding, model.mla.absorb true (the weight-absorbed path): the cache keeps [c, k_pe] per position, one
    "head" of kv_lora_rank + rope (its row in gptkit/model/attention_kinds.py), and nothing as the value:
      -> q_nope absorbed through kv_b_proj's key rows: q_c = q_nope W_uk [kv_lora_rank] per head
      -> attention of [q_c, q_pe] over the cached [c, k_pe] (one key head: MQA), values = the cached c
      -> the per-head result [kv_lora_rank] through kv_b_proj's value rows W_uv -> [v_head_dim]
    decoding, model.mla.absorb=false (the uncompressed path with a cache): training's path, its expanded
    per-head keys [nope + rope] and values [v_head_dim] cached (transformers' DeepseekV3 layout)
    -> [B, T, n_heads * v_head_dim] (model.attn_output_gate: times sigmoid(gate_proj(x))) -> o_proj

The two paths are the same sums in another order: q_nope . (W_uk c) = (q_nope W_uk) . c and
sum_j p_j (W_uv c_j) = W_uv sum_j p_j c_j. Scores are scaled by (nope + rope)^-0.5, times YaRN's
mscale(factor, mscale_all_dim)^2 when model.rope_scaling is yarn with mscale_all_dim (DeepSeek's; RoPE's own
attention factor rides on cos and sin as for every kind). Biases as DeepSeek's: model.qkv_bias on q_a_proj
and kv_a_proj_with_mqa, model.bias on o_proj, none on q_proj, q_b_proj, kv_b_proj. docs/mla.md.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model.attention import eager_attention, get_attention, sdpa_attention
from gptkit.model.config import ModelConfig
from gptkit.model.documents import Documents
from gptkit.model.kv_cache import KVCache
from gptkit.model.layers import RotaryEmbedding, make_norm


def mla_scale(cfg: ModelConfig) -> float:
    """The factor of the scores: (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale^2 with
    mscale = 0.1 * mscale_all_dim * ln(factor) + 1 under a yarn model.rope_scaling with mscale_all_dim and
    factor > 1 (transformers' yarn_apply_mscale, DeepSeek's reference)."""
    scale = cfg.mla.qk_head_dim**-0.5
    s = cfg.rope_scaling
    if s is not None and s.get("mscale_all_dim") and s["factor"] > 1:
        mscale = 0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def _halves(x: torch.Tensor) -> torch.Tensor:
    """[..., r] with rotated pairs side by side (x0, x1), (x2, x3), ... -> the two halves RoPE turns,
    [x0, x2, ..., x1, x3, ...] (transformers' apply_rotary_pos_emb_interleave)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentUpProjection(nn.Linear):
    """kv_b_proj: the latent to each head's nope key and value. A Linear of its own type: the decoding path
    reads its weight as W_uk and W_uv, so the CPU decoding layout (gptkit/inference/decoding_layout.py, which
    swaps plain Linear layers for copies laid out for decoding) leaves it in place."""


def dense_weight(linear: nn.Linear) -> torch.Tensor:
    """The [out, in] matrix `linear` applies, for a caller that reads it instead of calling the layer (the
    absorbed path): its weight, dequantized when it is a quantized tensor (torchao's NF4 or int8 weight,
    gptkit/quant.py), plus a LoRA adapter's update when the layer has one (lora_update():
    gptkit/training/finetune/lora.py's LoRALinear)."""
    w = linear.weight
    if type(w) not in (torch.Tensor, nn.Parameter):
        # a tensor subclass: NF4Tensor (get_original_weight) or torchao's affine-quantized int8 (dequantize)
        original = getattr(w, "get_original_weight", None)
        w = original() if original is not None else w.dequantize()
    update = linear.lora_update() if hasattr(linear, "lora_update") else None
    return w if update is None else w + update.to(w.dtype)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (model.attention_kind=mla, model.mla): the layout of
    gptkit/model/attention_kinds.py's row, [kv_lora_rank + qk_rope_head_dim] per cached position."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.mla
        self.layer, self.n_heads = layer, cfg.n_heads
        self.nope, self.rope_dim, self.v_dim, self.rank = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        self.qk_dim = m.qk_head_dim
        self.rope_interleave = m.rope_interleave
        # decoding through the latent cache (absorbed) or through each head's expanded key and value
        self.absorb = m.absorb
        d, H = cfg.d_model, cfg.n_heads
        fused_norm = "norm" in cfg.kernels

        # the latent norms' eps: model.mla.latent_norm_eps (transformers' DeepseekV3: 1e-6), else norm_eps
        eps = cfg.norm_eps if m.latent_norm_eps is None else m.latent_norm_eps

        def norm(dim: int) -> nn.Module:
            return make_norm(cfg.norm, dim=dim, eps=eps, bias=cfg.bias, fused=fused_norm)

        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = norm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = norm(self.rank)
        # rows per head: its nope key rows (W_uk), then its value rows (W_uv)
        self.kv_b_proj = LatentUpProjection(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.attend = get_attention(cfg.attention)
        # decoding attends over one key head [kv_lora_rank + rope] (576 wide at DeepSeek-V3's shape): torch's
        # kernels (the Triton kernel is for training's heads)
        self.attend_cached = sdpa_attention if cfg.attention == "triton" else self.attend
        self.window = cfg.window(layer)
        self.scale = mla_scale(cfg)
        self.softcap = cfg.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attn_sinks else None
        self.gate_proj = nn.Linear(d, H * self.v_dim, bias=cfg.qkv_bias) if cfg.attn_output_gate else None

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
        H = self.n_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # [B, T, H * qk]
        q = q.view(B, T, H, self.qk_dim).transpose(1, 2)  # [B, H, T, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.rank, self.rope_dim], dim=-1
        )  # [B, T, rank], [B, T, r]
        c = self.kv_a_layernorm(c)  # [B, T, rank]
        k_pe = k_pe.unsqueeze(1)  # [B, 1, T, rope]
        if self.rope_interleave:
            q_pe, k_pe = _halves(q_pe), _halves(k_pe)
        if rope is not None:
            # rotated before caching: the cache holds the rotated key
            q_pe, k_pe = rope(q_pe.contiguous(), k_pe.contiguous(), positions)
        args = dict(
            causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            return_probs=return_probs,
            docs=docs,
            window=self.window,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        if cache is None:
            y, probs = self._uncompressed(q_nope, q_pe, c, k_pe, args)
        elif self.absorb:
            y, probs = self._absorbed(q_nope, q_pe, c, k_pe, cache, args)
        else:
            y, probs = self._uncompressed(q_nope, q_pe, c, k_pe, args, cache)
        y = y.transpose(1, 2).reshape(B, T, H * self.v_dim)  # [B, T, H * v_head_dim]
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return F.dropout(self.o_proj(y), self.dropout, self.training), probs

    def _uncompressed(self, q_nope, q_pe, c, k_pe, args, cache: Optional[KVCache] = None):
        """Training's path: each head's key and value expanded from the latent -> y [B, H, T, v_head_dim].
        With a cache (model.mla.absorb=false: decoding without absorption) the expanded keys and values are
        what it keeps."""
        B, H, T, _ = q_nope.shape
        kv = self.kv_b_proj(c).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)  # [B, H, T, nope + v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(B, H, T, self.rope_dim)), dim=-1)  # [B, H, T, nope + rope]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, H, T, nope + rope]
        if cache is None:
            attend = eager_attention if args["return_probs"] else self.attend
            return attend(q, k, v, mask=None, **args)
        k, v = cache.update(self.layer, k.to(c.dtype), v)  # [B, H, keys, nope + rope], [B, H, keys, v]
        attend = eager_attention if args["return_probs"] else self.attend_cached
        return attend(q.to(k.dtype), k, v, mask=cache.mask_for(self.layer), **args)

    def _absorbed(self, q_nope, q_pe, c, k_pe, cache, args):
        """Decoding's path: attention over the cached latents, kv_b_proj folded into the query and the
        output. -> y [B, H, T, v_head_dim]."""
        latent = torch.cat((c.unsqueeze(1), k_pe.to(c.dtype)), dim=-1)  # [B, 1, T, rank + rope]
        # the layout caches no value (width 0): the values are the latents themselves
        keys, _ = cache.update(self.layer, latent, latent[..., :0])  # [B, 1, keys, rank + rope]
        # kv_b_proj's matrix as the uncompressed path applies it (LoRA's update in, quantized dequantized)
        w = dense_weight(self.kv_b_proj).view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, nope, rank], [H, v, rank]
        q_c = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # [B, H, T, rank]
        q = torch.cat((q_c, q_pe.to(q_c.dtype)), dim=-1)  # [B, H, T, rank + rope]
        mask = cache.mask_for(self.layer)
        values = keys[..., : self.rank]  # [B, 1, keys, rank]
        plain = self.window is None and self.sinks is None and self.softcap is None
        if q.shape[2] == 1 and mask is None and plain and not args["return_probs"]:
            # one new token attending to every cached position through one key head: the heads are the rows
            # of one query (the same sums; torch's CPU kernel for GQA would repeat the cache per head)
            y_c, probs = self.attend_cached(
                q.transpose(1, 2), keys, values, mask=None, **{**args, "causal": False}
            )
            y_c = y_c.transpose(1, 2)  # [B, H, 1, rank]
        else:
            attend = eager_attention if args["return_probs"] else self.attend_cached
            y_c, probs = attend(q, keys, values, mask=mask, **args)  # [B, H, T, rank]
        return torch.einsum("bhtr,hvr->bhtv", y_c, w_uv), probs  # [B, H, T, v_head_dim]
