"""Tokenizers, all of them HF `tokenizers` objects, built from the `tokenizer` config group.

    kind: char   one id per character of the corpus, in code point order (then the special tokens)
    kind: byte   256 ids, id == byte value (then the special tokens); lossless for any text
    kind: bpe    byte-level BPE trained on the corpus (vocab_size, min_frequency, special_tokens), on at
                 most train_chars characters of it (an evenly spread sample of a larger corpus)
    kind: file   any tokenizer.json from disk (path)

`eos_token`, when set, is appended after every document of the corpus. Whatever tokenizer is used
is saved as tokenizer.json next to the token shards, so sampling and export use exactly it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from gptkit.conf_files import preset_defaults
from gptkit.errors import GptkitError
from gptkit.fsio import file_sha256  # noqa: F401 - read as gptkit.tokenizer.file_sha256 too

# tokenizers is imported inside the functions that build or load one (the CLI imports this module first).

KINDS = ("char", "byte", "bpe", "file")
# Built-in kinds whose encoding of a text equals the concatenated encodings of its pieces when the
# text is cut at a newline between two non-space characters (see gptkit.data.build.split_long).
SPLITTABLE_KINDS = ("char", "byte", "bpe")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 byte values to printable characters (the byte-level alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _as_dict(cfg: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


@dataclass(frozen=True)
class TokenizerSpec:
    """The `tokenizer` group resolved once: its kind checked, the defaults of conf/tokenizer/<kind>.yaml
    filled in, the EOS among the special tokens, a file's path resolved. Every data kind receives this;
    `settings` is its complete plain dict, what cache keys and manifests hold."""

    kind: str
    # the complete settings as canonical JSON (a frozen, hashable form of the dict)
    settings_json: str

    @property
    def settings(self) -> dict[str, Any]:
        """The complete settings as a fresh plain dict."""
        return json.loads(self.settings_json)

    def get(self, key: str, default: Any = None) -> Any:
        """One setting (None, or `default`, where the kind has no such key)."""
        return self.settings.get(key, default)

    @property
    def eos_token(self) -> str | None:
        return self.get("eos_token")

    @property
    def path(self) -> str | None:
        """tokenizer=file: the resolved path of its tokenizer.json (None for the kinds built here)."""
        return self.get("path")

    @property
    def built_from_corpus(self) -> bool:
        """char and bpe are made from the corpus they tokenize; byte and file exist without it."""
        return self.kind in ("char", "bpe")


def tokenizer_spec(cfg: Any) -> TokenizerSpec:
    """The tokenizer config (a DictConfig, a dict, or a TokenizerSpec already) as a TokenizerSpec; a bad kind
    or a missing file is a one-line GptkitError."""
    if isinstance(cfg, TokenizerSpec):
        return cfg
    d = _as_dict(cfg)
    kind = d.get("kind")
    if kind not in KINDS:
        raise GptkitError(
            f"unknown tokenizer kind {kind!r}; use tokenizer=char|byte|bpe|file "
            f"(or set tokenizer.kind to one of {', '.join(KINDS)})"
        )
    d = {"kind": kind, **preset_defaults("tokenizer", kind), **d}
    if kind == "file":
        if not d["path"]:
            raise GptkitError("tokenizer=file needs tokenizer.path=/path/to/tokenizer.json")
        d["path"] = str(checked_file(Path(str(d["path"])).expanduser().resolve()))
    else:
        d["special_tokens"] = list(d["special_tokens"] or [])
        if d["eos_token"] is not None and d["eos_token"] not in d["special_tokens"]:
            d["special_tokens"].append(d["eos_token"])
    return TokenizerSpec(kind, json.dumps(d, sort_keys=True))


def tokenizer_sha256(tok) -> str:
    """Hash of the tokenizer's tokenizer.json text: equal hashes, identical encodings."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def checked_file(p: Path) -> Path:
    """`p` if it is a file; else a GptkitError that says whether it is missing or a folder."""
    if p.is_dir():
        inside = " (the tokenizer.json in it?)" if (p / "tokenizer.json").is_file() else ""
        raise GptkitError(
            f"tokenizer file {p} is a folder; set tokenizer.path to a tokenizer.json file{inside}"
        )
    if not p.is_file():
        raise GptkitError(f"tokenizer file {p} does not exist; set tokenizer.path to a tokenizer.json")
    return p


