"""A run as one GGUF file for llama.cpp and ollama (`gptkit export format=gguf`), written with the `gguf`
package (gguf-py, llama.cpp's own writer; the `gguf` extra).

The weights go through the transformers layout first (convert.to_hf_state_dict, the same tensors `gptkit
export` writes), then each family says what llama.cpp reads (family.py: gguf_arch, gguf_check, gguf_keys,
gguf_state: its architecture, its own metadata keys, a tensor's llama.cpp layout) and gguf-py's
TensorNameMap names each tensor as llama.cpp's loader looks it up. The tokenizer becomes llama.cpp's
vocabulary (gguf_vocab): a byte-level BPE with merges (gptkit's tokenizer=bpe, GPT-2's, Llama 3's, Qwen2's
pre-tokenizer) as its `gpt2` model with the merges, a char vocabulary (tokenizer=char) as its `llama`
(SentencePiece) model of one-character pieces, anything else refused in one line. The chat template and the
end-of-turn token go in the metadata (tokenizer.chat_template, tokenizer.ggml.eot_token_id).

Types: f32, f16, bf16 and q8_0 (llama.cpp's 8-bit blocks of 32; a matrix whose rows are not a whole number
of blocks stays f16, and the line says which). 1-D tensors (norms, biases) stay f32, as llama.cpp's own
converter keeps them. q4_k is refused: gguf-py cannot quantize it (llama-quantize can, from the f16 file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptkit.chat_templates import reply_stop_ids, template_in_folder
from gptkit.errors import GptkitError
from gptkit.extras import require
from gptkit.fsio import staged_dir
from gptkit.hf.convert import to_hf_state_dict
from gptkit.hf.families import family_of
from gptkit.runs import TOKENIZER_FILE, check_tokenizer_fits, load_model, load_tokenizer
from gptkit.tokenizer import special_tokens

# export format=gguf's dtype= values -> gguf-py's GGMLQuantizationType and LlamaFileType names
TYPES = {
    "fp32": ("F32", "ALL_F32"),
    "fp16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}
# what gguf-py cannot write, and why (one line each)
REFUSED_TYPES = {
    "q4_k": "gguf-py has no Q4_K quantizer (only its dequantizer); write dtype=fp16 and run llama.cpp's "
    "llama-quantize model.gguf model-q4_k.gguf Q4_K_M",
}
GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"

# the pre-tokenizer regexes llama.cpp knows by name (tokenizer.ggml.pre), as tokenizer.json spells them in a
# Split before a ByteLevel without its own regex: Llama 3's and Qwen2's
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SPLIT_PRES = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}
# gguf-py's TokenType values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5
# SentencePiece's space, which llama.cpp's `llama` tokenizer puts for " " before it looks pieces up
SPM_SPACE = "\u2581"


@dataclass
class Vocab:
    """llama.cpp's vocabulary of a tokenizer: its model (gpt2 | llama), pre-tokenizer, tokens in id order,
    their types (and scores: the llama model's), the BPE merges."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    # said on export's line: "byte-level BPE (gpt-2 pre-tokenizer, 1,024 merges)"
    what: str = ""


def _refuse_tokenizer(why: str) -> GptkitError:
    return GptkitError(
        f"the run's tokenizer {why}, which llama.cpp's tokenizers cannot reproduce exactly (it reads "
        f"byte-level BPE with GPT-2's, Llama 3's or Qwen2's pre-tokenizer, and one-character vocabularies); "
        f"refusing rather than write a GGUF that tokenizes differently"
    )


def _byte_level(pre: dict[str, Any] | None) -> str:
    """The llama.cpp pre-tokenizer name of a byte-level tokenizer.json pre_tokenizer, or a GptkitError."""
    if pre is None:
        raise _refuse_tokenizer("has no pre-tokenizer")
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space"):
            raise _refuse_tokenizer("adds a prefix space (ByteLevel add_prefix_space=true)")
        if not pre.get("use_regex", True):
            raise _refuse_tokenizer("is byte-level without a pre-tokenizer regex")
        return "gpt-2"
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if parts and len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel":
        split, byte_level = parts
        pattern = (split.get("pattern") or {}).get("Regex")
        if (
            pattern in SPLIT_PRES
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and not byte_level.get("add_prefix_space")
            and not byte_level.get("use_regex", True)
        ):
            return SPLIT_PRES[pattern]
        raise _refuse_tokenizer(f"splits by the regex {pattern!r}")
    raise _refuse_tokenizer(f"has the pre-tokenizer {pre.get('type')}")


def _ids(d: dict[str, Any], vocab_size: int) -> tuple[list[str | None], dict[int, bool]]:
    """tokenizer.json's model vocabulary and added tokens by id (None where no token has that id, up to the
    model's vocab_size), and which ids are added tokens (True: special)."""
    vocab: dict[str, int] = d["model"]["vocab"]
    added = {t["id"]: t for t in d.get("added_tokens") or []}
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    tokens: list[str | None] = [None] * n
    for t, i in vocab.items():
        tokens[i] = t
    for i, t in added.items():
        tokens[i] = t["content"]
    return tokens, {i: bool(t.get("special")) for i, t in added.items()}


def gguf_vocab(tokenizer, vocab_size: int) -> Vocab:
    """llama.cpp's vocabulary of a `tokenizers.Tokenizer` (the model's vocab_size rows, ids past the
    tokenizer's as unused [PAD<i>] tokens), or a GptkitError naming what llama.cpp cannot reproduce."""
    d = json.loads(tokenizer.to_str())
    model = d["model"]
    if d.get("normalizer") is not None:
        raise _refuse_tokenizer(f"normalizes the text first ({d['normalizer'].get('type')})")
    tokens, added = _ids(d, vocab_size)
    types = [
        UNUSED if t is None else ((CONTROL if added[i] else USER_DEFINED) if i in added else NORMAL)
        for i, t in enumerate(tokens)
    ]
    names = [f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)]
    kind = model.get("type")
    if kind == "BPE":
        pre = _byte_level(d.get("pre_tokenizer"))
        if (
            model.get("byte_fallback")
            or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")
        ):
            raise _refuse_tokenizer("is a BPE with byte fallback or word affixes")
        if bool(model.get("ignore_merges")) != (pre == "llama-bpe"):
            raise _refuse_tokenizer(
                f"has ignore_merges={bool(model.get('ignore_merges'))} with the {pre} regex"
            )
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        if not merges:
            # its loader refuses a gpt2 vocabulary without tokenizer.ggml.merges (gguf-py writes no empty one)
            raise _refuse_tokenizer(
                "is a byte-level BPE without merges (tokenizer=byte; llama.cpp's loader needs merges)"
            )
        what = f"byte-level BPE ({pre} pre-tokenizer, {len(merges):,} merges)"
        return Vocab("gpt2", pre, names, types, merges=merges, what=what)
    if kind == "WordLevel" and _one_char_split(d.get("pre_tokenizer")):
        # WordLevel names "<unk>" even without one: an unk not in the vocabulary is gptkit's refusal
        unk = model.get("unk_token") if model.get("unk_token") in model["vocab"] else None
        chars = [t for i, t in enumerate(tokens) if t is not None and i not in added and t != unk]
        long = next((t for t in chars if len(t) != 1), None)
        if long is not None:
            raise _refuse_tokenizer(f"is a word-level vocabulary with the multi-character entry {long!r}")
        if SPM_SPACE in chars:
            raise _refuse_tokenizer(f"holds {SPM_SPACE!r} (U+2581), llama.cpp's spelling of a space")
        if unk is not None:
            # llama.cpp's `llama` tokenizer spells an unknown character in <0xNN> byte pieces, never unk
            raise _refuse_tokenizer(f"maps unknown characters to {unk!r}")
        # llama.cpp looks a space up as U+2581
        names = [SPM_SPACE if t == " " and i not in added else t for i, t in enumerate(names)]
        what = f"character vocabulary ({len(chars):,} characters)"
        return Vocab("llama", None, names, types, scores=[0.0] * len(names), what=what)
    raise _refuse_tokenizer(
        f"is a {kind} model with the pre-tokenizer {(d.get('pre_tokenizer') or {}).get('type')}"
    )


