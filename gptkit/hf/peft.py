"""A LoRA run's adapters in PEFT's format (adapter_config.json, adapter_model.safetensors), for the model
`gptkit export` makes: the tensor names are the family's (convert.name_map)."""

from __future__ import annotations

from typing import Any

import torch

from gptkit import adapters
from gptkit.errors import GptkitError
from gptkit.hf.convert import name_map
from gptkit.hf.families import family_of
from gptkit.model.config import ModelConfig


def peft_adapters(
    state: dict[str, Any], cfg: ModelConfig, lora: dict[str, Any], base: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A LoRA run's adapters (`state`: gptkit.adapters names; `lora`: rank, alpha, dropout, targets) as PEFT
    writes them for the model `export` makes of `cfg`: (adapter_config.json, adapter_model.safetensors).

    Keys are base_model.model.<transformers module>.lora_A|B.weight, A [r, in], B [out, r]. Llama's q, k and
    v are its own q_proj, k_proj, v_proj; GPT-2's fused c_attn (a Conv1D: fan_in_fan_out) takes the adapters
    of all its targeted parts at once: A side by side [n*r, in], B block-diagonal [3*d_model, n*r] (zeros
    for a part not targeted), with rank n*r and alpha n*alpha in rank_pattern/alpha_pattern so that its
    scale stays alpha / r. The same update, so the same logits.

    A reward model (model.score_head): task_type SEQ_CLS, its score head (trained in full beside the adapters)
    in modules_to_save=["score"], stored as base_model.model.score.weight, as PEFT saves a module to save."""
    if any(adapters.is_expert_target(cfg, i, t) for i in range(cfg.n_layers) for t in lora["targets"]):
        raise GptkitError(
            f"lora.targets={list(lora['targets'])} adapt a mixture's experts, which have no PEFT adapter "
            "layout here: export the model with its adapters merged (adapters=false)"
        )
    if cfg.attention_kind != "mha":
        raise GptkitError(
            f"model.attention_kind={cfg.attention_kind}: its LoRA targets have no PEFT adapter layout here "
            "yet: export the model with its adapters merged (adapters=false)"
        )
    linear = [t for t in lora["targets"] if t in adapters.ATTENTION]
    if cfg.linear_layers and linear:
        raise GptkitError(
            f"lora.targets {linear} adapt the linear-attention layers' fused input projection by parts "
            "(q, k, v, z), in_proj_ba or out_proj, which have no PEFT adapter layout here: "
            "export the model with its adapters merged (adapters=false)"
        )
    family = family_of(cfg)
    attention = [t for t in lora["targets"] if t in ("q", "k", "v")]
    if cfg.attn_output_gate and attention:
        raise GptkitError(
            f"lora.targets {attention} with model.attn_output_gate: {family.architecture}'s q_proj holds "
            "each head's query rows and gate rows together, which have no PEFT adapter layout here: export "
            "the model with its adapters merged (adapters=false)"
        )
    if not family.peft_adapters:
        raise GptkitError(
            f"{family.architecture} fuses q/k/v and gate/up into one weight each, which have no PEFT adapter "
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
                start = adapters.target_shape(cfg, t)[0][0][0]
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
    whole = {ours: theirs for ours, theirs, _ in name_map(cfg) if ours in adapters.whole_keys(cfg)}
    for ours, theirs in whole.items():
        tensors[f"base_model.model.{theirs}"] = state[ours].contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if cfg.score_head else "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": float(lora["dropout"]),
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": family_of(cfg).fan_in_fan_out,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": sorted(t.removesuffix(".weight") for t in whole.values()) or None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    return config, tensors
