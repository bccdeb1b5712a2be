"""The LoRA adapter format: which weight each `lora.targets` name adapts, the adapters' tensor names and
shapes, and merging them into the base weights. One place for these facts: training
(gptkit.training.finetune.lora) builds the adapters, loading a run (gptkit.runs: sample, eval, chat,
export) merges them, and the PEFT export (gptkit.hf) renames them.

    target   module inside blocks.<i>     rows of its weight            layer
    q, k, v  attn.qkv_proj                [0, d_attn), [d_attn, d_attn + d_kv), [d_attn + d_kv, end)
    o        attn.o_proj                  all
    gate     mlp.gate_proj (SwiGLU only)  all
    up       mlp.up_proj                  all
    down     mlp.down_proj                all

A layer of multi-head latent attention (model.attention_kind=mla, gptkit/model/mla.py) has other attention
projections, each a target of its own (whole: all its rows), named as DeepSeek's modules without _proj:

    q        attn.q_proj                  (model.mla.q_lora_rank null)
    q_a      attn.q_a_proj                (model.mla.q_lora_rank set: d_model -> q_lora_rank ...
    q_b      attn.q_b_proj                 ... and q_lora_rank -> each head's nope + rope query)
    kv_a     attn.kv_a_proj_with_mqa      d_model -> the latent and the shared rope key
    kv_b     attn.kv_b_proj               the latent -> each head's nope key and value
    o        attn.o_proj

its k and v are no targets (kv_a and kv_b make them). Decoding reads kv_b_proj's weight as W_uk and W_uv (the
absorbed path): an adapted kv_b_proj gives it W + (alpha / rank) * B @ A (gptkit.model.mla.dense_weight).

A linear-attention layer (Gated DeltaNet, model.layer_types `linear`, gptkit/model/gated_deltanet.py) has its
q, k, v and o in other modules, and two targets of its own (z and ba, which a softmax layer lacks):

    q, k, v  attn.in_proj_qkvz            each key head's q, k and v rows (the layout is grouped by key head:
    z        attn.in_proj_qkvz            its q, k, v, then its value heads' gate z), one adapter over them
    ba       attn.in_proj_ba              all (beta's and the decay's inputs)
    o        attn.out_proj                all

(model.gdn.layout=split, Qwen3.5's: q, k, v are one segment each of attn.in_proj_qkv, z is attn.in_proj_z,
and ba is no target, b and a being two modules there), so q, k, v, o on a hybrid adapt every layer's
attention, and z, ba the linear layers only (a target is adapted in the layers that have it). A target's
rows can be several segments of its module's weight (target_shape): its B's rows are those segments in
order (q's: key head 0's q rows, then head 1's, ...).

In a mixture of experts' MoE layers (model.moe) gate, up and down adapt every routed expert's own matrix:
the module is mlp.experts, whose gate_proj, up_proj [E, d_expert, d_model] and down_proj [E, d_model,
d_expert] stack the experts, and each expert e gets its own A[e] and B[e] (the router and the shared experts
stay frozen). Dense layers of such a model (moe.every, moe.first_dense) are adapted as above.

A target t of block i adds two tensors beside that module's weight:

    blocks.<i>.<module>.lora_<t>_A   [rank, in_features]   (kaiming-uniform init)
    blocks.<i>.<module>.lora_<t>_B   [rows of t, rank]     (zeros: training starts at the base model)

and the module computes  y = x W^T + b + (alpha / rank) * (dropout(x) A^T) B^T  on the rows of t; merged,
W[rows of t] += (alpha / rank) * B @ A. A GPT-2-style model (mlp=gelu) has no gate. An MoE layer's are

    blocks.<i>.mlp.experts.lora_<t>_A   [n_experts, rank, in_features]
    blocks.<i>.mlp.experts.lora_<t>_B   [n_experts, out_features, rank]

each token's rows through its experts' adapters (the same grouped matmuls as the weights), merged as
<t>_proj[e] += (alpha / rank) * B[e] @ A[e].
"""

from __future__ import annotations

import math
import re
from typing import Any

from gptkit.errors import ConfigError
from gptkit.model.config import LINEAR_KIND

