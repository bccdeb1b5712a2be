"""The model's sub-configurations, each a mapping under model.<key> with its own rules: model.moe (a
mixture of experts), model.mtp (multi-token prediction), model.mla (multi-head latent attention), model.gdn
(Gated DeltaNet). ModelConfig (config.py) holds them and checks how they combine with its other fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from gptkit.errors import ConfigError


def _positive(v: Any) -> bool:
    """v is a finite number > 0 (not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf")


class SubConfig:
    """A model.<KEY> mapping read into a dataclass: unknown keys are one-line errors."""

    # model.<KEY> in one-line errors, and SHAPE: what a valid value looks like
    KEY = ""
    SHAPE = ""

    @classmethod
    def from_dict(cls, d: Any):
        """model.<KEY> as given (a mapping: unknown keys are an error)."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise ConfigError(f"model.{cls.KEY}={d!r} must be {cls.SHAPE}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model.{cls.KEY} field(s) {', '.join(map(str, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(d))


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
# model.gdn.layout: Gated DeltaNet's input projections as Qwen3-Next holds them | as Qwen3.5 does
GDN_LAYOUTS = ("grouped", "split")


@dataclass
class MoEConfig(SubConfig):
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

    KEY = "moe"
    SHAPE = "null (a dense model) or a mapping such as {n_experts: 8, top_k: 2}"


@dataclass
class MTPConfig(SubConfig):
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

    KEY = "mtp"
    SHAPE = "null (no MTP) or a mapping such as {depth: 1, loss_scale: 0.3}"


@dataclass
class MLAConfig(SubConfig):
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

    KEY = "mla"
    SHAPE = (
        "a mapping such as {kv_lora_rank: 512, qk_nope_head_dim: 128, qk_rope_head_dim: 64, v_head_dim: 128, "
        "q_lora_rank: null}"
    )


@dataclass
class GDNConfig(SubConfig):
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
    # how the input projections hold their rows (GDN_LAYOUTS; the computation is the same): grouped,
    # Qwen3-Next's in_proj_qkvz and in_proj_ba (each key head's q, k, then its value heads' v, z; b, a) |
    # split, Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a
    layout: str = "grouped"

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
            if name.name == "layout":
                if v not in GDN_LAYOUTS:
                    raise ConfigError(f"model.gdn.layout={v!r} must be one of {', '.join(GDN_LAYOUTS)}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"model.gdn.{name.name}={v!r} must be a positive integer")
        if self.n_value_heads % self.n_key_heads:
            raise ConfigError(
                f"model.gdn.n_value_heads={self.n_value_heads} is not a multiple of model.gdn.n_key_heads="
                f"{self.n_key_heads}: each key head serves a whole group of value heads"
            )

    KEY = "gdn"
    SHAPE = (
        "a mapping such as {n_key_heads: 16, n_value_heads: 32, key_head_dim: 128, value_head_dim: 128, "
        "conv_kernel: 4, chunk_size: 64, layout: grouped}"
    )
