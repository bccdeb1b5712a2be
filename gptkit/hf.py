"""Hugging Face `transformers` interop: the mapping between a gptkit GPT and the transformers architectures.

    gptkit variant (rope + swiglu + rmsnorm, any n_kv_heads)    transformers architecture
    bias = qkv_bias, no qk_norm                              -> LlamaForCausalLM (attention_bias + mlp_bias)
    bias=false, qkv_bias=true (biases on q/k/v only)         -> Qwen2ForCausalLM
    qk_norm=head (RMSNorm per head of q and k), no biases    -> Qwen3ForCausalLM
    qk_norm=full, norm_placement=post, no biases             -> Olmo2ForCausalLM (x + norm(f(x)))
    learned + gelu + layernorm + bias, MHA                   -> GPT2LMHeadModel (Conv1D weights are
                                                                [in, out]: transposed)
RoPE may carry model.rope_scaling (type llama3: Llama 3.1/3.2) on every RoPE architecture.

Any other combination is refused with a GptkitError that names the variant that does not map:
never a silently different model. RoPE is in the rotate-half layout on both sides and GELU is the
tanh approximation (GPT-2's gelu_new) on both sides, so no permutation or activation change is needed.

Three levels:
  - plain data (no `transformers` needed): hf_config(), to_hf_state_dict(), model_config_from_hf(),
    from_hf_state_dict(), and the folder I/O used by `gptkit export` / `gptkit import`;
  - sources: locate() turns `hf=<folder | owner/name[@revision]>` into a local folder (a Hub model is fetched
    into the Hugging Face cache by `huggingface_hub`), import_folder() turns that folder into a gptkit run
    folder, import_cached() does both for `train init_from=hf:...` and reuses the result;
  - in memory: to_transformers(model) and from_transformers(hf_model) (need `transformers`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from gptkit import adapters, hub
from gptkit.data.chat import CHAT_FILE, template_in_folder
from gptkit.errors import GptkitError
from gptkit.fsio import FILE_MODE, confined, staged_dir
from gptkit.model import GPT
from gptkit.model.config import ModelConfig
from gptkit.runs import IMPORTED_FILE, TOKENIZER_FILE, check_import_out, load_tokenizer, write_run_folder

# transformers (optional, the test extra), huggingface_hub and torch are imported where used: `gptkit import`
# of a local folder needs no hub, and the mapping tables load without transformers.

# transformers' model_type
LLAMA, QWEN2, QWEN3, OLMO2, GPT2 = "llama", "qwen2", "qwen3", "olmo2", "gpt2"
ARCHITECTURES = {
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    QWEN3: "Qwen3ForCausalLM",
    OLMO2: "Olmo2ForCausalLM",
    GPT2: "GPT2LMHeadModel",
}
CONFIG_CLASSES = {
    LLAMA: "LlamaConfig",
    QWEN2: "Qwen2Config",
    QWEN3: "Qwen3Config",
    OLMO2: "Olmo2Config",
    GPT2: "GPT2Config",
}
# the decoder layout of Llama, with their own twists
ROPE_ARCHITECTURES = (LLAMA, QWEN2, QWEN3, OLMO2)
# both are the tanh approximation gptkit uses
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# What each RoPE architecture fixes beyond rope + swiglu + rmsnorm (the keys of ModelConfig)
ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    QWEN2: {"bias": False, "qkv_bias": True, "qk_norm": None, "norm_placement": "pre"},
    QWEN3: {"bias": False, "qkv_bias": False, "qk_norm": "head", "norm_placement": "pre"},
    OLMO2: {"bias": False, "qkv_bias": False, "qk_norm": "full", "norm_placement": "post"},
}


# ---- which architecture ------------------------------------------------------------------------
def architecture(cfg: ModelConfig) -> str:
    """The transformers model_type of a mappable config; GptkitError naming the first variant that does not
    map."""
    if cfg.position == "rope":
        need: dict[str, Any] = {"mlp": "swiglu", "norm": "rmsnorm"}
        target = "the transformers architectures for RoPE models (Llama, Qwen2, Qwen3, OLMo-2)"
        arch = LLAMA
        if cfg.qk_norm is not None or cfg.norm_placement != "pre" or cfg.qkv_bias != cfg.bias:
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
        }
        target = "GPT-2 (the transformers architecture for learned-position models)"
        arch = GPT2
    for name, want in need.items():
        have = getattr(cfg, name)
        if have != want:
            raise GptkitError(
                f"model.{name}={have} with position={cfg.position} has no faithful "
                f"transformers architecture: {target} needs {name}={want}; refusing rather "
                f"than produce a different model"
            )
    return arch


# ---- config ------------------------------------------------------------------------------------
def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters (5.x) for cfg's RoPE: default, or llama3 with its four numbers."""
    s = cfg.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": s["type"],
        "rope_theta": cfg.rope_theta,
        "factor": s["factor"],
        "low_freq_factor": s["low_freq_factor"],
        "high_freq_factor": s["high_freq_factor"],
        "original_max_position_embeddings": s["original_max_seq_len"],
    }


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
        d = common | {
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
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
        elif arch in (QWEN3, OLMO2):
            d |= {"attention_bias": False}
        if arch in (QWEN2, QWEN3):
            d |= {"use_sliding_window": False, "sliding_window": None}
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


def model_config_from_hf(d: dict[str, Any], name: str = "imported") -> ModelConfig:
    """The gptkit ModelConfig equal to a transformers config.json (Llama, Qwen2, Qwen3, OLMo-2 or GPT-2),
    or a GptkitError."""
    mtype = d.get("model_type")
    if mtype not in ARCHITECTURES:
        arch = ", ".join(d.get("architectures") or []) or "no architectures field"
        raise GptkitError(
            f"model_type={mtype!r} ({arch}) is not supported; gptkit imports Llama, Qwen2, "
            f"Qwen3, OLMo-2 and GPT-2 models (model_type {', '.join(ARCHITECTURES)})"
        )

    def refuse(field: str, value: Any, want: str) -> GptkitError:
        return GptkitError(f"{mtype} config has {field}={value!r}, which gptkit cannot represent ({want})")

    if mtype in ROPE_ARCHITECTURES:
        if d.get("hidden_act", "silu") != "silu":
            raise refuse("hidden_act", d["hidden_act"], "the MLPs are SwiGLU in gptkit: hidden_act=silu")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            absent = [k for k in keys if not isinstance(rope.get(k), (int, float))]
            if absent:
                raise refuse("rope_scaling", rope, f"rope_type llama3 needs {', '.join(absent)}")
            scaling = {
                "type": "llama3",
                "factor": rope["factor"],
                "low_freq_factor": rope["low_freq_factor"],
                "high_freq_factor": rope["high_freq_factor"],
                "original_max_seq_len": rope["original_max_position_embeddings"],
            }
        elif rope_type != "default":
            raise refuse("rope_type", rope_type, "plain RoPE or rope_type llama3")
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise refuse("partial_rotary_factor", d["partial_rotary_factor"], "RoPE over the whole head")
        if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()):
            raise refuse("use_sliding_window", True, "full attention in every layer")
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
        missing = [
            k
            for k in (
                "vocab_size",
                "max_position_embeddings",
                "num_hidden_layers",
                "num_attention_heads",
                "hidden_size",
                "intermediate_size",
            )
            if not isinstance(d.get(k), int)
        ]
        if missing:
            raise GptkitError(
                f"{mtype} config.json has no {missing[0]} (an integer), which gptkit does not "
                f"guess; add it to config.json"
            )
        n_heads = d["num_attention_heads"]
        return ModelConfig(
            vocab_size=d["vocab_size"],
            max_seq_len=d["max_position_embeddings"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            d_model=d["hidden_size"],
            d_ff=d["intermediate_size"],
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            position="rope",
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            dropout=float(d.get("attention_dropout", 0.0)),
            init_std=float(d.get("initializer_range", 0.02)),
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
# how one of our tensors becomes theirs
COPY, TRANSPOSE, SPLIT = "copy", "transpose", "split"


def name_map(cfg: ModelConfig) -> list[tuple[str, str | tuple[str, ...], str]]:
    """Every tensor of a gptkit GPT state dict and its transformers counterpart, as
    (ours, theirs, how): COPY (the same tensor), TRANSPOSE (GPT-2's Conv1D stores [in, out]) or SPLIT
    (our fused qkv_proj rows are Llama's q_proj, k_proj, v_proj, in that order). lm_head appears only
    when it is not tied to the embedding. Both directions of the mapping read this one table."""
    rows: list[tuple[str, str | tuple[str, ...], str]] = []
    arch = architecture(cfg)
    if arch in ROPE_ARCHITECTURES:
        # OLMo-2 normalizes each branch's output: its two norms are named after what they follow
        norms = (
            ("post_attention_layernorm", "post_feedforward_layernorm")
            if arch == OLMO2
            else ("input_layernorm", "post_attention_layernorm")
        )
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
                rows += [
                    (g + f"mlp.{proj}.{part}", h + f"mlp.{proj}.{part}", COPY)
                    for proj in ("gate_proj", "up_proj", "down_proj")
                ]
            if cfg.qk_norm is not None:
                rows += [
                    (g + f"attn.{n}.weight", h + f"self_attn.{n}.weight", COPY) for n in ("q_norm", "k_norm")
                ]
            rows.append((g + "attn_norm.weight", h + f"{norms[0]}.weight", COPY))
            rows.append((g + "mlp_norm.weight", h + f"{norms[1]}.weight", COPY))
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
        else:
            state[ours] = hf[theirs].t() if how == TRANSPOSE else hf[theirs]
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return {k: v.contiguous() for k, v in state.items()}


# ---- in memory: transformers objects -----------------------------------------------------------
def to_transformers(model):
    """The LlamaForCausalLM / GPT2LMHeadModel (fp32, eval mode, CPU) with exactly `model`'s weights."""
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
    if cfg.tie_embeddings:
        tied = "transformer.wte.weight" if arch == GPT2 else "model.embed_tokens.weight"
        state["lm_head.weight"] = state[tied]
    hf_model.load_state_dict(state, strict=True)
    return hf_model.float().eval()


def from_transformers(hf_model, name: str = "imported"):
    """The gptkit GPT (fp32, eval mode) with exactly `hf_model`'s weights."""
    cfg = model_config_from_hf(hf_model.config.to_dict(), name=name)
    return GPT.from_state(cfg, from_hf_state_dict(hf_model.state_dict(), cfg, source=type(hf_model).__name__))


# ---- folders: safetensors shards and tokenizer files -------------------------------------------
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def parse_size(size: str | int) -> int:
    """'5GB' / '500MB' / '20KB' / 1000 -> bytes (decimal units, as transformers' max_shard_size)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise GptkitError(f"max_shard_size={size!r} is not a size; write e.g. 5GB, 500MB or 20KB")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def save_weights(state: dict[str, Any], out_dir: Path, max_shard_size: int) -> list[str]:
    """Write `state` as model.safetensors, or as numbered shards plus an index when larger than
    max_shard_size. Returns the file names written."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    names = (
        [SAFE_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        # safetensors writes owner-only files
        os.chmod(out_dir / name, FILE_MODE)
    if len(shards) == 1:
        return names
    weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    return names + [SAFE_INDEX]


def load_weights(hf_dir: Path) -> dict[str, Any]:
    """All tensors of a transformers folder: safetensors (single or sharded), else pytorch_model.bin
    loaded with weights_only=True (a pickle that would run code is refused)."""
    import torch
    from safetensors.torch import load_file

    def safe(f: Path) -> dict[str, Any]:
        try:
            return load_file(str(f))
        except Exception as exc:
            raise GptkitError(f"{f} is not a readable safetensors file ({str(exc)[:160]})") from exc

    def pickle(f: Path) -> dict[str, Any]:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as exc:
            from gptkit.checkpoints import load_refusal

            raise GptkitError(
                f"{f} could not be loaded safely: it {load_refusal(f, exc)}; convert it to safetensors"
            ) from exc
        if not isinstance(obj, dict):
            raise GptkitError(f"{f} does not hold a state dict")
        return obj

    for single, index, load in ((SAFE_SINGLE, SAFE_INDEX, safe), (BIN_SINGLE, BIN_INDEX, pickle)):
        if (hf_dir / single).is_file():
            return load(hf_dir / single)
        if (hf_dir / index).is_file():
            try:
                files = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as exc:
                raise GptkitError(f"{hf_dir / index} is not a valid weight index ({exc})") from exc
            state: dict[str, Any] = {}
            for name in files:
                # never a file outside the model folder
                f = confined(hf_dir, name, hf_dir / index)
                if not f.is_file():
                    raise GptkitError(f"{hf_dir / index} names {name}, which is missing from {hf_dir}")
                state.update(load(f))
            return state
    raise GptkitError(
        f"no weights in {hf_dir} (looked for {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE}, {BIN_INDEX})"
    )


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    f = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise GptkitError(
            f"{hf_dir} is not a folder; pass a local transformers model folder or a Hugging "
            f"Face Hub model id (owner/name[@revision])"
        )
    if not f.is_file():
        raise GptkitError(f"{hf_dir} is not a transformers model folder (no config.json in it)")
    try:
        d = json.loads(f.read_text())
    except ValueError as exc:
        raise GptkitError(f"{f} is not valid JSON ({exc})") from exc
    if not isinstance(d, dict):
        raise GptkitError(f"{f} is not a transformers config (not a JSON object)")
    return d


def tokenizer_files(tokenizer, max_seq_len: int, special: dict[str, tuple[str, int]]) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for AutoTokenizer
    (`special`: {role: (token, id)}, as gptkit.tokenizer.special_tokens() finds them)."""
    special = {role: tok for role, (tok, _) in special.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


def generation_config(bos_id: int | None, eos_id: int | None, pad_id: int | None) -> dict[str, Any]:
    d: dict[str, Any] = {"_from_model_config": True}
    d.update(
        {
            k: v
            for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos_id), ("pad_token_id", pad_id))
            if v is not None
        }
    )
    return d


# ---- sources: a local folder or a Hugging Face Hub model ---------------------------------------
HUB_FIRST = [
    "config.json",
    # fetched first: an unsupported model fails before its weights
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    # the chat template (gptkit chat, data=chat)
]
HUB_WEIGHTS = [SAFE_SINGLE, "model-*-of-*.safetensors", SAFE_INDEX]
# only for a model without safetensors
HUB_PICKLES = [BIN_SINGLE, "pytorch_model-*-of-*.bin", BIN_INDEX]
# owner/name[@revision] (or a legacy name)
HUB_ID = re.compile(r"[\w-][\w.-]*(?:/[\w-][\w.-]*)?(?:@[\w./-]+)?")
LOCAL_IMPORT = "gptkit import hf=/path/to/folder out=runs/<name>"


@dataclass
class Source:
    """A transformers folder on this machine, and where it came from."""

    dir: Path
    # the default model (and folder) name: the folder's or the repository's
    name: str
    # what names exactly these files again: the resolved folder, or owner/name@commit
    spec: str
    # worth one line on stderr (e.g. an unreachable hub left only the cache)
    note: str | None = None


def source_name(spec: str) -> str:
    """The name `locate(spec)` gives its Source (the folder's, or the repository's), fetching nothing."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_ID.fullmatch(spec):
        return path.resolve().name
    return spec.partition("@")[0].rsplit("/", 1)[-1]


def locate(spec: str, local_alternative: str = LOCAL_IMPORT) -> Source:
    """`hf=<spec>` as a transformers folder on this machine: a local folder (it wins whenever it exists, even
    one named like owner/name), else a Hugging Face Hub model id, owner/name[@revision], fetched into the
    Hugging Face cache. `local_alternative` is the command that uses a local folder instead, for the message
    that the hub cannot be used."""
    path = Path(spec).expanduser()
    if path.exists() or not HUB_ID.fullmatch(spec):
        return Source(path, source_name(spec), str(path.resolve()))
    repo_id, _, revision = spec.partition("@")
    return _fetch(repo_id, revision or None, local_alternative)


def _fetch(repo_id: str, revision: str | None, local_alternative: str) -> Source:
    """What import reads of a Hub model (config.json and tokenizer.json first, then the safetensors weights,
    and pytorch_model.bin only when there are none), downloaded into the Hugging Face cache by huggingface_hub
    with its progress bars. Offline (HF_HUB_OFFLINE=1) or with the hub unreachable (a connect with a short
    timeout, no retries), only the cache is read: a model already there works, any other fails at once with
    one line."""
    from huggingface_hub import constants, errors, snapshot_download

    unreachable = None
    if not hub.offline():
        try:
            hub.check_hub_reachable(hub.TIMEOUT_S)
        except GptkitError as exc:
            unreachable = str(exc)
    if unreachable:
        not_cached = (
            f"{repo_id} is not a local folder, nor in the Hugging Face cache, and {unreachable}; "
            f"without network (HF_HUB_OFFLINE=1) only models in that cache and local folders work: "
            f"{local_alternative}"
        )
    else:
        not_cached = (
            f"{repo_id} is not a local folder, nor (completely) in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids downloading it; unset "
            "HF_HUB_OFFLINE to download it, or use a local transformers folder: "
            f"{local_alternative}"
        )
    local_only = unreachable is not None or hub.offline()

    def get(patterns: list[str], rev: str | None) -> Path:
        try:
            return Path(
                snapshot_download(repo_id, revision=rev, allow_patterns=patterns, local_files_only=local_only)
            )
        except errors.GatedRepoError:
            raise GptkitError(
                f"{repo_id} is a gated model: accept its conditions on its Hub page and log in "
                f"(`hf auth login` or HF_TOKEN), then try again"
            ) from None
        except errors.RepositoryNotFoundError:
            raise GptkitError(
                f"{repo_id} is neither a local folder nor a model on the Hugging Face Hub "
                f"(check the name; a private model needs `hf auth login` or "
                f"HF_TOKEN)"
            ) from None
        except errors.RevisionNotFoundError:
            raise GptkitError(
                f"{repo_id} has no revision {rev!r} on the Hugging Face Hub; give a branch, "
                f"tag or commit it has: {repo_id}@<revision>"
            ) from None
        # offline and not (completely) in the cache
        except errors.LocalEntryNotFoundError:
            raise GptkitError(not_cached) from None
        except errors.HFValidationError as exc:
            raise GptkitError(
                f"{repo_id} is neither a local folder nor a valid Hub model id (owner/name): "
                f"{str(exc).splitlines()[0][:160]}"
            ) from None
        # the network or the hub failed part-way
        except Exception as exc:
            raise GptkitError(
                f"cannot download {repo_id} from the Hugging Face Hub ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:160]}); try again, or use a local "
                f"folder: {local_alternative}"
            ) from None

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    # e.g. "No files matched" for a model without safetensors: we handle it
    hub_log.setLevel(logging.ERROR)
    try:
        folder = get(HUB_FIRST, revision)
        # a snapshot folder is named by its commit: the later calls fetch exactly this one
        commit = folder.name
        if not (folder / "config.json").is_file():
            raise GptkitError(
                f"{repo_id} has no config.json: it is not a transformers model (gptkit imports "
                f"Llama, Qwen2, Qwen3, OLMo-2 and GPT-2 models)"
            )
        # an unsupported model fails before its weights download
        model_config_from_hf(read_hf_config(folder))
        folder = get(HUB_WEIGHTS, commit)
        if not any((folder / f).is_file() for f in (SAFE_SINGLE, SAFE_INDEX)):
            # read with weights_only=True: a pickle that would run code is refused
            folder = get(HUB_PICKLES, commit)
    finally:
        hub_log.setLevel(level)
    note = f"{unreachable}; using {repo_id}@{commit} from the Hugging Face cache" if unreachable else None
    return Source(folder, source_name(repo_id), f"{repo_id}@{commit}", note)


def fingerprint(folder: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of the files import reads from `folder`: an import of it is current while this
    holds."""
    patterns = HUB_FIRST + HUB_WEIGHTS + HUB_PICKLES
    if not folder.is_dir():
        return []
    files = sorted(f for f in folder.iterdir() if f.is_file() and any(fnmatch(f.name, p) for p in patterns))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


@dataclass
class Imported:
    out: Path
    model_type: str | None
    n_params: int
    # of the source tensors (the run folder holds fp32)
    dtypes: list[str]
    has_tokenizer: bool
    # what the weight shapes confirm about the attention heads (heads_confirmed)
    heads: str
    # tokenizer_config.json's chat_template, kept as chat.json
    has_chat_template: bool = False


def import_folder(src: Source, out: Path, force: bool = False, name: str | None = None) -> Imported:
    """Write the transformers folder src.dir as the gptkit run folder `out`: config.yaml, tokenizer.json (when
    the folder has one), checkpoints/last.ckpt (fp32; lower-precision sources widened exactly) and
    imported_from.json. `out` is written whole or not at all; a non-empty `out` needs force=True, and is never
    the source, around it, a run with training in it or a run another process holds
    (runs.check_import_out)."""
    check_import_out(out, src.dir, force)

    hf_cfg = read_hf_config(src.dir)
    model_cfg = model_config_from_hf(hf_cfg, name=name or src.name)
    tokenizer = load_tokenizer(src.dir) if (src.dir / TOKENIZER_FILE).is_file() else None
    # the check sample, eval and chat make of a run (runs.check_tokenizer_fits), before the weights are read
    if tokenizer is not None and tokenizer.get_vocab_size() > model_cfg.vocab_size:
        raise GptkitError(
            f"{src.dir / TOKENIZER_FILE} has {tokenizer.get_vocab_size():,} tokens but the model has "
            f"{model_cfg.vocab_size:,} (vocab_size in {src.dir / 'config.json'}): it is not this model's "
            f"tokenizer (its ids would have no embedding row); import a folder with the model's own tokenizer"
        )
    source = load_weights(src.dir)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in source.values()})
    model = GPT.from_state(model_cfg, from_hf_state_dict(source, model_cfg, source=str(src.dir)))
    # tokenizer_config.json's
    template = template_in_folder(src.dir) if tokenizer is not None else None
    with staged_dir(out, force=force) as tmp:
        write_run_folder(tmp, {}, model, tokenizer)
        if template is not None:
            (tmp / CHAT_FILE).write_text(template.to_json())
        provenance = {
            "source": src.spec,
            "architectures": hf_cfg.get("architectures"),
            "model_type": hf_cfg.get("model_type"),
            "dtypes": dtypes,
            "files": fingerprint(src.dir),
        }
        (tmp / IMPORTED_FILE).write_text(json.dumps(provenance, indent=2))
    return Imported(
        out,
        hf_cfg.get("model_type"),
        model.num_parameters(),
        dtypes,
        tokenizer is not None,
        heads_confirmed(hf_cfg, model_cfg),
        template is not None,
    )


def import_cached(spec: str, runs_dir: Path | str, local_alternative: str) -> tuple[Path, Source, bool]:
    """For `train init_from=hf:<spec>`: the run folder <runs_dir>/<name>-imported holding `spec`, imported now
    or reused (True) when it already holds these very files (the same hub commit, or the same local folder
    unchanged). Processes started together (torchrun ranks) import once: the others wait and reuse it."""
    from filelock import FileLock

    src = locate(spec, local_alternative)
    out = Path(runs_dir) / f"{src.name}-imported"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        try:
            held = json.loads((out / IMPORTED_FILE).read_text())
        except (OSError, ValueError):
            held = None
        if (
            isinstance(held, dict)
            and held.get("source") == src.spec
            and held.get("files") == fingerprint(src.dir)
        ):
            return out, src, True
        if not isinstance(held, dict) and out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise GptkitError(
                f"{out} exists and is not an import by gptkit; move it away, or import into a "
                f"folder of your choice (gptkit import hf={spec} out=<folder>) and pass "
                "init_from=<folder>"
            )
        import_folder(src, out, force=True)
    return out, src, False
