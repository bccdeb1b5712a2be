"""The Llama-layout families: rope + swiglu + rmsnorm, any n_kv_heads.

gptkit variant                                        transformers architecture
bias = qkv_bias, no qk_norm                        -> LlamaForCausalLM (attention_bias + mlp_bias)
bias=false, qkv_bias=true (biases on q/k/v only)   -> Qwen2ForCausalLM
qk_norm=head (RMSNorm per head of q and k)         -> Qwen3ForCausalLM
qk_norm=full, norm_placement=post, no biases       -> Olmo2ForCausalLM (x + norm(f(x)))
Llama's fields, a sliding window in every layer    -> MistralForCausalLM
Qwen2's / Qwen3's fields, the last layers local    -> Qwen2/Qwen3 (use_sliding_window)
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import Decoder, hf_layer_types, interleaved_qk, one_bias_flag, rope_decoder
from gptkit.hf.rope import llama3_freq_factors
from gptkit.model.config import ModelConfig


def windows_refused(cfg: ModelConfig, said: str, how: str) -> GptkitError:
    """The GptkitError for local layers where the family's window does not slide."""
    return GptkitError(
        f"model.layer_types={cfg.layer_types}{said} has no faithful transformers architecture: {how}; "
        f"refusing rather than produce a different model"
    )


NO_BIASES = {"bias": False, "qkv_bias": False}


class Llama(Decoder):
    """The plain Llama layout: one bias flag for every linear. Last of the RoPE families in the table: it
    claims what the others leave."""

    model_type, architecture, config_class, title = "llama", "LlamaForCausalLM", "LlamaConfig", "Llama"
    score_architecture = "LlamaForSequenceClassification"
    fixes = {"qk_norm": None, "norm_placement": "pre"}
    gguf_arch = "llama"
    gguf_rope_scalings = ("llama3",)

    def gguf_check(self, cfg: ModelConfig) -> None:
        if cfg.bias:
            raise GptkitError(
                "export format=gguf: model.bias=true, and llama.cpp's llama reads no biases on the MLP; "
                "refusing rather than produce a different model"
            )
        super().gguf_check(cfg)

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        state = interleaved_qk(state, cfg)
        if cfg.rope_scaling is not None:
            # Llama 3.1's scaling: llama.cpp divides each frequency by its factor in rope_freqs
            state["rope.freqs.weight"] = llama3_freq_factors(cfg)
        return state

    def claims(self, cfg: ModelConfig) -> bool:
        return rope_decoder(cfg)

    def target(self, cfg: ModelConfig) -> str:
        return "the transformers architectures for RoPE models (Llama, Mistral, Qwen2, Qwen3, OLMo-2)"

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        return one_bias_flag(d, refuse)


class Qwen(Decoder):
    """Qwen2 and Qwen3: a sliding window in the layers from max_window_layers on (use_sliding_window)."""

    windowed = True

    def claims_window(self, cfg: ModelConfig) -> bool:
        raise NotImplementedError

    def claims(self, cfg: ModelConfig) -> bool:
        return rope_decoder(cfg) and self.claims_window(cfg)

    def target(self, cfg: ModelConfig) -> str:
        if cfg.local_layers:
            return f"{self.architecture} (q/k/v biases or qk_norm=head, with local layers)"
        return super().target(cfg)

    def check(self, cfg: ModelConfig) -> None:
        local = cfg.local_layers
        if local and local != list(range(local[0], cfg.n_layers)):
            raise windows_refused(
                cfg,
                "",
                f"{self.architecture} slides its window in the layers from max_window_layers on only "
                "(the last ones)",
            )
        super().check(cfg)

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        d: dict[str, Any] = {"use_sliding_window": False, "sliding_window": None}
        if cfg.local_layers:
            d |= {
                "use_sliding_window": True,
                "sliding_window": cfg.sliding_window,
                "max_window_layers": cfg.local_layers[0],
                "layer_types": hf_layer_types(cfg),
            }
        return d

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        n = d["num_hidden_layers"]
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        raw = d.get("layer_types")
        if raw is None:
            first = d.get("max_window_layers", n)
            raw = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        return window, raw


