"""gpt-oss (GptOssForCausalLM, transformers' model_type gpt_oss): openai/gpt-oss-20b and -120b.

gptkit variant                                        transformers architecture
model.moe with router_bias, expert_biases and       -> GptOssForCausalLM
activation clamped_swiglu, attn_sinks, biases on
q/k/v/o (one flag), local layers (layer_types)

Every layer is a mixture: the router's logits (with a bias) -> top-k -> softmax over the k chosen (the same
weights as our softmax over all, top-k, renormalized), each expert (clamp(up) + 1) * g * sigmoid(alpha * g)
with g = clamp(gate, max=limit), every projection with a bias. Each head has a learned sink logit in its
softmax's denominator (self_attn.sinks). The released models alternate a window of 128 and full attention
(layer_types; without it transformers' GptOssConfig starts with a local layer) and scale RoPE by YaRN
(factor 32 over 4096 positions, truncate false: rope.py).

The files (transformers 5 holds them in memory the same way) store a layer's experts as three tensors:
mlp.experts.gate_up_proj [E, d_model, 2 * d_expert], its columns gate and up INTERLEAVED (column 2j is gate
row j, 2j + 1 up row j: WEAVE), gate_up_proj_bias [E, 2 * d_expert] interleaved the same way, down_proj
[E, d_expert, d_model] (ours transposed) and down_proj_bias [E, d_model].

The released checkpoints hold the experts' weights in MXFP4 (config.json's quantization_config.quant_method
mxfp4): <name>_blocks [E, rows, in / 32, 16] and <name>_scales [E, rows, in / 32], rows = output features
(gptkit/hf/mxfp4.py). Import reads them back (unpack; the note says so and into which dtype); export writes
plain weights and no quantization_config.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder, hf_layer_types
from gptkit.hf.family import COPY, PLAIN, TRANSPOSE, WEAVE, Row, refusal, require, whole
from gptkit.model.config import ModelConfig

# what gpt-oss fixes of model.moe (the keys of MoEConfig); the losses and impl are training's
MOE_FIXES = {
    "router": "softmax",
    "norm_topk_prob": True,
    "n_shared": 0,
    "route_scale": 1.0,
    "bias_update_rate": 0.0,
    "every": 1,
    "first_dense": 0,
    "router_bias": True,
    "expert_biases": True,
    "activation": "clamped_swiglu",
}
# transformers' GptOssConfig's clamped SwiGLU when config.json has none (the released config.json sets only
# swiglu_limit; transformers < 5 had alpha fixed at 1.702)
SWIGLU_DEFAULTS = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
# the expert tensors MXFP4 packs, and the bias whose dtype their values take
PACKED = {"gate_up_proj": "gate_up_proj_bias", "down_proj": "down_proj_bias"}
MXFP4 = "mxfp4"


def alternating(n: int) -> list[str]:
    """transformers' GptOssConfig's layer_types when config.json has none: local first, then every other."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]