def load_tokenizer_file(path: Path | str):
    from tokenizers import Tokenizer

    p = checked_file(Path(path).expanduser())
    try:
        tok = Tokenizer.from_file(str(p))
    # the Rust side raises plain Exceptions with long messages
    except Exception as exc:
        raise GptkitError(f"{p} is not a valid tokenizer.json ({str(exc).splitlines()[0][:160]})") from exc
    # a model gets an embedding row per id up to the largest: the ids must be 0 .. entries-1, each once
    vocab = tok.get_vocab(with_added_tokens=True)
    ids = list(vocab.values())
    if ids and (max(ids) >= len(ids) or len(set(ids)) < len(ids)):
        raise _bad_ids(p, vocab)
    return tok


def _bad_ids(p: Path, vocab: dict[str, int]) -> GptkitError:
    """What is wrong with the ids of a tokenizer file whose ids are not 0 .. entries-1, each once."""
    fix = "each entry needs its own id below their count: fix the file or use the tokenizer it was made from"
    ids = sorted((i, t) for t, i in vocab.items())
    i, t = ids[-1]
    if i >= len(ids):
        return GptkitError(
            f"{p}: the token {t!r} has id {i:,}, not below the {len(ids):,} entries of its vocabulary and "
            f"added tokens; {fix}"
        )
    a, ta, tb = next((a, ta, tb) for (a, ta), (b, tb) in zip(ids, ids[1:]) if a == b)
    return GptkitError(f"{p}: the tokens {ta!r} and {tb!r} both have id {a:,}; {fix}")


def char_tokenizer(chars: Iterable[str], special_tokens: list[str], unk_token: str | None = None):
    """One id per character, in code point order; special tokens (and unk) after them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(set(chars)))}
    for t in [*special_tokens, *([unk_token] if unk_token else [])]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk_token))
    # every code point
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if special_tokens:
        tok.add_special_tokens(special_tokens)
    return tok


def byte_tokenizer(special_tokens: list[str]):
    """256 ids, id == byte value: a byte-level BPE without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if special_tokens:
        tok.add_special_tokens(special_tokens)
    return tok