def _one_char_split(pre: dict[str, Any] | None) -> bool:
    """gptkit's char tokenizer: a Split of every code point (gptkit.tokenizer.char_tokenizer)."""
    return (
        pre is not None
        and pre.get("type") == "Split"
        and (pre.get("pattern") or {}).get("Regex") == r"[\s\S]"
        and pre.get("behavior") == "Isolated"
    )


@dataclass
class GgufExported:
    """What export_gguf wrote."""

    checkpoint: Path
    path: Path
    arch: str
    dtype: str
    n_tensors: int
    vocab: Vocab
    # tensors written as f16 where q8_0 was asked (rows not a whole number of 32-blocks)
    kept_f16: list[str]
    template: Any = None
    stop_tokens: list[str] = field(default_factory=list)


def check_type(dtype: str) -> str:
    """dtype= for format=gguf, or one line naming the ones it takes."""
    if dtype in REFUSED_TYPES:
        raise GptkitError(f"export format=gguf dtype={dtype}: {REFUSED_TYPES[dtype]}")
    if dtype not in TYPES:
        raise GptkitError(
            f"export format=gguf dtype={dtype!r}: choose one of "
            f"{', '.join(TYPES)} (q4_k: not written by gguf-py)"
        )
    return dtype


def gguf_family(model_cfg):
    """The family of a config, with llama.cpp's architecture for it, or one line naming why not."""
    family = family_of(model_cfg)
    if not family.gguf_arch:
        raise GptkitError(
            f"export format=gguf: {family.title} ({family.architecture}) is not written as GGUF: "
            f"{family.gguf_refused}; export it as a transformers folder (format=hf)"
        )
    family.gguf_check(model_cfg)
    scaling = (model_cfg.rope_scaling or {}).get("type")
    if scaling is not None and scaling not in family.gguf_rope_scalings:
        raise GptkitError(
            f"export format=gguf: model.rope_scaling {scaling} is not written to GGUF for llama.cpp's "
            f"{family.gguf_arch} by gptkit (llama3 is, for the llama architecture); export it as a "
            f"transformers folder (format=hf)"
        )
    return family


