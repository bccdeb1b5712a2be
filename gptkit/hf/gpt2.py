"""The GPT-2 family: learned positions + gelu + layernorm + biases, multi-head attention -> GPT2LMHeadModel.
Its Conv1D weights are [in, out] (TRANSPOSE rows); GELU is the tanh approximation (gelu_new) on both sides."""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.family import COPY, PLAIN, TRANSPOSE, Family, Row, check_int, refusal, require
from gptkit.model.config import ModelConfig

# both are the tanh approximation gptkit uses
GPT2_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# config.json's integer fields and transformers' defaults when absent
GPT2_INTS = {"vocab_size": 50257, "n_positions": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
T = "transformer."


class GPT2(Family):
    model_type, architecture, config_class, title = "gpt2", "GPT2LMHeadModel", "GPT2Config", "GPT-2"
    score_architecture = "GPT2ForSequenceClassification"
    embedding = T + "wte.weight"
    layer_prefix = T + "h."
    size_fields = ("n_layer", "n_embd", "vocab_size")
    fan_in_fan_out = True
    attention_dropout_only = False
    gguf_arch = "gpt2"

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        # llama.cpp's gpt2 reads its linears [out, in], not Conv1D's [in, out]
        conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
        return {k: v.t() if k.endswith(conv1d) else v for k, v in state.items()}

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.moe is None and cfg.position != "rope"

    def check(self, cfg: ModelConfig) -> None:
        need = {
            "mlp": "gelu",
            "norm": "layernorm",
            "bias": True,
            "qkv_bias": True,
            "qk_norm": None,
            "norm_placement": "pre",
            "n_kv_heads": cfg.n_heads,
            "head_dim": cfg.d_model // cfg.n_heads,
            **PLAIN,
        }
        if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            need["query_pre_attn_scalar"] = cfg.head_dim
        if cfg.local_layers:
            need["sliding_window"] = None
        target = "GPT-2 (the transformers architecture for learned-position models)"
        require(cfg, need, f"with position={cfg.position}", target)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
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

    def check_hf(self, d: dict[str, Any]) -> None:
        mtype = self.model_type
        for field in GPT2_INTS:
            if field in d:
                check_int(d, mtype, field)
        if d.get("n_inner") is not None:
            check_int(d, mtype, "n_inner")
        n_embd, n_head = d.get("n_embd", GPT2_INTS["n_embd"]), d.get("n_head", GPT2_INTS["n_head"])
        if n_embd % n_head:
            raise GptkitError(
                f"{mtype} config.json has n_embd={n_embd}, not divisible by n_head={n_head}: each head "
                f"needs n_embd / n_head dimensions"
            )

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        refuse = refusal(self.model_type)
        act = d.get("activation_function", "gelu_new")
        if act not in GPT2_GELUS:
            raise refuse(
                "activation_function",
                act,
                f"gptkit's GELU is the tanh approximation: {' or '.join(GPT2_GELUS)}",
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

    def size(self, d: dict[str, Any], field: str) -> int:
        return d.get(field, GPT2_INTS.get(field))

    def file_names(self, state: dict[str, Any]) -> dict[str, Any]:
        # GPT2Model checkpoints (the original gpt2 on the hub) have no "transformer." prefix; the heads
        # (GPT2ForSequenceClassification's score) sit beside the transformer
        return {(k if k.startswith((T, "lm_head.", "score.")) else T + k): v for k, v in state.items()}

    def embedding_rows(self, cfg: ModelConfig) -> list[Row]:
        return [("tok_emb.weight", T + "wte.weight", COPY), ("pos_emb.weight", T + "wpe.weight", COPY)]

    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, h = f"blocks.{i}.", f"{T}h.{i}."
        rows: list[Row] = []
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
        return rows

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        return [("final_norm.weight", T + "ln_f.weight", COPY), ("final_norm.bias", T + "ln_f.bias", COPY)]
