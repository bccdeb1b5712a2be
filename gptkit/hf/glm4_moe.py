"""The GLM-4.5 family (transformers' model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7).

gptkit variant                                          transformers architecture
the Llama layout with q/k/v biases or none (o_proj     -> Glm4MoeForCausalLM
never), QK-norm per head or none, partial RoPE
(model.rotary_dim: the first features of each head,
rotate-half within them), and a sigmoid-routed mixture
(model.moe: router sigmoid with its correction bias,
group-limited top-k, routed scale, shared experts,
dense first layers, every later layer MoE)

config.json                          gptkit
attention_bias / use_qk_norm         model.qkv_bias (model.bias false) / model.qk_norm=head
partial_rotary_factor                model.rotary_dim = int(head_dim * factor) (transformers' rule; absent:
                                     0.5, Glm4MoeConfig's default)
n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts
                                     moe.n_experts, top_k, d_expert, n_shared
first_k_dense_replace                moe.first_dense (moe.every 1), the dense layers model.d_ff wide
n_group, topk_group, routed_scaling_factor, norm_topk_prob
                                     moe.n_group, topk_group, route_scale, norm_topk_prob
mlp.gate.e_score_correction_bias     moe.correction_bias: the layer's expert_bias buffer

A layer's experts are experts.<j>.gate_proj/up_proj/down_proj in the files (STACK rows), two fused tensors
per layer in transformers' memory (memory_layout and files_layout convert). The released checkpoints also
hold num_nextn_predict_layers MTP layers after the last layer (model.layers.<num_hidden_layers + k>: enorm,
hnorm, eh_proj, a decoder layer, shared_head.norm; maybe copies of the embedding and the head), which
transformers ignores. gptkit's model.mtp (gptkit/model/mtp.py) is the same computation (the embedding's norm
first in eh_proj's input, the main model's final-normed hidden state, the shared embedding and head): import
keeps them as model.mtp when they map exactly (with_files), else drops them, and says which in one note
line; export writes them back under the same names.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder
from gptkit.hf.family import COPY, PLAIN, STACK, Row, check_int, refusal, require, whole
from gptkit.hf.rope import hf_rope
from gptkit.model.config import ModelConfig

# config.json's integers of the mixture and its MTP layers beyond the layout's: (field, smallest value)
GLM_INTS = (
    ("n_routed_experts", 2),
    ("num_experts_per_tok", 1),
    ("moe_intermediate_size", 1),
    ("n_shared_experts", 0),
    ("first_k_dense_replace", 0),
    ("n_group", 1),
    ("topk_group", 1),
    ("num_nextn_predict_layers", 0),
)
# Glm4MoeConfig's defaults for the keys a config.json may leave out (transformers reads them so)
GLM_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
}
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# an MTP layer's own tensors (ours, theirs) besides its decoder layer's
MTP_OWN = (("e_norm", "enorm"), ("h_norm", "hnorm"), ("proj", "eh_proj"), ("out_norm", "shared_head.norm"))
# the copies of the main model's embedding and head an MTP layer may hold: (theirs, the main tensor's name)
MTP_COPIES = (
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("shared_head.head.weight", "lm_head.weight"),
)


class Glm4Moe(Decoder):
    """GLM-4.5: GQA with q/k/v biases, optional QK-norm, partial RoPE, DeepSeek-style sigmoid routing."""

    model_type, architecture, config_class, title = (
        "glm4_moe",
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        # GLM-4.5, 4.6, 4.7 (the helps' list spells model_types)
        "GLM4-MoE",
    )
    partial_rotary_default = 0.5
    fixes = {"bias": False, "norm_placement": "pre", "rope_scaling": None}

    def claims(self, cfg: ModelConfig) -> bool:
        # the sigmoid router with shared experts and multi-head attention (DeepSeek-V3's is multi-head
        # latent attention; without shared experts the softmax mixtures' refusal names the router)
        return (
            cfg.position == "rope"
            and cfg.moe is not None
            and cfg.moe.router == "sigmoid"
            and cfg.moe.n_shared >= 1
            and cfg.attention_kind == "mha"
        )

    def target(self, cfg: ModelConfig) -> str:
        return "Glm4MoeForCausalLM (a sigmoid-routed mixture with multi-head attention)"

    def check(self, cfg: ModelConfig) -> None:
        target = self.target(cfg)
        plain = {k: v for k, v in PLAIN.items() if k not in ("rotary_dim", "mtp")}
        need = {"position": "rope", **LLAMA_LAYOUT, **plain} | self.fixes
        if cfg.qk_norm not in (None, "head"):
            need["qk_norm"] = "head"
        if cfg.local_layers:
            need["sliding_window"] = None
        if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            need["query_pre_attn_scalar"] = cfg.head_dim
        require(cfg, need, "with a sigmoid router", target)
        m = cfg.moe
        for name, want in (
            ("every", 1),
            ("router_bias", False),
            ("expert_biases", False),
            ("activation", "swiglu"),
        ):
            if getattr(m, name) != want:
                raise GptkitError(
                    f"model.moe.{name}={getattr(m, name)} has no faithful transformers architecture: "
                    f"{target} needs moe.{name}={want}; refusing rather than produce a different model"
                )
        if m.n_shared < 1:
            raise GptkitError(
                f"model.moe.n_shared={m.n_shared} has no faithful transformers architecture: {target} has "
                "n_shared_experts >= 1 (its shared expert is always there); refusing rather than produce a "
                "different model"
            )
        if not (m.correction_bias or m.bias_update_rate > 0):
            raise GptkitError(
                f"model.moe.correction_bias=False has no faithful transformers architecture: {target} holds "
                "e_score_correction_bias in every MoE layer (set moe.correction_bias=true); refusing rather "
                "than produce a different model"
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
        # written even over the whole head: Glm4MoeConfig's default is 0.5
        factor = cfg.rope_dim / cfg.head_dim
        d["rope_parameters"] = d["rope_parameters"] | {"partial_rotary_factor": factor}
        return d | {"partial_rotary_factor": factor}

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        return {
            "attention_bias": bool(cfg.qkv_bias),
            "use_qk_norm": cfg.qk_norm == "head",
            "moe_intermediate_size": m.d_expert,
            "n_routed_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "n_shared_experts": m.n_shared,
            "first_k_dense_replace": m.first_dense,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "routed_scaling_factor": m.route_scale,
            "norm_topk_prob": m.norm_topk_prob,
            "num_nextn_predict_layers": cfg.mtp_depth,
            "output_router_logits": False,
        }

    def check_hf(self, d: dict[str, Any]) -> None:
        super().check_hf(d)
        for field, least in GLM_INTS:
            if d.get(field) is not None:
                check_int(d, self.model_type, field, least)

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        d = GLM_DEFAULTS | {k: v for k, v in d.items() if v is not None}
        rope, _ = hf_rope(d, None)
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise refusal(self.model_type)(
                "rope_type", rope.get("rope_type", rope.get("type")), "plain RoPE (GLM-4.5 has no scaling)"
            )
        # the MTP layers are the files' (with_files): config.json alone never makes them
        return super().config_from_hf(d, name)

    def bias_from_hf(self, d: dict[str, Any], refuse) -> dict[str, Any]:
        # q/k/v biases under attention_bias, never o_proj's nor the MLPs'
        return {
            "bias": False,
            "qkv_bias": bool(d.get("attention_bias", False)),
            "qk_norm": "head" if d.get("use_qk_norm") else None,
            "norm_placement": "pre",
        }

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any], int]:
        refuse = refusal(self.model_type)
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not whole(d.get(key)):
                raise GptkitError(
                    f"{self.model_type} config.json has no {key} (an integer), which gptkit does not guess; "
                    f"add it to config.json"
                )
        if d["n_shared_experts"] < 1:
            raise refuse("n_shared_experts", d["n_shared_experts"], "one or more shared experts")
        scale = d["routed_scaling_factor"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise refuse("routed_scaling_factor", scale, "a number > 0")
        moe = {
            "n_experts": d["n_routed_experts"],
            "top_k": d["num_experts_per_tok"],
            "d_expert": d["moe_intermediate_size"],
            "n_shared": d["n_shared_experts"],
            "first_dense": d["first_k_dense_replace"],
            "router": "sigmoid",
            "correction_bias": True,
            "n_group": d["n_group"],
            "topk_group": d["topk_group"],
            "route_scale": float(scale),
            "norm_topk_prob": bool(d["norm_topk_prob"]),
            "aux_loss_coef": float(d.get("router_aux_loss_coef", 0.0) or 0.0),
        }
        return moe, d["intermediate_size"]

    # ---- weights -------------------------------------------------------------------------------
    def expert_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, moe = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        rows: list[Row] = [
            (g + "router.weight", moe + "gate.weight", COPY),
            (g + "expert_bias", moe + "gate.e_score_correction_bias", COPY),
        ]
        rows += [
            (
                g + f"experts.{p}",
                tuple(f"{moe}experts.{j}.{p}.weight" for j in range(cfg.moe.n_experts)),
                STACK,
            )
            for p in EXPERT_NAMES
        ]
        rows += [(g + f"shared.{p}.weight", moe + f"shared_experts.{p}.weight", COPY) for p in EXPERT_NAMES]
        return rows

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        rows = super().final_rows(cfg)
        last = cfg.n_layers - 1
        for k in range(cfg.mtp_depth):
            g, h = f"mtp.layers.{k}.", f"model.layers.{cfg.n_layers + k}."
            rows += [(g + f"{ours}.weight", h + f"{theirs}.weight", COPY) for ours, theirs in MTP_OWN]
            # its block: the last layer's rows under the MTP layer's names
            for ours, theirs, how in self.layer_rows(cfg, last):
                rows.append(
                    (
                        _renamed(ours, f"blocks.{last}.", g + "block."),
                        _renamed(theirs, f"model.layers.{last}.", h),
                        how,
                    )
                )
        return rows

    def trailing_layers(self, d: dict[str, Any]) -> int:
        # absent: Glm4MoeConfig's default
        return d.get("num_nextn_predict_layers", GLM_DEFAULTS["num_nextn_predict_layers"]) or 0

    def with_files(
        self, cfg: ModelConfig, d: dict[str, Any], state: dict[str, Any], source: str
    ) -> tuple[ModelConfig, str | None]:
        """cfg with model.mtp when the files' MTP layers map exactly onto gptkit's (a note otherwise, and
        without MTP); an MTP tensor of another shape than the config gives is one GptkitError line."""
        import torch

        n = cfg.n_layers
        held = sorted({i for k in state if (i := _layer(k)) is not None and i >= n})
        nextn = self.trailing_layers(d)
        if not held:
            if not nextn:
                return cfg, None
            return cfg, (
                f"config.json has num_nextn_predict_layers={nextn} but the files hold no MTP layer (a "
                "transformers save leaves it out): imported without model.mtp"
            )
        if held != list(range(n, n + nextn)):
            raise GptkitError(
                f"{source} does not match its config.json: it holds layers {held[0]}..{held[-1]} after the "
                f"num_hidden_layers={n}, the config names num_nextn_predict_layers={nextn} MTP layer(s)"
            )
        kept = ModelConfig.from_dict(cfg.to_dict() | {"mtp": {"depth": nextn}})
        want = self.mtp_shapes(kept, lambda k: _is_mtp(k, n) and not _is_copy(k, n))
        have = {k: tuple(v.shape) for k, v in state.items() if _is_mtp(k, n)}
        dropped = f"imported without model.mtp (its {nextn} MTP layer(s) in the files left out)"
        head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
        copies = [k for k in have if _is_copy(k, n)]
        for name in copies:
            main = "model.embed_tokens.weight" if name.endswith("embed_tokens.weight") else head
            if have[name] != tuple(state[main].shape) or not torch.equal(state[name], state[main]):
                return cfg, f"{name} is not the main model's {main} (gptkit's MTP shares them): {dropped}"
        what = self.read_mtp({k: v for k, v in have.items() if k not in copies}, want, source)
        if what is not None:
            return cfg, f"the MTP layer does not map onto gptkit's ({what}): {dropped}"
        return kept, f"its {nextn} MTP layer(s) kept as model.mtp (depth {nextn})"

    def moe_layer_indices(self, cfg: ModelConfig) -> list[int]:
        """The MoE layers in the files: the main model's and its MTP layers'."""
        return list(cfg.moe_layers) + [cfg.n_layers + k for k in range(cfg.mtp_depth)]

    def check_files(self, hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
        """The experts in the files, layer by layer (the MTP layers' too), are those config.json names: else
        one GptkitError line."""
        moe_layers = set(self.moe_layer_indices(cfg))
        for i in range(cfg.n_layers + cfg.mtp_depth):
            moe = f"model.layers.{i}.mlp."
            found = {int(k[len(moe) :].split(".")[1]) for k in hf if k.startswith(moe + "experts.")}
            want = cfg.moe.n_experts if i in moe_layers else 0
            if found != set(range(want)):
                held = f"experts {min(found)}..{max(found)} ({len(found)})" if found else "no experts"
                raise GptkitError(
                    f"{source} does not match its config.json: layer {i} holds {held}, the config needs "
                    + (f"{want} (n_routed_experts)" if want else "a dense MLP (first_k_dense_replace)")
                )

    def memory_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """As transformers holds the model: each MoE layer's experts as experts.gate_up_proj
        [E, 2 * d_expert, d_model] (gate rows first) and experts.down_proj [E, d_model, d_expert]; no MTP
        layers (transformers ignores them)."""
        import torch

        out = {k: v for k, v in state.items() if not _is_mtp(k, cfg.n_layers)}
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
        """The inverse of memory_layout (a state dict in the files' layout already is returned as it is); MTP
        layers left out unless cfg has model.mtp, and the copies of the embedding and the head an MTP layer
        may hold (with_files found them equal) left out."""
        n = cfg.n_layers
        out = {k: v for k, v in state.items() if not _is_mtp(k, n) or (cfg.mtp_depth and not _is_copy(k, n))}
        for i in self.moe_layer_indices(cfg):
            moe = f"model.layers.{i}.mlp."
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


def _layer(name: str) -> int | None:
    if not name.startswith("model.layers."):
        return None
    index = name[len("model.layers.") :].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def _is_mtp(name: str, n_layers: int) -> bool:
    """Whether `name` belongs to a layer at or past n_layers (an MTP layer)."""
    i = _layer(name)
    return i is not None and i >= n_layers


def _is_copy(name: str, n_layers: int) -> bool:
    """Whether `name` is an MTP layer's copy of the embedding or the head."""
    return _is_mtp(name, n_layers) and name.split(".", 3)[3] in {c for c, _ in MTP_COPIES}