TARGETS = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b", "z", "ba", "gate", "up", "down")
# the attention targets (of some attention kind), the rest are the MLP's
ATTENTION = TARGETS[:10]
# the model.mlp kinds with a gate projection
GATED = ("swiglu", "geglu")
MODULES = {
    "q": "attn.qkv_proj",
    "k": "attn.qkv_proj",
    "v": "attn.qkv_proj",
    "o": "attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# the attention targets of a multi-head latent attention layer (each a whole module)
MLA_MODULES = {
    "q": "attn.q_proj",
    "q_a": "attn.q_a_proj",
    "q_b": "attn.q_b_proj",
    "kv_a": "attn.kv_a_proj_with_mqa",
    "kv_b": "attn.kv_b_proj",
    "o": "attn.o_proj",
}
# the targets of a linear-attention layer (Gated DeltaNet): q, k, v, z parts of in_proj_qkvz
GDN_MODULES = {
    "q": "attn.in_proj_qkvz",
    "k": "attn.in_proj_qkvz",
    "v": "attn.in_proj_qkvz",
    "z": "attn.in_proj_qkvz",
    "ba": "attn.in_proj_ba",
    "o": "attn.out_proj",
}
# the same under model.gdn.layout=split (Qwen3.5's): q, k, v parts of in_proj_qkv (all q rows, then all k,
# then all v), z its own in_proj_z; b and a are two modules there, so ba is not a target of that layout
GDN_SPLIT_MODULES = {
    "q": "attn.in_proj_qkv",
    "k": "attn.in_proj_qkv",
    "v": "attn.in_proj_qkv",
    "z": "attn.in_proj_z",
    "o": "attn.out_proj",
}
KEY = re.compile(
    r"blocks\.(\d+)\.(attn\.qkv_proj|attn\.o_proj|attn\.q_proj|attn\.q_a_proj|attn\.q_b_proj"
    r"|attn\.kv_a_proj_with_mqa|attn\.kv_b_proj|attn\.in_proj_qkvz|attn\.in_proj_ba|attn\.in_proj_qkv"
    r"|attn\.in_proj_z|attn\.out_proj"
    r"|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj|mlp\.experts)"
    r"\.lora_(q_a|q_b|kv_a|kv_b|q|k|v|o|z|ba|gate|up|down)_([AB])"
)
# the module of a MoE layer's expert targets
EXPERTS = "mlp.experts"
# a LoRA run's checkpoint: {"rank", "alpha", "targets", "base", ...}
CHECKPOINT_KEY = "gptkit_lora"


def settings(lora: Any) -> dict[str, Any]:
    """The `lora` group (a DictConfig or dict) as plain data: rank, alpha, dropout, targets (a list)."""
    targets = lora.get("targets")
    return {
        "rank": lora.get("rank"),
        "alpha": lora.get("alpha"),
        "dropout": lora.get("dropout"),
        "targets": targets if isinstance(targets, str) or targets is None else list(targets),
    }


def is_adapter_key(name: str) -> bool:
    """Whether a GPT state-dict name is a LoRA adapter tensor (blocks.<i>.<module>.lora_<t>_A|B)."""
    return KEY.fullmatch(name) is not None


# the weights that train in full beside the adapters, and that a LoRA checkpoint holds with them: a reward
# model's new score head (model.score_head), as PEFT's modules_to_save=["score"] of a SEQ_CLS model
WHOLE = ("score.weight",)


def whole_keys(cfg: Any) -> tuple[str, ...]:
    """The weights of `cfg`'s model that train in full under LoRA (WHOLE: its score head, if it has one)."""
    return WHOLE if getattr(cfg, "score_head", False) else ()


def is_saved_key(name: str) -> bool:
    """Whether a LoRA checkpoint holds a GPT state-dict name: an adapter tensor or a weight of WHOLE."""
    return name in WHOLE or is_adapter_key(name)


def attention_targets(cfg: Any, layer: int) -> tuple[str, ...]:
    """The attention targets of layer `layer`: q, k, v, o under multi-head attention; under multi-head latent
    attention q (or q_a and q_b with model.mla.q_lora_rank), kv_a, kv_b, o; in a linear-attention layer
    (Gated DeltaNet) q, k, v, o, z, ba (no ba under model.gdn.layout=split)."""
    kind = cfg.attention_kind_of(layer)
    if kind == LINEAR_KIND:
        return tuple(gdn_modules(cfg))
    if kind != "mla":
        return ("q", "k", "v", "o")
    q = ("q",) if cfg.mla.q_lora_rank is None else ("q_a", "q_b")
    return (*q, "kv_a", "kv_b", "o")


def layer_targets(cfg: Any, layer: int) -> tuple[str, ...]:
    """The targets of layer `layer`: its attention's (attention_targets), gate with a gated MLP (SwiGLU,
    GeGLU), up and down."""
    mlp = ("up", "down") + (("gate",) if cfg.mlp in GATED else ())
    return (*attention_targets(cfg, layer), *mlp)


def model_targets(cfg: Any) -> tuple[str, ...]:
    """The targets a model of config `cfg` (a ModelConfig) has in some layer (each adapted in the layers that
    have it: a hybrid's z and ba in its linear layers), in TARGETS order."""
    have = {t for i in range(cfg.n_layers) for t in layer_targets(cfg, i)}
    return tuple(t for t in TARGETS if t in have)


def is_expert_target(cfg: Any, layer: int, target: str) -> bool:
    """Whether `target` adapts the routed experts of layer `layer` (an MoE layer's gate, up or down)."""
    return target in ("gate", "up", "down") and cfg.feed_forward(layer) == "moe"


def module_of(cfg: Any, layer: int, target: str) -> str:
    """The module inside blocks.<layer> that `target` adapts (mlp.experts for an MoE layer's experts; a
    multi-head latent attention layer's own projections, MLA_MODULES)."""
    if is_expert_target(cfg, layer, target):
        return EXPERTS
    kind = cfg.attention_kind_of(layer)
    if target in MLA_MODULES and kind == "mla":
        return MLA_MODULES[target]
    if target in GDN_MODULES and kind == LINEAR_KIND:
        return gdn_modules(cfg)[target]
    return MODULES[target]


def gdn_modules(cfg: Any) -> dict[str, str]:
    """A linear-attention layer's targets and their modules, by its projections' layout (model.gdn.layout)."""
    return GDN_SPLIT_MODULES if cfg.gdn.layout == "split" else GDN_MODULES


def target_shape(cfg: Any, target: str, layer: int | None = None) -> tuple[tuple[tuple[int, int], ...], int]:
    """(the row segments [start, end) of its module's weight that `target` adapts, in its B's row order;
    in_features) in layer `layer` (for an MoE layer's experts, of each expert's matrix). One segment but
    for a linear-attention layer's q, k, v and z: one per key head."""
    if layer is not None and is_expert_target(cfg, layer, target):
        d = cfg.moe.d_expert
        return (((0, cfg.d_model),), d) if target == "down" else (((0, d),), cfg.d_model)
    kind = cfg.attention_kind_of(layer or 0)
    if target in MLA_MODULES and kind == "mla":
        out, n_in = _mla_shape(cfg, target)
        return ((0, out),), n_in
    if target in GDN_MODULES and kind == LINEAR_KIND:
        return _gdn_shape(cfg, target)
    if target in ("q", "k", "v"):
        start = {"q": 0, "k": cfg.d_attn, "v": cfg.d_attn + cfg.d_kv}[target]
        return ((start, start + (cfg.d_attn if target == "q" else cfg.d_kv)),), cfg.d_model
    if target == "o":
        return ((0, cfg.d_model),), cfg.d_attn
    if target == "down":
        return ((0, cfg.d_model),), cfg.d_ff
    # gate, up
    return ((0, cfg.d_ff),), cfg.d_model


def _gdn_shape(cfg: Any, target: str) -> tuple[tuple[tuple[int, int], ...], int]:
    """target_shape of a Gated DeltaNet layer's target: in_proj_qkvz holds per key head [q (d_k), k (d_k),
    v (r d_v), z (r d_v)], r value heads per key head (gptkit.model.gated_deltanet)."""
    g, d = cfg.gdn, cfg.d_model
    r = g.n_value_heads // g.n_key_heads
    if g.layout == "split":
        # in_proj_qkv: [all q (H_k d_k), all k (H_k d_k), all v (H_v d_v)]; in_proj_z: the gate alone
        key, value = g.n_key_heads * g.key_head_dim, g.n_value_heads * g.value_head_dim
        if target in ("q", "k", "v", "z"):
            start = {"q": 0, "k": key, "v": 2 * key, "z": 0}[target]
            return ((start, start + (key if target in ("q", "k") else value)),), d
    if target == "ba":
        return ((0, 2 * g.n_value_heads),), d
    if target == "o":
        return ((0, d),), g.n_value_heads * g.value_head_dim
    sizes = {"q": g.key_head_dim, "k": g.key_head_dim, "v": r * g.value_head_dim, "z": r * g.value_head_dim}
    offset = {"q": 0, "k": sizes["q"], "v": 2 * sizes["q"], "z": 2 * sizes["q"] + sizes["v"]}[target]
    group = 2 * g.key_head_dim + 2 * r * g.value_head_dim
    starts = (h * group + offset for h in range(g.n_key_heads))
    return tuple((s, s + sizes[target]) for s in starts), d


def rows_of(segments: tuple[tuple[int, int], ...]) -> int:
    """How many rows a target's segments hold (its B's rows)."""
    return sum(end - start for start, end in segments)


def _mla_shape(cfg: Any, target: str) -> tuple[int, int]:
    """(out_features, in_features) of a multi-head latent attention target's module."""
    m, H, d = cfg.mla, cfg.n_heads, cfg.d_model
    return {
        "q": (H * m.qk_head_dim, d),
        "q_a": (m.q_lora_rank, d),
        "q_b": (H * m.qk_head_dim, m.q_lora_rank),
        "kv_a": (m.kv_lora_rank + m.qk_rope_head_dim, d),
        "kv_b": (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "o": (d, H * m.v_head_dim),
    }[target]


def check_lora(lora: Any, cfg: Any) -> tuple[str, ...]:
    """The `lora` settings against a model config: rank an integer in [1, the smallest adapted side],
    alpha > 0, dropout in [0, 1), targets a non-empty list of names this model has. Returns the targets
    (deduplicated, in TARGETS order); a problem is a one-line ConfigError naming the key."""
    targets = lora.get("targets")
    if isinstance(targets, str) or not targets:
        raise ConfigError(
            f"lora.targets={targets} must be a non-empty list of {', '.join(TARGETS)} "
            f"(e.g. lora.targets=[q,v])"
        )
    have = model_targets(cfg)
    wrong = [str(t) for t in targets if t not in have]
    if wrong:
        why = ""
        if "gate" in wrong and cfg.mlp not in GATED:
            why = " (a GPT-2-style model, mlp=gelu, has no gate projection)"
        elif set(wrong) & set(ATTENTION) and cfg.attention_kind == "mla":
            why = (
                " (multi-head latent attention, model.attention_kind=mla: its attention targets are its own "
                "projections, whose keys and values come from kv_a and kv_b)"
            )
        elif set(wrong) & {"z", "ba"}:
            why = " (z and ba are a linear-attention layer's, model.layer_types `linear`)"
        verb = "matches" if len(wrong) == 1 else "match"
        raise ConfigError(
            f"lora.targets: {', '.join(wrong)} {verb} no module of this model{why}; "
            f"its targets are {', '.join(have)}"
        )
    rank = lora.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"lora.rank={rank} must be a positive integer")
    chosen = tuple(t for t in TARGETS if t in targets)
    # every adapted matrix: (target, rows, in_features), dense and experts alike
    # (in TARGETS order: the first too small is named)
    adapted = dict.fromkeys(
        (t, rows_of(segments), n_in)
        for t in chosen
        for layer in range(cfg.n_layers)
        if t in layer_targets(cfg, layer)
        for segments, n_in in [target_shape(cfg, t, layer)]
    )
    for t, rows, n_in in adapted:
        if rank > min(rows, n_in):
            raise ConfigError(
                f"lora.rank={rank} is larger than the {t} projection ({rows} x {n_in}): "
                f"a rank-{rank} update of it is not low-rank; use lora.rank <= "
                f"{min(min(r, i) for _, r, i in adapted)}"
            )
    alpha = lora.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"lora.alpha={alpha} must be a number > 0 (the update is scaled by alpha / rank)")
    dropout = lora.get("dropout")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"lora.dropout={dropout} must be a number in [0, 1)")
    return chosen


