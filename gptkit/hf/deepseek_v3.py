"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3/V3.1, Kimi K2, Moonlight) and DeepSeek-V2
(DeepseekV2ForCausalLM: its softmax routing, DeepseekV2 at the end of this file): multi-head latent attention
(model.attention_kind=mla), dense first layers, then DeepSeek's mixture, and the multi-token prediction layers
its checkpoints keep after the model's.

    gptkit                                     config.json / the files (model.layers.<i>.)
    model.mla.q_lora_rank (null: q_proj)       q_lora_rank: self_attn.q_a_proj, q_a_layernorm, q_b_proj
    model.mla.kv_lora_rank, qk_nope_head_dim,  kv_lora_rank, ...: self_attn.kv_a_proj_with_mqa,
      qk_rope_head_dim, v_head_dim               kv_a_layernorm, kv_b_proj, o_proj
    model.mla.rope_interleave                  rope_interleave
    model.mla.latent_norm_eps                  1e-6 in transformers whatever rms_norm_eps is
    model.moe.first_dense                      first_k_dense_replace (layers before it: mlp.gate/up/down_proj)
    model.moe: sigmoid router, n_experts,      n_routed_experts, num_experts_per_tok,
      top_k, d_expert, n_shared                  moe_intermediate_size, n_shared_experts: mlp.gate.weight,
                                                 mlp.experts.<j>.gate/up/down_proj, mlp.shared_experts.*
    the expert bias (moe.correction_bias)      mlp.gate.e_score_correction_bias (the choice only)
    moe.route_scale, norm_topk_prob,           routed_scaling_factor, norm_topk_prob, n_group, topk_group
      n_group, topk_group
    model.mtp.depth                            num_nextn_predict_layers: model.layers.<n_layers + k>.enorm,
                                                 hnorm, eh_proj, the block, shared_head.norm (and copies of
                                                 the embedding and the head: embed_tokens,
                                                 shared_head.head)

transformers' class builds no MTP layer: in memory (to_transformers) they are left out, an import keeps them
as model.mtp when the files hold them in gptkit/model/mtp.py's layout (with_files) and says so in a note.
The experts are E tensors each in the files, two fused tensors per layer in transformers 5's memory, as the
other mixtures' (gptkit/hf/moe.py). A model without a mixture (moe null) is every layer dense:
first_k_dense_replace = its layers.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import GptkitError
from gptkit.hf.decoder import LLAMA_LAYOUT, Decoder
from gptkit.hf.family import COPY, PLAIN, STACK, Row, check_int, require, whole
from gptkit.model.config import ModelConfig

# what the family fixes beyond the layout (MLA's own projections carry no biases in gptkit's mapping)
FIXES = {"qk_norm": None, "norm_placement": "pre", "bias": False, "qkv_bias": False}
# what it fixes of model.moe (its router and experts); the losses, impl and bias updates are training's
MOE_FIXES = {
    "router": "sigmoid",
    "every": 1,
    "router_bias": False,
    "expert_biases": False,
    "activation": "swiglu",
}
# config.json's MLA integers: (field, smallest value)
MLA_INTS = (("kv_lora_rank", 1), ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 2), ("v_head_dim", 1))
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_INTS = (
    ("n_routed_experts", 2),
    ("num_experts_per_tok", 1),
    ("moe_intermediate_size", 1),
    ("n_shared_experts", 1),
    ("first_k_dense_replace", 0),
    ("n_group", 1),
    ("topk_group", 1),
    ("num_nextn_predict_layers", 0),
)
EXPERT = ("gate_proj", "up_proj", "down_proj")
# the eps of transformers' q_a_layernorm and kv_a_layernorm (DeepseekV3RMSNorm's default, not rms_norm_eps)
LATENT_EPS = 1e-6


