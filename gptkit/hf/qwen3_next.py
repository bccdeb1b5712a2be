"""The Qwen3-Next family group: Qwen3-Next (transformers' model_type qwen3_next: Qwen3-Next-80B-A3B) and
Qwen3.5's language model (qwen3_5_text, qwen3_5_moe_text; the composite qwen3_5, qwen3_5_moe read for it),
which is Qwen3-Next's layers with the differences its classes below say (the Qwen3_5 section).

gptkit variant                                          transformers architecture
a hybrid of Gated DeltaNet layers (model.layer_types    -> Qwen3NextForCausalLM
`linear`, model.gdn) and full-attention layers
(`global`) with the attention output gate
(model.attn_output_gate), QK-norm per head, partial
RoPE (model.rotary_dim), the zero-centred RMSNorm
(model.norm=rmsnorm_unit_offset: x / rms(x) * (1 + w))
and a softmax-routed mixture whose shared expert has a
sigmoid gate (model.moe.shared_expert_gate), or the
dense MLP in every layer (num_experts 0)

config.json                          gptkit
layer_types (linear_attention /      model.layer_types (linear / global); absent: full_attention_interval
full_attention)                      (default 4: three linear layers, then a full one)
linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
linear_conv_kernel_dim               model.gdn.n_key_heads, n_value_heads, key_head_dim, value_head_dim,
                                     conv_kernel (chunk_size is gptkit's: the result does not depend on it)
partial_rotary_factor                model.rotary_dim = int(head_dim * factor) (absent: 0.25)
num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob
                                     moe.n_experts, top_k, d_expert, norm_topk_prob (router softmax)
shared_expert_intermediate_size      moe.n_shared = it / moe_intermediate_size, moe.shared_expert_gate
decoder_sparse_step, mlp_only_layers moe.every, moe.first_dense (dense layers first only)

A full layer's q_proj holds, per query head, its query's head_dim rows then its output gate's: our qkv_proj
and attn.gate_proj (GATE_SPLIT rows). A linear layer's tensors (linear_attn.in_proj_qkvz, in_proj_ba,
conv1d, A_log, dt_bias, norm, out_proj) are gptkit's as they are (gptkit/model/gated_deltanet.py keeps
transformers' names and layouts). A layer's experts are experts.<j>.gate_proj/up_proj/down_proj in the
files (STACK rows), two fused tensors per layer in transformers' memory (memory_layout, files_layout). The
released checkpoints also hold an MTP module (mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
mtp.layers.0: a full-attention MoE decoder layer, mtp.norm), which transformers ignores. gptkit's model.mtp
(gptkit/model/mtp.py) is the same computation (vLLM's qwen3_next_mtp: the embedding's norm first in fc's
input, the main model's final-normed hidden state, the shared embedding and head, a block of the last
layer's kind, which is full attention in Qwen3-Next): import keeps it as model.mtp (depth 1) when every
tensor has its place (with_files), else drops it, and says which in one note line; export writes it back
under the same names.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder
from gptkit.hf.family import COPY, GATE_SPLIT, PLAIN, STACK, Row, check_int, refusal, require, whole
from gptkit.hf.rope import hf_rope
from gptkit.model.config import ModelConfig

# Qwen3NextConfig's defaults for the keys a config.json may leave out (transformers reads them so)
QWEN3_NEXT_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "full_attention_interval": 4,
}
# config.json's integers beyond the layout's: (field, smallest value)
QWEN3_NEXT_INTS = (
    ("linear_conv_kernel_dim", 1),
    ("linear_key_head_dim", 1),
    ("linear_value_head_dim", 1),
    ("linear_num_key_heads", 1),
    ("linear_num_value_heads", 1),
    ("shared_expert_intermediate_size", 1),
    ("num_experts", 0),
    ("full_attention_interval", 1),
)
# transformers' layer_types <-> model.layer_types
KINDS = {"linear_attention": "linear", "full_attention": "global"}
# model.gdn <-> config.json
GDN_KEYS = {
    "n_key_heads": "linear_num_key_heads",
    "n_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
}
# a linear layer's tensors by model.gdn.layout (Qwen3-Next's grouped, Qwen3.5's split projections), the same
# names in gptkit's GatedDeltaNet and under linear_attn.
LINEAR_TENSORS = {
    "grouped": ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"),
    "split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"),
}
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# the MTP module's own tensors (ours under mtp.layers.0., theirs under mtp.) besides its decoder layer's
MTP_OWN = (
    ("e_norm", "pre_fc_norm_embedding"),
    ("h_norm", "pre_fc_norm_hidden"),
    ("proj", "fc"),
    ("out_norm", "norm"),
)
# what Qwen3-Next's mixture fixes of model.moe (transformers' Qwen3NextSparseMoeBlock)
MOE_FIXES = {
    "router": "softmax",
    "shared_expert_gate": True,
    "route_scale": 1.0,
    "bias_update_rate": 0.0,
    "correction_bias": False,
    "router_bias": False,
    "expert_biases": False,
    "activation": "swiglu",
    "n_group": 1,
}


class Qwen3Next(Decoder):
    """Qwen3-Next: Gated DeltaNet and gated full-attention layers, the (1 + w) RMSNorm, a gated shared
    expert."""

    model_type, architecture, config_class, title = (
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        "Qwen3-Next",
    )
    partial_rotary_default = 0.25
    # the config class's defaults for the keys a config.json may leave out, and model.gdn.layout
    defaults = QWEN3_NEXT_DEFAULTS
    gdn_layout = "grouped"
    fixes = {
        "norm": "rmsnorm_unit_offset",
        "bias": False,
        "qkv_bias": False,
        "qk_norm": "head",
        "norm_placement": "pre",
        "rope_scaling": None,
        "attn_output_gate": True,
    }

    def claims(self, cfg: ModelConfig) -> bool:
        # what only Qwen3-Next has among the families: linear layers, the output gate, the gated shared expert
        gated_shared = cfg.moe is not None and cfg.moe.shared_expert_gate
        hybrid = cfg.position == "rope" and (cfg.gdn is not None or cfg.attn_output_gate or gated_shared)
        # its projections' layout (Qwen3.5's classes below claim the split one)
        return hybrid and (cfg.gdn is None or cfg.gdn.layout == self.gdn_layout)

    def target(self, cfg: ModelConfig) -> str:
        return "Qwen3NextForCausalLM (Gated DeltaNet and gated attention layers)"

    def check(self, cfg: ModelConfig) -> None:
        target = self.target(cfg)
        plain = {k: v for k, v in PLAIN.items() if k not in ("rotary_dim", "gdn", "mtp")}
        need = {"position": "rope", **LLAMA_LAYOUT, **plain} | self.fixes | self.extra_needs(cfg)
        require(cfg, need, "in a Qwen3-Next model", target)
        m = cfg.moe
        if m is not None:
            fixes = MOE_FIXES | ({} if m.n_shared >= 1 else {"n_shared": 1})
            for name, want in fixes.items():
                have = getattr(m, name)
                if have != want:
                    raise GptkitError(
                        f"model.moe.{name}={have} has no faithful transformers architecture: {target} needs "
                        f"moe.{name}={want}; refusing rather than produce a different model"
                    )
        if cfg.mtp_depth > 1:
            raise GptkitError(
                f"model.mtp.depth={cfg.mtp_depth} has no faithful transformers layout: {target}'s "
                "checkpoints hold one MTP layer (mtp.*); set model.mtp.depth=1 or model.mtp=null"
            )
        if cfg.mtp_depth and cfg.layer_types is not None and cfg.layer_types[-1] == "linear":
            raise GptkitError(
                f"model.mtp with a linear last layer has no faithful transformers layout: {target}'s MTP "
                "layer is a full-attention layer (gptkit's MTP block is the last layer's kind); end the "
                "model with a global layer or set model.mtp=null"
            )
        if int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
            raise GptkitError(
                f"model.rotary_dim={cfg.rope_dim} of head_dim={cfg.head_dim} is no partial_rotary_factor "
                "transformers reads back exactly (int(head_dim * factor) != rotary_dim); choose another "
                "width"
            )

    # ---- config.json ---------------------------------------------------------------------------
    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        # written even over the whole head: Qwen3NextConfig's default is 0.25
        factor = cfg.rope_dim / cfg.head_dim
        d["rope_parameters"] = d["rope_parameters"] | {"partial_rotary_factor": factor}
        return d | {"partial_rotary_factor": factor}

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        types = cfg.layer_types or ["global"] * cfg.n_layers
        d: dict[str, Any] = {
            "attention_bias": False,
            "layer_types": [{"linear": "linear_attention"}.get(t, "full_attention") for t in types],
        }
        if cfg.gdn is not None:
            d |= {theirs: getattr(cfg.gdn, ours) for ours, theirs in GDN_KEYS.items()}
        m = cfg.moe
        if m is None:
            return d | {"num_experts": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}
        return d | {
            "num_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.d_expert,
            "shared_expert_intermediate_size": m.n_shared * m.d_expert,
            "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.every,
            "mlp_only_layers": list(range(m.first_dense)),
            "router_aux_loss_coef": m.aux_loss_coef,
            "output_router_logits": False,
        }

    def check_hf(self, d: dict[str, Any]) -> None:
        # num_experts 0: every layer the dense MLP (the layout's check takes positive counts only)
        super().check_hf({k: v for k, v in d.items() if not (k == "num_experts" and v == 0)})
        for field, least in QWEN3_NEXT_INTS:
            if d.get(field) is not None:
                check_int(d, self.model_type, field, least)

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        d = self.defaults | {k: v for k, v in d.items() if v is not None}
        rope, _ = hf_rope(d, None)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise refusal(self.model_type)(
                "rope_type",
                rope.get("rope_type", rope.get("type")),
                f"plain RoPE ({self.title} has no scaling)",
            )
        return super().config_from_hf(d, name)

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        if bool(d.get("attention_bias", False)):
            # o_proj's bias would be model.bias, which puts biases in the MLPs too
            raise refuse("attention_bias", True, "no biases: gptkit's o_proj bias comes with the MLPs'")
        return {k: v for k, v in self.fixes.items() if k != "rope_scaling"}

    def window_layers(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        n = d["num_hidden_layers"]
        raw = d.get("layer_types")
        if raw is None:
            every = d["full_attention_interval"]
            raw = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if not isinstance(raw, list) or len(raw) != n or any(t not in KINDS for t in raw):
            raise refuse("layer_types", raw, f"{n} of {' or '.join(KINDS)}")
        return None, raw

    def windows_from_hf(self, d: dict[str, Any], refuse) -> tuple[int | None, list[str] | None]:
        _, raw = self.window_layers(d, refuse)
        types = [KINDS[t] for t in raw]
        return None, types if "linear" in types else None

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        super().extra_from_hf(d, local_theta, local_rope, refuse)
        _, raw = self.window_layers(d, refuse)
        if "linear_attention" not in raw:
            return {}
        gdn = {ours: d[theirs] for ours, theirs in GDN_KEYS.items()}
        return {"gdn": gdn | {"layout": self.gdn_layout}}

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
        refuse = refusal(self.model_type)
        if d["num_experts"] == 0:
            return None, d["intermediate_size"]
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not whole(d.get(key)) or d[key] < 1:
                raise GptkitError(
                    f"{self.model_type} config.json has {key}={d.get(key)!r}; it must be a positive integer"
                )
        width, shared = d["moe_intermediate_size"], d["shared_expert_intermediate_size"]
        if shared % width:
            raise refuse(
                "shared_expert_intermediate_size",
                shared,
                f"a multiple of moe_intermediate_size={width} (gptkit's shared experts are d_expert wide)",
            )
        dense = sorted(d.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise refuse("mlp_only_layers", dense, "dense layers only at the start: [0, 1, ..., k - 1]")
        moe = {
            "n_experts": d["num_experts"],
            "top_k": d["num_experts_per_tok"],
            "d_expert": width,
            "n_shared": shared // width,
            "shared_expert_gate": True,
            "router": "softmax",
            "norm_topk_prob": bool(d["norm_topk_prob"]),
            "every": d["decoder_sparse_step"],
            "first_dense": len(dense),
            "aux_loss_coef": float(d.get("router_aux_loss_coef") or 0.0),
        }
        return moe, d["intermediate_size"]

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """The first full layer's q_proj (query and gate per head) and k_proj rows against the heads."""
        head_dim = d.get("head_dim") or self.defaults["head_dim"]
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        full = sorted(int(k.split(".")[2]) for k in shapes if k.endswith(".self_attn.k_proj.weight"))
        if not full:
            return
        for proj, need, rows in (
            ("q_proj", f"2 x num_attention_heads={heads} x head_dim={head_dim}", 2 * heads * head_dim),
            ("k_proj", f"num_key_value_heads={kv} x head_dim={head_dim}", kv * head_dim),
        ):
            name = f"model.layers.{full[0]}.self_attn.{proj}.weight"
            if name in shapes and shapes[name][0] != rows:
                raise GptkitError(
                    f"{source} does not match its config.json: {need} = {rows} rows, but {name} has shape "
                    f"{tuple(shapes[name])}"
                )

    # ---- weights -------------------------------------------------------------------------------
    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, h = f"blocks.{i}.", f"model.layers.{i}."
        if cfg.layer_types is not None and cfg.layer_types[i] == "linear":
            rows: list[Row] = [
                (g + f"attn.{t}.weight", h + f"linear_attn.{t}.weight", COPY)
                for t in LINEAR_TENSORS[cfg.gdn.layout]
            ]
            rows += [(g + f"attn.{p}", h + f"linear_attn.{p}", COPY) for p in ("A_log", "dt_bias")]
        else:
            a = h + "self_attn."
            rows = [
                (
                    (g + "attn.qkv_proj.weight", g + "attn.gate_proj.weight"),
                    tuple(a + f"{p}_proj.weight" for p in "qkv"),
                    GATE_SPLIT,
                ),
                (g + "attn.o_proj.weight", a + "o_proj.weight", COPY),
            ]
            rows += [(g + f"attn.{n}.weight", a + f"{n}.weight", COPY) for n in ("q_norm", "k_norm")]
        if cfg.feed_forward(i) == "moe":
            rows += self.expert_rows(cfg, i)
        else:
            rows += [(g + f"mlp.{p}.weight", h + f"mlp.{p}.weight", COPY) for p in EXPERT_NAMES]
        rows += [
            (g + "attn_norm.weight", h + "input_layernorm.weight", COPY),
            (g + "mlp_norm.weight", h + "post_attention_layernorm.weight", COPY),
        ]
        return rows

    def expert_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, moe = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        rows: list[Row] = [(g + "router.weight", moe + "gate.weight", COPY)]
        rows += [
            (
                g + f"experts.{p}",
                tuple(f"{moe}experts.{j}.{p}.weight" for j in range(cfg.moe.n_experts)),
                STACK,
            )
            for p in EXPERT_NAMES
        ]
        rows += [(g + f"shared.{p}.weight", moe + f"shared_expert.{p}.weight", COPY) for p in EXPERT_NAMES]
        rows.append((g + "shared_gate.weight", moe + "shared_expert_gate.weight", COPY))
        return rows

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        rows = super().final_rows(cfg)
        if not cfg.mtp_depth:
            return rows
        g, h, last = "mtp.layers.0.", "mtp.", cfg.n_layers - 1
        rows += [(g + f"{ours}.weight", h + f"{theirs}.weight", COPY) for ours, theirs in MTP_OWN]
        # its block: the last layer's rows (a full layer's) under mtp.layers.0.
        for ours, theirs, how in self.layer_rows(cfg, last):
            rows.append(
                (
                    _renamed(ours, f"blocks.{last}.", g + "block."),
                    _renamed(theirs, f"model.layers.{last}.", h + "layers.0."),
                    how,
                )
            )
        return rows

    def with_files(
        self, cfg: ModelConfig, d: dict[str, Any], state: dict[str, Any], source: str
    ) -> tuple[ModelConfig, str | None]:
        """cfg with model.mtp (depth 1) when the files' MTP module (mtp.*) maps exactly onto gptkit's (else
        without it, and a note saying why); an MTP tensor of another shape than the config gives is one
        GptkitError line."""
        mtp = {k: v for k, v in state.items() if k.startswith("mtp.")}
        if not mtp:
            return cfg, None
        dropped = f"imported without model.mtp (its MTP module's {len(mtp)} mtp.* tensors left out)"
        if cfg.layer_types is not None and cfg.layer_types[-1] == "linear":
            return (
                cfg,
                f"the last layer is linear, the MTP layer full attention (gptkit's is the last's): {dropped}",
            )
        kept = ModelConfig.from_dict(cfg.to_dict() | {"mtp": {"depth": 1}})
        # its experts fused or one by one (files_layout reads both)
        have = {k: tuple(v.shape) for k, v in self.files_layout(mtp, kept).items()}
        what = self.read_mtp(have, self.mtp_shapes(kept, lambda k: k.startswith("mtp.")), source)
        if what is not None:
            return cfg, f"the MTP module does not map onto gptkit's ({what}): {dropped}"
        return kept, "its MTP module (mtp.*) kept as model.mtp (depth 1)"

    def check_files(self, hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
        """The experts in the files, layer by layer, are those config.json names: else one GptkitError
        line."""
        for i in range(cfg.n_layers):
            moe = f"model.layers.{i}.mlp."
            found = {int(k[len(moe) :].split(".")[1]) for k in hf if k.startswith(moe + "experts.")}
            want = cfg.moe.n_experts if cfg.feed_forward(i) == "moe" else 0
            if found != set(range(want)):
                held = f"experts {min(found)}..{max(found)} ({len(found)})" if found else "no experts"
                raise GptkitError(
                    f"{source} does not match its config.json: layer {i} holds {held}, the config needs "
                    + (f"{want} (num_experts)" if want else "a dense MLP (mlp_only_layers)")
                )

    def memory_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """As transformers holds the model: each MoE layer's experts as experts.gate_up_proj
        [E, 2 * d_expert, d_model] (gate rows first) and experts.down_proj [E, d_model, d_expert]."""
        import torch

        # no MTP module: transformers ignores it
        out = {k: v for k, v in state.items() if not k.startswith("mtp.")}
        for i in cfg.moe_layers:
            moe = f"model.layers.{i}.mlp."
            experts = {
                p: torch.stack([out.pop(f"{moe}experts.{j}.{p}.weight") for j in range(cfg.moe.n_experts)])
                for p in EXPERT_NAMES
            }
            out[moe + "experts.gate_up_proj"] = torch.cat([experts["gate_proj"], experts["up_proj"]], dim=1)
            out[moe + "experts.down_proj"] = experts["down_proj"]
        return out

    def files_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The inverse of memory_layout (a state dict in the files' layout already is returned as it is; the
        released Qwen3.5-MoE files may fuse the experts as transformers holds them), with the MTP module only
        when cfg has model.mtp (with_files kept it; else it said so)."""
        out = {k: v for k, v in state.items() if cfg.mtp_depth or not k.startswith("mtp.")}
        # the mixtures: the layers', and the MTP layer's (a block of the last layer's kind)
        mixtures = [f"model.layers.{i}.mlp." for i in cfg.moe_layers]
        if cfg.mtp_depth and cfg.feed_forward(cfg.n_layers - 1) == "moe":
            mixtures.append("mtp.layers.0.mlp.")
        for moe in mixtures:
            if moe + "experts.gate_up_proj" not in out:
                continue
            gate_up, down = out.pop(moe + "experts.gate_up_proj"), out.pop(moe + "experts.down_proj")
            gate, up = gate_up.chunk(2, dim=1)  # [E, d_expert, d_model] each
            for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                out.update({f"{moe}experts.{j}.{p}.weight": t for j, t in enumerate(w.unbind(0))})
        return out


def _renamed(name: str | tuple[str, ...], old: str, new: str) -> str | tuple[str, ...]:
    """A row's name (or names) with the prefix `old` replaced by `new`."""
    if isinstance(name, tuple):
        return tuple(new + x[len(old) :] for x in name)
    return new + name[len(old) :]


# ---- Qwen3.5 ---------------------------------------------------------------------------------------
# What transformers' modeling_qwen3_5.py / modeling_qwen3_5_moe.py change of Qwen3-Next's:
#   - Gated DeltaNet's input projections held apart, in_proj_qkv (all q rows, all k, all v), in_proj_z,
#     in_proj_b, in_proj_a: model.gdn.layout=split (the same computation as in_proj_qkvz/in_proj_ba's rows)
#   - the text rotary is interleaved M-RoPE (mrope_section); text positions are equal in its three sections,
#     so it is Qwen3-Next's partial RoPE (tests/hf/test_hf_qwen3_5.py: cos, sin equal); no RoPE scaling
#   - dense: no mixture keys, intermediate_size everywhere; MoE: a mixture in every layer whose top-k weights
#     are always renormalized, no intermediate_size / decoder_sparse_step / norm_topk_prob / mlp_only_layers
#   - the same (1 + w) norms, gated q_proj, QK-norm, gated shared expert; the MTP module under mtp.* as
#     Qwen3-Next's; a composite checkpoint's language model under model.language_model.* (text_config)
# Qwen3_5TextConfig's defaults (Qwen3NextConfig's GDN and head keys; no mixture), Qwen3_5MoeTextConfig's
QWEN3_5_DEFAULTS = {
    k: v
    for k, v in QWEN3_NEXT_DEFAULTS.items()
    if k in GDN_KEYS.values()
    or k
    in (
        "rms_norm_eps",
        "head_dim",
        "full_attention_interval",
    )
}
QWEN3_5_MOE_DEFAULTS = QWEN3_5_DEFAULTS | {
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "router_aux_loss_coef": 0.001,
}
# what Qwen3.5's mixture fixes beyond Qwen3-Next's (Qwen3_5MoeSparseMoeBlock: every layer, the top-k weights
# always renormalized)
QWEN3_5_MOE_FIXES = {"norm_topk_prob": True, "every": 1, "first_dense": 0}


class Qwen3_5(Qwen3Next):
    """Qwen3.5's language model (dense): Qwen3-Next's layers, the Gated DeltaNet projections held apart
    (model.gdn.layout=split), interleaved M-RoPE that text positions make plain partial RoPE."""

    model_type, architecture, config_class, title = (
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        "Qwen3.5",
    )
    defaults = QWEN3_5_DEFAULTS
    gdn_layout = "split"

    def claims(self, cfg: ModelConfig) -> bool:
        return (
            cfg.position == "rope" and cfg.gdn is not None and cfg.gdn.layout == "split" and cfg.moe is None
        )

    def target(self, cfg: ModelConfig) -> str:
        return f"{self.architecture} (Qwen3.5: Gated DeltaNet with split projections and gated attention)"

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        # Qwen3_5TextConfig has no mixture's keys
        d = super().own_keys(cfg)
        return {
            k: v for k, v in d.items() if k not in ("num_experts", "mlp_only_layers", "decoder_sparse_step")
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        # text positions: the three M-RoPE sections turn by the same position (transformers' default
        # sections apply)
        d["rope_parameters"] = d["rope_parameters"] | {"mrope_interleaved": True}
        return d

    def check_hf(self, d: dict[str, Any]) -> None:
        super().check_hf(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        if section is not None and (
            not isinstance(section, list) or not all(whole(x) and x >= 0 for x in section)
        ):
            raise refusal(self.model_type)(
                "rope_parameters.mrope_section", section, "a list of non-negative integers (M-RoPE sections)"
            )

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
        return None, d["intermediate_size"]


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5's language model with a mixture in every layer (Qwen3-Next's gated shared expert, the top-k
    weights always renormalized)."""

    model_type, architecture, config_class, title = (
        "qwen3_5_moe_text",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        "Qwen3.5-MoE",
    )
    defaults = QWEN3_5_MOE_DEFAULTS

    def claims(self, cfg: ModelConfig) -> bool:
        return (
            cfg.position == "rope"
            and cfg.gdn is not None
            and cfg.gdn.layout == "split"
            and cfg.moe is not None
        )

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        for name, want in QWEN3_5_MOE_FIXES.items():
            have = getattr(cfg.moe, name)
            if have != want:
                raise GptkitError(
                    f"model.moe.{name}={have} has no faithful transformers architecture: {self.target(cfg)} "
                    f"needs moe.{name}={want}; refusing rather than produce a different model"
                )

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        d = Qwen3Next.own_keys(self, cfg)
        return {
            k: v
            for k, v in d.items()
            if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        # Qwen3_5MoeTextConfig has no intermediate_size (no dense layer)
        return {k: v for k, v in super().config_to_hf(cfg).items() if k != "intermediate_size"}

    def check_hf(self, d: dict[str, Any]) -> None:
        super().check_hf(self.with_width(d))

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        return super().config_from_hf(self.with_width(d), name)

    def with_width(self, d: dict[str, Any]) -> dict[str, Any]:
        """config.json with the mixture's keys Qwen3_5MoeTextConfig fixes (every layer a mixture, the top-k
        weights renormalized) and gptkit's model.d_ff (unused: no dense layer) = moe_intermediate_size."""
        width = d.get("moe_intermediate_size", self.defaults["moe_intermediate_size"])
        return (
            {"intermediate_size": width}
            | d
            | {
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        )

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any] | None, int | None]:
        if not whole(d.get("num_experts")) or d["num_experts"] < 1:
            raise GptkitError(
                f"{self.model_type} config.json has num_experts={d.get('num_experts')!r}; it must be a "
                "positive integer"
            )
        return Qwen3Next.moe_from_hf(self, d)