def adapter_shapes(cfg: Any, targets: tuple[str, ...], rank: int) -> dict[str, tuple[int, ...]]:
    """Every adapter tensor's name and shape for a model config, targets and rank (an MoE layer's expert
    adapters with the experts first: [n_experts, rank, in], [n_experts, rows, rank])."""
    shapes = {}
    for i in range(cfg.n_layers):
        here = layer_targets(cfg, i)
        for t in targets:
            if t not in here:
                continue
            segments, n_in = target_shape(cfg, t, i)
            prefix = f"blocks.{i}.{module_of(cfg, i, t)}.lora_{t}"
            experts = (cfg.moe.n_experts,) if is_expert_target(cfg, i, t) else ()
            shapes[prefix + "_A"] = (*experts, rank, n_in)
            shapes[prefix + "_B"] = (*experts, rows_of(segments), rank)
    return shapes


def adapter_params(cfg: Any, targets: Any, rank: int, active: bool = False) -> int:
    """How many parameters the adapters of `targets` at `rank` add to a model of config `cfg` (active: those
    one token goes through, top_k of an MoE layer's n_experts expert adapters; for FLOPs)."""
    n = 0
    for shape in adapter_shapes(cfg, tuple(targets), int(rank)).values():
        size = math.prod(shape)
        if active and len(shape) == 3:
            size = size * cfg.moe.top_k // cfg.moe.n_experts
        n += size
    return n


