"""The decoder layout every RoPE family shares (Llama's: model.embed_tokens, model.layers.<i>.self_attn's
q/k/v/o_proj, an MLP, two norms, model.norm): its config.json, its weight names, and the hooks a family turns
to say where it differs. The families (llama.py, gemma.py, moe.py) subclass Decoder; none reads another."""

from __future__ import annotations

from typing import Any, Callable

from gptkit.errors import GptkitError
from gptkit.hf.family import COPY, GATE_SPLIT, PLAIN, SPLIT, STACK, Family, Row, check_int, refusal, require
from gptkit.hf.rope import hf_rope, rope_parameters, rope_scaling_from_hf
from gptkit.model.config import ModelConfig

# transformers' layer_types <-> model.layer_types
LAYER_TYPES = {"sliding_attention": "local", "full_attention": "global"}
# config.json's integer fields: the required ones (never guessed), the optional ones (null or absent: a
# default); (field, smallest value)
ROPE_INTS = (
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "intermediate_size",
)
OPTIONAL_INTS = (
    ("num_key_value_heads", 1),
    ("head_dim", 1),
    ("sliding_window", 1),
    ("max_window_layers", 0),
    ("sliding_window_pattern", 1),
    ("num_experts", 1),
    ("num_local_experts", 1),
    ("num_experts_per_tok", 1),
    ("moe_intermediate_size", 1),
    ("decoder_sparse_step", 1),
)
# the Llama layout's feed-forward and norm, which Gemma changes
LLAMA_LAYOUT = {"mlp": "swiglu", "norm": "rmsnorm"}


def hf_layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' layer_types of cfg: sliding_attention for a local layer, full_attention for a global."""
    return ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)]


def one_bias_flag(d: dict[str, Any], refuse) -> dict[str, Any]:
    """model.bias and model.qkv_bias of config.json's attention_bias and mlp_bias (Llama's, SmolLM3's): one
    flag for every linear, else refused."""
    attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        raise refuse("attention_bias/mlp_bias", f"{attn_bias}/{mlp_bias}", "one bias flag for all linears")
    return {"bias": attn_bias, "qkv_bias": attn_bias}


def rope_decoder(cfg: ModelConfig) -> bool:
    """A RoPE model without experts: the configs the Llama-style families claim between them."""
    return cfg.position == "rope" and cfg.moe is None