def export_gguf(ckpt: Path, out: Path, dtype: str, force: bool = False) -> GgufExported:
    """Write the run's checkpoint `ckpt` as the folder `out`: model.gguf and an ollama Modelfile; written
    whole or not at all (staged_dir)."""
    require("gguf")
    import gguf
    import numpy as np

    run_dir, ckpt, run_cfg, model_cfg, model = load_model(ckpt)
    family = gguf_family(model_cfg)
    if not (Path(run_dir) / TOKENIZER_FILE).is_file():
        raise GptkitError(
            f"export format=gguf: {Path(run_dir) / TOKENIZER_FILE} is missing, and a GGUF file holds its "
            f"tokenizer; copy the run's tokenizer.json there"
        )
    tokenizer = load_tokenizer(run_dir)
    check_tokenizer_fits(run_dir, tokenizer.get_vocab_size(), model_cfg.vocab_size)
    vocab = gguf_vocab(tokenizer, model_cfg.vocab_size)
    eos = (run_cfg.get("tokenizer") or {}).get("eos_token")
    special = special_tokens(tokenizer, eos)
    template = template_in_folder(Path(run_dir))
    stop_ids = reply_stop_ids(tokenizer, template, eos) if template is not None else []

    arch = family.gguf_arch
    qtype = getattr(gguf.GGMLQuantizationType, TYPES[dtype][0])
    state = {k: v.float() for k, v in model.state_dict().items()}
    state = to_hf_state_dict(state, model_cfg)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), model_cfg.n_layers)
    kept_f16: list[str] = []
    tensors: list[tuple[str, Any, Any]] = []
    for name, data in family.gguf_state(state, model_cfg).items():
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise GptkitError(f"export format=gguf: llama.cpp's {arch} has no tensor for {name}")
        array = data.detach().float().contiguous().numpy()
        tensors.append((new, *_typed(gguf, np, array, qtype, new, kept_f16)))

    with staged_dir(out, force=force) as tmp:
        w = gguf.GGUFWriter(str(tmp / GGUF_FILE), arch)
        w.add_name(Path(run_dir).name)
        w.add_file_type(getattr(gguf.LlamaFileType, TYPES[dtype][1]))
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        # the family's keys win over the shared ones (Mixtral's feed_forward_length: an expert's)
        for key, value in (hparams(model_cfg) | family.gguf_keys(model_cfg)).items():
            _add(w, f"{arch}.{key}", value)
        _tokenizer_keys(w, vocab, special, template, stop_ids)
        for name, array, raw in tensors:
            w.add_tensor(name, array, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        (tmp / MODELFILE).write_text(modelfile(tokenizer, special, stop_ids))
    stops = [tokenizer.id_to_token(i) for i in stop_ids]
    return GgufExported(ckpt, out / GGUF_FILE, arch, dtype, len(tensors), vocab, kept_f16, template, stops)


def _typed(gguf, np, array, qtype, name: str, kept_f16: list[str]):
    """(the array to write, its raw GGML type or None): 1-D tensors f32, the others `qtype` (q8_0 where the
    rows are whole blocks, else f16)."""
    Q = gguf.GGMLQuantizationType
    if array.ndim == 1 or qtype == Q.F32:
        return array.astype(np.float32), None
    if qtype == Q.F16:
        return array.astype(np.float16), None
    if qtype == Q.Q8_0 and array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
        kept_f16.append(name)
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def _add(w, key: str, value) -> None:
    """One metadata key by its Python type (a bool, an int as uint32, a float as float32, a string)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        w.add_string(key, str(value))


def hparams(cfg) -> dict[str, Any]:
    """The hyperparameters every architecture reads (keys without the "<arch>." prefix)."""
    keys: dict[str, Any] = {
        "context_length": cfg.max_seq_len,
        "embedding_length": cfg.d_model,
        "block_count": cfg.n_layers,
        "feed_forward_length": cfg.d_ff,
        "attention.head_count": cfg.n_heads,
        "attention.head_count_kv": cfg.n_kv_heads,
    }
    eps = "layer_norm_epsilon" if cfg.norm == "layernorm" else "layer_norm_rms_epsilon"
    keys[f"attention.{eps}"] = float(cfg.norm_eps)
    if cfg.position == "rope":
        keys |= {
            "rope.freq_base": float(cfg.rope_theta),
            "rope.dimension_count": cfg.head_dim,
            "attention.key_length": cfg.head_dim,
            "attention.value_length": cfg.head_dim,
        }
    return keys


def _tokenizer_keys(w, vocab: Vocab, special, template, stop_ids: list[int]) -> None:
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    else:
        w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
        # gptkit's char vocabulary puts no space before the text
        w.add_add_space_prefix(False)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    # gptkit encodes a prompt as it is (add_special_tokens=False): no BOS, no EOS added
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for role, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        if role in special:
            add(special[role][1])
    if "pad_token" in special:
        w.add_pad_token_id(special["pad_token"][1])
    if template is not None:
        w.add_chat_template(template.text)
        # the end of a turn (reply_stop_ids: end-of-turn first, then end-of-text)
        if stop_ids:
            w.add_eot_token_id(stop_ids[0])


def modelfile(tokenizer, special, stop_ids: list[int]) -> str:
    """An ollama Modelfile beside model.gguf: `ollama create <name> -f Modelfile`. Greedy by default (as
    `gptkit sample greedy=true`), stopping at the end of a turn and at the end of the text."""
    stops = [tokenizer.id_to_token(i) for i in stop_ids]
    if "eos_token" in special and special["eos_token"][0] not in stops:
        stops.append(special["eos_token"][0])
    lines = [f"FROM ./{GGUF_FILE}", "PARAMETER temperature 0"]
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines) + "\n"
