"""The model configuration: one dataclass whose fields switch the variants.

Presets are data (YAML under conf/model/); this file only knows the fields and their rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gptkit.errors import ConfigError
from gptkit.model import attention_kinds as _attention_kinds

POSITIONS = ("learned", "rope")
# gelu: GPT-2's | swiglu: down(silu(gate) * up) (Llama) | geglu: down(gelu_tanh(gate) * up) (Gemma)
MLPS = ("gelu", "swiglu", "geglu")
# rmsnorm_unit_offset: RMSNorm scaled by (1 + weight), the weight starting at 0 (Gemma)
NORMS = ("layernorm", "rmsnorm", "rmsnorm_unit_offset")
ATTENTIONS = ("eager", "sdpa", "triton")
# RMSNorm of q and k: per head over head_dim (Qwen3) | all heads at once (OLMo-2)
QK_NORMS = ("head", "full")
# pre: x + f(norm(x)) (GPT-2, Llama) | post: x + norm(f(x)) (OLMo-2) | sandwich: x + norm(f(norm(x))) (Gemma)
NORM_PLACEMENTS = ("pre", "post", "sandwich")
# model.layer_types: a layer attends to its last model.sliding_window positions (local) or to all (global),
# both with model.attention_kind; or it is a linear-attention layer (linear: LINEAR_KIND, model.gdn)
LAYER_TYPES = ("local", "global", "linear")
# the attention kind of a `linear` layer (gptkit/model/attention_kinds.py): Gated DeltaNet
LINEAR_KIND = "gdn"
# model.rope_scaling: type -> (its required keys, its optional keys with their defaults); the frequencies of
# each type are gptkit/model/rope_scaling.py's (transformers' rope_type of the same name)
ROPE_SCALING_KEYS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth band between
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"), {}),
    # every frequency divided by factor (position interpolation)
    "linear": (("factor",), {}),
    # NTK-aware: past original_max_seq_len the base grows with the sequence length of the forward
    "dynamic": (("factor", "original_max_seq_len"), {}),
    # YaRN (Qwen2.5, Qwen3, DeepSeek): interpolation blended by wavelength between beta_fast and beta_slow
    # rotations, cos and sin times attention_factor (null: 0.1 ln(factor) + 1, or the mscale ratio)
    "yarn": (
        ("factor", "original_max_seq_len"),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": None,
            "mscale": None,
            "mscale_all_dim": None,
            "truncate": True,
        },
    ),
    # LongRoPE (Phi-3.5, Phi-4-mini): frequency i divided by short_factor[i] while a sequence is within
    # original_max_seq_len, by long_factor[i] once it is longer (rotary_dim / 2 numbers each); cos and sin
    # times attention_factor (null: sqrt(1 + ln(factor) / ln(original_max_seq_len)), 1 when factor <= 1;
    # transformers' factor is max_position_embeddings / original_max_position_embeddings)
    "longrope": (
        ("factor", "short_factor", "long_factor", "original_max_seq_len"),
        {"attention_factor": None},
    ),
}
# rope_scaling keys that hold one number per rotated frequency pair
ROPE_FACTOR_LISTS = ("short_factor", "long_factor")
ROPE_SCALINGS = tuple(ROPE_SCALING_KEYS)
# fused kernels model.kernels may switch on (gptkit/model/fused.py)
KERNELS = ("norm", "swiglu", "rope", "loss")
# model.moe.router: softmax over the experts, then top-k (Mixtral, Qwen3-MoE, OLMoE) | an independent
# sigmoid score per expert, then top-k (DeepSeek-V3)
ROUTERS = ("softmax", "sigmoid")
# model.moe.aux_loss_group: the tokens the balance loss is taken over
AUX_LOSS_GROUPS = ("sequence", "batch")
# model.moe.impl: how the experts' grouped matmuls run (gptkit/model/moe.py)
MOE_IMPLS = ("auto", "grouped_mm", "loop")
# model.moe.activation: each expert's down(silu(gate) * up) | gpt-oss's (up + 1) * g * sigmoid(alpha * g)
# with g = min(gate, limit) and up clamped to [-limit, limit] (gptkit/model/moe.py EXPERT_ACTIVATIONS)
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass
class MoEConfig:
    """model.moe: a mixture-of-experts feed-forward for the dense MLP (gptkit/model/moe.py, docs/moe.md).

    Token-choice and dropless: every token goes to its top_k experts (each a SwiGLU of width d_expert), none
    is dropped, and the experts' outputs are summed with the router's weights; n_shared always-on experts
    (DeepSeek, Qwen2-MoE) see every token. Which layers: layer i (from 0) is MoE when i >= first_dense and
    (i + 1) % every == 0 (Qwen's decoder_sparse_step; DeepSeek's first_k_dense_replace); the others keep
    the dense model.mlp of width model.d_ff."""

    n_experts: int = 8
    top_k: int = 2
    # null: = model.d_ff
    d_expert: int | None = None
    # always-on experts, each d_expert wide (one SwiGLU of n_shared * d_expert)
    n_shared: int = 0
    # every k-th layer is MoE (1: every layer)
    every: int = 1
    # the first k layers stay dense
    first_dense: int = 0
    # softmax | sigmoid (ROUTERS)
    router: str = "softmax"
    # the top_k weights renormalized to sum to 1 (Mixtral always; Qwen3-MoE's and OLMoE's norm_topk_prob)
    norm_topk_prob: bool = True
    # the routed experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    route_scale: float = 1.0
    # the Switch/GShard load-balancing loss, n_experts * sum_i f_i * P_i (1 when balanced), times this
    aux_loss_coef: float = 0.01
    # sequence | batch: the tokens f_i and P_i are taken over (AUX_LOSS_GROUPS)
    aux_loss_group: str = "sequence"
    # the router z-loss, mean logsumexp(router logits)^2 (ST-MoE), times this
    z_loss_coef: float = 0.0
    # > 0: the auxiliary-loss-free expert bias (DeepSeek-V3): added to the scores for the top-k choice only,
    # moved by this much per optimizer step against each expert's load
    bias_update_rate: float = 0.0
    # the expert bias held even without updates (bias_update_rate 0: a fixed bias, DeepSeek-V3's
    # e_score_correction_bias of an imported checkpoint); bias_update_rate > 0 implies it
    correction_bias: bool = False
    # auto | grouped_mm | loop (MOE_IMPLS)
    impl: str = "auto"
    # a bias in the router's logits (gpt-oss)
    router_bias: bool = False
    # biases in every expert's gate, up and down projections (gpt-oss)
    expert_biases: bool = False
    # swiglu | clamped_swiglu (EXPERT_ACTIVATIONS; gpt-oss: clamped_swiglu, with its limit and alpha)
    activation: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # group-limited routing (DeepSeek-V3): the experts in n_group groups of n_experts / n_group, each group
    # scored by the sum of its two best choice scores (the expert bias included), only the topk_group best
    # groups' experts may be chosen; n_group 1: every expert (no groups)
    n_group: int = 1
    topk_group: int = 1
    # the shared experts' output times sigmoid(x W_s), W_s [1, d_model] (Qwen3-Next's shared_expert_gate);
    # false: added as it is (DeepSeek, GLM-4.5)
    shared_expert_gate: bool = False

    def validate(self, n_layers: int) -> None:
        """Raise ConfigError (one line) for any invalid field."""
        for name, low in (("n_experts", 2), ("top_k", 1), ("every", 1), ("n_shared", 0), ("first_dense", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                if name == "n_experts" and isinstance(v, int) and not isinstance(v, bool):
                    raise ConfigError(
                        f"model.moe.n_experts={v} must be at least 2 (one expert is the dense MLP: "
                        f"set model.moe=null)"
                    )
                raise ConfigError(f"model.moe.{name}={v!r} must be an integer >= {low}")
        if self.shared_expert_gate is True and self.n_shared == 0:
            raise ConfigError(
                "model.moe.shared_expert_gate=true needs shared experts to gate: set model.moe.n_shared >= 1"
            )
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.n_experts={self.n_experts}: each token "
                f"goes to top_k of the n_experts experts"
            )
        d = self.d_expert
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d <= 0):
            raise ConfigError(f"model.moe.d_expert={d!r} must be a positive integer (or null: model.d_ff)")
        for name, allowed in (
            ("router", ROUTERS),
            ("aux_loss_group", AUX_LOSS_GROUPS),
            ("impl", MOE_IMPLS),
            ("activation", EXPERT_ACTIVATIONS),
        ):
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(f"model.moe.{name}={v!r} is not one of {', '.join(allowed)}")
        for name in (
            "norm_topk_prob",
            "router_bias",
            "expert_biases",
            "correction_bias",
            "shared_expert_gate",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} must be true or false")
        for name in ("swiglu_limit", "swiglu_alpha"):
            if not _positive(getattr(self, name)):
                raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} must be a number > 0")
        for name in ("route_scale", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(f"model.moe.{name}={v!r} must be a number >= 0")
        if not self.route_scale > 0:
            raise ConfigError(f"model.moe.route_scale={self.route_scale} must be > 0")
        self._validate_groups()
        if not any(self.first_dense <= i and (i + 1) % self.every == 0 for i in range(n_layers)):
            raise ConfigError(
                f"model.moe: no layer of the {n_layers} is MoE with first_dense={self.first_dense} and "
                f"every={self.every}; lower them (or set model.moe=null for a dense model)"
            )

    def _validate_groups(self) -> None:
        """model.moe.n_group and topk_group: ConfigError (one line) unless the groups split the experts
        evenly, each holds 2 or more (a group's score is its two best), and the kept groups hold top_k
        experts."""
        g, kg, E = self.n_group, self.topk_group, self.n_experts
        for name, v in (("n_group", g), ("topk_group", kg)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.moe.{name}={v!r} must be an integer >= 1")
        if kg > g:
            raise ConfigError(
                f"model.moe.topk_group={kg} exceeds model.moe.n_group={g}: each token keeps topk_group of "
                f"the n_group groups"
            )
        if g == 1:
            return
        if E % g:
            raise ConfigError(
                f"model.moe.n_experts={E} is not divisible by model.moe.n_group={g}: the groups split the "
                f"experts evenly"
            )
        if E // g < 2:
            raise ConfigError(
                f"model.moe.n_group={g} leaves {E // g} expert per group; a group is scored by its two best "
                f"experts: use n_group <= {E // 2}"
            )
        if self.top_k > kg * (E // g):
            raise ConfigError(
                f"model.moe.top_k={self.top_k} exceeds the {kg * (E // g)} experts of the topk_group={kg} "
                f"kept groups ({E // g} each): raise topk_group or lower top_k"
            )

    @classmethod
    def from_dict(cls, d: Any) -> "MoEConfig":
        """model.moe as given (a mapping: unknown keys are an error)."""
        if isinstance(d, MoEConfig):
            return d
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"model.moe={d!r} must be null (a dense model) or a mapping such as "
                f"{{n_experts: 8, top_k: 2}}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model.moe field(s) {', '.join(map(str, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(d))


@dataclass
class MTPConfig:
    """model.mtp: multi-token prediction (DeepSeek-V3's sequential MTP; gptkit/model/mtp.py, docs/mtp.md).

    depth D modules after the main model, module k predicting the token k + 1 places after the next one;
    each combines the previous depth's hidden state with the embedding of the token k places ahead, runs
    one block of the model's kind and the shared lm_head. Training adds loss_scale / D times the sum of
    their losses to the next-token loss; sampling never runs them. depth 0 is no MTP (model.mtp=null)."""

    depth: int = 1
    # lambda: the depths' summed losses times loss_scale / depth join the main loss (DeepSeek-V3: 0.3,
    # then 0.1)
    loss_scale: float = 0.3

    def validate(self) -> None:
        """Raise ConfigError (one line) for any invalid field."""
        d = self.depth
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ConfigError(f"model.mtp.depth={d!r} must be an integer >= 0 (0: no multi-token prediction)")
        v = self.loss_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"model.mtp.loss_scale={v!r} must be a number >= 0")

    @classmethod
    def from_dict(cls, d: Any) -> "MTPConfig":
        """model.mtp as given (a mapping: unknown keys are an error)."""
        if isinstance(d, MTPConfig):
            return d
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"model.mtp={d!r} must be null (no MTP) or a mapping such as {{depth: 1, loss_scale: 0.3}}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model.mtp field(s) {', '.join(map(str, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(d))


@dataclass
class MLAConfig:
    """model.mla: multi-head latent attention's shapes (model.attention_kind=mla: gptkit/model/mla.py,
    docs/mla.md; transformers' DeepseekV3Config fields of the same names).

    Each head's query and key are qk_nope_head_dim features without position and qk_rope_head_dim rotated
    ones (the rotated key is one, shared by the heads); its value is v_head_dim wide. Keys and values come
    from a latent of kv_lora_rank features per token (what the cache keeps, with the rotated key)."""

    # null: q_proj [d_model -> n_heads * (nope + rope)] (DeepSeek-V2-Lite, Moonlight); r: q_a_proj
    # [d_model -> r], an RMSNorm, q_b_proj [r -> n_heads * (nope + rope)] (DeepSeek-V3, Kimi K2)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # DeepSeek's checkpoints keep each rotated pair side by side (x0, x1), (x2, x3), ...: read them as the
    # two halves RoPE turns (transformers' rope_interleave); false: the halves as they come (gptkit's RoPE)
    rope_interleave: bool = False
    # decoding: true caches the latent and the rotated key and absorbs kv_b_proj into the query and the output
    # (the latent cache); false caches each head's expanded key and value, as transformers' DeepseekV3 does
    # (the uncompressed path: the same tokens, H * (nope + rope + v) numbers per position; docs/mla.md)
    absorb: bool = True
    # the eps of q_a_layernorm and kv_a_layernorm; null: model.norm_eps (transformers' DeepseekV3 fixes 1e-6
    # whatever rms_norm_eps is: Moonlight's layers use 1e-5, its latent norms 1e-6)
    latent_norm_eps: float | None = None

    @property
    def qk_head_dim(self) -> int:
        """The width of each head's query and key: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> None:
        """Raise ConfigError (one line) for any invalid field."""
        r = self.q_lora_rank
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r <= 0):
            raise ConfigError(f"model.mla.q_lora_rank={r!r} must be a positive integer (or null: q_proj)")
        for name, low in (
            ("kv_lora_rank", 1),
            ("qk_nope_head_dim", 0),
            ("qk_rope_head_dim", 2),
            ("v_head_dim", 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"model.mla.{name}={v!r} must be an integer >= {low}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE turns pairs of "
                f"features)"
            )
        e = self.latent_norm_eps
        if e is not None and not _positive(e):
            raise ConfigError(
                f"model.mla.latent_norm_eps={e!r} must be a number > 0 (or null: model.norm_eps)"
            )
        if not isinstance(self.rope_interleave, bool):
            raise ConfigError(f"model.mla.rope_interleave={self.rope_interleave!r} must be true or false")
        if not isinstance(self.absorb, bool):
            raise ConfigError(f"model.mla.absorb={self.absorb!r} must be true or false")

    @classmethod
    def from_dict(cls, d: Any) -> "MLAConfig":
        """model.mla as given (a mapping: unknown keys are an error)."""
        if isinstance(d, MLAConfig):
            return d
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"model.mla={d!r} must be a mapping such as {{kv_lora_rank: 512, qk_nope_head_dim: 128, "
                f"qk_rope_head_dim: 64, v_head_dim: 128, q_lora_rank: null}}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model.mla field(s) {', '.join(map(str, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(d))


@dataclass
class GDNConfig:
    """model.gdn: Gated DeltaNet's shapes (the `linear` layers of model.layer_types, or every layer with
    model.attention_kind=gdn: gptkit/model/gated_deltanet.py, docs/linear-attention.md). Each field is
    transformers' Qwen3NextConfig field named beside it."""

    # linear_num_key_heads: the query and key heads
    n_key_heads: int = 16
    # linear_num_value_heads: the value heads (a multiple of n_key_heads; each key head serves
    # n_value_heads / n_key_heads of them), each with its own state and decay
    n_value_heads: int = 32
    # linear_key_head_dim, linear_value_head_dim
    key_head_dim: int = 128
    value_head_dim: int = 128
    # linear_conv_kernel_dim: the taps of the causal depthwise convolution over q, k and v
    conv_kernel: int = 4
    # the positions of one chunk of the chunked delta rule (FLA's and transformers' 64): the work per token
    # grows with it, the sequential steps per sequence shrink with it; the result does not change
    chunk_size: int = 64

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q and k (n_key_heads x key_head_dim each) and v."""
        return 2 * self.n_key_heads * self.key_head_dim + self.n_value_heads * self.value_head_dim

    def state_shape(self) -> tuple[int]:
        """One layer's decode state per sequence, flat: the delta-rule state n_value_heads x key_head_dim x
        value_head_dim, then the convolution's last conv_kernel - 1 inputs, conv_dim x (conv_kernel - 1)."""
        delta = self.n_value_heads * self.key_head_dim * self.value_head_dim
        return (delta + self.conv_dim * (self.conv_kernel - 1),)

    def validate(self) -> None:
        """Raise ConfigError (one line) for any invalid field."""
        for name in dataclasses.fields(self):
            v = getattr(self, name.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.gdn.{name.name}={v!r} must be a positive integer")
        if self.n_value_heads % self.n_key_heads:
            raise ConfigError(
                f"model.gdn.n_value_heads={self.n_value_heads} is not a multiple of model.gdn.n_key_heads="
                f"{self.n_key_heads}: each key head serves a whole group of value heads"
            )

    @classmethod
    def from_dict(cls, d: Any) -> "GDNConfig":
        """model.gdn as given (a mapping: unknown keys are an error)."""
        if isinstance(d, GDNConfig):
            return d
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"model.gdn={d!r} must be a mapping such as {{n_key_heads: 16, n_value_heads: 32, "
                f"key_head_dim: 128, value_head_dim: 128, conv_kernel: 4, chunk_size: 64}}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model.gdn field(s) {', '.join(map(str, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(d))


@dataclass
class ModelConfig:
    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_layers: int = 12
    n_heads: int = 12
    # None: = n_heads (MHA); fewer: GQA; 1: MQA
    n_kv_heads: int | None = None
    d_model: int = 768
    # None: 4 * d_model (gelu) or the Llama rule (swiglu)
    d_ff: int | None = None
    # None: d_model // n_heads
    head_dim: int | None = None
    # learned | rope
    position: str = "learned"
    # null: RoPE turns the whole head; r (even, <= head_dim): only the first r features of each head, with the
    # frequencies of an r-wide head, the rest pass through (partial RoPE: transformers' partial_rotary_factor)
    rotary_dim: int | None = None
    rope_theta: float = 10000.0
    # null: plain RoPE; {type: llama3 | linear | dynamic | yarn | longrope, ...}: the frequencies rescaled
    # (the keys of each type: ROPE_SCALING_KEYS; transformers' rope_type of the same name)
    rope_scaling: dict[str, Any] | None = None
    # null: local layers (model.layer_types) rotate as the global ones; a base: local layers use plain RoPE
    # of this base, rope_theta and rope_scaling are the global layers' (Gemma 3: 10000 local, 1e6 global)
    rope_local_theta: float | None = None
    # gelu | swiglu
    mlp: str = "gelu"
    # layernorm | rmsnorm
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    # biases in the linear layers and LayerNorm
    bias: bool = True
    # biases of the q/k/v projections; null: = bias (Qwen2: true, bias false)
    qkv_bias: bool | None = None
    # null | head | full: RMSNorm of queries and keys before RoPE (QK_NORMS)
    qk_norm: str | None = None
    # pre | post: where each block's two norms sit (NORM_PLACEMENTS)
    norm_placement: str = "pre"
    tie_embeddings: bool = True
    dropout: float = 0.0
    # eager | sdpa | triton: the attention function (the backend)
    attention: str = "sdpa"
    # mha | mla: the attention module and its cache (gptkit/model/attention_kinds.py) of every layer but the
    # `linear` ones of layer_types; gdn: every layer Gated DeltaNet (a linear-attention model)
    attention_kind: str = "mha"
    # null, or with attention_kind=mla its shapes (MLAConfig: ranks and head widths; docs/mla.md)
    mla: MLAConfig | None = None
    # null, or with `linear` layers (or attention_kind=gdn) Gated DeltaNet's shapes (GDNConfig;
    # docs/linear-attention.md)
    gdn: GDNConfig | None = None
    # null: every layer attends to all earlier positions; W: a local layer (model.layer_types) attends to its
    # last W positions, its own included (transformers' sliding_window), and caches only those
    sliding_window: int | None = None
    # null: every layer local when sliding_window is set (Mistral v0.1), else global; or one of LAYER_TYPES
    # per layer, n_layers of them (Gemma 3: five local, then one global; Qwen3-Next: three linear, then one
    # global, repeated)
    layer_types: list[str] | None = None
    # null: every layer rotates q and k (position=rope); a list of layer indices (from 0): those layers apply
    # no rotary embedding at all, NoPE (SmolLM3: every 4th layer, 3, 7, ...; Llama 4 likewise)
    nope_layers: list[int] | None = None
    # null: attention scores scaled by head_dim^-0.5; s: by s^-0.5 (Gemma's query_pre_attn_scalar)
    query_pre_attn_scalar: float | None = None
    # null | c: attention scores soft-capped to c * tanh(scores / c) before the mask (Gemma 2)
    attn_softcap: float | None = None
    # a learned logit per head in each softmax's denominator, with no value (gpt-oss's attention sinks): the
    # attention module gets a parameter `sinks` [n_heads]
    attn_sinks: bool = False
    # a sigmoid gate on each query head's attention output, from the layer's input (Qwen3-Next's and
    # OLMo-core's): y * sigmoid(x W_g) before o_proj; the attention module gets gate_proj [d_model -> d_attn]
    attn_output_gate: bool = False
    # null | c: the output logits soft-capped to c * tanh(logits / c) (Gemma 2)
    logit_softcap: float | None = None
    # token embeddings times sqrt(d_model), rounded to their dtype (Gemma)
    scale_embeddings: bool = False
    # fused kernels to use, any of KERNELS; [] = eager torch
    kernels: list[str] = field(default_factory=list)
    # with packed documents (data.pack=documents): positions restart per document
    position_reset: bool = False
    init_std: float = 0.02
    # null: every layer's feed-forward is the dense model.mlp; a mapping: a mixture of experts (MoEConfig)
    moe: MoEConfig | None = None
    # null: next-token prediction only; {depth, loss_scale}: multi-token prediction modules (MTPConfig);
    # depth 0 is null
    mtp: MTPConfig | None = None
    name: str = field(default="custom", compare=False)

    # ---- derived sizes -------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_heads
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model if self.mlp == "gelu" else swiglu_hidden(self.d_model)
        if self.moe is not None and self.moe.d_expert is None:
            self.moe.d_expert = self.d_ff
        if self.rotary_dim == self.head_dim:
            # the whole head: one spelling (null) for one model
            self.rotary_dim = None

    def feed_forward(self, layer: int) -> str:
        """The feed-forward of layer `layer` (from 0): "moe", or the dense model.mlp
        (gptkit/model/feedforward.py builds it)."""
        m = self.moe
        if m is not None and layer >= m.first_dense and (layer + 1) % m.every == 0:
            return "moe"
        return self.mlp

    @property
    def mtp_depth(self) -> int:
        """The multi-token prediction modules (model.mtp.depth; 0 without)."""
        return self.mtp.depth if self.mtp is not None else 0

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose feed-forward is a mixture of experts ([] for a dense model)."""
        return [i for i in range(self.n_layers) if self.feed_forward(i) == "moe"]

    def attention_kind_of(self, layer: int) -> str:
        """The attention kind of layer `layer` (from 0): LINEAR_KIND for a `linear` layer of
        model.layer_types, else model.attention_kind (gptkit/model/attention_kinds.py builds it and gives its
        cache layout). The one place that says a layer's kind."""
        if self.layer_types is not None and self.layer_types[layer] == "linear":
            return LINEAR_KIND
        return self.attention_kind

    @property
    def linear_layers(self) -> list[int]:
        """The layers of linear attention (Gated DeltaNet: model.gdn), [] for a softmax-only model."""
        return [i for i in range(self.n_layers) if self.attention_kind_of(i) == LINEAR_KIND]

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (from 0): model.sliding_window for a local layer, None for a
        global one (it attends to every earlier position)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "local":
            return self.sliding_window
        return None

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) applies the rotary embedding: position=rope and not a NoPE layer
        (model.nope_layers)."""
        return self.position == "rope" and layer not in (self.nope_layers or ())

    @property
    def local_layers(self) -> list[int]:
        """The layers that attend to a sliding window ([] without model.sliding_window)."""
        return [i for i in range(self.n_layers) if self.window(i) is not None]

    @property
    def attn_scale(self) -> float:
        """The factor of the attention scores q k^T: query_pre_attn_scalar^-0.5, else head_dim^-0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope_dim(self) -> int:
        """The features of each head RoPE turns: model.rotary_dim, else the whole head (multi-head latent
        attention: model.mla.qk_rope_head_dim)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @property
    def d_attn(self) -> int:
        """Width of the concatenated query heads (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def d_kv(self) -> int:
        """Width of the concatenated key (or value) heads (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim

    def validate(self) -> None:
        """Raise ConfigError (one line: the problem and the fix) for any invalid field."""
        for name in ("vocab_size", "max_seq_len", "n_layers", "n_heads", "d_model"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{name}={v!r} must be a positive integer")
        for name in ("n_kv_heads", "d_ff", "head_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"model.{name}={v!r} must be a positive integer (or null for the default)")
        for name, allowed in (
            ("position", POSITIONS),
            ("mlp", MLPS),
            ("norm", NORMS),
            ("attention", ATTENTIONS),
            # the attention module of a layer and what its cache keeps: a row each in
            # gptkit/model/attention_kinds.py (which imports no torch)
            ("attention_kind", tuple(_attention_kinds.ATTENTION_KINDS)),
        ):
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(f"model.{name}={v!r} is not one of {', '.join(allowed)}")
        if not isinstance(self.kernels, (list, tuple)) or any(k not in KERNELS for k in self.kernels):
            raise ConfigError(
                f"model.kernels={self.kernels!r} must be a list of {', '.join(KERNELS)} "
                f"(e.g. model.kernels=[norm,loss]; [] for none)"
            )
        self.kernels = list(dict.fromkeys(self.kernels))
        if not isinstance(self.position_reset, bool):
            raise ConfigError(f"model.position_reset={self.position_reset!r} must be true or false")
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise ConfigError(f"model.qkv_bias={self.qkv_bias!r} must be true, false or null (= model.bias)")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ConfigError(
                f"model.qk_norm={self.qk_norm!r} is not one of {', '.join(QK_NORMS)} (or null: none)"
            )
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(
                f"model.norm_placement={self.norm_placement!r} is not one of {', '.join(NORM_PLACEMENTS)}"
            )
        if self.rope_scaling is not None:
            self.rope_scaling = check_rope_scaling(self.rope_scaling, self.position)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                f"choose d_model a multiple of n_heads (or set model.head_dim)"
            )
        n_kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.n_heads % n_kv:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={n_kv}; "
                f"n_kv_heads must divide n_heads (n_heads for MHA, 1 for MQA)"
            )
        hd = self.head_dim if self.head_dim is not None else self.d_model // self.n_heads
        # (multi-head latent attention's rotated width is model.mla.qk_rope_head_dim)
        if self.position == "rope" and hd % 2 and self.attention_kind != "mla":
            raise ConfigError(f"RoPE needs an even head_dim, got {hd}; change model.d_model or model.n_heads")
        self._validate_rotary_dim(hd)
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not float(self.norm_eps) > 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be > 0")
        if not float(self.rope_theta) > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0")
        self._validate_windows()
        self._validate_nope()
        if self.rope_local_theta is not None:
            if self.position != "rope":
                raise ConfigError(
                    f"model.rope_local_theta needs model.position=rope (it is {self.position}); set it to "
                    f"null"
                )
            if not _positive(self.rope_local_theta):
                raise ConfigError(f"model.rope_local_theta={self.rope_local_theta!r} must be a number > 0")
        for name in ("query_pre_attn_scalar", "attn_softcap", "logit_softcap"):
            v = getattr(self, name)
            if v is not None and not _positive(v):
                raise ConfigError(f"model.{name}={v!r} must be a number > 0 (or null: none)")
        if not isinstance(self.scale_embeddings, bool):
            raise ConfigError(f"model.scale_embeddings={self.scale_embeddings!r} must be true or false")
        for name in ("attn_sinks", "attn_output_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model.{name}={getattr(self, name)!r} must be true or false")
        self._validate_mla()
        self._validate_gdn()
        s = self.rope_scaling
        if s is not None and s["type"] == "longrope":
            # the features RoPE turns: model.rotary_dim, else the head (MLA: model.mla.qk_rope_head_dim)
            pairs = (self.mla.qk_rope_head_dim if self.mla is not None else self.rotary_dim or hd) // 2
            for k in ROPE_FACTOR_LISTS:
                if len(s[k]) != pairs:
                    raise ConfigError(
                        f"model.rope_scaling.{k} has {len(s[k])} numbers; it needs {pairs}, one per pair of "
                        f"features RoPE turns (model.rotary_dim, else head_dim, / 2)"
                    )
        if self.moe is not None:
            self.moe = MoEConfig.from_dict(self.moe)
            self.moe.validate(self.n_layers)
            if self.mlp != "swiglu":
                raise ConfigError(
                    f"model.moe: the experts are SwiGLU MLPs, but model.mlp={self.mlp}; set model.mlp=swiglu"
                )
        if self.mtp is not None:
            self.mtp = MTPConfig.from_dict(self.mtp)
            self.mtp.validate()
            if self.mtp.depth == 0:
                # no module: one spelling (null) for one model
                self.mtp = None

    def _validate_mla(self) -> None:
        """model.mla with attention_kind=mla: ConfigError (one line) when missing, invalid, or beside a knob
        multi-head latent attention does not have."""
        if self.attention_kind != "mla":
            if self.mla is not None:
                raise ConfigError(
                    f"model.mla is set but model.attention_kind={self.attention_kind}; set "
                    f"model.attention_kind=mla (or model.mla=null)"
                )
            return
        if self.mla is None:
            raise ConfigError(
                "model.attention_kind=mla needs model.mla: {kv_lora_rank, qk_nope_head_dim, "
                "qk_rope_head_dim, v_head_dim, q_lora_rank} (see conf/model/mla-tiny.yaml)"
            )
        self.mla = MLAConfig.from_dict(self.mla)
        self.mla.validate()
        # knobs of multi-head attention's projections that have no place in MLA's
        for name, why in (
            ("qk_norm", "its latent and low-rank query have their own RMSNorms"),
            ("rotary_dim", "the rotated width is model.mla.qk_rope_head_dim"),
            ("query_pre_attn_scalar", "scores are scaled by (qk_nope_head_dim + qk_rope_head_dim)^-0.5"),
        ):
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"model.{name} does not apply to model.attention_kind=mla ({why}); set it to null"
                )
        if self.n_kv_heads not in (None, self.n_heads):
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not apply to model.attention_kind=mla (each head's "
                f"key and value come from one cached latent); set it to null"
            )

    def _validate_gdn(self) -> None:
        """model.gdn with linear layers: ConfigError (one line) when missing, invalid, set without a linear
        layer, or mixed in a way the layers cannot take."""
        types = self.layer_types or ()
        if self.attention_kind == LINEAR_KIND and any(t != "linear" for t in types):
            raise ConfigError(
                f"model.attention_kind={LINEAR_KIND} makes every layer linear, but model.layer_types holds "
                f"{', '.join(sorted(set(types) - {'linear'}))}: for a hybrid set model.attention_kind=mha "
                f"(the full layers' kind) and mark the linear layers `linear` in model.layer_types"
            )
        linear = self.attention_kind == LINEAR_KIND or "linear" in types
        if not linear:
            if self.gdn is not None:
                raise ConfigError(
                    "model.gdn is set but no layer is linear; mark some `linear` in model.layer_types (or "
                    "set model.gdn=null)"
                )
            return
        if self.gdn is None:
            raise ConfigError(
                "linear layers (Gated DeltaNet) need model.gdn: {n_key_heads, n_value_heads, key_head_dim, "
                "value_head_dim, conv_kernel, chunk_size} (see conf/model/gdn-tiny.yaml)"
            )
        self.gdn = GDNConfig.from_dict(self.gdn)
        self.gdn.validate()
        if self.attention_kind == LINEAR_KIND:
            # knobs of softmax attention, with no softmax layer to apply to
            for name in ("sliding_window", "qk_norm", "query_pre_attn_scalar", "attn_softcap"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"model.{name} applies to softmax attention layers, but model.attention_kind="
                        f"{LINEAR_KIND} has none; set it to null"
                    )
            for name in ("attn_sinks", "attn_output_gate"):
                if getattr(self, name):
                    raise ConfigError(
                        f"model.{name} applies to softmax attention layers, but model.attention_kind="
                        f"{LINEAR_KIND} has none; set it to false"
                    )

    def _validate_rotary_dim(self, head_dim: int) -> None:
        """model.rotary_dim: ConfigError (one line) unless null or an even width within a RoPE head."""
        r = self.rotary_dim
        if r is None:
            return
        if self.position != "rope":
            raise ConfigError(
                f"model.rotary_dim={r!r} needs model.position=rope (it is {self.position}); set it to null"
            )
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or r % 2:
            raise ConfigError(
                f"model.rotary_dim={r!r} must be a positive even integer (the features of each head RoPE "
                f"turns), or null for the whole head"
            )
        if r > head_dim:
            raise ConfigError(
                f"model.rotary_dim={r} exceeds head_dim={head_dim}: RoPE turns part of a head at most; set "
                f"it <= {head_dim} (or null for the whole head)"
            )
        if "rope" in self.kernels and r < head_dim:
            raise ConfigError(
                f"model.kernels=[rope] turns whole heads, but model.rotary_dim={r} < head_dim={head_dim}; "
                f"drop rope from model.kernels (or set model.rotary_dim=null)"
            )

    def _validate_windows(self) -> None:
        """model.sliding_window and model.layer_types: ConfigError (one line) when they do not fit."""
        w = self.sliding_window
        if w is not None:
            if not isinstance(w, int) or isinstance(w, bool) or w < 1:
                raise ConfigError(
                    f"model.sliding_window={w!r} must be a positive integer (the positions a local layer "
                    f"attends to), or null for full attention in every layer"
                )
            if w > self.max_seq_len:
                raise ConfigError(
                    f"model.sliding_window={w} exceeds model.max_seq_len={self.max_seq_len}: a window is "
                    f"part of the context; set it <= {self.max_seq_len} (or null for full attention)"
                )
        types = self.layer_types
        if types is None:
            return
        if isinstance(types, str) or not isinstance(types, Sequence):
            raise ConfigError(
                f"model.layer_types={types!r} must be a list of {', '.join(LAYER_TYPES)}, one per layer "
                f"(or null)"
            )
        types = [str(t) for t in types]
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(
                f"model.layer_types holds {', '.join(bad)}: each must be one of {', '.join(LAYER_TYPES)} (a "
                f"full-attention layer is global)"
            )
        if len(types) != self.n_layers:
            raise ConfigError(
                f"model.layer_types has {len(types)} entries but model.n_layers={self.n_layers}: give one "
                f"({' or '.join(LAYER_TYPES)}) per layer"
            )
        if w is None and "local" in types:
            raise ConfigError(
                "model.layer_types has local layers but model.sliding_window is null: set the window "
                "(e.g. model.sliding_window=512), or make every layer global"
            )
        self.layer_types = types

    def _validate_nope(self) -> None:
        """model.nope_layers: ConfigError (one line) when it does not fit; sorted, [] as null."""
        nope = self.nope_layers
        if nope is None:
            return
        if isinstance(nope, str) or not isinstance(nope, Sequence):
            raise ConfigError(
                f"model.nope_layers={nope!r} must be a list of layer indices (from 0) that apply no rotary "
                f"embedding, or null (every layer rotates)"
            )
        bad = [i for i in nope if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(
                f"model.nope_layers holds {', '.join(map(repr, bad))}: each must be a layer index from 0 to "
                f"{self.n_layers - 1} (model.n_layers={self.n_layers})"
            )
        if len(set(nope)) != len(nope):
            raise ConfigError(
                f"model.nope_layers={list(nope)} names a layer twice; name each NoPE layer once"
            )
        if nope and self.position != "rope":
            raise ConfigError(
                f"model.nope_layers needs model.position=rope (it is {self.position}): only a rotary "
                f"embedding can be left out of a layer; set it to null"
            )
        self.nope_layers = sorted(nope) or None

    # ---- conversion ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """A ModelConfig from the `model` group (unknown keys are an error), validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(names))}"
            )
        return cls(**{k: v for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        """The config as the plain dict a run folder's config.yaml holds."""
        return dataclasses.asdict(self)


def check_rope_scaling(d: Any, position: str) -> dict[str, Any]:
    """model.rope_scaling as a plain dict holding every key of its type (the optional ones at their defaults),
    numbers as floats (the original context as an int); ConfigError naming what is wrong."""
    if position != "rope":
        raise ConfigError(f"model.rope_scaling needs model.position=rope (it is {position}); set it to null")
    if not isinstance(d, Mapping) or "type" not in d:
        raise ConfigError(
            f"model.rope_scaling={d!r} must be null or a mapping with type: one of {', '.join(ROPE_SCALINGS)}"
        )
    if d["type"] not in ROPE_SCALINGS:
        raise ConfigError(
            f"model.rope_scaling type {d['type']!r} is not known; known types: {', '.join(ROPE_SCALINGS)}"
        )
    need, optional = ROPE_SCALING_KEYS[d["type"]]
    have = set(d) - {"type"}
    if not set(need) <= have <= set(need) | set(optional):
        raise ConfigError(
            f"model.rope_scaling of type {d['type']} takes {', '.join(need)}"
            + (f" (optional: {', '.join(optional)})" if optional else "")
            + f" (missing: {', '.join(sorted(set(need) - have)) or '-'}; unknown: "
            f"{', '.join(sorted(have - set(need) - set(optional))) or '-'})"
        )
    out: dict[str, Any] = {"type": d["type"]}
    for k in (*need, *optional):
        v = d.get(k, optional.get(k))
        if k in ROPE_FACTOR_LISTS:
            if not isinstance(v, Sequence) or isinstance(v, str) or not v or not all(_positive(x) for x in v):
                raise ConfigError(
                    f"model.rope_scaling.{k} must be a list of positive numbers, one per pair of features "
                    f"RoPE turns (got {str(v)[:60]})"
                )
            out[k] = [float(x) for x in v]
            continue
        if k == "truncate":
            if not isinstance(v, bool):
                raise ConfigError(f"model.rope_scaling.truncate={v!r} must be true or false")
            out[k] = v
            continue
        if v is None and k in optional and optional[k] is None:
            out[k] = None
            continue
        if not _positive(v):
            raise ConfigError(f"model.rope_scaling.{k}={v!r} must be a positive number")
        out[k] = int(v) if k == "original_max_seq_len" else float(v)
    if out["type"] == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError(
            f"model.rope_scaling: high_freq_factor={out['high_freq_factor']} must exceed "
            f"low_freq_factor={out['low_freq_factor']}"
        )
    return out


def _positive(v: Any) -> bool:
    """v is a finite number > 0 (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf")


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's rule for the SwiGLU width: 2/3 of 4*d_model, rounded up to a multiple."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
