"""The mixture-of-experts families: model.moe (softmax router, no shared experts, no expert bias), no biases.

    no qk_norm, every layer MoE, top-k renormalized           -> MixtralForCausalLM
    qk_norm=head (moe.every, moe.first_dense: dense layers)   -> Qwen3MoeForCausalLM
    qk_norm=full, norm_placement=pre, every layer MoE         -> OlmoeForCausalLM

An MoE layer's experts are our three [E, out, in] tensors (gptkit/model/moe.py) and, in transformers' files
(the Hub's layout, which transformers 5 still writes), E tensors each: experts.<j>.w1/w3/w2 (Mixtral) or
experts.<j>.gate_proj/up_proj/down_proj: a STACK row of the name map. transformers 5 holds them in memory as
two fused tensors per layer (experts.gate_up_proj [E, 2 * d_expert, d_model], experts.down_proj), which
memory_layout and files_layout convert to and from.
"""

from __future__ import annotations

import re
from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder, interleaved_qk
from gptkit.hf.family import COPY, PLAIN, STACK, Row, refusal, require, whole
from gptkit.model.config import ModelConfig

NO_BIASES = {"bias": False, "qkv_bias": False}
# what every mixture here fixes of model.moe (the keys of MoEConfig); the losses and impl are training's
MOE_COMMON = {
    "n_shared": 0,
    "route_scale": 1.0,
    "bias_update_rate": 0.0,
    "correction_bias": False,
    # gpt-oss's experts (a family of their own)
    "router_bias": False,
    "expert_biases": False,
    "activation": "swiglu",
}
SAME_NAMES = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
# torch is imported in memory_layout: the family table loads without it (`gptkit --help` lists the families)


