"""A gptkit GPT to and from transformers, asking its family (gptkit/hf/families.py) and never its name.

    config         architecture(cfg), hf_config(cfg), check_hf_config(d), model_config_from_hf(d)
    weights        name_map(cfg): (ours, theirs, how) rows; to_hf_state_dict, from_hf_state_dict,
                   check_weight_sizes (config.json against the files' headers)
    in memory      to_transformers(model), from_transformers(hf_model) (need `transformers`)

Any combination no family maps is refused with a GptkitError that names the variant that does not map:
never a silently different model. RoPE is in the rotate-half layout on both sides and GELU is the tanh
approximation on both sides, so no permutation or activation change is needed. What each family maps is
in its file (llama.py, gemma.py, moe.py, gpt2.py); RoPE scalings in rope.py; PEFT adapters in peft.py;
folders (safetensors shards, tokenizer files, a Hub model, `gptkit import`) in folders.py.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gptkit.errors import GptkitError
from gptkit.hf.families import ARCHITECTURES, FAMILIES, SCORE_ARCHITECTURES, family_named, family_of, imported
from gptkit.hf.family import COPY, GATE_SPLIT, JOIN, SPLIT, STACK, TRANSPOSE, WEAVE, Family, Row
from gptkit.model import GPT
from gptkit.model.config import ModelConfig

# transformers (optional, the test extra) is imported where used: the mapping tables load without it.


# ---- config ------------------------------------------------------------------------------------
def architecture(cfg: ModelConfig) -> str:
    """The transformers model_type of a mappable config; GptkitError naming the first variant that does not
    map."""
    return family_of(cfg).model_type


def architecture_class(cfg: ModelConfig) -> str:
    """The transformers class `cfg` exports as: its family's causal LM, or with a score head (a reward model,
    model.score_head) its *ForSequenceClassification; a family that has none is a one-line GptkitError."""
    family = family_of(cfg)
    if not cfg.score_head:
        return family.architecture
    if not family.score_architecture:
        raise GptkitError(
            f"a reward model (model.score_head) of the {family.title} family has no transformers "
            f"*ForSequenceClassification export in gptkit (it writes {', '.join(SCORE_ARCHITECTURES)}); "
            "refusing rather than drop its score head"
        )
    return family.score_architecture


def hf_config(
    cfg: ModelConfig,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json of the transformers model equal to `cfg`."""
    family = family_of(cfg)
    common = {
        "architectures": [architecture_class(cfg)],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
        "use_cache": True,
    }
    if cfg.score_head:
        # one label: the reward; transformers scores a row at its last token that is not pad_token_id, which
        # it needs for a batch: the tokenizer's pad, else its end of text, else 0 (as training pads rows)
        pad = next((i for i in (pad_id, eos_id) if i is not None), 0)
        common |= {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": pad}
    return common | family.config_to_hf(cfg)


def check_hf_config(d: dict[str, Any]) -> str:
    """The model_type of config.json `d` when gptkit imports it and its numbers are sane: positive integers
    where sizes go (not 0, 1e9 as a float, true or "32"), the heads dividing as attention needs; else one
    GptkitError line naming the field. Checked before anything is sized by them."""
    mtype = d.get("model_type")
    family = family_named(mtype)
    if family is None:
        arch = ", ".join(d.get("architectures") or []) or "no architectures field"
        hint = next((f.refused_types[mtype] for f in FAMILIES if mtype in f.refused_types), None)
        raise GptkitError(
            f"model_type={mtype!r} ({arch}) is not supported{f' ({hint})' if hint else ''}; gptkit imports "
            f"{imported()} models (model_type {', '.join(ARCHITECTURES)})"
        )
    family.check_hf(d)
    return mtype


def model_config_from_hf(d: dict[str, Any], name: str = "imported") -> ModelConfig:
    """The gptkit ModelConfig equal to a transformers config.json of a family in ARCHITECTURES, or a
    GptkitError; a *ForSequenceClassification of one label (a reward model) with its score head."""
    cfg = family_named(check_hf_config(d)).config_from_hf(d, name)
    return score_head_from_hf(d, cfg)


def score_head_from_hf(d: dict[str, Any], cfg: ModelConfig) -> ModelConfig:
    """`cfg` with model.score_head when config.json `d` names a *ForSequenceClassification (a reward model:
    `score` in place of the LM head, which its files lack, so the embedding stands for it: tied); its one
    label (num_labels 1) is the reward. More labels, or a family whose export has no such class, is one
    GptkitError line."""
    import dataclasses

    arch = next((a for a in d.get("architectures") or [] if a.endswith("ForSequenceClassification")), None)
    if arch is None:
        return cfg
    labels = len(d["id2label"]) if d.get("id2label") else int(d.get("num_labels") or 2)
    if labels != 1:
        raise GptkitError(
            f"config.json: {arch} with {labels} labels; gptkit reads a reward model, one score (num_labels 1)"
        )
    cfg = dataclasses.replace(cfg, score_head=True, tie_embeddings=True)
    family = family_of(cfg)
    if family.score_architecture != arch:
        raise GptkitError(
            f"config.json: {arch} reads as the {family.title} family, whose reward models gptkit does not "
            f"read or write (it does {', '.join(SCORE_ARCHITECTURES)})"
        )
    return cfg


def unpack_weights(
    hf_state: dict[str, Any], d: dict[str, Any], source: str
) -> tuple[dict[str, Any], str | None]:
    """The tensors of a folder whose config.json `d` (check_hf_config passed) packs some (gpt-oss's MXFP4
    experts) read back by its family, and the one-line note that says so (None: nothing was packed)."""
    return family_named(d["model_type"]).unpack(hf_state, d, source)


def heads_confirmed(d: dict[str, Any], cfg: ModelConfig) -> str:
    """What the weights' shapes confirm about the attention heads of a config.json, and what rests on
    config.json alone: a wrong head count with the same tensor shapes loads, and computes another model."""
    d = family_named(d["model_type"]).text_config(d)
    kv = f", n_kv_heads={cfg.n_kv_heads}" if cfg.n_kv_heads != cfg.n_heads else ""
    heads = f"n_heads={cfg.n_heads}{kv}"
    if cfg.position == "rope" and d.get("head_dim"):
        return (
            f"{heads}, head_dim={cfg.head_dim}: confirmed by the q/k/v weight shapes "
            f"(config.json sets head_dim)"
        )
    if cfg.position == "rope" and cfg.n_kv_heads != cfg.n_heads:
        return (
            f"{heads} from config.json; the weight shapes confirm only their ratio "
            f"({cfg.n_heads // cfg.n_kv_heads}:1) and n_heads x head_dim = {cfg.d_attn}"
        )
    return (
        f"{heads} from config.json; the weight shapes cannot confirm it (any head count that divides "
        f"{cfg.d_attn} fits them)"
    )


# ---- weights -----------------------------------------------------------------------------------
# the layer index in a weight's name: model.layers.<i>. (the RoPE families), transformer.h.<i>. (GPT-2)
LAYER_NAME = re.compile(r"^(?:model\.layers|(?:transformer\.)?h)\.(\d+)\.")


def check_weight_sizes(d: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """config.json `d` (check_hf_config passed) against the weights' names and shapes, read from the files'
    headers before anything is allocated: the layers, hidden size, vocabulary and heads it sets are those the
    weights hold, else one GptkitError line naming the field and what the weights hold (a config of 10^9
    layers is refused at once, never built). The full tensor-by-tensor check is from_hf_state_dict's."""
    family = family_named(d["model_type"])
    layers_f, hidden_f, vocab_f = family.size_fields

    def refuse(field: str, held: str) -> GptkitError:
        return GptkitError(
            f"{source} does not match its config.json: {field}={family.size(d, field):,}, but the weights "
            f"hold {held}"
        )

    shapes = family.file_names(shapes)
    held = {int(m.group(1)) for k in shapes if (m := LAYER_NAME.match(k))}
    # the layers after the last one the files may hold (MTP layers): with_files' to judge
    n = family.size(d, layers_f)
    held -= set(range(n, n + family.trailing_layers(d)))
    if len(held) != family.size(d, layers_f):
        prefix = family.layer_prefix
        where = f"{prefix}0 .. {prefix}{max(held)}" if held else ""
        raise refuse(layers_f, f"{len(held):,} layers ({where})" if held else "no layers")
    emb = family.embedding
    if emb not in shapes or len(shapes[emb]) != 2:
        raise GptkitError(f"{source} does not match its config.json: it has no 2-D {emb} (the embedding)")
    rows, width = shapes[emb]
    if width != family.size(d, hidden_f):
        raise refuse(hidden_f, f"{width:,} ({emb} has shape {tuple(shapes[emb])})")
    if rows != family.size(d, vocab_f):
        raise refuse(vocab_f, f"{rows:,} tokens ({emb} has shape {tuple(shapes[emb])})")
    family.check_head_shapes(d, shapes, source)


def files_config(
    d: dict[str, Any], cfg: ModelConfig, state: dict[str, Any], source: str
) -> tuple[ModelConfig, str | None]:
    """(cfg of config.json `d` as the files' tensors `state` complete it, one note line or None): the family's
    with_files (GLM-4.5's MTP layers kept or dropped)."""
    return family_named(d["model_type"]).with_files(cfg, d, state, source)


def name_map(cfg: ModelConfig, family: Family | None = None) -> list[Row]:
    """Every tensor of a gptkit GPT state dict and its transformers counterpart (in the files), as
    (ours, theirs, how): COPY (the same tensor), TRANSPOSE (GPT-2's Conv1D stores [in, out]), SPLIT
    (our fused qkv_proj rows are Llama's q_proj, k_proj, v_proj, in that order), STACK (our [E, out, in]
    experts tensor is their E tensors, expert 0 first), JOIN (our gate_proj and up_proj are the two row
    halves of Phi-3's gate_up_proj, in that order), WEAVE (our two tensors are the even and odd entries of
    their last axis, an [E, out, in] stack transposed first: gpt-oss's gate_up_proj and its bias) or
    GATE_SPLIT (our qkv_proj and gate_proj are q_proj, k_proj, v_proj, q_proj holding each query head's
    rows then its gate's: Qwen3-Next). lm_head
    appears only when it is not tied to the embedding. Both directions of the mapping read this one table;
    its rows are the family's: `family`, the one whose files are read (a Phi-3 folder of the Llama layout),
    else the family of cfg."""
    family = family or family_of(cfg)
    rows = family.embedding_rows(cfg)
    for i in range(cfg.n_layers):
        rows += family.layer_rows(cfg, i)
    rows += family.final_rows(cfg)
    if cfg.score_head:
        # *ForSequenceClassification: the score head in place of the LM head
        rows.append(("score.weight", "score.weight", COPY))
    elif not cfg.tie_embeddings:
        rows.append(("lm_head.weight", "lm_head.weight", COPY))
    return rows


def to_hf_state_dict(state: dict[str, Any], cfg: ModelConfig, family: Family | None = None) -> dict[str, Any]:
    """gptkit GPT state dict -> transformers state dict (new tensors; lm_head left out when tied), in the
    names of `family` (default: cfg's)."""
    out: dict[str, Any] = {}
    for ours, theirs, how in name_map(cfg, family):
        if how == SPLIT:
            out.update(zip(theirs, state[ours].split([cfg.d_attn, cfg.d_kv, cfg.d_kv], dim=0)))
        elif how == GATE_SPLIT:
            q, k, v = state[ours[0]].split([cfg.d_attn, cfg.d_kv, cfg.d_kv], dim=0)
            heads = (x.unflatten(0, (cfg.n_heads, cfg.head_dim)) for x in (q, state[ours[1]]))
            # [n_heads, 2, head_dim, ...]: each head's query rows, then its gate's
            out.update(zip(theirs, (torch.stack(tuple(heads), dim=1).flatten(0, 2), k, v)))
        elif how == STACK:
            out.update(zip(theirs, state[ours].unbind(0)))
        elif how == JOIN:
            out[theirs] = torch.cat([state[k] for k in ours], dim=0)
        elif how == WEAVE:
            pair = [state[k].transpose(-2, -1) if state[k].dim() == 3 else state[k] for k in ours]
            out[theirs] = torch.stack(pair, dim=-1).flatten(-2)  # [..., 2 * n]: a0 b0 a1 b1 ...
        else:
            out[theirs] = state[ours].transpose(-2, -1) if how == TRANSPOSE else state[ours]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# old non-learned buffers
_IGNORED = re.compile(r"(?:^|\.)(?:rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


# old non-learned buffers
_IGNORED = re.compile(r"(?:^|\.)(?:rotary_emb\.inv_freq|attn\.bias|attn\.masked_bias)$")


def from_hf_state_dict(
    hf_state: dict[str, Any], cfg: ModelConfig, source: str = "the checkpoint", model_type: str | None = None
) -> dict[str, Any]:
    """transformers state dict -> gptkit GPT state dict; GptkitError when a tensor is missing,
    unexpected, or has a shape the config contradicts. `model_type`: config.json's, whose family names the
    tensors (a Phi-3 model with RoPE over the whole head is cfg of the Llama layout, in Phi-3's files)."""
    family = family_of(cfg)
    named = family_named(model_type) if model_type is not None else None
    if named is not None and named.own_files:
        family = named
    hf = {k: v for k, v in hf_state.items() if not _IGNORED.search(k)}
    hf = family.files_layout(hf, cfg)
    family.check_files(hf, cfg, source)
    hf = family.file_names(hf)
    if cfg.tie_embeddings:
        hf.pop("lm_head.weight", None)
    with torch.device("meta"):
        expected = to_hf_state_dict(GPT(cfg).state_dict(), cfg, family)
    missing, unexpected = sorted(set(expected) - set(hf)), sorted(set(hf) - set(expected))
    if missing or unexpected:
        raise GptkitError(
            f"{source} does not match its config.json: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for k, v in expected.items():
        if tuple(hf[k].shape) != tuple(v.shape):
            raise GptkitError(
                f"{source} contradicts its config.json: {k} has shape {tuple(hf[k].shape)}, "
                f"the config needs {tuple(v.shape)}"
            )
    state: dict[str, Any] = {}
    for ours, theirs, how in name_map(cfg, family):
        if how == SPLIT:
            state[ours] = torch.cat([hf[k] for k in theirs], dim=0)  # [d_attn + 2 * d_kv, ...]
        elif how == GATE_SPLIT:
            heads = hf[theirs[0]].unflatten(0, (cfg.n_heads, 2, cfg.head_dim))  # [n_heads, 2, head_dim, ...]
            q, gate = heads[:, 0].flatten(0, 1), heads[:, 1].flatten(0, 1)
            state[ours[0]] = torch.cat([q, hf[theirs[1]], hf[theirs[2]]], dim=0)
            state[ours[1]] = gate
        elif how == STACK:
            state[ours] = torch.stack([hf[k] for k in theirs])  # [E, out, in]
        elif how == JOIN:
            state.update(zip(ours, hf[theirs].chunk(len(ours), dim=0)))  # equal row blocks, in order
        elif how == WEAVE:
            t = hf[theirs]
            pair = (t[..., 0::2], t[..., 1::2])  # the even and odd entries of the last axis
            state.update(zip(ours, (p.transpose(-2, -1) if p.dim() == 3 else p for p in pair)))
        else:
            state[ours] = hf[theirs].transpose(-2, -1) if how == TRANSPOSE else hf[theirs]
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return {k: v.contiguous() for k, v in state.items()}


# ---- in memory: transformers objects -----------------------------------------------------------
def to_transformers(model):
    """The transformers model of `model`'s architecture (LlamaForCausalLM, ..., MixtralForCausalLM; fp32, eval
    mode, CPU) with exactly its weights."""
    import transformers

    cfg = model.cfg
    family = family_of(cfg)
    d = hf_config(cfg)
    d.pop("model_type")
    config_cls = getattr(transformers, family.config_class)
    config = config_cls(**{k: v for k, v in d.items() if k not in ("architectures", "dtype")})
    model_cls = getattr(transformers, architecture_class(cfg))
    with torch.device("cpu"):
        hf_model = model_cls(config)
    state = to_hf_state_dict({k: v.float().cpu() for k, v in model.state_dict().items()}, cfg)
    state = family.memory_layout(state, cfg)
    if cfg.tie_embeddings and not cfg.score_head:
        state["lm_head.weight"] = state[family.embedding]
    hf_model.load_state_dict(state, strict=True)
    return hf_model.float().eval()


def from_transformers(hf_model, name: str = "imported"):
    """The gptkit GPT (fp32, eval mode) with exactly `hf_model`'s weights."""
    d = hf_model.config.to_dict()
    cfg = model_config_from_hf(d, name=name)
    state = from_hf_state_dict(
        hf_model.state_dict(), cfg, source=type(hf_model).__name__, model_type=d["model_type"]
    )
    return GPT.from_state(cfg, state)