def train_bpe(
    texts: Callable[[], Iterable[str]],
    vocab_size: int,
    special_tokens: list[str],
    min_frequency: int = 2,
    progress: bool = True,
    length: int | None = None,
):
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on the texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens):
        raise GptkitError(
            f"tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs at least "
            f"256 + {len(special_tokens)} special tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=progress,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts(), trainer=trainer, length=length)
    got = tok.get_vocab_size()
    # the corpus ran out of pairs seen min_frequency times: say so, once
    if got < 0.9 * vocab_size:
        print(
            f"note: tokenizer.vocab_size={vocab_size} asked, the corpus gave a BPE of {got:,} entries (no "
            f"more pairs occur {min_frequency}+ times); the model's vocabulary follows the tokenizer",
            file=sys.stderr,
        )
    return tok


def build_tokenizer(cfg: Any, texts: Callable[[], Iterable[str]] | None = None, progress: bool = True):
    """The configured tokenizer (a TokenizerSpec, or a config made one). `texts()` yields the corpus (needed
    by char and bpe)."""
    s = tokenizer_spec(cfg).settings
    kind, special = s["kind"], s.get("special_tokens", [])
    if kind == "file":
        tok = load_tokenizer_file(s["path"])
    elif kind == "byte":
        tok = byte_tokenizer(special)
    elif kind == "char":
        if texts is None:
            raise GptkitError("tokenizer=char is built from a corpus; none was given")
        seen: set[str] = set()
        for t in texts():
            seen.update(t)
        if not seen:
            raise GptkitError("tokenizer=char found no characters in the corpus")
        tok = char_tokenizer(seen, special, s["unk_token"])
    else:
        if texts is None:
            raise GptkitError("tokenizer=bpe is trained on a corpus; none was given")
        tok = train_bpe(texts, int(s["vocab_size"]), special, int(s["min_frequency"]), progress)
    eos = s["eos_token"]
    if eos is not None and tok.token_to_id(eos) is None:
        raise GptkitError(
            f"tokenizer.eos_token={eos!r} is not in the tokenizer's vocabulary; "
            f"set it to one of its special tokens or null"
        )
    return tok


def spec_special_tokens(spec: TokenizerSpec) -> list[str]:
    """The special tokens a tokenizer of these settings has, known before it is built: its special_tokens
    (the EOS among them), or those of a tokenizer=file's tokenizer.json (read from it)."""
    if spec.kind == "file":
        added = load_tokenizer_file(spec.path).get_added_tokens_decoder().values()
        return [t.content for t in added if t.special]
    return list(spec.get("special_tokens") or [])


def eos_id(tok, spec: TokenizerSpec) -> int | None:
    """The id of the configured EOS token in `tok` (None without one)."""
    eos = spec.eos_token
    return None if eos is None else tok.token_to_id(eos)


def unknown_policy(tok) -> tuple[int | None, bool]:
    """(the id of the model's own unknown token or None, whether it falls back to <0xNN> byte tokens): how
    `tok` marks text it cannot represent. Read from the model, never from a round trip through the decoder
    (a SentencePiece decoder strips a leading space: ' ' does not round-trip, yet it is encoded)."""
    from tokenizers import models

    model = tok.model
    if isinstance(model, models.Unigram):
        # Unigram's unk is an id and its byte_fallback a field of the JSON, neither exposed in Python
        m = json.loads(tok.to_str())["model"]
        return m.get("unk_id"), bool(m.get("byte_fallback"))
    unk = getattr(model, "unk_token", None)
    return (tok.token_to_id(unk) if unk else None), bool(getattr(model, "byte_fallback", False))


# per tokenizer: (its vocabulary's size, its unknown_policy, character -> known), so that a server asks the
# tokenizer about each character once, not twice per distinct character of every prompt (a char tokenizer's
# prompt of 400 distinct characters was 800 encode calls); a tokenizer whose vocabulary grew starts anew
_KNOWN: "weakref.WeakKeyDictionary[Any, tuple[int, tuple[int | None, bool], dict[str, bool]]]" = (
    weakref.WeakKeyDictionary()
)
# characters remembered per tokenizer at most
_KNOWN_MAX = 1 << 16


def _known_memo(tok) -> tuple[tuple[int | None, bool], dict[str, bool]]:
    """(unknown_policy(tok), its character -> known memo); a fresh one for an object that takes no weak
    reference."""
    try:
        size = tok.get_vocab_size(with_added_tokens=True)
        got = _KNOWN.get(tok)
    except (TypeError, AttributeError):
        return unknown_policy(tok), {}
    if got is None or got[0] != size:
        got = (size, unknown_policy(tok), {})
        _KNOWN[tok] = got
    return got[1], got[2]


def unknown_characters(tok, text: str) -> list[str]:
    """The distinct characters of `text` that `tok` cannot represent, in order of first appearance: those it
    encodes as its own unknown token, or raises on; for a tokenizer with neither an unknown token nor byte
    fallback, also those it drops (encodes as nothing). With byte fallback every character is bytes: none
    is unknown. A char tokenizer's are the characters its corpus never had. Each character's answer is
    remembered per tokenizer (_KNOWN)."""
    (unk_id, byte_fallback), memo = _known_memo(tok)

    def known(t: str) -> bool:
        try:
            ids = tok.encode(t, add_special_tokens=False).ids
            if unk_id is not None or byte_fallback:
                return unk_id not in ids
            # dropped: it adds no token, even twice (alone it may still bring a prepended '▁')
            return bool(ids) and tok.encode(t + t, add_special_tokens=False).ids != ids
        except Exception:  # noqa: BLE001 - e.g. a WordLevel vocabulary without an unknown token
            return False

    # with an unknown token (or bytes to fall back to) the whole text answers at once; a tokenizer that
    # drops what it cannot represent is asked character by character
    if (unk_id is not None or byte_fallback) and known(text):
        return []
    out = []
    for c in dict.fromkeys(text):
        ok = memo.get(c)
        if ok is None:
            ok = known(c)
            if len(memo) < _KNOWN_MAX:
                memo[c] = ok
        if not ok:
            out.append(c)
    return out


def describe_characters(chars: list[str], limit: int = 10) -> str:
    """ "'é' (U+00E9), '€' (U+20AC)": characters named unambiguously, at most `limit` of them."""
    names = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars[:limit])
    return names + (f" and {len(chars) - limit} more" if len(chars) > limit else "")


# Special tokens by role, in order of preference, as the common tokenizers spell them.
SPECIAL_ROLES = {
    "bos_token": ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "<|endoftext|>"),
    "eos_token": ("<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|endoftext|>"),
    "unk_token": ("<unk>", "<|unk|>", "[UNK]"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
}


def special_tokens(tokenizer, eos_token: str | None = None) -> dict[str, tuple[str, int]]:
    """{role: (token, id)} for the special tokens of a `tokenizers.Tokenizer` that have a known role
    (`eos_token`: the run's own end-of-text token, which wins over the usual spellings)."""
    found = {}
    for role, names in SPECIAL_ROLES.items():
        for name in ((eos_token,) if role == "eos_token" and eos_token else ()) + names:
            tid = tokenizer.token_to_id(name)
            if tid is not None:
                found[role] = (name, tid)
                break
    return found