class Mixture(Decoder):
    """A mixture of experts in the Llama layout; a family claims the configs of its attention's qk_norm."""

    # the qk_norm of its attention, what it fixes of model.moe, where a layer's mixture lives in the files
    # (model.layers.<i>.<block>) and an expert's three weights' names there
    qk_norm: str | None = None
    moe_fixes: dict[str, Any] = {}
    block = "mlp."
    expert_names = SAME_NAMES

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.moe is not None and cfg.qk_norm == self.qk_norm

    def check(self, cfg: ModelConfig) -> None:
        target = f"{self.architecture} (the transformers mixture of experts for qk_norm={cfg.qk_norm})"
        need = {"position": "rope", **LLAMA_LAYOUT, **PLAIN} | self.fixes
        if cfg.local_layers:
            need["sliding_window"] = None
        if cfg.query_pre_attn_scalar not in (None, cfg.head_dim):
            need["query_pre_attn_scalar"] = cfg.head_dim
        require(cfg, need, "with model.moe", target)
        for name, want in (MOE_COMMON | self.moe_fixes).items():
            have = getattr(cfg.moe, name)
            if have != want:
                why = " (the expert bias moves the top-k choice; transformers' model has none)" * (
                    name in ("bias_update_rate", "correction_bias")
                )
                raise GptkitError(
                    f"model.moe.{name}={have} has no faithful transformers architecture: {target} needs "
                    f"moe.{name}={want}{why}; refusing rather than produce a different model"
                )

    # ---- llama.cpp (export format=gguf) -----------------------------------------------------------
    def gguf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"expert_count": cfg.moe.n_experts, "expert_used_count": cfg.moe.top_k}

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """Each layer's experts stacked into one [E, out, in] tensor per projection, under the name
        llama.cpp's converter gives it (model.layers.<i>.<block>experts.<w1|gate_proj>.weight)."""
        import torch

        block = re.escape(self.block)
        expert = re.compile(rf"^(model\.layers\.\d+\.{block}experts\.)(\d+)\.(\w+)\.weight$")

        out: dict[str, Any] = {}
        stacks: dict[str, dict[int, Any]] = {}
        for k, v in state.items():
            m = expert.match(k)
            if m is None:
                out[k] = v
            else:
                stacks.setdefault(f"{m[1]}{m[3]}.weight", {})[int(m[2])] = v
        for k, by_expert in stacks.items():
            out[k] = torch.stack([by_expert[j] for j in range(len(by_expert))])
        return out

    # ---- config.json ---------------------------------------------------------------------------
    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        d = {"num_experts_per_tok": m.top_k, "router_aux_loss_coef": m.aux_loss_coef}
        return d | {
            "num_experts": m.n_experts,
            "norm_topk_prob": m.norm_topk_prob,
            "output_router_logits": False,
        }

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """(model.moe, model.d_ff) of the family's config.json; GptkitError for what gptkit cannot
        represent."""
        mtype = self.model_type
        experts = d.get("num_experts", d.get("num_local_experts"))
        for key, value in (("num_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok"))):
            if not whole(value):
                raise GptkitError(
                    f"{mtype} config.json has no {key} (an integer), which gptkit does not guess; add it to "
                    f"config.json"
                )
        moe: dict[str, Any] = {
            "n_experts": experts,
            "top_k": d["num_experts_per_tok"],
            "router": "softmax",
            "aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001)),
        }
        return self.own_moe(d, moe, refusal(mtype))

    def own_moe(self, d: dict[str, Any], moe: dict[str, Any], refuse) -> tuple[dict[str, Any], int]:
        raise NotImplementedError

    # ---- weights -------------------------------------------------------------------------------
    def prefix(self, layer: int) -> str:
        """Where layer `layer`'s mixture lives in the files."""
        return f"model.layers.{layer}.{self.block}"

    def expert_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        g, moe = f"blocks.{i}.", self.prefix(i)
        rows: list[Row] = [(g + "mlp.router.weight", moe + "gate.weight", COPY)]
        rows += [
            (
                g + f"mlp.experts.{proj}",
                tuple(f"{moe}experts.{j}.{theirs}.weight" for j in range(cfg.moe.n_experts)),
                STACK,
            )
            for proj, theirs in self.expert_names.items()
        ]
        return rows

    def check_files(self, hf: dict[str, Any], cfg: ModelConfig, source: str) -> None:
        """The experts in the files, layer by layer, are those config.json names: else one GptkitError line
        that says which layer holds how many (or has an MoE where the config says dense, or none where it
        says MoE)."""
        for i in range(cfg.n_layers):
            moe = self.prefix(i)
            found = {int(k[len(moe) :].split(".")[1]) for k in hf if k.startswith(moe + "experts.")}
            want = cfg.moe.n_experts if cfg.feed_forward(i) == "moe" else 0
            if found != set(range(want)):
                held = f"experts {min(found)}..{max(found)} ({len(found)})" if found else "no experts"
                raise GptkitError(
                    f"{source} does not match its config.json: layer {i} holds {held}, the config needs "
                    + (f"{want} (num_experts/num_local_experts)" if want else "a dense MLP (mlp_only_layers)")
                )

    def memory_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """Each MoE layer's experts as mlp.experts.gate_up_proj [E, 2 * d_expert, d_model] (gate rows first)
        and mlp.experts.down_proj [E, d_model, d_expert], its router as mlp.gate.weight (Mixtral's
        block_sparse_moe renamed)."""
        import torch

        out = dict(state)
        names = self.expert_names
        for i in cfg.moe_layers:
            moe, mem = self.prefix(i), f"model.layers.{i}.mlp."
            experts = {
                p: torch.stack(
                    [out.pop(f"{moe}experts.{j}.{names[p]}.weight") for j in range(cfg.moe.n_experts)]
                )
                for p in names
            }
            out[mem + "gate.weight"] = out.pop(moe + "gate.weight")
            out[mem + "experts.gate_up_proj"] = torch.cat([experts["gate_proj"], experts["up_proj"]], dim=1)
            out[mem + "experts.down_proj"] = experts["down_proj"]
        return out

    def files_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The inverse of memory_layout; a state dict in the files' layout already is returned as it is."""
        out = dict(state)
        names = self.expert_names
        for i in cfg.moe_layers:
            moe, mem = self.prefix(i), f"model.layers.{i}.mlp."
            if mem + "experts.gate_up_proj" not in out:
                continue
            gate_up, down = out.pop(mem + "experts.gate_up_proj"), out.pop(mem + "experts.down_proj")
            gate, up = gate_up.chunk(2, dim=1)  # [E, d_expert, d_model] each
            for p, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                out.update({f"{moe}experts.{j}.{names[p]}.weight": t for j, t in enumerate(w.unbind(0))})
            out[moe + "gate.weight"] = out.pop(mem + "gate.weight")
        return out