class GptOss(Decoder):
    """gpt-oss: a mixture in every layer with biased router and experts, clamped SwiGLU, attention sinks;
    before the other mixtures in the table (they refuse these blocks)."""

    model_type, architecture, config_class, title = "gpt_oss", "GptOssForCausalLM", "GptOssConfig", "gpt-oss"
    fixes = {"qk_norm": None, "norm_placement": "pre", "attn_sinks": True}
    windowed = True
    # transformers' GptOssConfig
    default_theta = 150000.0

    def claims(self, cfg: ModelConfig) -> bool:
        m = cfg.moe
        return (
            cfg.position == "rope"
            and m is not None
            and (cfg.attn_sinks or m.router_bias or m.expert_biases or m.activation == "clamped_swiglu")
        )

    def target(self, cfg: ModelConfig) -> str:
        return "GptOssForCausalLM (gpt-oss: sinks, biased router and experts, clamped SwiGLU)"

    def check(self, cfg: ModelConfig) -> None:
        target = self.target(cfg)
        need = {"position": "rope", **LLAMA_LAYOUT, **PLAIN} | self.fixes | self.extra_needs(cfg)
        # one bias flag (attention_bias) for q/k/v and o
        need["qkv_bias"] = cfg.bias
        require(cfg, need, "with model.moe", target)
        for name, want in MOE_FIXES.items():
            have = getattr(cfg.moe, name)
            if have != want:
                raise GptkitError(
                    f"model.moe.{name}={have} has no faithful transformers architecture: {target} needs "
                    f"moe.{name}={want}; refusing rather than produce a different model"
                )

    # ---- config.json ---------------------------------------------------------------------------
    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        return {
            "attention_bias": cfg.bias,
            "sliding_window": cfg.sliding_window,
            "layer_types": hf_layer_types(cfg),
            "intermediate_size": m.d_expert,
            "num_local_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "swiglu_limit": m.swiglu_limit,
            "swiglu_alpha": m.swiglu_alpha,
            "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": False,
        }

    def check_hf(self, d: dict[str, Any]) -> None:
        super().check_hf(d)
        refuse = refusal(self.model_type)
        for key in SWIGLU_DEFAULTS:
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise refuse(key, v, "a positive number")
        q = d.get("quantization_config")
        if q is not None and (not isinstance(q, dict) or q.get("quant_method") != MXFP4):
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise refuse("quantization_config.quant_method", method, "plain weights or mxfp4 experts")

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        bias = d.get("attention_bias", True)
        if not isinstance(bias, bool):
            raise refuse("attention_bias", bias, "true or false")
        return {"bias": bias, "qkv_bias": bias, **self.fixes}

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        return d.get("sliding_window"), d.get("layer_types") or alternating(d["num_hidden_layers"])

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any], int]:
        refuse = refusal(self.model_type)
        experts = d.get("num_local_experts", d.get("num_experts"))
        for key, value in (
            ("num_local_experts", experts),
            ("num_experts_per_tok", d.get("num_experts_per_tok")),
        ):
            if not whole(value):
                raise GptkitError(
                    f"{self.model_type} config.json has no {key} (an integer), which gptkit does not guess; "
                    f"add it to config.json"
                )
        swiglu = {k: float(d.get(k) if d.get(k) is not None else v) for k, v in SWIGLU_DEFAULTS.items()}
        if d["num_experts_per_tok"] > experts:
            raise refuse(
                "num_experts_per_tok", d["num_experts_per_tok"], f"at most num_local_experts={experts}"
            )
        moe = {
            "n_experts": experts,
            "top_k": d["num_experts_per_tok"],
            "d_expert": d["intermediate_size"],
            "aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
            **{k: v for k, v in MOE_FIXES.items() if k in ("router", "norm_topk_prob")},
            "router_bias": True,
            "expert_biases": True,
            "activation": "clamped_swiglu",
            **swiglu,
        }
        return moe, d["intermediate_size"]

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """The heads (Decoder's), and each MXFP4 tensor's shape from the headers, before anything is read."""
        super().check_head_shapes(d, shapes, source)
        experts = d.get("num_local_experts", d.get("num_experts"))
        hidden, width = d["hidden_size"], d["intermediate_size"]
        # rows (output features) x input features of each packed tensor
        sizes = {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width)}
        for name, shape in shapes.items():
            base, _, part = name.rpartition("_")
            proj = base.rpartition(".")[2]
            if part not in ("blocks", "scales") or proj not in sizes:
                continue
            rows, cols = sizes[proj]
            want = (experts, rows, cols // 32) + ((16,) if part == "blocks" else ())
            if cols % 32 or tuple(shape) != want:
                raise GptkitError(
                    f"{source} does not match its config.json: the MXFP4 tensor {name} has shape "
                    f"{tuple(shape)}, the config needs {want} (num_local_experts={experts}, {rows} rows of "
                    f"{cols} values in blocks of 32)"
                )

    def unpack(
        self, state: dict[str, Any], d: dict[str, Any], source: str
    ) -> tuple[dict[str, Any], str | None]:
        """The experts MXFP4 packs (config.json's quantization_config) read back into the dtype of their
        biases (bfloat16 in the released files), in transformers' memory layout [E, in, out]; the note that
        says so (None: nothing was packed)."""
        import torch

        from gptkit.hf.mxfp4 import dequantize_mxfp4

        packed = sorted(k for k in state if k.endswith(("_blocks", "_scales")))
        if not packed:
            return state, None
        if (d.get("quantization_config") or {}).get("quant_method") != MXFP4:
            raise GptkitError(
                f"{source} holds MXFP4 tensors ({packed[0]}, ...) but its config.json has no "
                f"quantization_config with quant_method mxfp4; gptkit does not guess their format"
            )
        out = dict(state)
        dtypes = set()
        for name in [k for k in packed if k.endswith("_blocks")]:
            base = name.removesuffix("_blocks")
            if base + "_scales" not in out:
                raise GptkitError(f"{source} holds the MXFP4 tensor {name} without its {base}_scales")
            bias = out.get(base + "_bias")
            dtype = bias.dtype if bias is not None and bias.is_floating_point() else torch.float32
            value = dequantize_mxfp4(out.pop(name), out.pop(base + "_scales"), dtype, name=base)
            out[base] = value.transpose(-2, -1).contiguous()  # [E, in, out]
            dtypes.add(str(dtype).removeprefix("torch."))
        stray = sorted(k for k in out if k.endswith("_scales"))
        if stray:
            raise GptkitError(f"{source} holds the MXFP4 scales {stray[0]} without their _blocks")
        n = len(packed) // 2
        return out, (
            f"{source}'s experts are MXFP4 (quantization_config.quant_method=mxfp4): {n} tensors "
            f"dequantized to {'/'.join(sorted(dtypes))} on import; an export writes them unquantized"
        )

    # ---- weights -------------------------------------------------------------------------------
    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        h = f"model.layers.{i}."
        return super().layer_rows(cfg, i) + [(f"blocks.{i}.attn.sinks", h + "self_attn.sinks", COPY)]

    def expert_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, e = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        return [
            (g + "router.weight", e + "router.weight", COPY),
            (g + "router.bias", e + "router.bias", COPY),
            ((g + "experts.gate_proj", g + "experts.up_proj"), e + "experts.gate_up_proj", WEAVE),
            ((g + "experts.gate_bias", g + "experts.up_bias"), e + "experts.gate_up_proj_bias", WEAVE),
            (g + "experts.down_proj", e + "experts.down_proj", TRANSPOSE),
            (g + "experts.down_bias", e + "experts.down_proj_bias", COPY),
        ]