class Qwen3_5Vision(Qwen3_5):
    """A Qwen3.5 checkpoint with its vision tower (model_type qwen3_5: Qwen3_5ForConditionalGeneration):
    import reads its language model (text_config, model.language_model.*, the MTP module) and leaves the
    vision tower (model.visual.*) out, with a note; gptkit exports the language model as
    Qwen3_5ForCausalLM."""

    model_type, architecture, config_class, title = (
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5Config",
        "Qwen3.5 (with vision)",
    )
    # the text family of its language model; its tensors named its own way (file_names) in memory too
    text = Qwen3_5()
    own_files = True

    def claims(self, cfg: ModelConfig) -> bool:
        return False

    def text_config(self, d: dict[str, Any]) -> dict[str, Any]:
        """config.json's text_config, tie_word_embeddings the top level's (transformers ties by it)."""
        t = d.get("text_config")
        if not isinstance(t, dict):
            raise GptkitError(
                f"{self.model_type} config.json has no text_config (a JSON object): gptkit imports the "
                "language model of a Qwen3.5 checkpoint, and this one names none"
            )
        return t | {"tie_word_embeddings": bool(d.get("tie_word_embeddings", False))}

    def check_hf(self, d: dict[str, Any]) -> None:
        self.text.check_hf(self.text_config(d))

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        return self.text.config_from_hf(self.text_config(d), name)

    def size(self, d: dict[str, Any], field: str) -> int:
        return self.text_config(d)[field]

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        self.text.check_head_shapes(self.text_config(d), shapes, source)

    def file_names(self, state: dict[str, Any]) -> dict[str, Any]:
        """The language model's tensors under the text model's names (model.language_model.<x> ->
        model.<x>; lm_head and mtp.* as they are), the vision tower's (model.visual.*) left out."""
        lm = "model.language_model."
        if not any(k.startswith(lm) for k in state) and any(k.startswith("model.visual.") for k in state):
            raise GptkitError(
                f"the {self.model_type} checkpoint holds a vision tower (model.visual.*) and no language "
                "model (model.language_model.*): gptkit imports the language model of a Qwen3.5 checkpoint"
            )
        return {
            ("model." + k[len(lm) :] if k.startswith(lm) else k): v
            for k, v in state.items()
            if not k.startswith("model.visual.")
        }

    def files_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        # the language model's names first (transformers' model in memory holds model.language_model.*)
        return super().files_layout(self.file_names(state), cfg)

    def unpack(
        self, state: dict[str, Any], d: dict[str, Any], source: str
    ) -> tuple[dict[str, Any], str | None]:
        vision = sum(k.startswith("model.visual.") for k in state)
        note = (
            f"the vision tower ({vision} model.visual.* tensors) was not imported: gptkit imports the "
            "language model"
            if vision
            else None
        )
        return self.file_names(state), note


class Qwen3_5MoeVision(Qwen3_5Vision):
    """A Qwen3.5-MoE checkpoint with its vision tower (model_type qwen3_5_moe)."""

    model_type, architecture, config_class, title = (
        "qwen3_5_moe",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeConfig",
        "Qwen3.5-MoE (with vision)",
    )
    text = Qwen3_5Moe()
