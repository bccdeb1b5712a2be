"""The model configuration: one dataclass whose fields switch the variants.

Presets are data (YAML under conf/model/); this file only knows the fields and their rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gptkit.errors import ConfigError
from gptkit.model import attention_kinds as _attention_kinds
from gptkit.model.sub_configs import (  # noqa: F401 (the sub-configurations' names, read from here too)
    AUX_LOSS_GROUPS,
    EXPERT_ACTIVATIONS,
    MOE_IMPLS,
    ROUTERS,
    GDNConfig,
    MLAConfig,
    MoEConfig,
    MTPConfig,
    _positive,
)

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
    # a scalar head `score` [1, d_model] on the final-normed hidden state (a reward model: objective=reward,
    # docs/reward-models.md); such a model scores sequences and is refused as a policy (sample, chat, serve,
    # init_from= of another objective)
    score_head: bool = False
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


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's rule for the SwiGLU width: 2/3 of 4*d_model, rounded up to a multiple."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
