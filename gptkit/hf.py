"""Hugging Face `transformers` interop: the mapping between a gptkit GPT and the transformers architectures.

    gptkit variant (rope + swiglu + rmsnorm, any n_kv_heads)    transformers architecture
    bias = qkv_bias, no qk_norm                              -> LlamaForCausalLM (attention_bias + mlp_bias)
    bias=false, qkv_bias=true (biases on q/k/v only)         -> Qwen2ForCausalLM
    qk_norm=head (RMSNorm per head of q and k), no biases    -> Qwen3ForCausalLM
    qk_norm=full, norm_placement=post, no biases             -> Olmo2ForCausalLM (x + norm(f(x)))
    learned + gelu + layernorm + bias, MHA                   -> GPT2LMHeadModel (Conv1D weights are
                                                                [in, out]: transposed)
    Llama's fields, a sliding window in every layer          -> MistralForCausalLM
    Qwen2's / Qwen3's fields, the last layers local           -> Qwen2/Qwen3 (use_sliding_window)
    geglu + rmsnorm_unit_offset + sandwich + scaled embeddings:
      no qk_norm (soft-caps, any layer_types)                 -> Gemma2ForCausalLM
      qk_norm=head (rope_local_theta: local layers' RoPE)     -> Gemma3ForCausalLM (gemma3_text)
    model.moe (softmax router, no shared experts, no expert bias), no biases:
      no qk_norm, every layer MoE, top-k renormalized        -> MixtralForCausalLM
      qk_norm=head (moe.every, moe.first_dense: dense layers) -> Qwen3MoeForCausalLM
      qk_norm=full, norm_placement=pre, every layer MoE       -> OlmoeForCausalLM
RoPE may carry model.rope_scaling (llama3, linear, dynamic, yarn) on every RoPE architecture.

An MoE layer's experts are our three [E, out, in] tensors (gptkit/model/moe.py) and, in transformers' files
(the Hub's layout, which transformers 5 still writes), E tensors each: experts.<j>.w1/w3/w2 (Mixtral) or
experts.<j>.gate_proj/up_proj/down_proj: a STACK row of the name map. transformers 5 holds them in memory as
two fused tensors per layer (experts.gate_up_proj [E, 2 * d_expert, d_model], experts.down_proj), which
to_transformers and from_transformers convert to and from (memory_layout, files_layout).

Any other combination is refused with a GptkitError that names the variant that does not map:
never a silently different model. RoPE is in the rotate-half layout on both sides and GELU is the
tanh approximation (GPT-2's gelu_new) on both sides, so no permutation or activation change is needed.

Two levels here:
  - plain data (no `transformers` needed): hf_config(), to_hf_state_dict(), model_config_from_hf(),
    from_hf_state_dict();
  - in memory: to_transformers(model) and from_transformers(hf_model) (need `transformers`).
Folders (safetensors shards, tokenizer files, a Hub model, `gptkit import`) are gptkit/hf_io.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gptkit import adapters
from gptkit.errors import GptkitError
from gptkit.model import GPT
from gptkit.model.config import ROPE_SCALING_KEYS, ROPE_SCALINGS, ModelConfig, check_rope_scaling

# transformers (optional, the test extra), huggingface_hub and torch are imported where used: `gptkit import`
# of a local folder needs no hub, and the mapping tables load without transformers.

# transformers' model_type
LLAMA, QWEN2, QWEN3, OLMO2, GPT2 = "llama", "qwen2", "qwen3", "olmo2", "gpt2"
MISTRAL, GEMMA2, GEMMA3 = "mistral", "gemma2", "gemma3_text"
MIXTRAL, QWEN3_MOE, OLMOE = "mixtral", "qwen3_moe", "olmoe"
ARCHITECTURES = {
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    OLMO2: "Olmo2ForCausalLM",
    GPT2: "GPT2LMHeadModel",
    MISTRAL: "MistralForCausalLM",
    GEMMA2: "Gemma2ForCausalLM",
    GEMMA3: "Gemma3ForCausalLM",
    MIXTRAL: "MixtralForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    OLMOE: "OlmoeForCausalLM",
}
CONFIG_CLASSES = {
    LLAMA: "LlamaConfig",
    QWEN2: "Qwen2Config",
    QWEN3: "Qwen3Config",
    OLMO2: "Olmo2Config",
    GPT2: "GPT2Config",
    MISTRAL: "MistralConfig",
    GEMMA2: "Gemma2Config",
    GEMMA3: "Gemma3TextConfig",
    MIXTRAL: "MixtralConfig",
    QWEN3_MOE: "Qwen3MoeConfig",
    OLMOE: "OlmoeConfig",
}
# the mixtures of experts, by the qk_norm of their attention
MOE_ARCHITECTURES = {None: MIXTRAL, "head": QWEN3_MOE, "full": OLMOE}
# Gemma's decoder (GeGLU, (1 + w) RMSNorm, sandwich norms, scaled embeddings), by the qk_norm of its attention
GEMMA_ARCHITECTURES = {None: GEMMA2, "head": GEMMA3}
# the decoder layout of Llama, with their own twists
ROPE_ARCHITECTURES = (
    LLAMA,
    QWEN2,
    QWEN3,
    OLMO2,
    MISTRAL,
    *GEMMA_ARCHITECTURES.values(),
    *MOE_ARCHITECTURES.values(),
)
# the architectures whose layers may attend to a sliding window, and their model.layer_types: Mistral's every
# layer (sliding_window); Qwen2's and Qwen3's the layers from max_window_layers on; Gemma's any (layer_types)
WINDOWED = (MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3)
# transformers' layer_types <-> model.layer_types
LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
# Gemma's activation, the tanh approximation of GELU (model.mlp=geglu)
GEMMA_GELU = "gelu_pytorch_tanh"
# the fields only Gemma's architectures carry, at the values every other architecture needs
NOT_GEMMA = {"scale_embeddings": False, "attn_softcap": None, "logit_softcap": None, "rope_local_theta": None}
# both are the tanh approximation gptkit uses
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# What each RoPE architecture fixes beyond rope + swiglu + rmsnorm (the keys of ModelConfig)
ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    QWEN2: {"bias": False, "qkv_bias": True, "qk_norm": None, "norm_placement": "pre"},
    QWEN3: {"bias": False, "qkv_bias": False, "qk_norm": "head", "norm_placement": "pre"},
    OLMO2: {"bias": False, "qkv_bias": False, "qk_norm": "full", "norm_placement": "post"},
    MIXTRAL: {"bias": False, "qkv_bias": False, "qk_norm": None, "norm_placement": "pre"},
    QWEN3_MOE: {"bias": False, "qkv_bias": False, "qk_norm": "head", "norm_placement": "pre"},
    OLMOE: {"bias": False, "qkv_bias": False, "qk_norm": "full", "norm_placement": "pre"},
    MISTRAL: {"bias": False, "qkv_bias": False, "qk_norm": None, "norm_placement": "pre"},
    GEMMA2: {
        "mlp": "geglu",
        "norm": "rmsnorm_unit_offset",
        "norm_placement": "sandwich",
        "scale_embeddings": True,
        "bias": False,
        "qkv_bias": False,
        "qk_norm": None,
        "rope_local_theta": None,
    },
    GEMMA3: {
        "mlp": "geglu",
        "norm": "rmsnorm_unit_offset",
        "norm_placement": "sandwich",
        "scale_embeddings": True,
        "bias": False,
        "qkv_bias": False,
        "qk_norm": "head",
    },
}
# What the MoE architectures fix of model.moe (the keys of MoEConfig); the losses and impl are training's
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    MIXTRAL: {"router": "softmax", "norm_topk_prob": True, "every": 1, "first_dense": 0},
    QWEN3_MOE: {"router": "softmax"},
    OLMOE: {"router": "softmax", "every": 1, "first_dense": 0},
}
MOE_COMMON = {"n_shared": 0, "route_scale": 1.0, "bias_update_rate": 0.0}


# ---- which architecture ------------------------------------------------------------------------
def architecture(cfg: ModelConfig) -> str:
    """The transformers model_type of a mappable config; GptkitError naming the first variant that does not
    map."""
    if cfg.moe is not None:
        return _moe_architecture(cfg)
    gemma = {"mlp": "geglu", "norm": "rmsnorm_unit_offset", "norm_placement": "sandwich"}
    if cfg.position == "rope" and (
        any(getattr(cfg, k) == v for k, v in gemma.items()) or cfg.scale_embeddings
    ):
        arch = GEMMA_ARCHITECTURES.get(cfg.qk_norm, GEMMA3)
        need: dict[str, Any] = dict(ROPE_VARIANTS[arch])
        target = f"{ARCHITECTURES[arch]} (the transformers architecture for Gemma with qk_norm={cfg.qk_norm})"
    elif cfg.position == "rope":
        need = {"mlp": "swiglu", "norm": "rmsnorm", **NOT_GEMMA}
        target = "the transformers architectures for RoPE models (Llama, Mistral, Qwen2, Qwen3, OLMo-2)"
        arch = LLAMA
        if cfg.local_layers:
            arch, target = _windowed_architecture(cfg)
            need |= ROPE_VARIANTS[arch]
        elif cfg.qk_norm is not None or cfg.norm_placement != "pre" or cfg.qkv_bias != cfg.bias:
            arch = {None: QWEN2, "head": QWEN3, "full": OLMO2}[cfg.qk_norm]
            need |= ROPE_VARIANTS[arch]
            target = f"{ARCHITECTURES[arch]} (the transformers architecture for qk_norm={cfg.qk_norm})"
        else:
            need |= {"qk_norm": None, "norm_placement": "pre"}
    else:
        need = {
            "mlp": "gelu",
            "norm": "layernorm",
            "bias": True,
            "qkv_bias": True,
            "qk_norm": None,
            "norm_placement": "pre",
            "n_kv_heads": cfg.n_heads,
            "head_dim": cfg.d_model // cfg.n_heads,
            **NOT_GEMMA,
        }
        target = "GPT-2 (the transformers architecture for learned-position models)"
        arch = GPT2
    if arch not in GEMMA_ARCHITECTURES.values() and cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
        need["query_pre_attn_scalar"] = cfg.head_dim
    if arch not in WINDOWED and cfg.local_layers:
        need["sliding_window"] = None
    for name, want in need.items():
        have = getattr(cfg, name)
        if have != want:
            raise GptkitError(
                f"model.{name}={have} with position={cfg.position} has no faithful "
                f"transformers architecture: {target} needs {name}={want}; refusing rather "
                f"than produce a different model"
            )
    return arch


def _windowed_architecture(cfg: ModelConfig) -> tuple[str, str]:
    """(model_type, what it is) of a Llama-style config with local layers: Mistral when every layer is local,
    Qwen2 (q/k/v biases) or Qwen3 (qk_norm=head) when the local layers are the last ones (their
    max_window_layers); GptkitError otherwise."""
    local = cfg.local_layers
    if cfg.qkv_bias and not cfg.bias or cfg.qk_norm == "head":
        arch = QWEN3 if cfg.qk_norm == "head" else QWEN2
        if local != list(range(local[0], cfg.n_layers)):
            raise GptkitError(
                f"model.layer_types={cfg.layer_types} has no faithful transformers architecture: "
                f"{ARCHITECTURES[arch]} slides its window in the layers from max_window_layers on only "
                f"(the last ones); refusing rather than produce a different model"
            )
        return arch, f"{ARCHITECTURES[arch]} (q/k/v biases or qk_norm=head, with local layers)"
    if len(local) != cfg.n_layers:
        raise GptkitError(
            f"model.layer_types={cfg.layer_types} with qk_norm={cfg.qk_norm} has no faithful transformers "
            f"architecture: MistralForCausalLM (the Llama layout with a window) slides it in every layer; "
            f"refusing rather than produce a different model"
        )
    return MISTRAL, "MistralForCausalLM (the Llama layout with a sliding window in every layer)"


def _moe_architecture(cfg: ModelConfig) -> str:
    """Mixtral, Qwen3-MoE or OLMoE for a config with model.moe, by its attention's qk_norm."""
    arch = MOE_ARCHITECTURES.get(cfg.qk_norm)
    target = f"{ARCHITECTURES[arch]} (the transformers mixture of experts for qk_norm={cfg.qk_norm})"
    need = {"position": "rope", "mlp": "swiglu", "norm": "rmsnorm", **NOT_GEMMA} | ROPE_VARIANTS[arch]
    if cfg.local_layers:
        need["sliding_window"] = None
    if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
        need["query_pre_attn_scalar"] = cfg.head_dim
    for name, want in need.items():
        have = getattr(cfg, name)
        if have != want:
            raise GptkitError(
                f"model.{name}={have} with model.moe has no faithful transformers architecture: {target} "
                f"needs {name}={want}; refusing rather than produce a different model"
            )
    for name, want in (MOE_COMMON | MOE_VARIANTS[arch]).items():
        have = getattr(cfg.moe, name)
        if have != want:
            why = " (the expert bias moves the top-k choice; transformers' model has none)" * (
                name == "bias_update_rate"
            )
            raise GptkitError(
                f"model.moe.{name}={have} has no faithful transformers architecture: {target} needs "
                f"moe.{name}={want}{why}; refusing rather than produce a different model"
            )
    return arch


