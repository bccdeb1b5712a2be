"""RoPE in config.json: transformers' rope parameters (rope_parameters in 5.x, rope_theta and rope_scaling
before) to and from model.rope_theta and model.rope_scaling (llama3, linear, dynamic, yarn, longrope). Every
RoPE family reads and writes its RoPE here."""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.model.config import ROPE_SCALING_KEYS, ROPE_SCALINGS, ModelConfig, check_rope_scaling


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
    if s["type"] == "longrope":
        d |= {k: s[k] for k in ("short_factor", "long_factor")}
        d["original_max_position_embeddings"] = s["original_max_seq_len"]
        if s["attention_factor"] is not None:
            d["attention_factor"] = s["attention_factor"]
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
    if rope_type == "longrope":
        # transformers prefers a top-level original_max_position_embeddings (Phi-3's config.json has it)
        original = d.get("original_max_position_embeddings") or original
    factor = rope.get("factor")
    # YaRN or LongRoPE without a factor: the ratio of the two contexts (transformers' rule)
    if (
        rope_type in ("yarn", "longrope")
        and factor is None
        and isinstance(original, int)
        and isinstance(mpe, int)
    ):
        factor = mpe / original
    scaling: dict[str, Any] = {"type": rope_type, "factor": factor}
    if rope_type == "llama3":
        scaling |= {k: rope.get(k) for k in ("low_freq_factor", "high_freq_factor")}
    if rope_type != "linear":
        # dynamic: transformers scales past max_position_embeddings
        scaling["original_max_seq_len"] = mpe if rope_type == "dynamic" else original
    if rope_type == "longrope":
        scaling |= {k: rope.get(k) for k in ("short_factor", "long_factor", "attention_factor")}
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


def hf_rope(
    d: dict[str, Any], legacy_local: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global layers' rope parameters, the local layers' or None when they share them) of config.json
    `d`: transformers 5's rope_parameters (one per layer type, Gemma 3's), or the older rope_theta,
    rope_scaling (and `legacy_local`, the local layers' the family's older keys set: Gemma 3's
    rope_local_base_freq)."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope.get("full_attention") or {}, rope.get("sliding_attention")
    return rope or d.get("rope_scaling") or {}, legacy_local


def llama3_freq_factors(cfg: ModelConfig):
    """llama3's scaling as llama.cpp reads it: a [rotary_dim / 2] tensor of divisors of the plain RoPE
    frequencies (its rope_freqs; 1 for the short wavelengths, factor for the long ones, the smooth band
    between), from gptkit's own scaled frequencies (gptkit/model/rope_scaling.py)."""
    import torch

    from gptkit.model.rope_scaling import llama3

    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaled, _ = llama3(inv_freq, cfg.rope_scaling, dim, cfg.rope_theta)
    return (inv_freq / scaled).float()
