"""OLMo 3 (Olmo3ForCausalLM): OLMo-2's layer (qk_norm=full over all heads, x + norm(f(x)), no biases) with
sliding-window layers (transformers' layer_types: three local layers, then a global one, in the released
models) and a RoPE per layer type: the global layers' may be scaled (YaRN in the long-context models), the
local layers' is plain (rope_parameters.sliding_attention: rope_type default): model.rope_local_theta.
"""

from __future__ import annotations

from typing import Any

from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder, hf_layer_types, rope_decoder
from gptkit.hf.family import PLAIN, require
from gptkit.hf.rope import rope_parameters
from gptkit.model.config import ModelConfig


class Olmo3(Decoder):
    """OLMo-2's layer with local layers; a family before OLMo-2 in the table (OLMo-2 claims no window)."""

    model_type, architecture, config_class, title = "olmo3", "Olmo3ForCausalLM", "Olmo3Config", "OLMo 3"
    fixes = {"bias": False, "qkv_bias": False, "qk_norm": "full", "norm_placement": "post"}
    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")
    windowed = True
    # transformers' Olmo3Config
    default_theta = 500_000.0

    def claims(self, cfg: ModelConfig) -> bool:
        return rope_decoder(cfg) and bool(cfg.local_layers) and cfg.qk_norm == "full"

    def target(self, cfg: ModelConfig) -> str:
        return "Olmo3ForCausalLM (OLMo-2's layer with sliding-window layers)"

    def check(self, cfg: ModelConfig) -> None:
        # the local layers' own plain RoPE is OLMo 3's (rope_parameters.sliding_attention)
        need = {k: v for k, v in (LLAMA_LAYOUT | PLAIN | self.fixes).items() if k != "rope_local_theta"}
        require(cfg, need | self.extra_needs(cfg), f"with position={cfg.position}", self.target(cfg))

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        full = rope_parameters(cfg)
        theta = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
        local = full if cfg.rope_local_theta is None else {"rope_type": "default", "rope_theta": theta}
        return {
            "attention_bias": False,
            "sliding_window": cfg.sliding_window,
            "layer_types": hf_layer_types(cfg),
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
        }

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        return d.get("sliding_window"), d.get("layer_types")

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        return {"rope_local_theta": local_theta}
