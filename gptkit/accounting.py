"""Analytic accounting: parameter counts, FLOPs per token, MFU, memory and cost estimates.

Nothing here allocates weights: a 175B config answers as fast as a tiny one.

FLOPs convention (one multiply-add = 2 FLOPs; matmuls only, as in Kaplan et al. and PaLM):

    N_matmul   = parameters that take part in a matmul per token: the q/k/v/o and MLP weight
                 matrices of every layer plus the LM head (even when it is tied to the token
                 embedding, the output projection is still a d_model x vocab matmul). Token and
                 position embeddings are lookups (no FLOPs); norms and biases are elementwise.
    forward    = 2 * N_matmul + attention,  attention = 4 * n_layers * T * d_attn   (dense)
    training   = 3 * forward = 6 * N_matmul + 12 * n_layers * T * d_attn          (dense)
    causal     = the attention term halved (each query sees on average ~T/2 keys)
    local      = a layer with a sliding window of W keys (model.layer_types) counts w = min(W, T) keys for T:
                 4 * w * d_attn dense, 4 * (w - w^2 / 2T) * d_attn causal (the mean keys a query sees; T/2
                 when w = T), so a 5:1 local:global model at T = 8W counts ~1/4 of the attention FLOPs

MFU follows the published convention: `perf/mfu`, the logged FLOP/s and `count-params`' GPU-hours use
the dense training count (6N + 12·L·T·d_attn per token, N with the LM head), as the PaLM paper
(appendix B), nanoGPT's `estimate_mfu` and torchtitan's `get_num_flop_per_token` do: causal masking is
not discounted, so a figure here compares with theirs. Their N also holds the norms and biases (a
few elementwise FLOPs each, not 6): 0.085% more FLOPs for GPT-2 124M, 0.003% for Llama-2-7B
(tests/model/test_accounting.py pins both). `perf/mfu_causal` uses the causal count: the work a
kernel that skips the masked half does, lower than `perf/mfu` by 12·L·T·d_attn / 2 per token.

The literature's headline figure C = 6 * N * D (N = all parameters) is reported beside it.

A mixture of experts (model.moe) has two counts: `total`, every parameter (what the weights, gradients,
optimizer state and checkpoints hold), and `active`, the parameters one token goes through (its top_k of the
routed experts, the shared experts, the router and everything outside the feed-forwards). FLOPs, MFU and
6N count the active matmul weights: an MoE layer's are its router (d_model x n_experts), top_k routed and
n_shared shared SwiGLU experts, 3 x d_model x d_expert each. Mixtral-8x7B: 46,702,792,704 total,
12,879,925,248 active (tests/model/test_moe.py checks both against transformers' own model).

Multi-token prediction (model.mtp) has a row of its own, `mtp`: each depth's three norms, its projection
(2 d_model x d_model) and its block (the last layer's shape). It counts in `total` (trained, checkpointed)
but not in `active`, the parameters one token goes through at inference, where the modules never run
(DeepSeek-V3 reports 671B main + 14B MTP the same way). The training FLOPs (train_dense, train_causal) count
their forward and backward (projection, block, the shared lm_head again); the forward figures do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from gptkit import quant
from gptkit.adapters import adapter_params
from gptkit.errors import ConfigError
from gptkit.model.attention_kinds import cache_layouts
from gptkit.model.config import ModelConfig
from gptkit.precision import DTYPE_BYTES, Precision, precision

# Dense peak TFLOP/s by accelerator and compute dtype (vendor datasheets, no sparsity).
ACCELERATORS: dict[str, dict[str, float]] = {
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "h100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "h200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0, "fp8": 1979.0},
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0, "fp8": 4500.0},
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "a10g": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "l40s": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "t4": {"fp16": 65.0, "fp32": 8.1},
    "rtx3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "rtx4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
    "mi250x": {"bf16": 383.0, "fp16": 383.0, "fp32": 47.9},
    "mi300x": {"bf16": 1307.0, "fp16": 1307.0, "tf32": 654.0, "fp32": 163.4, "fp8": 2615.0},
}

# Peak memory bandwidth in GB/s (vendor datasheets; A100: the 80 GB SXM part): the ceiling of decoding,
# which reads every weight once per step.
MEMORY_BANDWIDTH_GBS: dict[str, float] = {
    "a100": 2039.0,
    "h100": 3350.0,
    "h200": 4800.0,
    "b200": 8000.0,
    "v100": 900.0,
    "a10g": 600.0,
    "l4": 300.0,
    "l40s": 864.0,
    "t4": 320.0,
    "rtx3090": 936.0,
    "rtx4090": 1008.0,
    "mi250x": 3277.0,
    "mi300x": 5300.0,
}


def peak_flops(gpu: str, dtype: str) -> float:
    """Dense peak FLOP/s of `gpu` for `dtype`; KeyError names what exists."""
    table = ACCELERATORS[gpu.lower()]
    return table[dtype] * 1e12


@dataclass
class ParamCounts:
    tok_emb: int
    pos_emb: int
    # all layers
    attn_q: int
    attn_k: int
    attn_v: int
    attn_o: int
    mlp: int
    # the per-layer norms (two; four when sandwich) and the QK-norms (model.qk_norm), all layers
    norms: int
    final_norm: int
    # 0 when tied to tok_emb
    lm_head: int
    # one layer's (the first: with moe.first_dense or moe.every, layers differ; mlp holds them all)
    per_layer: int
    n_layers: int
    # a mixture of experts (in mlp already): the routers, the routed experts, the shared experts, all layers
    router: int = 0
    experts: int = 0
    shared: int = 0
    # the routed experts' parameters a token does not use: (n_experts - top_k) of them per MoE layer
    inactive: int = 0
    # attention sinks (model.attn_sinks): one logit per query head, all layers
    attn_sinks: int = 0
    # the attention output gates' projections (model.attn_output_gate; a linear layer's z projection), all
    # layers
    attn_gate: int = 0
    # the linear-attention layers' own parts (Gated DeltaNet: in_proj_ba, A_log, dt_bias, conv1d), all layers
    attn_linear: int = 0
    # the multi-token prediction modules (model.mtp): norms, projection and block of every depth
    mtp: int = 0

    @property
    def active(self) -> int:
        """The parameters one token goes through at inference (= total for a dense model without MTP)."""
        return self.total - self.inactive - self.mtp

    @property
    def attention(self) -> int:
        return (
            self.attn_q
            + self.attn_k
            + self.attn_v
            + self.attn_o
            + self.attn_sinks
            + self.attn_gate
            + self.attn_linear
        )

    @property
    def total(self) -> int:
        return (
            self.tok_emb
            + self.pos_emb
            + self.attention
            + self.mlp
            + self.norms
            + self.final_norm
            + self.lm_head
            + self.mtp
        )

    @property
    def non_embedding(self) -> int:
        """All parameters but the token and position embeddings (Kaplan et al.'s N)."""
        return self.total - self.tok_emb - self.pos_emb


class AttentionParams(NamedTuple):
    """One layer's attention parameters by part, as its kind's module holds them (biases included)."""

    q: int
    k: int
    v: int
    o: int
    # the output gate's projection (model.attn_output_gate)
    gate: int
    # the norms inside the attention module (QK-norms; MLA's q_a_layernorm and kv_a_layernorm)
    norms: int
    # the biases among q, k, v, o and gate (AdamW's under optim=muon)
    biases: int
    # the weights a token's forward multiplies by (matmul_params): the matrices, no biases or norms
    matmul: int
    # the widths of the attention itself, all heads: query . key (scores) and the values (per key)
    qk_width: int
    v_width: int
    # attention sinks (model.attn_sinks): a logit per query head
    sinks: int = 0
    # a linear-attention layer's own parts (Gated DeltaNet: in_proj_ba, A_log, dt_bias, conv1d)
    linear: int = 0
    # of `linear`, what optim=muon gives AdamW: A_log, dt_bias and the conv1d's taps (vectors, not matrices)
    adamw: int = 0


def attention_params(cfg: ModelConfig, layer: int = 0) -> AttentionParams:
    """Layer `layer`'s attention parameters, by its kind (gptkit/model/attention_kinds.py): multi-head
    attention's q/k/v/o of d_attn and d_kv; multi-head latent attention's low-rank projections (model.mla:
    q = q_proj or q_a_proj + q_b_proj, k = kv_a_proj_with_mqa + kv_b_proj's key rows, v = kv_b_proj's value
    rows); Gated DeltaNet's (model.gdn: q, k, v and the gate z are in_proj_qkvz's rows, o is out_proj,
    `linear` in_proj_ba, A_log, dt_bias and conv1d, its norm the gated RMSNorm's weight)."""
    d, b, qkv_b = cfg.d_model, int(cfg.bias), int(cfg.qkv_bias)
    # weight (and bias) per normalized feature
    per_dim = 2 if (cfg.norm == "layernorm" and cfg.bias) else 1
    sinks = cfg.n_heads if cfg.attn_sinks else 0
    kind = cfg.attention_kind_of(layer)
    if kind == "gdn":
        g = cfg.gdn
        key, value = g.n_key_heads * g.key_head_dim, g.n_value_heads * g.value_head_dim
        adamw = 2 * g.n_value_heads + g.conv_dim * g.conv_kernel
        return AttentionParams(
            q=d * key,
            k=d * key,
            v=d * value,
            o=value * d,
            gate=d * value,
            norms=g.value_head_dim,
            biases=0,
            matmul=d * (2 * key + 2 * value + 2 * g.n_value_heads) + value * d,
            qk_width=0,
            v_width=0,
            linear=d * 2 * g.n_value_heads + adamw,
            adamw=adamw,
        )
    if kind == "mla":
        m, H = cfg.mla, cfg.n_heads
        q_out = H * m.qk_head_dim
        if m.q_lora_rank is None:
            q_mat, q_bias, q_norm = d * q_out, 0, 0
        else:
            r = m.q_lora_rank
            q_mat, q_bias, q_norm = d * r + r * q_out, qkv_b * r, r * per_dim
        kv_a = m.kv_lora_rank + m.qk_rope_head_dim
        k_mat = d * kv_a + m.kv_lora_rank * H * m.qk_nope_head_dim
        v_mat = m.kv_lora_rank * H * m.v_head_dim
        d_out = H * m.v_head_dim
        gate_mat, gate_bias = (d * d_out, qkv_b * d_out) if cfg.attn_output_gate else (0, 0)
        biases = q_bias + qkv_b * kv_a + gate_bias + b * d
        return AttentionParams(
            q=q_mat + q_bias,
            k=k_mat + qkv_b * kv_a,
            v=v_mat,
            o=d_out * d + b * d,
            gate=gate_mat + gate_bias,
            norms=q_norm + m.kv_lora_rank * per_dim,
            biases=biases,
            matmul=q_mat + k_mat + v_mat + d_out * d + gate_mat,
            qk_width=H * m.qk_head_dim,
            v_width=d_out,
            sinks=sinks,
        )
    gate = (d + qkv_b) * cfg.d_attn if cfg.attn_output_gate else 0
    return AttentionParams(
        q=d * cfg.d_attn + qkv_b * cfg.d_attn,
        k=d * cfg.d_kv + qkv_b * cfg.d_kv,
        v=d * cfg.d_kv + qkv_b * cfg.d_kv,
        o=cfg.d_attn * d + b * d,
        gate=gate,
        norms={None: 0, "head": 2 * cfg.head_dim, "full": cfg.d_attn + cfg.d_kv}[cfg.qk_norm] * per_dim,
        biases=qkv_b * (cfg.d_attn * (1 + int(cfg.attn_output_gate)) + 2 * cfg.d_kv) + b * d,
        matmul=d * cfg.d_attn * (2 + int(cfg.attn_output_gate)) + 2 * d * cfg.d_kv,
        qk_width=cfg.d_attn,
        v_width=cfg.d_attn,
        sinks=sinks,
    )


def count_params(cfg: ModelConfig) -> ParamCounts:
    d, L, b = cfg.d_model, cfg.n_layers, int(cfg.bias)
    # every layer's (a hybrid's linear and full layers differ)
    layers = [attention_params(cfg, i) for i in range(L)]
    a, last_a = layers[0], layers[-1]
    if cfg.mlp == "gelu":
        dense = 2 * d * cfg.d_ff + b * (cfg.d_ff + d)
    else:
        dense = 3 * d * cfg.d_ff + b * (2 * cfg.d_ff + d)
    # a mixture: no biases; each expert a SwiGLU of width d_expert
    m = cfg.moe
    n_moe = len(cfg.moe_layers)
    router = (d + int(m.router_bias)) * m.n_experts if m else 0
    # an expert's three matrices (and, model.moe.expert_biases, its biases: gate and up, down)
    expert = 3 * d * m.d_expert + int(m.expert_biases) * (2 * m.d_expert + d) if m else 0
    experts, shared = (m.n_experts * expert, m.n_shared * 3 * d * m.d_expert) if m else (0, 0)
    # model.moe.shared_expert_gate: its [1, d_model] weight
    shared += d * int(m.shared_expert_gate) if m else 0
    mlp = (L - n_moe) * dense + n_moe * (router + experts + shared)
    # weight (and bias) per normalized feature
    per_dim = 2 if (cfg.norm == "layernorm" and cfg.bias) else 1
    norm = d * per_dim
    first = router + experts + shared if cfg.feed_forward(0) == "moe" else dense
    # a block's norms: before attention and MLP (and, sandwich, after each too)
    n_norms = 4 if cfg.norm_placement == "sandwich" else 2

    def attn(x: AttentionParams) -> int:
        """A layer's attention module, its inner norms (QK-norms, MLA's latent norms) included."""
        return x.q + x.k + x.v + x.o + x.sinks + x.gate + x.linear + x.norms

    per_layer = attn(a) + first + n_norms * norm
    # an MTP depth: e_norm, h_norm, out_norm, the projection, a block of the last layer's kind
    last = router + experts + shared if cfg.feed_forward(L - 1) == "moe" else dense
    mtp = 3 * norm + 2 * d * d + (attn(last_a) + last + n_norms * norm)
    return ParamCounts(
        tok_emb=cfg.vocab_size * d,
        pos_emb=cfg.max_seq_len * d if cfg.position == "learned" else 0,
        attn_q=sum(x.q for x in layers),
        attn_k=sum(x.k for x in layers),
        attn_v=sum(x.v for x in layers),
        attn_o=sum(x.o for x in layers),
        mlp=mlp,
        norms=L * n_norms * norm + sum(x.norms for x in layers),
        final_norm=norm,
        lm_head=0 if cfg.tie_embeddings else d * cfg.vocab_size,
        per_layer=per_layer,
        n_layers=L,
        router=n_moe * router,
        experts=n_moe * experts,
        shared=n_moe * shared,
        inactive=n_moe * (m.n_experts - m.top_k) * expert if m else 0,
        attn_sinks=sum(x.sinks for x in layers),
        attn_gate=sum(x.gate for x in layers),
        attn_linear=sum(x.linear for x in layers),
        mtp=cfg.mtp_depth * mtp,
    )


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for every token (see the module docstring): a mixture's router, its
    top_k routed experts and its shared experts, not the other routed experts."""
    d = cfg.d_model
    mlp_matrices = 2 if cfg.mlp == "gelu" else 3
    attention = sum(attention_params(cfg, i).matmul for i in range(cfg.n_layers))
    n_moe = len(cfg.moe_layers)
    dense = (cfg.n_layers - n_moe) * mlp_matrices * d * cfg.d_ff
    m = cfg.moe
    moe = n_moe * (d * m.n_experts + (m.top_k + m.n_shared) * 3 * d * m.d_expert) if m else 0
    # the shared experts' gate (model.moe.shared_expert_gate): d weights
    moe += n_moe * d * int(m.shared_expert_gate) if m else 0
    return attention + dense + moe + d * cfg.vocab_size


def mtp_matmul_params(cfg: ModelConfig) -> int:
    """The matmul weights a token goes through in the multi-token prediction modules (model.mtp), every
    depth: its projection, its block (the last layer's kind) and the shared lm_head."""
    if not cfg.mtp_depth:
        return 0
    d, m = cfg.d_model, cfg.moe
    attention = attention_params(cfg, cfg.n_layers - 1).matmul
    if cfg.feed_forward(cfg.n_layers - 1) == "moe":
        ff = d * m.n_experts + (m.top_k + m.n_shared) * 3 * d * m.d_expert + d * int(m.shared_expert_gate)
    else:
        ff = (2 if cfg.mlp == "gelu" else 3) * d * cfg.d_ff
    return cfg.mtp_depth * (2 * d * d + attention + ff + d * cfg.vocab_size)


@dataclass
class Flops:
    n_matmul: int
    seq_len: int
    # per token
    forward_dense: float
    forward_causal: float
    # 6N + 12·L·T·d_attn: the MFU convention of PaLM, nanoGPT, torchtitan (perf/mfu)
    train_dense: float
    # the attention term halved (perf/mfu_causal)
    train_causal: float
    # the attention-score part of forward_dense
    attention_forward_dense: float
    # the attention-score part of forward_causal
    attention_forward_causal: float = 0.0


def delta_rule_flops(cfg: ModelConfig) -> float:
    """FLOPs per token of one Gated DeltaNet layer's delta rule (model.gdn), by the chunked algorithm of
    gptkit/model/gated_deltanet.py as it runs (matmuls only, a multiply-add = 2 FLOPs, the projections
    counted in N as every layer's): per value head and chunk of C positions, the C x C products (beta k) k^T,
    q k^T and their D-masked product with V' computed whole (C^2 (2 d_k + d_v) multiply-adds), the two
    triangular solves at half (C^2 (d_k + d_v) / 2), and W S, q S, k^T V' against the d_k x d_v state
    (3 C d_k d_v); per token, divided by C. It does not grow with the context (dense = causal); the
    convolution (conv_kernel multiply-adds per channel) and the gates are elementwise, not counted."""
    g = cfg.gdn
    C, dk, dv = g.chunk_size, g.key_head_dim, g.value_head_dim
    return 2.0 * g.n_value_heads * (C * (2 * dk + dv) + C * (dk + dv) / 2 + 3 * dk * dv)


def layer_attention_flops(cfg: ModelConfig, layer: int, T: int) -> tuple[float, float]:
    """(dense, causal) attention FLOPs per token of layer `layer` at context T, beside its projections: a
    softmax layer's QK^T and AV, 2 * keys * width each (keys: T and T/2 for a global layer; w = min(W, T)
    and w - w^2 / 2T, the mean over the T queries of a causal window, for a local layer of window W; width:
    multi-head latent attention's heads' query-key and value widths, as the training path computes them); a
    linear layer's delta rule (delta_rule_flops), the same in both."""
    if cfg.attention_kind_of(layer) == "gdn":
        f = delta_rule_flops(cfg)
        return f, f
    a = attention_params(cfg, layer)
    width = a.qk_width + a.v_width
    w = min(cfg.window(layer) or T, T)
    return 2.0 * w * width, 2.0 * (w - w * w / (2 * T)) * width


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> Flops:
    T = seq_len or cfg.max_seq_len
    n = matmul_params(cfg)
    per_layer = [layer_attention_flops(cfg, i, T) for i in range(cfg.n_layers)]
    attn, attn_causal = sum(f[0] for f in per_layer), sum(f[1] for f in per_layer)
    fwd_dense = 2.0 * n + attn
    fwd_causal = 2.0 * n + attn_causal
    # model.mtp: each depth's matmuls and its block's attention (the last layer's), in training only
    depth = cfg.mtp_depth
    last_dense, last_causal = per_layer[-1]
    mtp_dense = 2.0 * mtp_matmul_params(cfg) + depth * last_dense
    mtp_causal = 2.0 * mtp_matmul_params(cfg) + depth * last_causal
    return Flops(
        n,
        T,
        fwd_dense,
        fwd_causal,
        3 * (fwd_dense + mtp_dense),
        3 * (fwd_causal + mtp_causal),
        attn,
        attn_causal,
    )


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """What every layer caches per position, K and V (its cache layout: multi-head attention's
    2 * n_kv_heads * head_dim elements), in bytes; a local layer's rolling cache stops growing at its window
    and a recurrent state does not grow at all (kv_cache_bytes counts both)."""
    return sum(lay.per_position for lay in cache_layouts(cfg)) * DTYPE_BYTES[dtype]


def kv_cache_bytes(cfg: ModelConfig, context: int, dtype: str = "bf16") -> int:
    """What one sequence of `context` tokens keeps cached, by every layer's cache layout: a global layer
    every token's K and V, a local layer (its rolling cache, gptkit/model/kv_cache.py) at most its window's,
    a recurrent layer its state (in fp32 where its layout keeps it so: Gated DeltaNet's)."""
    return sum(lay.nbytes(context, DTYPE_BYTES[dtype]) for lay in cache_layouts(cfg))


def decode_bytes_per_step(cfg: ModelConfig, batch: int, context: int, dtype: str = "bf16") -> int:
    """Bytes one decoding step must read: every weight but the embedding tables (a lookup reads only the
    batch's rows; a tied table is read whole, as the LM head), plus the K/V of `context` cached tokens per
    sample (a local layer's at most its window). The HBM roofline of decoding is batch * bandwidth / this,
    in tokens/s. A mixture's routed experts count as many as a step's batch is expected to pick under
    uniform routing (top_k / n_experts of them at batch 1, nearly all at a large batch)."""
    c = count_params(cfg)
    weights = c.total - c.pos_emb - (0 if cfg.tie_embeddings else c.tok_emb)
    if cfg.moe is not None:
        # the routed experts a step reads: each is picked by one of `batch` tokens with probability
        # 1 - (1 - top_k / n_experts)^batch (uniform routing)
        unread = (1 - cfg.moe.top_k / cfg.moe.n_experts) ** batch
        weights -= round(c.experts * unread)
    return weights * DTYPE_BYTES[dtype] + batch * kv_cache_bytes(cfg, context, dtype)


def memory_bandwidth(gpu_name: str) -> float | None:
    """Peak bytes/s of the GPU whose name (torch.cuda.get_device_name) contains a MEMORY_BANDWIDTH_GBS key."""
    name = gpu_name.lower().replace(" ", "").replace("-", "")
    for key, gbs in MEMORY_BANDWIDTH_GBS.items():
        if key in name:
            return gbs * 1e9
    return None


def muon_params(cfg: ModelConfig) -> int:
    """The parameters optim=muon gives torch.optim.Muon (training/optim.py muon_split): the 2-D weights inside
    the blocks and the multi-token prediction modules (attention projections, dense MLP matrices, a mixture's
    routers and stacked experts, MTP's projections), not their biases, the norms, the embeddings or the LM
    head (AdamW's); of a Gated DeltaNet layer its four projections (in_proj_qkvz, in_proj_ba, out_proj), not
    A_log, dt_bias, the conv1d's taps or its gated norm."""
    c = count_params(cfg)
    d, b = cfg.d_model, int(cfg.bias)
    # q/k/v (and the output gate's) biases, o_proj's; a linear layer's A_log, dt_bias and conv1d
    attention_biases = sum(
        a.biases + a.adamw for a in (attention_params(cfg, i) for i in range(cfg.n_layers))
    )
    per_dense = b * ((cfg.d_ff if cfg.mlp == "gelu" else 2 * cfg.d_ff) + d)
    mlp_biases = (cfg.n_layers - len(cfg.moe_layers)) * per_dense
    m = cfg.moe
    per_moe = 0
    if m is not None:
        # the router's bias (a vector) and the experts' stacked biases are AdamW's
        per_moe = int(m.router_bias) * m.n_experts + int(m.expert_biases) * m.n_experts * (2 * m.d_expert + d)
        mlp_biases += len(cfg.moe_layers) * per_moe
    # model.mtp: each depth's projection and its block's matrices are Muon's; its three norms, its block's
    # norms, sinks and biases AdamW's
    # (a block of the last layer's kind: a linear layer's A_log, dt_bias and conv1d AdamW's too)
    a = attention_params(cfg, cfg.n_layers - 1)
    norm = d * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)
    n_norms = 4 if cfg.norm_placement == "sandwich" else 2
    last = per_moe if cfg.feed_forward(cfg.n_layers - 1) == "moe" else per_dense
    mtp_rest = cfg.mtp_depth * ((3 + n_norms) * norm + a.norms + a.sinks + a.biases + a.adamw + last)
    return (
        c.total
        - c.tok_emb
        - c.pos_emb
        - c.lm_head
        - c.norms
        - c.final_norm
        - c.attn_sinks
        - attention_biases
        - mlp_biases
        - mtp_rest
    )


OPTIMIZERS = ("adamw", "muon")


def optimizer_bytes(
    precision_name: "str | Precision", params: int, muon: int = 0, n_shards: int = 1
) -> float:
    """Bytes of optimizer state for `params` trainable parameters, `muon` of them Muon's: AdamW keeps two
    moments per parameter, Muon one momentum buffer (precision.optimizer_bytes is the two moments)."""
    p = precision(precision_name, "precision")
    return ((params - muon) * p.optimizer_bytes + muon * p.optimizer_bytes / 2) / n_shards


def mla_attention_units(cfg: ModelConfig) -> float:
    """What a multi-head latent attention layer's attention keeps for the backward pass, in training_memory's
    units (16-bit values of d_model per token), in place of the 11 of a d_model-wide one (its input 2,
    Q and K 4, V 2, the heads' output 2, a dropout mask 1): the input 2 and mask 1; the heads' queries and
    keys (H * qk_head_dim each), values and output (H * v_head_dim each); the query latent before and after
    its norm (q_lora_rank each; none with q_proj), the kv projection's output (kv_lora_rank + the rotated
    key's width) and the normed latent (kv_lora_rank). A d_model-wide MHA gives the 11 again."""
    m, H = cfg.mla, cfg.n_heads
    heads = H * (2 * m.qk_head_dim + 2 * m.v_head_dim)
    latents = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim
    return 3 + 2 * (heads + latents) / cfg.d_model


def matmul_units(cfg: ModelConfig) -> float:
    """The outputs of one dense layer's matmuls in training_memory's units (16-bit values of d_model per
    token): q (the attention width), k and v (the kv heads' width each), o (d_model), and the MLP's (gate and
    up: d_ff each with swiglu, one d_ff with gelu; down: d_model)."""
    d = cfg.d_model
    mlp = (2 if cfg.mlp != "gelu" else 1) * cfg.d_ff + d
    return 2 * (cfg.d_attn + 2 * cfg.d_kv + d + mlp) / d


def selective_units(cfg: ModelConfig, units: list[float], policy: str, every: int) -> list[float]:
    """Each layer's kept units under trainer.activation_checkpointing=selective (training/activations.py):
    layers: every `every`-th layer (0, k, 2k, ...) keeps its input (2), the others all of theirs; attention:
    the input and the attention core's output (2 + 2); ops: those and the matmul outputs but every
    `every`-th (matmul_units; a mixture's or MLA's layer counted as a dense one's: an estimate)."""
    if policy == "layers":
        return [2.0 if i % every == 0 else u for i, u in enumerate(units)]
    kept = 4.0 + (matmul_units(cfg) * (1 - 1 / every) if policy == "ops" else 0.0)
    return [min(kept, u) for u in units]


def training_memory(
    cfg: ModelConfig,
    precision_name: str = "bf16-mixed",
    n_shards: int = 1,
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: "bool | str | None" = False,
    expert_shards: int | None = None,
    *,
    optimizer: str = "adamw",
    checkpointing_policy: str = "ops",
    checkpointing_every: int = 2,
    lora: dict | None = None,
    frozen: tuple[str, ...] = (),
) -> dict[str, float]:
    """Bytes per GPU for weights, grads and optimizer state (sharded over `n_shards` as in FSDP/ZeRO-3; a
    mixture's routed experts over `expert_shards` instead when given: trainer.expert_parallel),
    plus an activation estimate and the logits and loss.

    optimizer: adamw (two moments per trainable parameter) or muon (one momentum buffer for the 2-D weights
    inside the blocks, muon_params; AdamW's two moments for the rest). lora: {rank, targets} of finetune=lora,
    whose adapters alone train (their gradients and optimizer state; their weights beside the frozen ones),
    all of them Muon's under optim=muon. frozen: the names of an objective's frozen models of the starting
    weights (objective=dpo's and kto's "reference", grpo's with grpo.beta > 0, distill's "teacher"), each a
    second copy of the weights under its name with finetune=full (with lora the frozen model is the model with
    its adapters off: nothing more).

    Activations follow Korthikanti et al. (2022) for a layer with flash attention (no T x T
    scores kept): ~34 * T * B * d_model bytes per layer in 16-bit, twice that in fp32; with
    activation checkpointing (checkpointing True or "full") only the block inputs (2 * T * B * d_model bytes
    per layer) stay; "selective" (trainer.activation_checkpointing=selective) keeps what
    selective_units says of checkpointing_policy and checkpointing_every.
    Outside the layers: the embedding sum and the final norm's input and output (3 * d_model values per
    token) and the batch (input ids and targets, int64). The logits and loss hold three fp32
    [B, T, vocab_size] tensors at the start of the backward pass: the logits, the log-softmax that
    cross-entropy saves, and its gradient (measured on the CPU: the old count of one was short by two).
    It is an estimate: MLP widths and GQA move it by tens of percent. micro_batch counts sequences (a DPO
    pair is two).

    A mixture of experts: the weights, gradients and optimizer state are those of every parameter (the total
    count); an MoE layer's activations replace the dense MLP's 19 of the 34 (its 4 * d_model GELU MLP) with
    what a token keeps in each of its top_k routed and n_shared shared experts: its dispatched input (2),
    gate, up and their product (6 * d_expert / d_model), its weighted output (2), and the layer's input (2).
    A multi-head latent attention layer's attention counts its own widths (mla_attention_units) instead of
    the 11 of a d_model-wide one.
    """
    p = precision(precision_name, "precision")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    counts = count_params(cfg)
    # the parameters each device holds, as if unsharded over n_shards
    n = counts.total
    # Muon's share of them (the routed experts are matrices of the blocks)
    muon_held = muon_params(cfg)
    if expert_shards is not None:
        n = counts.total - counts.experts + counts.experts * n_shards / expert_shards
        muon_held = muon_held - counts.experts + counts.experts * n_shards / expert_shards
    T = seq_len or cfg.max_seq_len
    tokens = T * micro_batch
    act_unit = 4 if p.compute == "fp32" else 2
    # in units of tokens * d_model 16-bit values (Korthikanti's s*b*h)
    units = [34.0] * cfg.n_layers
    m = cfg.moe
    for i in cfg.moe_layers:
        experts = m.top_k + m.n_shared
        units[i] = 34 - 19 + 2 + experts * (2 + 6 * m.d_expert / cfg.d_model + 2)
    for i in range(cfg.n_layers):
        if cfg.attention_kind_of(i) == "mla":
            units[i] += mla_attention_units(cfg) - 11
    if checkpointing in (True, "true", "full"):
        units = [2.0] * cfg.n_layers
    elif checkpointing == "selective":
        units = selective_units(cfg, units, checkpointing_policy, checkpointing_every)
    layers = sum(units) * tokens * cfg.d_model * act_unit / 2
    # embeddings, final norm; the batch
    outside = 3 * tokens * cfg.d_model * act_unit + 2 * tokens * 8
    # the trainable parameters, and those of them Muon steps
    if lora is not None:
        trainable = adapter_params(cfg, lora["targets"], lora["rank"])
        muon = trainable if optimizer == "muon" else 0
    else:
        trainable, muon = n, muon_held if optimizer == "muon" else 0
    # the model's weights, and the adapters' beside them
    held = n + (trainable if lora is not None else 0)
    out = {
        "weights": held * p.weight_bytes / n_shards,
        "gradients": trainable * p.grad_bytes / n_shards,
        "optimizer": optimizer_bytes(p, trainable, muon, n_shards),
        "activations": layers + outside,
        # fp32 logits, log-softmax, its gradient
        "logits": 3 * tokens * cfg.vocab_size * 4,
    }
    # a half-precision working copy of the weights during compute
    if p.mixed:
        out["weights"] += held * 2 / n_shards
    if lora is None:
        for name in frozen:
            out[name] = out["weights"]
    out["total"] = sum(out.values())
    return out


def mfu(tokens_per_s: float, flops_per_token_train: float, peak: float) -> float:
    """Model FLOPs utilization of one device: its tokens/s x training FLOPs per token / its peak FLOP/s.
    Pass Flops.train_dense for the published convention (perf/mfu), Flops.train_causal for perf/mfu_causal."""
    return tokens_per_s * flops_per_token_train / peak


def checkpoint_bytes(cfg: ModelConfig, precision_name: str = "32-true") -> float:
    """Bytes of one training checkpoint: the kept weights and AdamW's two moments (as training_memory
    counts them, unsharded); the step counters and RNG state beside them are negligible."""
    p = precision(precision_name, "trainer.precision")
    return count_params(cfg).total * (p.weight_bytes + p.optimizer_bytes)


def quantized_weights(
    cfg: ModelConfig,
    kind: str,
    dtype: str = "bf16",
    block_size: int = quant.NF4_BLOCK,
    scaler: object = "auto",
) -> dict[str, float]:
    """Bytes of a model's weights with every block's linear projections quantized (`kind`: nf4, int8, int4;
    gptkit.quant; int8 as on the CPU: the LM head too, a tied one as its own int8 copy) and the rest
    (embeddings, norms, biases, the LM head but for int8) in `dtype`: {"quantized": the quantized weights,
    "rest", "total", "bits": their bits per value, "full": the same model all in `dtype`}. nf4 with QLoRA's
    block and scaler block sizes (finetune=qlora's memory). Analytic."""
    width = DTYPE_BYTES[dtype]
    names = quant.inference_names(cfg, kind)
    n_total = count_params(cfg).total
    n_q = sum(out * n_in for out, n_in in names.values())
    if quant.HEAD in names and cfg.tie_embeddings:
        # the embedding stays, whole, for the lookups: only the head's copy is new
        n_total += cfg.vocab_size * cfg.d_model
    q_bytes = sum(
        quant.bits_per_value(kind, out * n_in, out, width, block_size, scaler) * out * n_in / 8
        for out, n_in in names.values()
    )
    rest = (n_total - n_q) * width
    return {
        "quantized": q_bytes,
        "rest": rest,
        "total": q_bytes + rest,
        "bits": 8 * q_bytes / max(n_q, 1),
        "full": count_params(cfg).total * width,
    }
