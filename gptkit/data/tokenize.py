"""Text -> token ids at the tokenizer's speed, in bounded memory.

1. Cutting. A document is cut into pieces of about PIECE_CHARS characters, only where encoding the
   pieces gives exactly the ids of encoding the whole text (`Cutter`): at a newline between two
   non-space characters, else between two characters that GPT-2's pre-tokenizer never joins (a letter
   and a digit, a letter and ASCII punctuation, a non-space character and a space...), never inside the
   text of an added token the encoder matches. For char and byte any such place will do. For byte-level
   BPE a run of HARD_CHARS characters with no such place (a file of NUL bytes) is cut anyway, and counted.
   Any other tokenizer.json is cut only where its own encoding of the text around the cut is unchanged
   by it; a document with no such place in MAX_UNCUT characters is an error.
2. Encoding. The fastest encoder that gives the tokenizer's ids (`EncoderSpec.engine`): the UTF-8
   bytes themselves (byte), a code point lookup table (char), tiktoken built from the same merges
   (byte-level BPE, when it agrees with HF `tokenizers` on tricky text and on a sample of the corpus),
   else HF `tokenizers`. Text is data: a special token's string in the text is encoded as text (HF's
   encode_special_tokens, tiktoken's ordinary encoding), so only the EOS / BOS put between documents are
   special ids; the Cutter then treats it as any text. data.special_tokens_in_content=allow matches them as
   before (`EncoderSpec.allow_special_text`). A text that holds an added token the encoder matches (a
   non-special added token; with allow, any) always goes to HF `tokenizers`.
3. Workers: gptkit.data.workers (`Tokenizing`) runs the encoders of 2. in processes, in order.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

from gptkit.errors import GptkitError
from gptkit.tokenizer import bytes_to_unicode, describe_characters, unknown_characters

# tiktoken and tokenizers are imported by the encoder that uses them.

# long documents are cut into pieces of about this size
PIECE_CHARS = 64 << 10
# how far past PIECE_CHARS a cut is looked for
HARD_CHARS = 4 * PIECE_CHARS
# tokenizer=file: the longest stretch of a document that may have no safe cut
MAX_UNCUT = 16 << 20
# text of one encoding task (its HF Encodings cost ~100 B per token)
BATCH_CHARS = 1 << 20
# tokenizer=file: text either side of a cut that is encoded to check it
VERIFY_CHARS = 1024
# tokenizer=file: candidates of each kind checked before all of them are
VERIFY_FIRST = 8
# a newline before a non-space (a look-behind for the one before would make
_NL = re.compile(r"\n(?=\S)")
#                                  the search 10x slower: that character is checked in Python)
# places where the class of character changes (letter, digit, other non-space, space): cut candidates
_CHANGE = re.compile(
    r"(?<=[^\W\d_])(?=[^\w\s]|\d|[ \n\t])|(?<=\d)(?=[^\w\s]|[^\W\d_]|[ \n\t])"
    r"|(?<=[^\w\s])(?=\w|[ \n\t])"
)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TRICKY = (
    "naïve café — 日本語 🙂 \x00\t\r\n  \n\n   x  y\u00a0z\u2003w \u3000。 I'm you're it's we've 'S 'LL "
    "3.14159 1,000,000 ２０２６ x²+y½ ß ﬁ Ǆ İstanbul ÅΩ ﷺ \U0001f469\u200d\U0001f4bb\ufe0f e\u0301 "
    "<|endoftext|> < |endoftext| > <<>> ---- ==== .... ,,,, ;;\n\tdef f(x):\n\t\treturn x**2  # 🙂\n"
)


def split_long(text: str, size: int = PIECE_CHARS) -> list[str]:
    """Cut a long text into pieces of about `size` characters at newlines between two non-space
    characters. Such a newline is a pre-token of its own for char, byte and GPT-2 style byte-level
    BPE, so encoding the pieces gives exactly the tokens of encoding the whole text."""
    pieces, start = [], 0
    while len(text) - start > size:
        m = _NL.search(text, start + size)
        while m is not None and text[m.start() - 1].isspace():
            m = _NL.search(text, m.start() + 1)
        if m is None:
            break
        pieces.append(text[start : m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def _cls(c: str) -> str | None:
    """s (ASCII whitespace), L (letter), N (number), p (punctuation or symbol), None (anything else: other
    spaces, controls, marks, unassigned)."""
    if c in " \n\t":
        return "s"
    if c.isascii():
        return (
            "p"
            if c.isprintable() and not c.isalnum()
            else ("L" if c.isalpha() else "N" if c.isdigit() else None)
        )
    cat = unicodedata.category(c)[0]
    # punctuation and symbols are never spaces
    return cat if cat in "LN" else "p" if cat in "PS" else None


def gpt2_boundary(x: str, y: str) -> bool:
    """True when GPT-2's pre-tokenizer always ends a pre-token between x and y, whatever surrounds them:
    x is a letter, number, punctuation or symbol (not an apostrophe: 's, 't...) and y is a space or of
    another of those classes. Nothing before x and nothing after y then changes a token."""
    cx = _cls(x)
    if cx is None or cx == "s" or x == "'":
        return False
    cy = _cls(y)
    return cy is not None and cy != cx


class Cutter:
    """Cuts the parts of a stream of documents into pieces that encode to the ids of the whole text."""

    def __init__(
        self,
        mode: str,
        specials: list[str] = (),
        encode: Callable[[str], list[int]] | None = None,
        sizes: dict[str, int] | None = None,
    ):
        # any (char, byte) | gpt2 (byte-level BPE) | verify (any tokenizer.json)
        self.mode = mode
        # the added tokens the encoder matches in the text (matched_tokens): no cut inside one
        self.specials = [s for s in specials if s]
        # mode verify: text -> ids
        self.encode = encode
        # gpt2: cuts inside a pre-token longer than HARD_CHARS
        self.forced = 0
        # the module's sizes now, unless given (a worker that cuts gets the main process's: sizes())
        sizes = sizes or {
            "piece_chars": PIECE_CHARS,
            "hard_chars": HARD_CHARS,
            "max_uncut": MAX_UNCUT,
            "verify_chars": VERIFY_CHARS,
            "verify_first": VERIFY_FIRST,
        }
        self.piece_chars, self.hard_chars, self.max_uncut = (
            sizes["piece_chars"],
            sizes["hard_chars"],
            sizes["max_uncut"],
        )
        self.verify_chars, self.verify_first = sizes["verify_chars"], sizes["verify_first"]

    def sizes(self) -> dict[str, int]:
        """What this Cutter's cuts depend on besides its mode and specials (for a Cutter in a worker)."""
        return {
            "piece_chars": self.piece_chars,
            "hard_chars": self.hard_chars,
            "max_uncut": self.max_uncut,
            "verify_chars": self.verify_chars,
            "verify_first": self.verify_first,
        }

    def _clear(self, text: str, c: int) -> bool:
        """No special token's text straddles position c."""
        for s in self.specials:
            lo = max(0, c - len(s) + 1)
            i = text.find(s, lo, c + len(s) - 1)
            if i != -1 and i < c < i + len(s):
                return False
        return True

    def _ok(self, text: str, c: int) -> bool:
        if not self._clear(text, c):
            return False
        if self.mode != "verify":
            return True
        a, b = text[max(0, c - self.verify_chars) : c], text[c : c + self.verify_chars]
        return self.encode(a + b) == self.encode(a) + self.encode(b)

    def _candidates(self, text: str, lo: int, hi: int, limit: int | None) -> Iterator[int]:
        """Cut candidates in text[lo:hi]: newlines between two non-space characters, then changes of
        character class (at most `limit` of each kind, when given)."""
        n = 0
        for m in _NL.finditer(text, lo, hi):
            c = m.start()
            if c and not text[c - 1].isspace():
                if limit is not None and n >= limit:
                    break
                n += 1
                yield c
        n = 0
        # candidates found in C; each checked exactly
        for m in _CHANGE.finditer(text, lo, hi):
            c = m.start()
            if gpt2_boundary(text[c - 1], text[c]):
                if limit is not None and n >= limit:
                    break
                n += 1
                yield c

    def cut(self, text: str, lo: int, hi: int, complete: bool) -> int | None:
        """A safe cut in text[lo:hi] (lo > 0), or None. `complete`: text[lo:hi] is a whole window (a forced
        cut is allowed there). mode verify checks the first VERIFY_FIRST candidates of each kind first:
        every check encodes 2 x VERIFY_CHARS characters three times, and a tokenizer that rejects one kind
        (a Metaspace one: a piece that starts with a newline gets a prefix space) would otherwise check all
        of a window's newlines before its first word boundary; then every candidate, as before."""
        for limit in (self.verify_first, None) if self.mode == "verify" else (None,):
            for c in self._candidates(text, lo, hi, limit):
                if self._ok(text, c):
                    return c
        if not complete or self.mode == "verify":
            return None
        c = lo
        while not self._clear(text, c):
            c += 1
        if self.mode == "gpt2":
            self.forced += 1
        return c

    def pieces(
        self,
        parts: Iterator[tuple[str, bool]],
        eos: int | None,
        what: str = "a document",
    ) -> Iterator[tuple[str, bool]]:
        """(piece, ends a document) from (part, ends a document). Without an EOS token a document that does
        not end with a newline gets one (the separator)."""
        buf = ""
        for text, last in parts:
            buf = buf + text if buf else text
            if last and eos is None and buf and not buf.endswith("\n"):
                buf += "\n"
            start, search = 0, self.piece_chars
            hard = self.hard_chars
            while len(buf) - search >= hard or (last and search < len(buf)):
                c = self.cut(buf, search, min(len(buf), search + hard), search + hard <= len(buf))
                if c is None:
                    search += hard
                    if search - start > self.max_uncut:
                        raise GptkitError(
                            f"{what} has {self.max_uncut:,} characters in a row where the tokenizer "
                            f"cannot be cut without changing its tokens; split the document "
                            f"(e.g. at paragraphs) or use tokenizer=bpe or byte"
                        )
                    continue
                yield buf[start:c], False
                start, search = c, c + self.piece_chars
            buf = buf[start:]
            if last:
                if buf:
                    yield buf, True
                buf = ""
        if buf:
            yield buf, True


