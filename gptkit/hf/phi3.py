"""The Phi-3 family (transformers' model_type phi3: Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini).

gptkit variant                                        transformers architecture
the Llama layout without biases, RoPE over the first  -> Phi3ForCausalLM
model.rotary_dim features of each head (partial
RoPE), optionally a sliding window in every layer

Its files fuse what Llama's keep apart: self_attn.qkv_proj is our qkv_proj as it is (q, k, v rows in that
order: COPY) and mlp.gate_up_proj is our gate_proj and up_proj one after the other (JOIN). config.json's
partial_rotary_factor is rotary_dim / head_dim (transformers turns int(head_dim * factor) features).

A Phi-3 model with plain RoPE over the whole head is the Llama layout: it imports here and exports as
LlamaForCausalLM (the same model, its weights named Llama's way).

LongRoPE (rope_type longrope, or su and yarn in older config.json, which Phi3Config reads as longrope:
Phi-3-128k, Phi-3.5, Phi-4-mini) is model.rope_scaling's longrope, its original context config.json's
top-level original_max_position_embeddings (Phi3Config's 4096 when absent), its factor
max_position_embeddings / that when rope_scaling has none. A sequence longer than the original context turns
with the long factors, and transformers' Phi-3 generate computes every key again when a sequence first
outgrows it, as gptkit's decoding does (GPT.rope_restart): a LongRoPE model exports as Phi3ForCausalLM even
with RoPE over the whole head (Phi-3.5-mini), no other family takes it.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder, rope_decoder
from gptkit.hf.family import COPY, JOIN, PLAIN, Row, refusal, require
from gptkit.model.config import ModelConfig


class Phi3(Decoder):
    """Phi-3: partial RoPE, fused q/k/v and gate/up weights, no biases."""

    model_type, architecture, config_class, title = "phi3", "Phi3ForCausalLM", "Phi3Config", "Phi-3"
    partial_rotary_default = 1.0
    fixes = {"bias": False, "qkv_bias": False, "qk_norm": None, "norm_placement": "pre"}
    # Phi3Config's original_max_position_embeddings when config.json has none
    default_original = 4096
    windowed = True
    peft_adapters = False
    own_files = True
    longrope = True

    def claims(self, cfg: ModelConfig) -> bool:
        # partial RoPE: no other family turns part of a head; LongRoPE: no other family takes it
        longrope = cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "longrope"
        return rope_decoder(cfg) and (cfg.rotary_dim is not None or longrope)

    def target(self, cfg: ModelConfig) -> str:
        return "Phi3ForCausalLM (partial RoPE: the Llama layout without biases, plain RoPE or LongRoPE)"

    def check(self, cfg: ModelConfig) -> None:
        plain = {k: v for k, v in PLAIN.items() if k != "rotary_dim"}
        require(cfg, {**LLAMA_LAYOUT, **plain} | self.fixes, "with model.rotary_dim set", self.target(cfg))
        if cfg.rope_scaling is not None and cfg.rope_scaling["type"] != "longrope":
            raise GptkitError(
                f"model.rope_scaling type {cfg.rope_scaling['type']} has no faithful transformers "
                f"architecture with model.rotary_dim set: Phi3ForCausalLM takes plain RoPE or longrope; "
                "refusing rather than produce a different model"
            )
        if cfg.local_layers and len(cfg.local_layers) != cfg.n_layers:
            raise GptkitError(
                f"model.layer_types={cfg.layer_types} has no faithful transformers architecture: "
                f"Phi3ForCausalLM slides its window in every layer; refusing rather than produce a different "
                "model"
            )
        if int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
            raise GptkitError(
                f"model.rotary_dim={cfg.rope_dim} of head_dim={cfg.head_dim} is no partial_rotary_factor "
                f"transformers reads back exactly (int(head_dim * factor) != rotary_dim); choose another "
                "width"
            )

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        factor = cfg.rope_dim / cfg.head_dim
        d["rope_parameters"] = d["rope_parameters"] | {"partial_rotary_factor": factor}
        s = cfg.rope_scaling
        return d | {
            "partial_rotary_factor": factor,
            # Phi3Config reads LongRoPE's original context here before rope_parameters'
            "original_max_position_embeddings": s["original_max_seq_len"] if s else cfg.max_seq_len,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        }

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": cfg.sliding_window if cfg.local_layers else None}

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        # as Phi3Config reads it: rope_scaling before rope_parameters, its types su and yarn are longrope, and
        # its original_max_position_embeddings is 4096 when config.json has none (rope_scaling_from_hf
        # prefers the top-level one, as transformers does)
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        if rope.get("rope_type", rope.get("type")) in ("su", "yarn", "longrope"):
            rope.pop("type", None)
            rope["rope_type"] = "longrope"
        elif rope.get("rope_type", rope.get("type", "default")) != "default":
            raise refusal(self.model_type)(
                "rope_type", rope.get("rope_type", rope.get("type")), "plain RoPE or longrope (Phi3Config's)"
            )
        d = d | {"rope_parameters": rope or None, "rope_scaling": None}
        d.setdefault("original_max_position_embeddings", self.default_original)
        return super().config_from_hf(d, name)

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        # Phi3's linears have no biases (no config key turns them on)
        return dict(self.fixes)

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        # transformers' Phi3Model masks every layer to the window when config.json sets one
        window = d.get("sliding_window")
        return window, None if window is None else ["sliding_attention"] * d["num_hidden_layers"]

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
        name = "model.layers.0.self_attn.qkv_proj.weight"
        rows = (heads + 2 * kv) * head_dim
        if name in shapes and shapes[name][0] != rows:
            raise GptkitError(
                f"{source} does not match its config.json: (num_attention_heads={heads} + 2 x "
                f"num_key_value_heads={kv}) x head_dim={head_dim} = {rows} rows, but {name} has shape "
                f"{tuple(shapes[name])}"
            )

    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, h = f"blocks.{i}.", f"model.layers.{i}."
        return [
            (g + "attn.qkv_proj.weight", h + "self_attn.qkv_proj.weight", COPY),
            (g + "attn.o_proj.weight", h + "self_attn.o_proj.weight", COPY),
            ((g + "mlp.gate_proj.weight", g + "mlp.up_proj.weight"), h + "mlp.gate_up_proj.weight", JOIN),
            (g + "mlp.down_proj.weight", h + "mlp.down_proj.weight", COPY),
            (g + "attn_norm.weight", h + "input_layernorm.weight", COPY),
            (g + "mlp_norm.weight", h + "post_attention_layernorm.weight", COPY),
        ]
