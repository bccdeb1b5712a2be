"""SmolLM3 (SmolLM3ForCausalLM): the Llama layout whose NoPE layers apply no rotary embedding.

gptkit variant                                        transformers architecture
Llama's fields, model.nope_layers set              -> SmolLM3ForCausalLM (no_rope_layers)

config.json names the layers inverted (huggingface/transformers#43756): no_rope_layers[i] == 1 means layer i
USES RoPE, 0 that it is a NoPE layer; without the list, every no_rope_layer_interval-th layer is NoPE (layers
interval - 1, 2 * interval - 1, ...: transformers' SmolLM3Config). Its sliding window (use_sliding_window, on
the NoPE layers) gptkit refuses, as SmolLM3-3B has none.
"""

from __future__ import annotations

from typing import Any

from gptkit.hf.decoder import Decoder, one_bias_flag, rope_decoder
from gptkit.hf.family import check_int, whole
from gptkit.model.config import ModelConfig


def hf_no_rope_layers(cfg: ModelConfig) -> list[int]:
    """transformers' no_rope_layers of cfg: 1 for a layer that rotates, 0 for a NoPE layer (inverted)."""
    return [int(cfg.rotates(i)) for i in range(cfg.n_layers)]


class SmolLM3(Decoder):
    """Llama's layout and bias flags (attention_bias, mlp_bias), with NoPE layers; before Llama."""

    model_type, architecture, config_class, title = (
        "smollm3",
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        "SmolLM3",
    )
    # transformers' SmolLM3Config: rope_theta 2e6 and tied embeddings unless config.json says otherwise
    fixes = {"qk_norm": None, "norm_placement": "pre"}
    default_theta = 2000000.0
    tie_default = True
    nope = True

    def claims(self, cfg: ModelConfig) -> bool:
        return rope_decoder(cfg) and cfg.nope_layers is not None

    def target(self, cfg: ModelConfig) -> str:
        return "SmolLM3ForCausalLM (the Llama layout with NoPE layers)"

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias,
            "use_sliding_window": False,
            "sliding_window": None,
            "no_rope_layers": hf_no_rope_layers(cfg),
        }

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        return one_bias_flag(d, refuse) | self.fixes

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        extra = super().extra_from_hf(d, local_theta, local_rope, refuse)
        n = d["num_hidden_layers"]
        flags = d.get("no_rope_layers")
        if flags is None:
            if d.get("no_rope_layer_interval") is None:
                d = d | {"no_rope_layer_interval": 4}
            check_int(d, self.model_type, "no_rope_layer_interval")
            every = d["no_rope_layer_interval"]
            flags = [int((i + 1) % every != 0) for i in range(n)]
        if (
            not isinstance(flags, list)
            or len(flags) < n
            or any(not whole(f) or f not in (0, 1) for f in flags)
        ):
            raise refuse("no_rope_layers", flags, f"a list of at least {n} flags, 1: RoPE, 0: NoPE")
        return extra | {"nope_layers": [i for i in range(n) if flags[i] == 0] or None}