def batches(
    pieces: Iterator[tuple[str, bool]], chars: int | None = None
) -> Iterator[list[tuple[str, bool, bool]]]:
    """Pieces grouped into encoding tasks of about `chars` (BATCH_CHARS) characters (deterministic: the same
    corpus gives the same batches, which is what resuming a build counts)."""
    chars = chars or BATCH_CHARS
    # (text, ends a document, starts a document)
    batch: list[tuple[str, bool, bool]] = []
    n, fresh = 0, True
    for text, ends in pieces:
        batch.append((text, ends, fresh))
        fresh = ends
        n += len(text)
        if n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


# ---- encoders ---------------------------------------------------------------------------------------
ENGINES = ("utf8", "chars", "tiktoken", "hf")


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a worker process needs to build the encoder (picklable)."""

    tokenizer_json: str
    # one of ENGINES
    engine: str
    specials: tuple[str, ...]
    eos: int | None
    dtype: str
    bos: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    # where tokenizer_json is saved: a worker reads it there, once
    tokenizer_path: str | None = None
    # special tokens spelled in the text: False, their text (the default); True, the control tokens
    # (data.special_tokens_in_content=allow). `specials` are the added tokens matched in the text.
    allow_special_text: bool = False

    def light(self) -> EncoderSpec:
        """The spec as sent with every task to a worker: without the tokenizer's JSON when it has a file."""
        return replace(self, tokenizer_json="") if self.tokenizer_path else self

    def json(self) -> str:
        """The tokenizer's JSON (read from tokenizer_path when the spec is light)."""
        if self.tokenizer_json or not self.tokenizer_path:
            return self.tokenizer_json
        with open(self.tokenizer_path, encoding="utf-8") as f:
            return f.read()