class Mixtral(Mixture):
    """Every layer MoE, the top-k weights renormalized; its mixture is block_sparse_moe, its experts
    w1/w3/w2."""

    model_type, architecture, config_class, title = (
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        "Mixtral",
    )
    qk_norm = None
    fixes = NO_BIASES | {"qk_norm": None, "norm_placement": "pre"}
    moe_fixes = {"router": "softmax", "norm_topk_prob": True, "every": 1, "first_dense": 0}
    block = "block_sparse_moe."
    expert_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    # llama.cpp reads Mixtral as its llama architecture with experts
    gguf_arch = "llama"

    def gguf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return super().gguf_keys(cfg) | {"feed_forward_length": cfg.moe.d_expert}

    def gguf_state(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        return interleaved_qk(super().gguf_state(state, cfg), cfg)

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        return {
            "num_experts_per_tok": m.top_k,
            "router_aux_loss_coef": m.aux_loss_coef,
            "intermediate_size": m.d_expert,
            "num_local_experts": m.n_experts,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "output_router_logits": False,
        }

    def own_moe(self, d: dict[str, Any], moe: dict[str, Any], refuse) -> tuple[dict[str, Any], int]:
        if d.get("sliding_window") is not None:
            raise refuse("sliding_window", d["sliding_window"], "full attention in every layer: null")
        if float(d.get("router_jitter_noise") or 0.0):
            raise refuse("router_jitter_noise", d["router_jitter_noise"], "no router noise: 0.0")
        return moe | {"d_expert": d["intermediate_size"], "norm_topk_prob": True}, d["intermediate_size"]


class Qwen3Moe(Mixture):
    """Qwen3's attention (qk_norm=head); dense layers first (mlp_only_layers) or between them
    (decoder_sparse_step)."""

    model_type, architecture, config_class, title = (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        "Qwen3-MoE",
    )
    qk_norm = "head"
    fixes = NO_BIASES | {"qk_norm": "head", "norm_placement": "pre"}
    moe_fixes = {"router": "softmax"}
    gguf_arch = "qwen3moe"

    def gguf_check(self, cfg: ModelConfig) -> None:
        m = cfg.moe
        if m.first_dense or m.every != 1 or not m.norm_topk_prob:
            raise GptkitError(
                f"export format=gguf: model.moe has first_dense={m.first_dense}, every={m.every}, "
                f"norm_topk_prob={m.norm_topk_prob}, and llama.cpp's qwen3moe has experts in every layer "
                f"with the top-k weights renormalized (first_dense=0, every=1, norm_topk_prob=true); "
                f"refusing rather than produce a different model"
            )
        super().gguf_check(cfg)

    def gguf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return super().gguf_keys(cfg) | {"expert_feed_forward_length": cfg.moe.d_expert}

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        return (
            {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
            | super().own_keys(cfg)
            | {
                "intermediate_size": cfg.d_ff,
                "moe_intermediate_size": m.d_expert,
                "decoder_sparse_step": m.every,
                "mlp_only_layers": list(range(m.first_dense)),
            }
        )

    def own_moe(self, d: dict[str, Any], moe: dict[str, Any], refuse) -> tuple[dict[str, Any], int]:
        moe["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
        dense = sorted(d.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise refuse("mlp_only_layers", dense, "dense layers only at the start: [0, 1, ..., k - 1]")
        expert_width = d.get("moe_intermediate_size")
        if not whole(expert_width):
            raise GptkitError(
                f"{self.model_type} config.json has no moe_intermediate_size (an integer), which gptkit does "
                f"not guess; add it to config.json"
            )
        moe |= {
            "d_expert": expert_width,
            "every": int(d.get("decoder_sparse_step") or 1),
            "first_dense": len(dense),
        }
        return moe, d["intermediate_size"]


class Olmoe(Mixture):
    """OLMo's attention (qk_norm=full) with pre-norms; every layer MoE; a router z-loss."""

    model_type, architecture, config_class, title = "olmoe", "OlmoeForCausalLM", "OlmoeConfig", "OLMoE"
    qk_norm = "full"
    fixes = NO_BIASES | {"qk_norm": "full", "norm_placement": "pre"}
    moe_fixes = {"router": "softmax", "every": 1, "first_dense": 0}

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.moe
        # read back by gptkit import (transformers' OlmoeConfig keeps it as an extra key)
        z = {"router_z_loss_coef": m.z_loss_coef} if m.z_loss_coef else {}
        return (
            {"attention_bias": False}
            | super().own_keys(cfg)
            | {"intermediate_size": m.d_expert, "clip_qkv": None}
            | z
        )

    def own_moe(self, d: dict[str, Any], moe: dict[str, Any], refuse) -> tuple[dict[str, Any], int]:
        moe["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
        if d.get("clip_qkv") is not None:
            raise refuse("clip_qkv", d["clip_qkv"], "q, k and v unclipped: null")
        if float(d.get("router_z_loss_coef") or 0.0):
            moe["z_loss_coef"] = float(d["router_z_loss_coef"])
        return moe | {"d_expert": d["intermediate_size"]}, d["intermediate_size"]