# ---- config ------------------------------------------------------------------------------------
def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters (5.x) for cfg's (global layers') RoPE: default, or its scaling's
    rope_type with its numbers (a yarn scaling's optional ones only when set)."""
    s = cfg.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    d: dict[str, Any] = {"rope_type": s["type"], "rope_theta": cfg.rope_theta, "factor": s["factor"]}
    if s["type"] == "llama3":
        d |= {"low_freq_factor": s["low_freq_factor"], "high_freq_factor": s["high_freq_factor"]}
    # dynamic: transformers' original context is max_position_embeddings (hf_config writes it there)
    if s["type"] in ("llama3", "yarn"):
        d["original_max_position_embeddings"] = s["original_max_seq_len"]
    if s["type"] == "yarn":
        d |= {"beta_fast": s["beta_fast"], "beta_slow": s["beta_slow"]}
        d |= {k: s[k] for k in ("attention_factor", "mscale", "mscale_all_dim") if s[k] is not None}
        if not s["truncate"]:
            d["truncate"] = False
    return d


def rope_scaling_from_hf(rope: dict[str, Any], d: dict[str, Any], refuse) -> dict[str, Any] | None:
    """model.rope_scaling of transformers' rope parameters (rope_parameters, or the older rope_scaling) of
    config.json `d`; `refuse(field, value, want)` makes the GptkitError for what gptkit cannot represent."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALINGS:
        raise refuse("rope_type", rope_type, f"plain RoPE or rope_type {', '.join(ROPE_SCALINGS)}")
    mpe = d.get("max_position_embeddings")
    original = rope.get("original_max_position_embeddings") or (mpe if rope_type != "llama3" else None)
    factor = rope.get("factor")
    # YaRN without a factor: the ratio of the two contexts (transformers' rule)
    if rope_type == "yarn" and factor is None and isinstance(original, int) and isinstance(mpe, int):
        factor = mpe / original
    scaling: dict[str, Any] = {"type": rope_type, "factor": factor}
    if rope_type == "llama3":
        scaling |= {k: rope.get(k) for k in ("low_freq_factor", "high_freq_factor")}
    if rope_type != "linear":
        # dynamic: transformers scales past max_position_embeddings
        scaling["original_max_seq_len"] = mpe if rope_type == "dynamic" else original
    if rope_type == "yarn":
        scaling |= {
            "beta_fast": rope.get("beta_fast") or 32.0,
            "beta_slow": rope.get("beta_slow") or 1.0,
            "attention_factor": rope.get("attention_factor"),
            "mscale": rope.get("mscale"),
            "mscale_all_dim": rope.get("mscale_all_dim"),
            "truncate": bool(rope.get("truncate", True)),
        }
    absent = [k for k, v in scaling.items() if v is None and k in ROPE_SCALING_KEYS[rope_type][0]]
    if absent:
        raise refuse("rope_scaling", rope, f"rope_type {rope_type} needs {', '.join(absent)}")
    try:
        return check_rope_scaling(scaling, "rope")
    except GptkitError as exc:
        raise refuse("rope_scaling", rope, str(exc)) from None


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' layer_types of cfg: sliding_attention for a local layer, full_attention for a global."""
    return ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)]