def hf_encoder(tok) -> Callable[[list[str]], list[list[int]]]:
    """texts -> ids with HF `tokenizers`; a character the tokenizer cannot represent is a GptkitError."""
    # _fast (tokenizers >= 0.21): no offsets
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def run(texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        # e.g. a character a file (or fine-tuned char) tokenizer cannot represent
        except Exception as exc:
            unknown = unknown_characters(tok, "".join(texts))
            what = (
                f"{len(unknown)} character(s) it has never seen: {describe_characters(unknown)}"
                if unknown
                else str(exc).splitlines()[0][:160]
            )
            raise GptkitError(
                f"the tokenizer cannot encode the corpus: {what}; use a tokenizer that covers "
                f"its characters (byte or bpe), or remove them from the text"
            ) from exc

    return run


def tiktoken_tables(tokenizer_json: str) -> tuple[dict[bytes, int], dict[str, int], list[int]] | None:
    """(mergeable ranks, special tokens, rank -> id) of a tiktoken encoding with the merges of a byte-level
    BPE tokenizer.json (GPT-2 pre-tokenization, no normalizer); None when it is not such a tokenizer."""
    d = json.loads(tokenizer_json)
    m, pre = d.get("model") or {}, d.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if (
        m.get("type") != "BPE"
        or d.get("normalizer")
        or pre.get("type") != "ByteLevel"
        or not pre.get("use_regex", True)
        or pre.get("add_prefix_space")
        or m.get("dropout")
        or m.get("continuing_subword_prefix")
        or m.get("end_of_word_suffix")
        or m.get("byte_fallback")
        or m.get("ignore_merges")
    ):
        return None
    vocab: dict[str, int] = m["vocab"]
    char_byte = {c: b for b, c in bytes_to_unicode().items()}
    if any(c not in vocab for c in char_byte):
        return None
    ranks: dict[bytes, int] = {}
    rank_to_id: list[int] = []
    for c, b in sorted(char_byte.items(), key=lambda cb: cb[1]):
        ranks[bytes([b])] = len(rank_to_id)
        rank_to_id.append(vocab[c])
    for merge in m.get("merges", []):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        s = a + b
        if s not in vocab or any(ch not in char_byte for ch in s):
            return None
        key = bytes(char_byte[ch] for ch in s)
        if key not in ranks:
            ranks[key] = len(rank_to_id)
            rank_to_id.append(vocab[s])
    specials: dict[str, int] = {}
    for t in d.get("added_tokens", []):
        if (
            not t.get("special")
            or t.get("normalized")
            or t.get("lstrip")
            or t.get("rstrip")
            or t.get("single_word")
        ):
            return None
        specials[t["content"]] = len(rank_to_id)
        rank_to_id.append(t["id"])
    return ranks, specials, rank_to_id


def matched_tokens(tok, allow_special_text: bool) -> tuple[str, ...]:
    """The added tokens of a `tokenizers.Tokenizer` that an encoder matches in the text (EncoderSpec.specials,
    the Cutter's specials): the ones that are not special (vocabulary words), and with allow_special_text
    the special ones too."""
    added = tok.get_added_tokens_decoder().values()
    return tuple(t.content for t in added if allow_special_text or not t.special)


def text_encoder(tok, allow_special_text: bool):
    """`tok` (a `tokenizers.Tokenizer`) set to encode special tokens spelled in a text as text (HF's
    encode_special_tokens), unless allow_special_text; the setting is no part of its JSON."""
    tok.encode_special_tokens = not allow_special_text
    return tok


# choose_engine's check builds the encoder that prepare then uses
@lru_cache(maxsize=4)
def _tiktoken(spec_json: str, allow_special_text: bool = False):
    import tiktoken

    tables = tiktoken_tables(spec_json)
    if tables is None:
        raise ValueError("not a byte-level BPE")
    ranks, specials, rank_to_id = tables
    enc = tiktoken.Encoding(
        name="gptkit-bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    lut = np.asarray(rank_to_id, dtype=np.uint32)  # [n ranks]

    # ordinary text, special tokens' strings included (allow: those become their ids)
    allowed = "all" if allow_special_text else set()

    def run(texts: list[str]) -> list[Any]:
        return [lut[enc.encode_to_numpy(t, allowed_special=allowed, disallowed_special=())] for t in texts]

    return run


def build_encoder(spec: EncoderSpec) -> Callable[[list[str]], list[Any]]:
    """texts -> their id sequences (lists or numpy arrays) with the spec's engine."""
    from tokenizers import Tokenizer

    if spec.engine == "tiktoken":
        # tiktoken_tables: every added token is special (text, or matched as HF does with allow)
        return _tiktoken(spec.json(), spec.allow_special_text)
    tok = text_encoder(Tokenizer.from_str(spec.json()), spec.allow_special_text)
    hf = hf_encoder(tok)
    specials = [s for s in spec.specials if s]

    def plain(t: str) -> bool:
        return not any(s in t for s in specials)

    if spec.engine == "hf":
        return hf
    if spec.engine == "utf8":

        def utf8(texts: list[str]) -> list[Any]:
            return [np.frombuffer(t.encode(), np.uint8) if plain(t) else hf([t])[0] for t in texts]

        return utf8
    if spec.engine == "chars":
        vocab = tok.get_vocab(with_added_tokens=False)
        singles = {c: i for c, i in vocab.items() if len(c) == 1}
        lut = np.full(max(map(ord, singles)) + 1, -1, dtype=np.int64)
        for c, i in singles.items():
            lut[ord(c)] = i

        def chars(texts: list[str]) -> list[Any]:
            out = []
            for t in texts:
                cps = np.frombuffer(t.encode("utf-32-le"), dtype="<u4")  # [len(t)]
                ids = lut[cps] if plain(t) and (not len(cps) or int(cps.max()) < len(lut)) else None
                out.append(ids if ids is not None and (not len(ids) or int(ids.min()) >= 0) else hf([t])[0])
            return out

        return chars
    raise ValueError(f"unknown engine {spec.engine!r}")


# a batch that ends no document
NO_ENDS = np.zeros(0, dtype=np.int64)


def encode_batch(
    encode: Callable[[list[str]], list[Any]],
    batch: list[tuple[str, bool, bool]],
    eos: int | None,
    dtype: str,
    bos: int | None = None,
):
    """One batch of pieces -> (its ids as one array, the ends of the documents it ends: [documents] int64,
    each the position in those ids just after a document's last token, its EOS included): a BOS before each
    document's first piece and an EOS after its last, when given."""
    out = []
    # documents' ends, and the ids so far
    ends, n = [], 0
    eos_arr = np.asarray([eos], dtype=dtype) if eos is not None else None
    bos_arr = np.asarray([bos], dtype=dtype) if bos is not None else None
    for ids, (_, ends_doc, starts) in zip(encode([b[0] for b in batch]), batch):
        if starts and bos_arr is not None:
            out.append(bos_arr)
            n += 1
        out.append(np.asarray(ids, dtype=dtype))
        n += len(out[-1])
        if ends_doc:
            if eos_arr is not None:
                out.append(eos_arr)
                n += 1
            ends.append(n)
    return (np.concatenate(out) if out else np.zeros(0, dtype=dtype)), np.asarray(ends, dtype=np.int64)


def char_like(tokenizer_json: str) -> bool:
    """A tokenizer.json of tokenizer=char (one id per code point): e.g. the shared tokenizer of a mixture."""
    d = json.loads(tokenizer_json)
    pre = d.get("pre_tokenizer") or {}
    return (
        (d.get("model") or {}).get("type") == "WordLevel"
        and pre.get("type") == "Split"
        and pre.get("pattern") == {"Regex": "[\\s\\S]"}
        and not d.get("normalizer")
    )


def choose_engine(
    tokenizer_json: str,
    kind: str,
    check: Callable[[], Iterator[str]] | None = None,
    allow_special_text: bool = False,
) -> tuple[str, str]:
    """(engine, why) for a tokenizer: byte -> utf8, char -> chars; byte-level BPE -> tiktoken when it gives
    HF's ids on TRICKY and on the texts of `check()` (a sample of the corpus), else hf; both encode special
    tokens' strings as text (allow_special_text: as their ids)."""
    if kind == "byte":
        return "utf8", "ids are the UTF-8 bytes"
    if kind == "char" or (kind == "file" and char_like(tokenizer_json)):
        return "chars", "a code point lookup table"
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        return "hf", "tiktoken is not installed"
    if tiktoken_tables(tokenizer_json) is None:
        return "hf", "not a byte-level BPE that tiktoken can run"
    from tokenizers import Tokenizer

    spec = EncoderSpec(tokenizer_json, "tiktoken", (), None, "uint32", allow_special_text=allow_special_text)
    fast = build_encoder(spec)
    hf = hf_encoder(text_encoder(Tokenizer.from_str(tokenizer_json), allow_special_text))
    texts = [TRICKY, *(check() if check is not None else [])]
    for t in texts:
        a, b = [list(map(int, x)) for x in fast([t])], hf([t])
        if a != b:
            return "hf", "tiktoken's ids differ from HF tokenizers' on this corpus"
    return "tiktoken", "tiktoken with the same merges (same ids as HF tokenizers on a sample)"