def interleaved(t: Any, heads: int) -> Any:
    """A q_proj or k_proj weight (or bias) of `heads` heads, each head's rows from the rotate-half order
    (transformers': the first half of a head, then the second) to llama.cpp's interleaved pairs (its `llama`
    architecture rotates rows 2j and 2j+1 together): the permutation llama.cpp's converter applies."""
    rows = t.shape[0]
    return t.reshape(heads, 2, rows // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def whole_context(family: Family, cfg: ModelConfig) -> None:
    """GptkitError for local layers, which llama.cpp's architecture of `family` does not slide a window in."""
    if cfg.local_layers:
        raise GptkitError(
            f"export format=gguf: model.layer_types has local layers (a window of {cfg.sliding_window}), and "
            f"llama.cpp's {family.gguf_arch} attends to the whole context in every layer; refusing rather "
            f"than produce a different model"
        )


def interleaved_qk(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """A transformers state dict with its layers' q_proj and k_proj (weights, biases) in llama.cpp's
    interleaved RoPE order (its `llama` architecture's: Llama, Mistral, Mixtral)."""
    heads = {".self_attn.q_proj.": cfg.n_heads, ".self_attn.k_proj.": cfg.n_kv_heads}
    out = {}
    for k, v in state.items():
        n = next((n for part, n in heads.items() if part in k), None)
        out[k] = v if n is None else interleaved(v, n)
    return out


class Decoder(Family):
    """A RoPE family of the Llama layout; the class attributes are Llama's."""

    # what the family fixes beyond the layout (the keys of ModelConfig)
    fixes: dict[str, Any] = {}
    # its two norms of a layer, in the order of ours (attn_norm, mlp_norm[, attn_post_norm, mlp_post_norm])
    norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # transformers' rope_theta when config.json has none, and tie_word_embeddings
    default_theta = 10000.0
    tie_default = False
    # it has model.query_pre_attn_scalar (Gemma), and its layers may attend to a sliding window
    scales_queries = False
    windowed = False
    # its layers may leave out the rotary embedding (model.nope_layers)
    nope = False

    def gguf_check(self, cfg: ModelConfig) -> None:
        whole_context(self, cfg)

    def extra_needs(self, cfg: ModelConfig) -> dict[str, Any]:
        """The fields a family without a query scale or a window needs at their plain values."""
        need: dict[str, Any] = {}
        if not self.scales_queries and cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            need["query_pre_attn_scalar"] = cfg.head_dim
        if not self.windowed and cfg.local_layers:
            need["sliding_window"] = None
        return need

    def target(self, cfg: ModelConfig) -> str:
        """The architecture, said for a reader of a refusal."""
        return f"{self.architecture} (the transformers architecture for qk_norm={cfg.qk_norm})"

    def check(self, cfg: ModelConfig) -> None:
        need = {**LLAMA_LAYOUT, **PLAIN} | self.fixes | self.extra_needs(cfg)
        if self.nope:
            del need["nope_layers"]
        require(cfg, need, f"with position={cfg.position}", self.target(cfg))

    # ---- config.json ---------------------------------------------------------------------------
    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        rope = rope_parameters(cfg)
        s = cfg.rope_scaling
        d = {
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            # dynamic NTK scales past transformers' max_position_embeddings: its original context
            "max_position_embeddings": s["original_max_seq_len"]
            if s and s["type"] == "dynamic"
            else cfg.max_seq_len,
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
        return d | self.own_keys(cfg)

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config.json keys of this family beyond the layout's."""
        return {"attention_bias": False}

    def check_hf(self, d: dict[str, Any]) -> None:
        mtype = self.model_type
        for field in ROPE_INTS:
            if field not in d or d[field] is None:
                raise GptkitError(
                    f"{mtype} config.json has no {field} (an integer), which gptkit does not guess; add it "
                    f"to config.json"
                )
            check_int(d, mtype, field)
        for field, least in OPTIONAL_INTS:
            if d.get(field) is not None:
                check_int(d, mtype, field, least)
        heads, kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
        if heads % kv:
            raise GptkitError(
                f"{mtype} config.json has num_attention_heads={heads}, not divisible by "
                f"num_key_value_heads={kv}: each key/value head serves a whole group of query heads"
            )
        if d.get("head_dim") is None and d["hidden_size"] % heads:
            raise GptkitError(
                f"{mtype} config.json has hidden_size={d['hidden_size']}, not divisible by "
                f"num_attention_heads={heads}, and no head_dim: each head needs hidden_size / "
                f"num_attention_heads dimensions"
            )

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        refuse = refusal(self.model_type)
        self.check_activation(d, refuse)
        rope, local_rope = hf_rope(d, self.legacy_local_rope(d))
        scaling = rope_scaling_from_hf(rope, d, refuse)
        if scaling is not None and scaling["type"] == "longrope" and not self.longrope:
            raise refuse("rope_type", "longrope", "another RoPE (LongRoPE is Phi-3's: model_type phi3)")
        theta = float(rope.get("rope_theta", d.get("rope_theta", self.default_theta)))
        local_theta = None
        if local_rope is not None and (
            rope_scaling_from_hf(local_rope, d, refuse) != scaling
            or local_rope.get("rope_theta", theta) != theta
        ):
            if local_rope.get("rope_type", local_rope.get("type", "default")) != "default":
                raise refuse(
                    "rope_parameters.sliding_attention", local_rope, "plain RoPE in the local layers"
                )
            local_theta = float(local_rope.get("rope_theta", 10000.0))
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        variant = self.rotary_from_hf(d, rope, head_dim, refuse)
        variant |= self.bias_from_hf(d, refuse)
        window, layer_types = self.windows_from_hf(d, refuse)
        variant |= self.extra_from_hf(d, local_theta, local_rope, refuse)
        moe, d_ff = self.moe_from_hf(d)
        return ModelConfig(
            vocab_size=d["vocab_size"],
            max_seq_len=d["max_position_embeddings"],
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            d_model=d["hidden_size"],
            d_ff=d_ff or d["intermediate_size"],
            head_dim=head_dim,
            position="rope",
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=layer_types,
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", self.tie_default)),
            dropout=float(d.get("attention_dropout") or 0.0),
            init_std=float(d.get("initializer_range", 0.02)),
            moe=moe,
            name=name,
            **(LLAMA_LAYOUT | variant),
        )

    # None: RoPE over the whole head only; f: partial RoPE read, f its config class's default factor
    # (Phi-3 1.0, GLM-4.5 0.5, Qwen3-Next 0.25)
    partial_rotary_default: float | None = None

    def rotary_from_hf(
        self, d: dict[str, Any], rope: dict[str, Any], head_dim: int, refuse
    ) -> dict[str, Any]:
        """model.rotary_dim of config.json's partial_rotary_factor (in rope_parameters or beside it):
        transformers' rule, int(head_dim * factor) features turn; a family without partial RoPE refuses any
        factor but 1."""
        default = self.partial_rotary_default
        factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", default or 1.0))
        if default is None:
            if float(factor) != 1.0:
                raise refuse("partial_rotary_factor", factor, "RoPE over the whole head")
            return {}
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise refuse("partial_rotary_factor", factor, "a number in (0, 1]")
        rotary_dim = int(head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise refuse(
                "partial_rotary_factor", factor, f"an even number of the {head_dim} features turning"
            )
        return {} if rotary_dim == head_dim else {"rotary_dim": rotary_dim}

    def check_activation(self, d: dict[str, Any], refuse) -> None:
        if d.get("hidden_act", "silu") != "silu":
            raise refuse("hidden_act", d["hidden_act"], "the MLPs are SwiGLU in gptkit: hidden_act=silu")

    def legacy_local_rope(self, d: dict[str, Any]) -> dict[str, Any] | None:
        """The local layers' rope parameters in the family's older keys (None: the global layers')."""
        return None

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        """The ModelConfig fields of the family's variant: its MLPs have no biases, so q/k/v/o biases alone
        have no gptkit flag."""
        if bool(d.get("attention_bias", False)):
            raise refuse("attention_bias", True, "biases on q/k/v/o without MLP biases")
        return dict(self.fixes)

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        """(the window, transformers' layer_types) of config.json: a family without windows refuses one."""
        if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()):
            raise refuse("use_sliding_window", True, "full attention in every layer")
        return d.get("sliding_window"), d.get("layer_types")

    def windows_from_hf(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        """(model.sliding_window, model.layer_types) of config.json `d`; (None, None) without a window, or
        when it spans the whole context."""
        n = d["num_hidden_layers"]
        window, raw = self.window_layers(d, refuse)
        if window is None or raw is None:
            return None, None
        unknown = sorted({t for t in raw if t not in LAYER_TYPES})
        if unknown or len(raw) != n:
            raise refuse("layer_types", raw, f"{n} of {' or '.join(LAYER_TYPES)}")
        types = [LAYER_TYPES[t] for t in raw]
        if "local" not in types or window >= d["max_position_embeddings"]:
            return None, None
        return window, None if all(t == "local" for t in types) else types

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        """The ModelConfig fields only this family reads (Gemma's); one RoPE for every layer elsewhere."""
        if local_theta is not None:
            raise refuse("rope_parameters.sliding_attention", local_rope, "one RoPE for every layer")
        return {}

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[Any, int | None]:
        """(model.moe, model.d_ff) of a mixture's config.json; (None, None) for a dense family."""
        return None, None

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or d["num_attention_heads"]
        for proj, field, n in (
            ("q_proj", "num_attention_heads", d["num_attention_heads"]),
            ("k_proj", "num_key_value_heads", kv),
        ):
            name = f"model.layers.0.self_attn.{proj}.weight"
            if name in shapes and shapes[name][0] != n * head_dim:
                need = f"{field}={n} x head_dim={head_dim} = {n * head_dim} rows"
                raise GptkitError(
                    f"{source} does not match its config.json: {need}, but {name} has shape "
                    f"{tuple(shapes[name])} ({shapes[name][0]} rows)"
                )

    # ---- weights -------------------------------------------------------------------------------
    def embedding_rows(self, cfg: ModelConfig) -> list[Row]:
        return [("tok_emb.weight", "model.embed_tokens.weight", COPY)]

    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        rows: list[Row] = []
        g, h = f"blocks.{i}.", f"model.layers.{i}."
        for part in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            rows.append(
                (g + f"attn.qkv_proj.{part}", tuple(h + f"self_attn.{p}_proj.{part}" for p in "qkv"), SPLIT)
            )
        for part in ("weight", "bias") if cfg.bias else ("weight",):
            rows.append((g + f"attn.o_proj.{part}", h + f"self_attn.o_proj.{part}", COPY))
            if cfg.feed_forward(i) != "moe":
                rows += [
                    (g + f"mlp.{proj}.{part}", h + f"mlp.{proj}.{part}", COPY)
                    for proj in ("gate_proj", "up_proj", "down_proj")
                ]
        if cfg.feed_forward(i) == "moe":
            rows += self.expert_rows(cfg, i)
        if cfg.qk_norm is not None:
            rows += [
                (g + f"attn.{n}.weight", h + f"self_attn.{n}.weight", COPY) for n in ("q_norm", "k_norm")
            ]
        for ours, theirs in zip(
            ("attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"), self.norm_names
        ):
            rows.append((g + f"{ours}.weight", h + f"{theirs}.weight", COPY))
        return rows

    def expert_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        """The rows of layer i's mixture of experts (the mixtures' families)."""
        raise NotImplementedError(f"{self.model_type} has no mixture of experts")

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        return [("final_norm.weight", "model.norm.weight", COPY)]

    # ---- a multi-token prediction module in the files (GLM-4.5's, DeepSeek-V3's, Qwen3-Next's, Qwen3.5's) --
    def mtp_shapes(self, kept: ModelConfig, is_mtp: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
        """The files' tensors of `kept` (a config with model.mtp) that is_mtp(name) says are the MTP module's,
        and their shapes: final_rows' names, each sized from gptkit's tensors on the meta device."""
        import torch

        from gptkit.model import GPT

        with torch.device("meta"):
            ours = {k: tuple(v.shape) for k, v in GPT(kept).state_dict().items()}
        out: dict[str, tuple[int, ...]] = {}
        for mine, theirs, how in self.final_rows(kept):
            if how == STACK:
                out |= {t: ours[mine][1:] for t in theirs}
            elif how in (SPLIT, GATE_SPLIT):
                rest = ours[mine[0] if how == GATE_SPLIT else mine][1:]
                q = 2 * kept.d_attn if how == GATE_SPLIT else kept.d_attn
                out |= dict(zip(theirs, ((q, *rest), (kept.d_kv, *rest), (kept.d_kv, *rest))))
            elif isinstance(theirs, str):
                out[theirs] = ours[mine]
        return {k: v for k, v in out.items() if is_mtp(k)}

    def read_mtp(
        self, have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], source: str
    ) -> str | None:
        """The files' MTP tensors `have` (name: shape) against those of gptkit's MTP `want` (mtp_shapes): a
        tensor of another shape than the config gives is one GptkitError line; None when `have` is exactly
        `want`'s names, else what does not map (for the family's note or error)."""
        for name, shape in have.items():
            if name in want and tuple(want[name]) != tuple(shape):
                raise GptkitError(
                    f"{source} contradicts its config.json: the MTP tensor {name} has shape {tuple(shape)}, "
                    f"the config needs {tuple(want[name])}"
                )
        unknown, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        if unknown:
            return f"{unknown[0]} has no place in gptkit's MTP"
        return f"it has no {missing[0]}" if missing else None