class Qwen2(Qwen):
    """Biases on q, k and v only."""

    model_type, architecture, config_class, title = "qwen2", "Qwen2ForCausalLM", "Qwen2Config", "Qwen2"
    score_architecture = "Qwen2ForSequenceClassification"
    gguf_arch = "qwen2"
    fixes = {"bias": False, "qkv_bias": True, "qk_norm": None, "norm_placement": "pre"}

    def claims_window(self, cfg: ModelConfig) -> bool:
        if cfg.local_layers:
            return cfg.qkv_bias and not cfg.bias and cfg.qk_norm != "head"
        return cfg.qk_norm is None and (cfg.norm_placement != "pre" or cfg.qkv_bias != cfg.bias)

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        # attention_bias is its q/k/v biases (fixed: qkv_bias=true)
        return dict(self.fixes)


class Qwen3(Qwen):
    """RMSNorm per head of q and k."""

    model_type, architecture, config_class, title = "qwen3", "Qwen3ForCausalLM", "Qwen3Config", "Qwen3"
    fixes = NO_BIASES | {"qk_norm": "head", "norm_placement": "pre"}
    gguf_arch = "qwen3"

    def claims_window(self, cfg: ModelConfig) -> bool:
        return cfg.qk_norm == "head"

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False} | super().own_keys(cfg)


class Olmo2(Decoder):
    """Each branch's output normalized (x + norm(f(x))): its two norms are named after what they follow."""

    model_type, architecture, config_class, title = "olmo2", "Olmo2ForCausalLM", "Olmo2Config", "OLMo-2"
    fixes = NO_BIASES | {"qk_norm": "full", "norm_placement": "post"}
    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")
    gguf_arch = "olmo2"

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        # llama.cpp's olmo2 reads output.weight always: a tied head is written out
        if "lm_head.weight" not in state:
            return state | {"lm_head.weight": state["model.embed_tokens.weight"]}
        return state

    def claims(self, cfg: ModelConfig) -> bool:
        return rope_decoder(cfg) and not cfg.local_layers and cfg.qk_norm == "full"


class Mistral(Decoder):
    """Llama's layout with a sliding window in every layer."""

    model_type, architecture, config_class, title = (
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        "Mistral",
    )
    fixes = NO_BIASES | {"qk_norm": None, "norm_placement": "pre"}
    windowed = True
    # llama.cpp reads Mistral as its llama architecture, which slides no window
    gguf_arch = "llama"

    def gguf_check(self, cfg: ModelConfig) -> None:
        if cfg.sliding_window < cfg.max_seq_len:
            raise GptkitError(
                f"export format=gguf: model.sliding_window={cfg.sliding_window} is shorter than "
                f"model.max_seq_len={cfg.max_seq_len}, and llama.cpp runs Mistral as its llama "
                f"architecture, which attends to the whole context; refusing rather than produce a different "
                f"model"
            )

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        return interleaved_qk(state, cfg)

    def claims(self, cfg: ModelConfig) -> bool:
        qkv_only = cfg.qkv_bias and not cfg.bias
        return rope_decoder(cfg) and bool(cfg.local_layers) and not qkv_only and cfg.qk_norm != "head"

    def target(self, cfg: ModelConfig) -> str:
        return "MistralForCausalLM (the Llama layout with a sliding window in every layer)"

    def check(self, cfg: ModelConfig) -> None:
        if len(cfg.local_layers) != cfg.n_layers:
            raise windows_refused(
                cfg,
                f" with qk_norm={cfg.qk_norm}",
                "MistralForCausalLM (the Llama layout with a window) slides it in every layer",
            )
        super().check(cfg)

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False, "sliding_window": cfg.sliding_window if cfg.local_layers else None}

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        window = d.get("sliding_window")
        return window, None if window is None else ["sliding_attention"] * d["num_hidden_layers"]