def layer_of(name: str) -> int:
    """The layer index of a files' tensor name (model.layers.<i>. ...), -1 for the others."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1


def mtp_layers(d: dict[str, Any]) -> int:
    """config.json's MTP layers (num_nextn_predict_layers; transformers' num_mtp_layers)."""
    return d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0


class DeepseekV3(Decoder):
    """Multi-head latent attention with DeepSeek's mixture; it alone claims model.attention_kind=mla."""

    model_type, architecture, config_class, title = (
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        "DeepSeek-V3",
    )
    fixes = FIXES
    # what it fixes of model.moe, the routing keys its config.json writes and reads, whether its gate holds
    # e_score_correction_bias
    moe_fixes = MOE_FIXES
    routing = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    biased = True

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.attention_kind == "mla"

    def check(self, cfg: ModelConfig) -> None:
        target = f"{self.architecture} (multi-head latent attention)"
        # its MTP layers are model.mtp (with_files, final_rows)
        plain = {k: v for k, v in PLAIN.items() if k not in ("attention_kind", "mtp")}
        latent = cfg.norm_eps if cfg.mla.latent_norm_eps is None else cfg.mla.latent_norm_eps
        if latent != LATENT_EPS:
            raise GptkitError(
                f"model.mla.latent_norm_eps={latent} (the eps of q_a_layernorm and kv_a_layernorm) has no "
                f"faithful transformers architecture: {target} fixes {LATENT_EPS}; set "
                f"model.mla.latent_norm_eps={LATENT_EPS}"
            )
        need = {"position": "rope", **LLAMA_LAYOUT, **plain, **FIXES, **self.extra_needs(cfg)}
        require(cfg, need, "with attention_kind=mla", target)
        m = cfg.moe
        if m is None:
            return
        for name, want in self.moe_fixes.items():
            if getattr(m, name) != want:
                raise GptkitError(
                    f"model.moe.{name}={getattr(m, name)} has no faithful transformers architecture: "
                    f"{target} needs moe.{name}={want}; refusing rather than produce a different model"
                )
        if m.n_shared < 1:
            raise GptkitError(
                f"model.moe.n_shared={m.n_shared} has no faithful transformers architecture: {target} always "
                f"has shared experts (n_shared_experts >= 1); refusing rather than produce a different model"
            )
        if self.biased and not (m.correction_bias or m.bias_update_rate > 0):
            raise GptkitError(
                f"model.moe has no expert bias, which {target} always has (e_score_correction_bias): set "
                f"model.moe.correction_bias=true (a zero bias changes nothing) or bias_update_rate > 0"
            )

    # ---- config.json ---------------------------------------------------------------------------
    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().config_to_hf(cfg)
        # transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim itself
        del d["head_dim"]
        return d

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        mla, m = cfg.mla, cfg.moe
        d: dict[str, Any] = {k: getattr(mla, k) for k in MLA_FIELDS}
        d |= {"rope_interleave": mla.rope_interleave, "attention_bias": False}
        d["num_nextn_predict_layers"] = cfg.mtp_depth
        if m is None:
            # every layer dense (and the MTP blocks): no mixture is built
            return d | {
                "first_k_dense_replace": cfg.n_layers + cfg.mtp_depth,
                "n_routed_experts": 2,
                "num_experts_per_tok": 1,
                "moe_intermediate_size": cfg.d_ff,
                "n_shared_experts": 1,
                "n_group": 1,
                "topk_group": 1,
            }
        return d | {
            "first_k_dense_replace": m.first_dense,
            "n_routed_experts": m.n_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.d_expert,
            "n_shared_experts": m.n_shared,
            "routed_scaling_factor": m.route_scale,
            "norm_topk_prob": m.norm_topk_prob,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            # DeepSeek's own config.json keys (its inference code, vLLM, SGLang read them)
            **self.routing,
            "aux_loss_alpha": m.aux_loss_coef,
            "output_router_logits": False,
        }

    def check_hf(self, d: dict[str, Any]) -> None:
        super().check_hf(d)
        mtype = self.model_type
        for field, least in MLA_INTS:
            if not whole(d.get(field)):
                raise GptkitError(
                    f"{mtype} config.json has no {field} (an integer), which gptkit does not guess; add "
                    f"it to config.json"
                )
            check_int(d, mtype, field, least)
        if d.get("q_lora_rank") is not None:
            check_int(d, mtype, "q_lora_rank")
        for field, least in MOE_INTS:
            if d.get(field) is not None:
                check_int(d, mtype, field, least)
        kv = d.get("num_key_value_heads")
        if kv is not None and kv != d["num_attention_heads"]:
            raise GptkitError(
                f"{mtype} config.json has num_key_value_heads={kv} but num_attention_heads="
                f"{d['num_attention_heads']}: multi-head latent attention gives every head its own key and "
                f"value (transformers repeats them otherwise); they must be equal"
            )

    def config_from_hf(self, d: dict[str, Any], name: str) -> ModelConfig:
        # head_dim is transformers' qk_rope_head_dim here: gptkit's is d_model / n_heads (unused by MLA)
        return super().config_from_hf({k: v for k, v in d.items() if k != "head_dim"}, name)

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        super().extra_from_hf(d, local_theta, local_rope, refuse)
        for field, want in self.routing.items():
            if d.get(field, want) != want:
                raise refuse(field, d[field], f"{self.title}'s routing in transformers: {field}={want}")
        if d.get("n_shared_experts") in (None, 0):
            raise refuse("n_shared_experts", d.get("n_shared_experts"), "at least one shared expert")
        mla = {k: d.get(k) for k in MLA_FIELDS} | {"rope_interleave": bool(d.get("rope_interleave", True))}
        # transformers' latent norms keep 1e-6 whatever rms_norm_eps is
        if float(d.get("rms_norm_eps", 1e-6)) != LATENT_EPS:
            mla["latent_norm_eps"] = LATENT_EPS
        return {"attention_kind": "mla", "mla": mla}

    def moe_from_hf(self, d: dict[str, Any]) -> tuple[Any, int | None]:
        first = d.get("first_k_dense_replace") or 0
        if first >= d["num_hidden_layers"]:
            return None, d["intermediate_size"]
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not whole(d.get(key)):
                raise GptkitError(
                    f"{self.model_type} config.json has no {key} (an integer), which gptkit does not guess; "
                    f"add it to config.json"
                )
        moe = {
            "n_experts": d["n_routed_experts"],
            "top_k": d["num_experts_per_tok"],
            "d_expert": d["moe_intermediate_size"],
            "n_shared": d["n_shared_experts"],
            "first_dense": first,
            "router": self.moe_fixes["router"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
            "route_scale": float(d.get("routed_scaling_factor", 1.0)),
            "n_group": d.get("n_group") or 1,
            "topk_group": d.get("topk_group") or 1,
            "correction_bias": self.biased,
        }
        moe |= {k: v for k, v in self.moe_fixes.items() if k in ("norm_topk_prob", "n_group", "topk_group")}
        if d.get("aux_loss_alpha") is not None:
            moe["aux_loss_coef"] = float(d["aux_loss_alpha"])
        return moe, d["intermediate_size"]

    def check_head_shapes(self, d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """The MLA projections' shapes are checked tensor by tensor against config.json on import."""

    def trailing_layers(self, d: dict[str, Any]) -> int:
        return mtp_layers(d)

    # ---- weights -------------------------------------------------------------------------------
    def block_rows(self, cfg: ModelConfig, g: str, h: str, moe: bool) -> list[Row]:
        """One block's rows: gptkit's `g` prefix against the files' `h`, a mixture when `moe`."""
        a, s = g + "attn.", h + "self_attn."
        projs = ["q_proj"] if cfg.mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        projs += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        rows: list[Row] = [(a + f"{p}.weight", s + f"{p}.weight", COPY) for p in projs]
        if moe:
            rows.append((g + "mlp.router.weight", h + "mlp.gate.weight", COPY))
            if self.biased:
                rows.append((g + "mlp.expert_bias", h + "mlp.gate.e_score_correction_bias", COPY))
            rows += [
                (
                    g + f"mlp.experts.{p}",
                    tuple(f"{h}mlp.experts.{j}.{p}.weight" for j in range(cfg.moe.n_experts)),
                    STACK,
                )
                for p in EXPERT
            ]
            rows += [
                (g + f"mlp.shared.{p}.weight", h + f"mlp.shared_experts.{p}.weight", COPY) for p in EXPERT
            ]
        else:
            rows += [(g + f"mlp.{p}.weight", h + f"mlp.{p}.weight", COPY) for p in EXPERT]
        rows += [
            (g + "attn_norm.weight", h + "input_layernorm.weight", COPY),
            (g + "mlp_norm.weight", h + "post_attention_layernorm.weight", COPY),
        ]
        return rows

    def layer_rows(self, cfg: ModelConfig, i: int) -> list[Row]:
        return self.block_rows(cfg, f"blocks.{i}.", f"model.layers.{i}.", cfg.feed_forward(i) == "moe")

    def final_rows(self, cfg: ModelConfig) -> list[Row]:
        """The final norm, then each MTP depth k as the files' layer n_layers + k (its block a block like the
        last layer's, gptkit/model/mtp.py), with its copies of the embedding and the head."""
        rows: list[Row] = [("final_norm.weight", "model.norm.weight", COPY)]
        head = "tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"
        moe = cfg.feed_forward(cfg.n_layers - 1) == "moe"
        for k in range(cfg.mtp_depth):
            g, h = f"mtp.layers.{k}.", f"model.layers.{cfg.n_layers + k}."
            rows += [
                (g + "e_norm.weight", h + "enorm.weight", COPY),
                (g + "h_norm.weight", h + "hnorm.weight", COPY),
                (g + "proj.weight", h + "eh_proj.weight", COPY),
            ]
            rows += self.block_rows(cfg, g + "block.", h, moe)
            rows += [
                (g + "out_norm.weight", h + "shared_head.norm.weight", COPY),
                ("tok_emb.weight", h + "embed_tokens.weight", COPY),
                (head, h + "shared_head.head.weight", COPY),
            ]
        return rows

    def with_files(
        self, cfg: ModelConfig, d: dict[str, Any], hf: dict[str, Any], source: str
    ) -> tuple[ModelConfig, str | None]:
        """config.json's num_nextn_predict_layers against the files: MTP layers present in gptkit's layout are
        kept as model.mtp (their embedding and head copies the model's own), dropped when the files hold none
        or their copies differ from the model's; each case one note. Partly present, or other names or
        shapes than the layout's: one GptkitError line. A dropped layer's tensors are left out by
        files_layout."""
        import torch

        n, N = self.trailing_layers(d), cfg.n_layers
        extra = sorted(k for k in hf if layer_of(k) >= N)
        said = f"num_nextn_predict_layers={n}"
        if not extra:
            if not n:
                return cfg, None
            return cfg, f"config.json has {said} but the files hold no MTP layer: imported without MTP"
        with_mtp = ModelConfig.from_dict(cfg.to_dict() | {"mtp": {"depth": n}})
        want = self.mtp_shapes(with_mtp, lambda k: layer_of(k) >= N)
        if self.read_mtp({k: tuple(hf[k].shape) for k in extra}, want, source) is not None:
            odd = sorted(set(extra) ^ set(want))[0]
            where = "the files hold" if odd in hf else "the files lack"
            raise GptkitError(
                f"{source} does not match its config.json: its multi-token prediction layers ({said}) are "
                f"not DeepSeek-V3's layout ({where} {odd})"
            )
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        for k in range(n):
            h = f"model.layers.{N + k}."
            for copy, own in (
                (h + "embed_tokens.weight", "model.embed_tokens.weight"),
                (h + "shared_head.head.weight", head),
            ):
                if own in hf and not torch.equal(hf[copy], hf[own]):
                    note = (
                        f"dropped the {n} multi-token prediction layer(s) ({said}): {copy} differs from "
                        f"{own}, which gptkit's MTP shares; imported without MTP"
                    )
                    return cfg, note
        note = (
            f"kept the {n} multi-token prediction layer(s) model.layers.{N}.. ({said}) as "
            f"model.mtp.depth={n} (model.mtp.loss_scale {with_mtp.mtp.loss_scale}, docs/mtp.md)"
        )
        return with_mtp, note

    def memory_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """transformers 5's memory: each MoE layer's experts as experts.gate_up_proj
        [E, 2 * d_expert, d_model] (gate rows first) and experts.down_proj [E, d_model, d_expert]; no MTP
        layer."""
        import torch

        N = cfg.n_layers
        out = {k: v for k, v in state.items() if layer_of(k) < N}
        for i in cfg.moe_layers:
            h, E = f"model.layers.{i}.mlp.", cfg.moe.n_experts
            w = {p: torch.stack([out.pop(f"{h}experts.{j}.{p}.weight") for j in range(E)]) for p in EXPERT}
            out[h + "experts.gate_up_proj"] = torch.cat([w["gate_proj"], w["up_proj"]], dim=1)
            out[h + "experts.down_proj"] = w["down_proj"]
        return out

    def files_layout(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The inverse of memory_layout (a state in the files' layout already is returned as it is); the MTP
        layers left out when cfg has no model.mtp (with_files dropped them)."""
        out = {k: v for k, v in state.items() if cfg.mtp_depth or layer_of(k) < cfg.n_layers}
        for i in cfg.moe_layers:
            h = f"model.layers.{i}.mlp."
            if h + "experts.gate_up_proj" not in out:
                continue
            gate, up = out.pop(h + "experts.gate_up_proj").chunk(2, dim=1)  # [E, d_expert, d_model] each
            for p, w in (
                ("gate_proj", gate),
                ("up_proj", up),
                ("down_proj", out.pop(h + "experts.down_proj")),
            ):
                out.update({f"{h}experts.{j}.{p}.weight": t for j, t in enumerate(w.unbind(0))})
        return out


class DeepseekV2(DeepseekV3):
    """DeepSeek-V2's routing (DeepseekV2ForCausalLM, DeepSeek-V2-Lite's shape): softmax scores, the top-k
    weights not renormalized (transformers ignores norm_topk_prob), times routed_scaling_factor, no correction
    bias, no groups (topk_method greedy: group_limited_greedy scores a group by its best expert, which gptkit
    does not); the rotated pairs always interleaved; no MTP layer. A family before DeepSeek-V3 in the table:
    it claims the MLA mixtures with a softmax router."""

    model_type, architecture, config_class, title = (
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "DeepseekV2Config",
        "DeepSeek-V2",
    )
    moe_fixes = MOE_FIXES | {
        "router": "softmax",
        "norm_topk_prob": False,
        "correction_bias": False,
        "bias_update_rate": 0.0,
        "n_group": 1,
        "topk_group": 1,
    }
    routing = {"scoring_func": "softmax", "topk_method": "greedy"}
    biased = False

    def claims(self, cfg: ModelConfig) -> bool:
        return cfg.attention_kind == "mla" and cfg.moe is not None and cfg.moe.router == "softmax"

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        require(cfg, {"mtp": None}, "with a softmax router", f"{self.architecture} (no MTP layer)")
        if not cfg.mla.rope_interleave:
            raise GptkitError(
                f"model.mla.rope_interleave=False has no faithful transformers architecture: "
                f"{self.architecture} always rotates interleaved pairs; refusing rather than produce a "
                f"different model"
            )

    def own_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        d = super().own_keys(cfg)
        for key in ("rope_interleave", "num_nextn_predict_layers"):
            del d[key]
        return d

    def trailing_layers(self, d: dict[str, Any]) -> int:
        return 0

    def extra_from_hf(
        self, d: dict[str, Any], local_theta: float | None, local_rope: dict[str, Any] | None, refuse
    ) -> dict[str, Any]:
        if d.get("mlp_bias"):
            raise refuse("mlp_bias", d["mlp_bias"], "MLPs without biases")
        variant = super().extra_from_hf(d, local_theta, local_rope, refuse)
        variant["mla"]["rope_interleave"] = True
        return variant