def hf_config(
    cfg: ModelConfig,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json of the transformers model equal to `cfg`."""
    arch = architecture(cfg)
    common = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
        "use_cache": True,
    }
    if arch in ROPE_ARCHITECTURES:
        rope = rope_parameters(cfg)
        s = cfg.rope_scaling
        d = common | {
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            # dynamic NTK scales past transformers' max_position_embeddings: its original context
            "max_position_embeddings": s["original_max_seq_len"]
            if s and s["type"] == "dynamic"
            else cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": "silu",
            "attention_dropout": cfg.dropout,
            # read by transformers < 5; 5.x reads rope_parameters
            "rope_theta": cfg.rope_theta,
            "rope_parameters": rope,
        }
        # transformers < 5 reads the scaling from rope_scaling
        if cfg.rope_scaling is not None:
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if arch == LLAMA:
            d |= {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}
        elif arch in (QWEN3, OLMO2, QWEN3_MOE, OLMOE, MISTRAL):
            d |= {"attention_bias": False}
        if arch in (QWEN2, QWEN3, QWEN3_MOE):
            d |= {"use_sliding_window": False, "sliding_window": None}
        if arch in (QWEN2, QWEN3) and cfg.local_layers:
            d |= {
                "use_sliding_window": True,
                "sliding_window": cfg.sliding_window,
                "max_window_layers": cfg.local_layers[0],
                "layer_types": hf_layer_types(cfg),
            }
        if arch == MISTRAL:
            d["sliding_window"] = cfg.sliding_window if cfg.local_layers else None
        if arch in GEMMA_ARCHITECTURES.values():
            d |= gemma_hf_config(cfg, arch)
        if cfg.moe is not None:
            d |= moe_hf_config(cfg, arch)
        return d
    return common | {
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": cfg.d_ff,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def gemma_hf_config(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """The config.json keys of Gemma 2 (Gemma2ForCausalLM) or Gemma 3's text model (Gemma3ForCausalLM) that
    differ from Llama's: the activation, the attention scale and soft-caps, the layer types and (Gemma 3) the
    RoPE of each layer type."""
    d: dict[str, Any] = {
        "hidden_activation": GEMMA_GELU,
        "attention_bias": False,
        # an integer in transformers' configs
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.logit_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": hf_layer_types(cfg),
    }
    # its own key, hidden_activation, is the one read
    d["hidden_act"] = GEMMA_GELU
    if arch == GEMMA3:
        full = rope_parameters(cfg)
        local = (
            full
            if cfg.rope_local_theta is None
            else {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
        )
        d |= {"rope_parameters": {"full_attention": full, "sliding_attention": local}}
        # transformers < 5 reads rope_theta, rope_scaling (the global layers') and this
        d["rope_local_base_freq"] = local["rope_theta"]
    return d


def moe_hf_config(cfg: ModelConfig, arch: str) -> dict[str, Any]:
    """The config.json keys of a mixture of experts (Mixtral, Qwen3-MoE, OLMoE), as the Hub's configs name
    them."""
    m = cfg.moe
    d: dict[str, Any] = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef}
    if arch == MIXTRAL:
        return d | {
            "intermediate_size": m.d_expert,
            "num_local_experts": m.n_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "output_router_logits": False,
        }
    d |= {"num_experts": m.n_experts, "norm_topk_prob": m.norm_topk_prob, "output_router_logits": False}
    if arch == OLMOE:
        # read back by gptkit import (transformers' OlmoeConfig keeps it as an extra key)
        z = {"router_z_loss_coef": m.z_loss_coef} if m.z_loss_coef else {}
        return d | {"intermediate_size": m.d_expert, "clip_qkv": None} | z
    return d | {
        "intermediate_size": cfg.d_ff,
        "moe_intermediate_size": m.d_expert,
        "decoder_sparse_step": m.every,
        "mlp_only_layers": list(range(m.first_dense)),
    }


def moe_from_hf(d: dict[str, Any], mtype: str) -> tuple[dict[str, Any], int]:
    """(model.moe, model.d_ff) of a Mixtral, Qwen3-MoE or OLMoE config.json; GptkitError for what gptkit
    cannot represent."""

    def refuse(field: str, value: Any, want: str) -> GptkitError:
        return GptkitError(f"{mtype} config has {field}={value!r}, which gptkit cannot represent ({want})")

    experts = d.get("num_experts", d.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok"))):
        if not isinstance(value, int) or isinstance(value, bool):
            raise GptkitError(
                f"{mtype} config.json has no {key} (an integer), which gptkit does not guess; add it to "
                f"config.json"
            )
    moe: dict[str, Any] = {
        "n_experts": experts,
        "top_k": d["num_experts_per_tok"],
        "router": "softmax",
        "aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
    }
    if mtype == MIXTRAL:
        if d.get("sliding_window") is not None:
            raise refuse("sliding_window", d["sliding_window"], "full attention in every layer: null")
        if float(d.get("router_jitter_noise") or 0.0):
            raise refuse("router_jitter_noise", d["router_jitter_noise"], "no router noise: 0.0")
        return moe | {"d_expert": d["intermediate_size"], "norm_topk_prob": True}, d["intermediate_size"]
    moe["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
    if mtype == OLMOE:
        if d.get("clip_qkv") is not None:
            raise refuse("clip_qkv", d["clip_qkv"], "q, k and v unclipped: null")
        if float(d.get("router_z_loss_coef") or 0.0):
            moe["z_loss_coef"] = float(d["router_z_loss_coef"])
        return moe | {"d_expert": d["intermediate_size"]}, d["intermediate_size"]
    dense = sorted(d.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise refuse("mlp_only_layers", dense, "dense layers only at the start: [0, 1, ..., k - 1]")
    expert_width = d.get("moe_intermediate_size")
    if not isinstance(expert_width, int) or isinstance(expert_width, bool):
        raise GptkitError(
            f"{mtype} config.json has no moe_intermediate_size (an integer), which gptkit does not guess; "
            f"add it to config.json"
        )
    moe |= {
        "d_expert": expert_width,
        "every": int(d.get("decoder_sparse_step") or 1),
        "first_dense": len(dense),
    }
    return moe, d["intermediate_size"]


# config.json's integer fields: the RoPE architectures' required ones (never guessed), their optional ones
# (null or absent: a default), GPT-2's (absent: transformers' default); (field, smallest value)
ROPE_INTS = (
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
)
OPTIONAL_INTS = (
    ("num_key_value_heads", 1),
    ("head_dim", 1),
    ("sliding_window", 1),
    ("max_window_layers", 0),
    ("sliding_window_pattern", 1),
    ("num_experts", 1),
    ("num_local_experts", 1),
    ("num_experts_per_tok", 1),
    ("moe_intermediate_size", 1),
    ("decoder_sparse_step", 1),
)
GPT2_INTS = {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
# (layers, hidden size, vocabulary) as each family names them in config.json
SIZE_FIELDS = {
    "rope": ("num_hidden_layers", "hidden_size", "vocab_size"),
    GPT2: ("n_layer", "n_embd", "vocab_size"),
}


def check_hf_config(d: dict[str, Any]) -> str:
    """The model_type of config.json `d` when gptkit imports it and its numbers are sane: positive integers
    where sizes go (not 0, 1e9 as a float, true or "32"), the heads dividing as attention needs; else one
    GptkitError line naming the field. Checked before anything is sized by them."""
    mtype = d.get("model_type")
    if mtype not in ARCHITECTURES:
        arch = ", ".join(d.get("architectures") or []) or "no architectures field"
        # Gemma 3 4B and up: a vision tower beside the text model
        hint = " (the multimodal Gemma 3: gptkit imports its text-only model_type gemma3_text)" * (
            mtype == "gemma3"
        )
        raise GptkitError(
            f"model_type={mtype!r} ({arch}) is not supported{hint}; gptkit imports Llama, Qwen2, "
            f"Qwen3, OLMo-2, Mistral, Gemma 2, Gemma 3 (text), GPT-2, Mixtral, Qwen3-MoE and OLMoE models "
            f"(model_type {', '.join(ARCHITECTURES)})"
        )

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def check(field: str, least: int = 1) -> None:
        v = d[field]
        if not whole(v) or v < least:
            what = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise GptkitError(f"{mtype} config.json has {field}={v!r}; it must be {what}")

    if mtype == GPT2:
        for field in GPT2_INTS:
            if field in d:
                check(field)
        if d.get("n_inner") is not None:
            check("n_inner")
        n_embd, n_head = d.get("n_embd", GPT2_INTS["n_embd"]), d.get("n_head", GPT2_INTS["n_head"])
        if n_embd % n_head:
            raise GptkitError(
                f"{mtype} config.json has n_embd={n_embd}, not divisible by n_head={n_head}: each head "
                f"needs n_embd / n_head dimensions"
            )
        return mtype
    for field in ROPE_INTS:
        if field not in d or d[field] is None:
            raise GptkitError(
                f"{mtype} config.json has no {field} (an integer), which gptkit does not guess; add it to "
                f"config.json"
            )
        check(field)
    for field, least in OPTIONAL_INTS:
        if d.get(field) is not None:
            check(field, least)
    heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if heads % kv:
        raise GptkitError(
            f"{mtype} config.json has num_attention_heads={heads}, not divisible by "
            f"num_key_value_heads={kv}: each key/value head serves a whole group of query heads"
        )
    if d.get("head_dim") is None and d["hidden_size"] % heads:
        raise GptkitError(
            f"{mtype} config.json has hidden_size={d['hidden_size']}, not divisible by num_attention_heads="
            f"{heads}, and no head_dim: each head needs hidden_size / num_attention_heads dimensions"
        )
    return mtype


# the layer index in a weight's name: model.layers.<i>. (the RoPE architectures), transformer.h.<i>. (GPT-2)
LAYER_NAME = re.compile(r"^(?:model\.layers|(?:transformer\.)?h)\.(\d+)\.")


def check_weight_sizes(d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """config.json `d` (check_hf_config passed) against the weights' names and shapes, read from the files'
    headers before anything is allocated: the layers, hidden size, vocabulary and heads it sets are those the
    weights hold, else one GptkitError line naming the field and what the weights hold (a config of 10^9
    layers is refused at once, never built). The full tensor-by-tensor check is from_hf_state_dict's."""
    mtype = d["model_type"]
    gpt2 = mtype == GPT2
    layers_f, hidden_f, vocab_f = SIZE_FIELDS[GPT2 if gpt2 else "rope"]

    def get(field: str) -> int:
        return d.get(field, GPT2_INTS.get(field)) if gpt2 else d[field]

    def refuse(field: str, held: str) -> GptkitError:
        return GptkitError(
            f"{source} does not match its config.json: {field}={get(field):,}, but the weights hold {held}"
        )

    if gpt2:
        shapes = {
            k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
            for k, v in shapes.items()
        }
    held = {int(m.group(1)) for k in shapes if (m := LAYER_NAME.match(k))}
    if len(held) != get(layers_f):
        prefix = "transformer.h." if gpt2 else "model.layers."
        where = f"{prefix}0 .. {prefix}{max(held)}" if held else ""
        raise refuse(layers_f, f"{len(held):,} layers ({where})" if held else "no layers")
    emb = "transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"
    if emb not in shapes or len(shapes[emb]) != 2:
        raise GptkitError(f"{source} does not match its config.json: it has no 2-D {emb} (the embedding)")
    rows, width = shapes[emb]
    if width != get(hidden_f):
        raise refuse(hidden_f, f"{width:,} ({emb} has shape {tuple(shapes[emb])})")
    if rows != get(vocab_f):
        raise refuse(vocab_f, f"{rows:,} tokens ({emb} has shape {tuple(shapes[emb])})")
    if gpt2:
        # c_attn is [n_embd, 3 * n_embd] whatever n_head is: the weights cannot tell the heads
        return
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    kv = d.get("num_key_value_heads") or d["num_attention_heads"]
    for proj, field, n in (
        ("q_proj", "num_attention_heads", d["num_attention_heads"]),
        ("k_proj", "num_key_value_heads", kv),
    ):
        name = f"model.layers.0.self_attn.{proj}.weight"
        if name in shapes and shapes[name][0] != n * head_dim:
            need = f"{field}={n} x head_dim={head_dim} = {n * head_dim} rows"
            raise GptkitError(
                f"{source} does not match its config.json: {need}, but {name} has shape "
                f"{tuple(shapes[name])} ({shapes[name][0]} rows)"
            )


def model_config_from_hf(d: dict[str, Any], name: str = "imported") -> ModelConfig:
    """The gptkit ModelConfig equal to a transformers config.json of a family in ARCHITECTURES, or a
    GptkitError."""
    mtype = check_hf_config(d)

    def refuse(field: str, value: Any, want: str) -> GptkitError:
        return GptkitError(f"{mtype} config has {field}={value!r}, which gptkit cannot represent ({want})")

    if mtype in ROPE_ARCHITECTURES:
        gemma = mtype in GEMMA_ARCHITECTURES.values()
        if gemma:
            act = d.get("hidden_activation") or d.get("hidden_act") or GEMMA_GELU
            if act != GEMMA_GELU:
                raise refuse("hidden_activation", act, f"the MLPs are GeGLU with tanh GELU: {GEMMA_GELU}")
            if d.get("use_bidirectional_attention"):
                raise refuse("use_bidirectional_attention", True, "causal attention")
        elif d.get("hidden_act", "silu") != "silu":
            raise refuse("hidden_act", d["hidden_act"], "the MLPs are SwiGLU in gptkit: hidden_act=silu")
        rope, local_rope = hf_rope(d, mtype)
        scaling = rope_scaling_from_hf(rope, d, refuse)
        theta = float(rope.get("rope_theta", d.get("rope_theta", GEMMA_THETA.get(mtype, 10000.0))))
        local_theta = None
        if local_rope is not None and (
            rope_scaling_from_hf(local_rope, d, refuse) != scaling
            or local_rope.get("rope_theta", theta) != theta
        ):
            if local_rope.get("rope_type", local_rope.get("type", "default")) != "default":
                raise refuse(
                    "rope_parameters.sliding_attention", local_rope, "plain RoPE in the local layers"
                )
            local_theta = float(local_rope.get("rope_theta", 10000.0))
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse("partial_rotary_factor", d["partial_rotary_factor"], "RoPE over the whole head")
        attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
        if mtype == LLAMA:
            if attn_bias != mlp_bias:
                raise refuse(
                    "attention_bias/mlp_bias", f"{attn_bias}/{mlp_bias}", "one bias flag for all linears"
                )
            variant: dict[str, Any] = {"bias": attn_bias, "qkv_bias": attn_bias}
        else:
            # their MLPs have none: q/k/v/o biases alone have no gptkit flag
            if mtype != QWEN2 and attn_bias:
                raise refuse("attention_bias", True, "biases on q/k/v/o without MLP biases")
            variant = dict(ROPE_VARIANTS[mtype])
        window, layer_types = windows_from_hf(d, mtype, refuse)
        if gemma:
            variant |= {
                "rope_local_theta": local_theta,
                "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
                "attn_softcap": d.get("attn_logit_softcapping", 50.0 if mtype == GEMMA2 else None),
                "logit_softcap": d.get("final_logit_softcapping", 30.0 if mtype == GEMMA2 else None),
            }
        elif local_theta is not None:
            raise refuse("rope_parameters.sliding_attention", local_rope, "one RoPE for every layer")
        n_heads = d["num_attention_heads"]
        moe, d_ff = moe_from_hf(d, mtype) if mtype in MOE_ARCHITECTURES.values() else (None, None)
        return ModelConfig(
            vocab_size=d["vocab_size"],
            max_seq_len=d["max_position_embeddings"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            d_model=d["hidden_size"],
            d_ff=d_ff or d["intermediate_size"],
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            position="rope",
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=layer_types,
            **({} if gemma else {"mlp": "swiglu", "norm": "rmsnorm"}),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            dropout=float(d.get("attention_dropout") or 0.0),
            init_std=float(d.get("initializer_range", 0.02)),
            moe=moe,
            name=name,
            **variant,
        )
    act = d.get("activation_function", "gelu_new")
    if act not in GPT2_GELUS:
        raise refuse(
            "activation_function", act, f"gptkit's GELU is the tanh approximation: {' or '.join(GPT2_GELUS)}"
        )
    for field, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(d.get(field, want)) != want:
            raise refuse(field, d[field], f"needs {field}={want}")
    n_embd = d.get("n_embd", 768)
    return ModelConfig(
        vocab_size=d.get("vocab_size", 50257),
        max_seq_len=d.get("n_positions", 1024),
        n_layers=d.get("n_layer", 12),
        n_heads=d.get("n_head", 12),
        d_model=n_embd,
        d_ff=d.get("n_inner") or 4 * n_embd,
        position="learned",
        mlp="gelu",
        norm="layernorm",
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        bias=True,
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
        dropout=float(d.get("resid_pdrop", 0.1)),
        init_std=float(d.get("initializer_range", 0.02)),
        name=name,
    )


# transformers' default rope_theta of the architectures whose default is not 10000 (Gemma 3's global layers)
GEMMA_THETA = {GEMMA3: 1_000_000.0}


def hf_rope(d: dict[str, Any], mtype: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' rope parameters, the local layers' or None when they share them) of config.json
    `d`: transformers 5's rope_parameters (Gemma 3: one per layer type), or the older rope_theta, rope_scaling
    (and Gemma 3's rope_local_base_freq)."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope.get("full_attention") or {}, rope.get("sliding_attention")
    rope = rope or d.get("rope_scaling") or {}
    if mtype == GEMMA3:
        return rope, {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10000.0)}
    return rope, None


def windows_from_hf(d: dict[str, Any], mtype: str, refuse) -> tuple[int | None, list[str] | None]:
    """(model.sliding_window, model.layer_types) of config.json `d`: Mistral's window in every layer, Qwen2's
    and Qwen3's from max_window_layers on (use_sliding_window), Gemma's layer_types (or its older
    sliding_window_pattern); (None, None) without a window, or when it spans the whole context."""
    n = d["num_hidden_layers"]
    window = d.get("sliding_window")
    raw = d.get("layer_types")
    if mtype == MISTRAL:
        raw = None if window is None else ["sliding_attention"] * n
    elif mtype in (QWEN2, QWEN3):
        if not d.get("use_sliding_window"):
            window = None
        if raw is None:
            first = d.get("max_window_layers", n)
            raw = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    elif mtype in GEMMA_ARCHITECTURES.values():
        if raw is None:
            every = d.get("sliding_window_pattern", 6 if mtype == GEMMA3 else 2)
            raw = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    elif d.get("use_sliding_window") or "sliding_attention" in (raw or ()):
        raise refuse("use_sliding_window", True, "full attention in every layer")
    if window is None or raw is None:
        return None, None
    unknown = sorted({t for t in raw if t not in LAYER_TYPES})
    if unknown or len(raw) != n:
        raise refuse("layer_types", raw, f"{n} of {' or '.join(LAYER_TYPES)}")
    types = [LAYER_TYPES[t] for t in raw]
    if "local" not in types or window >= d["max_position_embeddings"]:
        return None, None
    return window, None if all(t == "local" for t in types) else types


def heads_confirmed(d: dict[str, Any], cfg: ModelConfig) -> str:
    """What the weights' shapes confirm about the attention heads of a config.json, and what rests on
    config.json alone: a wrong head count with the same tensor shapes loads, and computes another model."""
    kv = f", n_kv_heads={cfg.n_kv_heads}" if cfg.n_kv_heads != cfg.n_heads else ""
    heads = f"n_heads={cfg.n_heads}{kv}"
    if cfg.position == "rope" and d.get("head_dim"):
        return (
            f"{heads}, head_dim={cfg.head_dim}: confirmed by the q/k/v weight shapes "
            f"(config.json sets head_dim)"
        )
    if cfg.position == "rope" and cfg.n_kv_heads != cfg.n_heads:
        return (
            f"{heads} from config.json; the weight shapes confirm only their ratio "
            f"({cfg.n_heads // cfg.n_kv_heads}:1) and n_heads x head_dim = {cfg.d_attn}"
        )
    return (
        f"{heads} from config.json; the weight shapes cannot confirm it (any head count that divides "
        f"{cfg.d_attn} fits them)"
    )


# ---- weights -----------------------------------------------------------------------------------
# Gemma's four norms of a layer, in the order of ours: attn_norm, mlp_norm, attn_post_norm, mlp_post_norm
GEMMA_NORMS = (
    "input_layernorm",
    "pre_feedforward_layernorm",
    "post_attention_layernorm",
    "post_feedforward_layernorm",
)
# how one of our tensors becomes theirs
COPY, TRANSPOSE, SPLIT, STACK = "copy", "transpose", "split", "stack"
# an expert's three weights in the files: Mixtral's w1, w3, w2; the others' gate_proj, up_proj, down_proj
EXPERT_NAMES = {
    MIXTRAL: {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    QWEN3_MOE: {p: p for p in ("gate_proj", "up_proj", "down_proj")},
    OLMOE: {p: p for p in ("gate_proj", "up_proj", "down_proj")},
}


def moe_prefix(arch: str, layer: int) -> str:
    """Where layer `layer`'s mixture lives in the files: Mixtral's block_sparse_moe, the others' mlp."""
    return f"model.layers.{layer}." + ("block_sparse_moe." if arch == MIXTRAL else "mlp.")


def name_map(cfg: ModelConfig) -> list[tuple[str, str | tuple[str, ...], str]]:
    """Every tensor of a gptkit GPT state dict and its transformers counterpart (in the files), as
    (ours, theirs, how): COPY (the same tensor), TRANSPOSE (GPT-2's Conv1D stores [in, out]), SPLIT
    (our fused qkv_proj rows are Llama's q_proj, k_proj, v_proj, in that order) or STACK (our [E, out, in]
    experts tensor is their E tensors, expert 0 first). lm_head appears only when it is not tied to the
    embedding. Both directions of the mapping read this one table."""
    rows: list[tuple[str, str | tuple[str, ...], str]] = []
    arch = architecture(cfg)
    if arch in ROPE_ARCHITECTURES:
        # OLMo-2 normalizes each branch's output: its two norms are named after what they follow; Gemma has
        # both (attn_norm, mlp_norm, attn_post_norm, mlp_post_norm)
        norms = {
            OLMO2: ("post_attention_layernorm", "post_feedforward_layernorm"),
            GEMMA2: GEMMA_NORMS,
            GEMMA3: GEMMA_NORMS,
        }.get(arch, ("input_layernorm", "post_attention_layernorm"))
        rows.append(("tok_emb.weight", "model.embed_tokens.weight", COPY))
        for i in range(cfg.n_layers):
            g, h = f"blocks.{i}.", f"model.layers.{i}."
            for part in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                rows.append(
                    (
                        g + f"attn.qkv_proj.{part}",
                        tuple(h + f"self_attn.{p}_proj.{part}" for p in "qkv"),
                        SPLIT,
                    )
                )
            for part in ("weight", "bias") if cfg.bias else ("weight",):
                rows.append((g + f"attn.o_proj.{part}", h + f"self_attn.o_proj.{part}", COPY))
                if cfg.feed_forward(i) != "moe":
                    rows += [
                        (g + f"mlp.{proj}.{part}", h + f"mlp.{proj}.{part}", COPY)
                        for proj in ("gate_proj", "up_proj", "down_proj")
                    ]
            if cfg.feed_forward(i) == "moe":
                moe = moe_prefix(arch, i)
                rows.append((g + "mlp.router.weight", moe + "gate.weight", COPY))
                rows += [
                    (
                        g + f"mlp.experts.{proj}",
                        tuple(f"{moe}experts.{j}.{theirs}.weight" for j in range(cfg.moe.n_experts)),
                        STACK,
                    )
                    for proj, theirs in EXPERT_NAMES[arch].items()
                ]
            if cfg.qk_norm is not None:
                rows += [
                    (g + f"attn.{n}.weight", h + f"self_attn.{n}.weight", COPY) for n in ("q_norm", "k_norm")
                ]
            for ours, theirs in zip(("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"), norms):
                rows.append((g + f"{ours}.weight", h + f"{theirs}.weight", COPY))
        rows.append(("final_norm.weight", "model.norm.weight", COPY))
    else:
        t = "transformer."
        rows += [("tok_emb.weight", t + "wte.weight", COPY), ("pos_emb.weight", t + "wpe.weight", COPY)]
        for i in range(cfg.n_layers):
            g, h = f"blocks.{i}.", f"{t}h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                rows += [(g + f"{ours}.{part}", h + f"{theirs}.{part}", COPY) for part in ("weight", "bias")]
            for ours, theirs in (
                ("attn.qkv_proj", "attn.c_attn"),
                ("attn.o_proj", "attn.c_proj"),
                ("mlp.up_proj", "mlp.c_fc"),
                ("mlp.down_proj", "mlp.c_proj"),
            ):
                rows.append((g + f"{ours}.weight", h + f"{theirs}.weight", TRANSPOSE))
                rows.append((g + f"{ours}.bias", h + f"{theirs}.bias", COPY))
        rows += [("final_norm.weight", t + "ln_f.weight", COPY), ("final_norm.bias", t + "ln_f.bias", COPY)]
    if not cfg.tie_embeddings:
        rows.append(("lm_head.weight", "lm_head.weight", COPY))
    return rows


def peft_adapters(
    state: dict[str, Any], cfg: ModelConfig, lora: dict[str, Any], base: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A LoRA run's adapters (`state`: gptkit.adapters names; `lora`: rank, alpha, dropout, targets) as PEFT
    writes them for the model `export` makes of `cfg`: (adapter_config.json, adapter_model.safetensors).

    Keys are base_model.model.<transformers module>.lora_A|B.weight, A [r, in], B [out, r]. Llama's q, k and
    v are its own q_proj, k_proj, v_proj; GPT-2's fused c_attn (a Conv1D: fan_in_fan_out) takes the adapters
    of all its targeted parts at once: A side by side [n*r, in], B block-diagonal [3*d_model, n*r] (zeros
    for a part not targeted), with rank n*r and alpha n*alpha in rank_pattern/alpha_pattern so that its
    scale stays alpha / r. The same update, so the same logits."""
    if any(adapters.is_expert_target(cfg, i, t) for i in range(cfg.n_layers) for t in lora["targets"]):
        raise GptkitError(
            f"lora.targets={list(lora['targets'])} adapt a mixture's experts, which have no PEFT adapter "
            "layout here: export the model with its adapters merged (adapters=false)"
        )
    hf_of = {ours: theirs for ours, theirs, _ in name_map(cfg)}
    rank, alpha = int(lora["rank"]), lora["alpha"]
    tensors: dict[str, Any] = {}
    modules: set[str] = set()
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, Any] = {}
    for i in range(cfg.n_layers):
        # transformers module -> its adapted rows
        parts: dict[str, list[tuple[int, int, Any, Any]]] = {}
        for t in lora["targets"]:
            ours = f"blocks.{i}.{adapters.MODULES[t]}"
            a, b = state[f"{ours}.lora_{t}_A"], state[f"{ours}.lora_{t}_B"]  # [r, in], [rows, r]
            theirs = hf_of[ours + ".weight"]
            start = 0
            # Llama: q_proj, k_proj, v_proj, each whole
            if isinstance(theirs, tuple):
                theirs = theirs["qkv".index(t)]
            # GPT-2's c_attn: the rows of this part
            elif t in "qkv":
                start = adapters.target_shape(cfg, t)[0]
            parts.setdefault(theirs.removesuffix(".weight"), []).append((start, start + b.shape[0], a, b))
        for module, adapted in parts.items():
            # self_attn.q_proj, mlp.c_proj: one name per kind
            short = ".".join(module.split(".")[-2:])
            modules.add(short)
            if len(adapted) == 1 and short != "attn.c_attn":
                a, b = adapted[0][2], adapted[0][3]
            else:
                n = len(adapted)
                a = torch.cat([x[2] for x in adapted], dim=0)  # [n*r, in]
                b = torch.zeros(cfg.d_attn + 2 * cfg.d_kv, n * rank, dtype=a.dtype)  # [3*d_model, n*r]
                for j, (start, end, _, bj) in enumerate(adapted):
                    b[start:end, j * rank : (j + 1) * rank] = bj
                rank_pattern[short], alpha_pattern[short] = n * rank, n * alpha
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": float(lora["dropout"]),
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": architecture(cfg) == GPT2,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    return config, tensors


def to_hf_state_dict(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """gptkit GPT state dict -> transformers state dict (new tensors; lm_head left out when tied)."""
    out: dict[str, Any] = {}
    for ours, theirs, how in name_map(cfg):
        if how == SPLIT:
            out.update(zip(theirs, state[ours].split([cfg.d_attn, cfg.d_kv, cfg.d_kv], dim=0)))
        elif how == STACK:
            out.update(zip(theirs, state[ours].unbind(0)))
        else:
            out[theirs] = state[ours].t() if how == TRANSPOSE else state[ours]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# old non-learned buffers
_IGNORED = re.compile(r"(?:^|\.)(?:rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def from_hf_state_dict(
    hf_state: dict[str, Any], cfg: ModelConfig, source: str = "the checkpoint"
) -> dict[str, Any]:
    """transformers state dict -> gptkit GPT state dict; GptkitError when a tensor is missing,
    unexpected, or has a shape the config contradicts."""
    import torch

    hf = {k: v for k, v in hf_state.items() if not _IGNORED.search(k)}
    if cfg.moe is not None:
        hf = files_layout(hf, cfg)
        check_experts(hf, cfg, source)
    # GPT2Model checkpoints (the original gpt2 on the hub) have no "transformer." prefix
    if architecture(cfg) == GPT2:
        hf = {
            (k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
            for k, v in hf.items()
        }
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)
    with torch.device("meta"):
        expected = to_hf_state_dict(GPT(cfg).state_dict(), cfg)
    missing, unexpected = sorted(set(expected) - set(hf)), sorted(set(hf) - set(expected))
    if missing or unexpected:
        raise GptkitError(
            f"{source} does not match its config.json: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for k, v in expected.items():
        if tuple(hf[k].shape) != tuple(v.shape):
            raise GptkitError(
                f"{source} contradicts its config.json: {k} has shape {tuple(hf[k].shape)}, "
                f"the config needs {tuple(v.shape)}"
            )
    state: dict[str, Any] = {}
    for ours, theirs, how in name_map(cfg):
        if how == SPLIT:
            state[ours] = torch.cat([hf[k] for k in theirs], dim=0)  # [d_attn + 2 * d_kv, ...]
        elif how == STACK:
            state[ours] = torch.stack([hf[k] for k in theirs])  # [E, out, in]
        else:
            state[ours] = hf[theirs].t() if how == TRANSPOSE else hf[theirs]
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return {k: v.contiguous() for k, v in state.items()}


def check_experts(hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
    """The experts in the files, layer by layer, are those config.json names: else one GptkitError line that
    says which layer holds how many (or has an MoE where the config says dense, or none where it says MoE)."""
    arch = architecture(cfg)
    for i in range(cfg.n_layers):
        moe = moe_prefix(arch, i)
        found = {int(k[len(moe) :].split(".")[1]) for k in hf if k.startswith(moe + "experts.")}
        want = cfg.moe.n_experts if cfg.feed_forward(i) == "moe" else 0
        if found != set(range(want)):
            held = f"experts {min(found)}..{max(found)} ({len(found)})" if found else "no experts"
            raise GptkitError(
                f"{source} does not match its config.json: layer {i} holds {held}, the config needs "
                + (f"{want} (num_experts/num_local_experts)" if want else "a dense MLP (mlp_only_layers)")
            )


def memory_layout(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A transformers state dict in the files' layout as transformers 5 holds it in memory: each MoE layer's
    experts as mlp.experts.gate_up_proj [E, 2 * d_expert, d_model] (gate rows first) and mlp.experts.down_proj
    [E, d_model, d_expert], its router as mlp.gate.weight (Mixtral's block_sparse_moe renamed)."""
    arch = architecture(cfg)
    out = dict(state)
    for i in cfg.moe_layers:
        moe, mem = moe_prefix(arch, i), f"model.layers.{i}.mlp."
        names = EXPERT_NAMES[arch]
        experts = {
            p: torch.stack([out.pop(f"{moe}experts.{j}.{names[p]}.weight") for j in range(cfg.moe.n_experts)])
            for p in names
        }
        out[mem + "gate.weight"] = out.pop(moe + "gate.weight")
        out[mem + "experts.gate_up_proj"] = torch.cat([experts["gate_proj"], experts["up_proj"]], dim=1)
        out[mem + "experts.down_proj"] = experts["down_proj"]
    return out


def files_layout(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of memory_layout: a state dict as transformers 5 holds it in memory, in the files' layout;
    a state dict in the files' layout already is returned as it is."""
    arch = architecture(cfg)
    out = dict(state)
    for i in cfg.moe_layers:
        moe, mem = moe_prefix(arch, i), f"model.layers.{i}.mlp."
        if mem + "experts.gate_up_proj" not in out:
            continue
        names = EXPERT_NAMES[arch]
        gate_up, down = out.pop(mem + "experts.gate_up_proj"), out.pop(mem + "experts.down_proj")
        gate, up = gate_up.chunk(2, dim=1)  # [E, d_expert, d_model] each
        for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            out.update({f"{moe}experts.{j}.{names[p]}.weight": t for j, t in enumerate(w.unbind(0))})
        out[moe + "gate.weight"] = out.pop(mem + "gate.weight")
    return out


# ---- in memory: transformers objects -----------------------------------------------------------
def to_transformers(model):
    """The transformers model of `model`'s architecture (LlamaForCausalLM, ..., MixtralForCausalLM; fp32, eval
    mode, CPU) with exactly its weights."""
    import torch
    import transformers

    cfg = model.cfg
    d = hf_config(cfg)
    arch = d.pop("model_type")
    config_cls = getattr(transformers, CONFIG_CLASSES[arch])
    config = config_cls(**{k: v for k, v in d.items() if k not in ("architectures", "dtype")})
    model_cls = getattr(transformers, ARCHITECTURES[arch])
    with torch.device("cpu"):
        hf_model = model_cls(config)
    state = to_hf_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()}, cfg)
    if cfg.moe is not None:
        state = memory_layout(state, cfg)
    if cfg.tie_embeddings:
        tied = "transformer.wte.weight" if arch == GPT2 else "model.embed_tokens.weight"
        state["lm_head.weight"] = state[tied]
    hf_model.load_state_dict(state, strict=True)
    return hf_model.float().eval()


def from_transformers(hf_model, name: str = "imported"):
    """The gptkit GPT (fp32, eval mode) with exactly `hf_model`'s weights."""
    cfg = model_config_from_hf(hf_model.config.to_dict(), name=name)
    return GPT.from_state(cfg, from_hf_state_dict(hf_model.state_dict(), cfg, source=type(hf_model).__name__))
