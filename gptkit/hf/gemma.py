"""The Gemma families: geglu + rmsnorm_unit_offset + sandwich norms + scaled embeddings.

no qk_norm (soft-caps, any layer_types)                -> Gemma2ForCausalLM
qk_norm=head (rope_local_theta: local layers' RoPE)    -> Gemma3ForCausalLM (gemma3_text)
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import Decoder, hf_layer_types, rope_decoder
from gptkit.hf.family import require
from gptkit.hf.rope import rope_parameters
from gptkit.model.config import ModelConfig

# Gemma's activation, the tanh approximation of GELU (model.mlp=geglu)
GEMMA_GELU = "gelu_pytorch_tanh"
# the fields that make a config Gemma's (any one of them, or scaled embeddings)
GEMMA_LAYOUT = {"mlp": "geglu", "norm": "rmsnorm_unit_offset", "norm_placement": "sandwich"}
# Gemma's four norms of a layer, in the order of ours: attn_norm, mlp_norm, attn_post_norm, mlp_post_norm
GEMMA_NORMS = (
    "input_layernorm",
    "pre_feedforward_layernorm",
    "post_attention_layernorm",
    "post_feedforward_layernorm",
)


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


class Gemma(Decoder):
    """Gemma's decoder; Gemma 2 and 3 differ in qk_norm, the defaults and the local layers' RoPE."""

    norm_names = GEMMA_NORMS
    tie_default = True
    scales_queries = True
    windowed = True
    # transformers' defaults: the soft-caps and every how-many-th layer is global
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    global_every = 2

    def claims(self, cfg: ModelConfig) -> bool:
        gemma = any(getattr(cfg, k) == v for k, v in GEMMA_LAYOUT.items()) or cfg.scale_embeddings
        return rope_decoder(cfg) and gemma and self.claims_qk_norm(cfg.qk_norm)

    def claims_qk_norm(self, qk_norm: str | None) -> bool:
        raise NotImplementedError

    # ---- llama.cpp (export format=gguf) -----------------------------------------------------------
    # llama.cpp's Gemma: every how-many-th layer global (from the first), its soft-caps always on or never
    gguf_every = 2
    gguf_softcaps = True

    def gguf_check(self, cfg: ModelConfig) -> None:
        def refuse(what: str, want: str) -> GptkitError:
            return GptkitError(
                f"export format=gguf: {what}, and llama.cpp's {self.gguf_arch} has {want}; refusing rather "
                f"than produce a different model"
            )

        if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            raise refuse(
                f"model.query_pre_attn_scalar={cfg.query_pre_attn_scalar}",
                f"scores scaled by head_dim^-0.5 (query_pre_attn_scalar={cfg.head_dim}) below 27B",
            )
        local = [i for i in range(cfg.n_layers) if (i + 1) % self.gguf_every]
        if cfg.local_layers and cfg.local_layers != local:
            raise refuse(
                f"model.layer_types={cfg.layer_types}",
                f"every {self.gguf_every}th layer global and the others local (layers {local})",
            )
        if [cfg.attn_softcap is not None, cfg.logit_softcap is not None] != [self.gguf_softcaps] * 2:
            have = f"model.attn_softcap={cfg.attn_softcap}, logit_softcap={cfg.logit_softcap}"
            raise refuse(have, "both soft-caps" if self.gguf_softcaps else "no soft-caps")

    def gguf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        # no local layers: a window as long as the context (llama.cpp slides one in its local layers)
        d: dict[str, Any] = {"attention.sliding_window": cfg.sliding_window or cfg.max_seq_len}
        if self.gguf_softcaps:
            d |= {
                "attn_logit_softcapping": float(cfg.attn_softcap),
                "final_logit_softcapping": float(cfg.logit_softcap),
            }
        return d

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        # transformers' Gemma norms hold w of x * (1 + w); llama.cpp's hold 1 + w
        return {k: v + 1 if k.endswith("norm.weight") else v for k, v in state.items()}

    def target(self, cfg: ModelConfig) -> str:
        return f"{self.architecture} (the transformers architecture for Gemma with qk_norm={cfg.qk_norm})"

    def check(self, cfg: ModelConfig) -> None:
        require(cfg, self.fixes | self.extra_needs(cfg), f"with position={cfg.position}", self.target(cfg))

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        """The keys that differ from Llama's: the activation, the attention scale and soft-caps, the layer
        types."""
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
        return d

    def check_activation(self, d: dict[str, Any], refuse) -> None:
        act = d.get("hidden_activation") or d.get("hidden_act") or GEMMA_GELU
        if act != GEMMA_GELU:
            raise refuse("hidden_activation", act, f"the MLPs are GeGLU with tanh GELU: {GEMMA_GELU}")
        if d.get("use_bidirectional_attention"):
            raise refuse("use_bidirectional_attention", True, "causal attention")

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        raw = d.get("layer_types")
        if raw is None:
            every = d.get("sliding_window_pattern", self.global_every)
            raw = [
                "sliding_attention" if (i + 1) % every else "full_attention"
                for i in range(d["num_hidden_layers"])
            ]
        return d.get("sliding_window"), raw

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        return {
            "rope_local_theta": local_theta,
            "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
            "attn_softcap": d.get("attn_logit_softcapping", self.attn_softcap),
            "logit_softcap": d.get("final_logit_softcapping", self.logit_softcap),
        }


class Gemma2(Gemma):
    model_type, architecture, config_class, title = "gemma2", "Gemma2ForCausalLM", "Gemma2Config", "Gemma 2"
    fixes = GEMMA_LAYOUT | {
        "scale_embeddings": True,
        "bias": False,
        "qkv_bias": False,
        "qk_norm": None,
        "rope_local_theta": None,
    }
    attn_softcap, logit_softcap = 50.0, 30.0
    gguf_arch = "gemma2"

    def claims_qk_norm(self, qk_norm: str | None) -> bool:
        return qk_norm is None


class Gemma3(Gemma):
    """Gemma 3's text model; the local layers have a RoPE of their own (rope_local_theta)."""

    model_type, architecture, config_class, title = (
        "gemma3_text",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        "Gemma 3",
    )
    refused_types = {"gemma3": "the multimodal Gemma 3: gptkit imports its text-only model_type gemma3_text"}
    fixes = GEMMA_LAYOUT | {"scale_embeddings": True, "bias": False, "qkv_bias": False, "qk_norm": "head"}
    # transformers' default rope_theta of its global layers
    default_theta = 1_000_000.0
    global_every = 6
    gguf_arch, gguf_every, gguf_softcaps = "gemma3", 6, False

    def gguf_check(self, cfg: ModelConfig) -> None:
        super().gguf_check(cfg)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        if cfg.local_layers and local_theta != 10000.0:
            raise GptkitError(
                f"export format=gguf: the local layers' RoPE base is {local_theta}, and llama.cpp's gemma3 "
                f"rotates its local layers with base 10000; refusing rather than produce a different model"
            )

    def claims_qk_norm(self, qk_norm: str | None) -> bool:
        return qk_norm is not None

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().own_keys(cfg)
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

    def legacy_local_rope(self, d: dict[str, Any]) -> dict[str, Any] | None:
        return {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10000.0)}