def merge(state: dict[str, Any], cfg: Any, scale: float) -> dict[str, Any]:
    """`state` (a GPT state dict with adapter tensors) as a plain GPT state dict: the adapters folded into
    their weights, W[rows] + scale * B @ A computed in fp32 and stored in W's dtype; the adapters dropped.
    The input is not modified."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    # weight name -> its fp32 copy, every adapter of it added
    merged: dict[str, Any] = {}
    for name, a in state.items():
        m = KEY.fullmatch(name)
        if m is None or m.group(4) != "A":
            continue
        if m.group(2) == EXPERTS:
            # [E, out, in]: each expert's B[e] @ A[e]
            weight = f"blocks.{m.group(1)}.{EXPERTS}.{m.group(3)}_proj"
            segments = ((0, state[weight].shape[-2]),)
        else:
            weight = f"blocks.{m.group(1)}.{m.group(2)}.weight"
            segments, _ = target_shape(cfg, m.group(3), int(m.group(1)))
        if weight not in merged:
            merged[weight] = state[weight].float().clone()  # [(E,) out_features, in_features]
        w = merged[weight]
        b = state[name[:-1] + "B"]  # [(E,) rows, rank]
        update = scale * (b.float() @ a.float())  # [(E,) rows, in_features]
        row = 0
        for start, end in segments:
            w[..., start:end, :] += update[..., row : row + end - start, :]
            row += end - start
    for weight, w in merged.items():
        out[weight] = w.to(state[weight].dtype)
    return out


def check_adapters(state: dict[str, Any], cfg: Any, lora: dict[str, Any], where: str) -> None:
    """The adapter tensors of `state` are exactly those of `lora` (rank, targets) for `cfg`: else a one-line
    GptkitError naming `where`."""
    from gptkit.errors import GptkitError

    want = adapter_shapes(cfg, tuple(lora["targets"]), int(lora["rank"]))
    have = {k: tuple(v.shape) for k, v in state.items() if is_adapter_key(k)}
    lacking = [k for k in whole_keys(cfg) if k not in state]
    if lacking:
        raise GptkitError(
            f"{where} does not hold {', '.join(lacking)}, which train in full beside the adapters of a "
            "reward model (model.score_head)"
        )
    if have != want:
        missing = sorted(set(want) - set(have))[:2]
        odd = sorted(k for k in have if want.get(k) != have[k])[:2]
        raise GptkitError(
            f"{where} does not hold the adapters its LoRA settings name (rank {lora['rank']}, "
            f"targets {', '.join(lora['targets'])}): missing {missing}, unexpected {odd}"
        )


def fingerprint(path: Any) -> str:
    """A cheap identity of a checkpoint's content, recorded with a LoRA run's adapters for its base weights:
    the SHA-256 of the CRC-32 and size of every record of a torch.save archive (read from its index, no
    tensor read), of a sharded folder's checksums.json, or of a file's bytes otherwise (safetensors)."""
    import hashlib
    import zipfile
    from pathlib import Path

    path, h = Path(path), hashlib.sha256()
    if path.is_dir():
        h.update((path / "checksums.json").read_bytes() if (path / "checksums.json").is_file() else b"")
    elif zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for r in sorted(z.infolist(), key=lambda r: r.filename.split("/", 1)[-1]):
                h.update(f"{r.filename.split('/', 1)[-1]}:{r.CRC}:{r.file_size};".encode())
    else:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]
