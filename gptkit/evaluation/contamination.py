"""Test-set contamination (`gptkit contamination`): which items of lm-eval tasks occur in a prepared corpus,
found by word n-gram overlap, and the training documents they occur in.

The convention is lm-eval's decontamination (lm_eval/decontamination/janitor.py, after GPT-3's appendix C):
a text is normalized (normalize=lm-eval: ASCII letters lowercased, string.punctuation deleted), split on
whitespace into words, and cut into every run of n consecutive words (n=13 by default); a test item is
contaminated when any of its n-grams occurs in a training document. An item with fewer than n words has no
n-gram and is counted `too short`, never flagged. normalize=none splits on whitespace only.

An item's text is what lm-eval would decontaminate against: the task's doc_to_decontamination_query when the
task sets should_decontaminate, else its doc_to_text, the target delimiter and its target (a multiple-choice
target is the text of its correct choice).

The task side is small: its n-grams are hashed into a sorted array (and kept as text to confirm every hit, so
a hash collision never flags an item). The corpus side is streamed: the train shard's documents (the
documents file a build writes beside it, gptkit/data/provenance.py) are decoded in blocks of at most
PIECE_TOKENS tokens (a longer document in pieces, its last n-1 words carried into the next piece), so memory
stays bounded by a block whatever the corpus size. Each hit names the document: its number, its source file
and its place there (a JSON line's byte offset, a text file's byte), through the same provenance as
`gptkit trace`. A folder without a documents file (data=tokens) is scanned as one stream and a hit is named
by its token offset.
"""

from __future__ import annotations

import codecs
import json
import re
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gptkit.errors import ConfigError, GptkitError
from gptkit.tokenizer import bytes_to_unicode

DEFAULT_N = 13
# normalize=: how a text becomes words (lm-eval's Janitor: ASCII lowercased, ASCII punctuation deleted)
_LM_EVAL_TABLE = str.maketrans(
    string.ascii_uppercase,
    string.ascii_lowercase,
    string.punctuation,
)
NORMALIZATIONS: dict[str, Callable[[str], str]] = {
    "lm-eval": lambda text: text.translate(_LM_EVAL_TABLE),
    "none": lambda text: text,
}
# tokens decoded at once: a block of documents, or a piece of a longer one
PIECE_TOKENS = 1 << 20
# training documents named per contaminated item (the count of every match is kept)
MAX_DOCUMENTS = 20
# the rolling hash's multiplier (odd: invertible modulo 2**64)
_MUL = np.uint64(0x9E3779B97F4A7C15)
_WORD = re.compile(r"\S+")


def check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n={n!r} must be an integer >= 1 (the n-gram size in words; 13 by default)")
    return int(n)


def check_normalize(name: Any) -> Callable[[str], str]:
    if name not in NORMALIZATIONS:
        raise ConfigError(f"normalize={name!r} must be one of {', '.join(NORMALIZATIONS)}")
    return NORMALIZATIONS[name]


def words_of(text: str, norm: Callable[[str], str]) -> list[str]:
    return norm(text).split()


def ngram_hashes(words: list[str], n: int) -> np.ndarray:
    """[len(words) - n + 1] uint64: a hash of each n-gram of words (a rolling polynomial over the words'
    hashes; within one process, as the task side and the corpus side are hashed)."""
    m = len(words) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    w = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MUL + w[j : j + m]
    return h


@dataclass
class Item:
    task: str
    doc_id: int
    ngrams: int
    # the training documents it occurs in (at most MAX_DOCUMENTS), and the count of every match
    documents: list[dict[str, Any]] = field(default_factory=list)
    matches: int = 0
    seen: set = field(default_factory=set)


class TaskNgrams:
    """The n-grams of every test item of some tasks: hash -> the items holding it, and its words."""

    def __init__(self, n: int, norm: Callable[[str], str]) -> None:
        self.n, self.norm = n, norm
        self.items: list[Item] = []
        self.by_hash: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.tasks: dict[str, dict[str, int]] = {}

    def add(self, task: str, doc_id: int, text: str) -> None:
        stats = self.tasks.setdefault(task, {"items": 0, "too_short": 0})
        stats["items"] += 1
        words = words_of(text, self.norm)
        hashes = ngram_hashes(words, self.n)
        if not len(hashes):
            stats["too_short"] += 1
        i = len(self.items)
        self.items.append(Item(task, doc_id, len(hashes)))
        for j, h in enumerate(hashes.tolist()):
            holders = self.by_hash.setdefault(h, [])
            if not holders or holders[-1] != i:
                holders.append(i)
            self.text.setdefault(h, " ".join(words[j : j + self.n]))

    def sorted_hashes(self) -> np.ndarray:
        return np.array(sorted(self.by_hash), dtype=np.uint64)


def item_text(task, doc) -> str:
    """The text of one test item that lm-eval decontaminates against (module docstring)."""
    if task.should_decontaminate():
        return str(task.doc_to_decontamination_query(doc))
    text = task.doc_to_text(doc)
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(doc)
        if isinstance(target, int) and 0 <= target < len(choices):
            target = choices[target]
        elif isinstance(target, list):
            target = " ".join(choices[t] if isinstance(t, int) else str(t) for t in target)
    elif isinstance(target, list):
        target = " ".join(str(t) for t in target)
    text = text if isinstance(text, str) else str(text)
    delim = getattr(task.config, "target_delimiter", " ") or " "
    return f"{text}{delim}{target}"


def task_ngrams(tasks: dict[str, Any], n: int, norm: Callable[[str], str]) -> TaskNgrams:
    """The n-grams of every evaluated document (lm-eval's eval_docs) of each task."""
    out = TaskNgrams(n, norm)
    for name, task in tasks.items():
        for doc_id, doc in enumerate(task.eval_docs):
            out.add(name, doc_id, item_text(task, doc))
    return out


class TokenBytes:
    """The UTF-8 bytes of every token of a byte-level BPE (GPT-2 style: gptkit's byte and bpe) or a
    per-character tokenizer, in one flat table: a block of ids becomes its text with a few numpy gathers
    instead of the tokenizer's decode (several times faster); special tokens are no bytes (decode's
    skip_special_tokens), an undecodable byte U+FFFD (as the tokenizer's lossy decode). `table` is None for
    any other tokenizer (its decode_batch is used)."""

    def __init__(self, tokenizer) -> None:
        self.table = self._table(tokenizer)

    @staticmethod
    def _table(tokenizer):
        spec = json.loads(tokenizer.to_str())
        model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):
            return None
        pieces: dict[int, bytes] = {}
        if decoder.get("type") == "ByteLevel" and model.get("type") == "BPE":
            chars = {c: b for b, c in bytes_to_unicode().items()}
            if not all(ch in chars for token in vocab for ch in token):
                return None
            pieces = {i: bytes(chars[ch] for ch in token) for token, i in vocab.items()}
        elif (
            model.get("type") == "WordLevel"
            and decoder.get("type") in (None, "Fuse")
            and all(len(t) == 1 for t in vocab)
        ):
            pieces = {i: token.encode("utf-8") for token, i in vocab.items()}
        else:
            return None
        for t in spec.get("added_tokens") or []:
            pieces[int(t["id"])] = b"" if t.get("special") else str(t["content"]).encode("utf-8")
        size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(pieces) + 1)
        lens = np.zeros(size, dtype=np.int64)
        for i, b in pieces.items():
            lens[i] = len(b)
        starts = np.zeros(size, dtype=np.int64)
        starts[1:] = np.cumsum(lens)[:-1]
        flat = np.frombuffer(b"".join(pieces.get(i, b"") for i in range(size)), dtype=np.uint8)
        return flat, starts, lens

    def raw(self, tokens, a: int, b: int) -> tuple[bytes, np.ndarray]:
        """(the bytes of tokens[a:b], where each token's bytes end in them)."""
        flat, starts, lens = self.table
        ids = np.asarray(tokens[a:b], dtype=np.int64)
        n = lens[ids]  # [T] bytes of each token
        ends = np.cumsum(n)
        total = int(ends[-1]) if len(ends) else 0
        # byte k of the block comes from flat[starts[id] + (k - the first byte of its token)]
        where = np.repeat(starts[ids] - (ends - n), n) + np.arange(total)
        return flat[where].tobytes(), ends

    def texts(self, tokens, bounds: list[int]) -> list[str]:
        """The text of each range bounds[i]:bounds[i + 1] of tokens."""
        data, ends = self.raw(tokens, bounds[0], bounds[-1])
        cut = [0, *(int(ends[b - bounds[0] - 1]) if b > bounds[0] else 0 for b in bounds[1:])]
        return [data[a:b].decode("utf-8", errors="replace") for a, b in zip(cut, cut[1:])]


class Scan:
    """Stream a token shard's documents against the tasks' n-grams, recording each confirmed hit."""

    def __init__(self, grams: TaskNgrams, tokenizer, origins, label: str) -> None:
        self.grams, self.tokenizer, self.origins, self.label = grams, tokenizer, origins, label
        self.keys = grams.sorted_hashes()
        self.n = grams.n
        self.fast = TokenBytes(tokenizer)
        self.documents = self.tokens = self.bytes = 0

    def _decode(self, tokens: np.ndarray, bounds: list[int]) -> list[str]:
        """The text of each range bounds[i]:bounds[i + 1] of tokens."""
        if self.fast.table is not None:
            return self.fast.texts(tokens, bounds)
        block, a0 = tokens[bounds[0] : bounds[-1]], bounds[0]
        pieces = [block[a - a0 : b - a0].tolist() for a, b in zip(bounds, bounds[1:])]
        return self.tokenizer.decode_batch(pieces, skip_special_tokens=True)

    def text(self, text: str, doc: int | None, token0: int, byte0: int, last: bool) -> tuple[str, int]:
        """Check one text (a document, or a piece of one that starts `byte0` bytes into it); returns the text
        to carry into the next piece (its last n-1 whole words and a word cut at its end) and the byte of the
        document where that carried text starts."""
        norm, n = self.grams.norm, self.n
        whole = text
        cut = ""
        if not last and text and not text[-1].isspace():
            at = max(text.rfind(c) for c in " \n\t\r\f\v")
            # a piece without a space is checked whole (nothing carried grows without bound)
            if at >= 0:
                whole, cut = text[: at + 1], text[at + 1 :]
        words = norm(whole).split()
        if len(words) >= n and len(self.keys):
            h = ngram_hashes(words, n)
            # the task side's sorted hashes: a binary search each (np.isin would sort them again per text)
            at = np.minimum(np.searchsorted(self.keys, h), len(self.keys) - 1)
            found = np.nonzero(self.keys[at] == h)[0]
            if len(found):
                self._record(whole, words, h, found, doc, token0, byte0)
        if last:
            return "", 0
        carried = self._tail(whole, n - 1) + cut
        start = len(text) - len(carried)
        return carried, byte0 + len(text[:start].encode("utf-8"))

    def _tail(self, text: str, k: int) -> str:
        """The end of text from its k-th last word (normalized words: a word that normalizes to nothing does
        not count)."""
        if k == 0:
            return ""
        width = 256
        while True:
            part = text[-width:]
            starts = [m.start() for m in _WORD.finditer(part) if self.grams.norm(m.group())]
            if len(starts) > k or width >= len(text):
                return part[starts[-k] :] if len(starts) >= k else text
            width *= 4

    def _record(self, text, words, h, found, doc, token0, byte0) -> None:
        """Confirm the hash hits by their words and name the document of each."""
        g, n = self.grams, self.n
        positions = None
        for j in found.tolist():
            key = int(h[j])
            if " ".join(words[j : j + n]) != g.text.get(key):
                continue  # a hash collision
            for i in g.by_hash[key]:
                item = g.items[i]
                item.matches += 1
                place = (self.label, doc if doc is not None else token0)
                if place in item.seen or len(item.documents) >= MAX_DOCUMENTS:
                    continue
                if positions is None:
                    positions = [m.start() for m in _WORD.finditer(text) if g.norm(m.group())]
                byte = byte0 + len(text[: positions[j]].encode("utf-8"))
                item.seen.add(place)
                item.documents.append(self._name(doc, token0, byte, " ".join(words[j : j + n])))

    def _name(self, doc: int | None, token0: int, byte: int, gram: str) -> dict[str, Any]:
        if doc is None:
            return {
                "data": self.label,
                "document": None,
                "file": None,
                "where": f"token {token0:,} (decoded from there: byte {byte:,})",
                "byte_in_text": byte,
                "ngram": gram,
            }
        o = self.origins
        return {
            "data": self.label,
            "document": doc,
            "file": o.source_of(doc),
            "where": o.where(doc, byte, f"byte {byte:,} of its text", True),
            "byte_in_text": byte,
            "ngram": gram,
        }

    def run(self, tokens: np.ndarray, ends: np.ndarray | None) -> None:
        """Every document of the shard (ends: where each ends; None: one stream)."""
        total = len(tokens)
        self.tokens += total
        if ends is None:
            self._long(tokens, 0, total, None)
            self.documents += 1
            return
        ends = np.minimum(ends.astype(np.int64), total)
        k, start = 0, 0
        while k < len(ends) and start < total:
            # a block of whole documents up to PIECE_TOKENS, or one longer document in pieces
            j = k
            while j < len(ends) and int(ends[j]) - start <= PIECE_TOKENS:
                j += 1
            if j == k:
                self._long(tokens, start, int(ends[k]), k)
                start, k = int(ends[k]), k + 1
                self.documents += 1
                continue
            bounds = [start, *[int(e) for e in ends[k:j]]]
            texts = self._decode(tokens, bounds)
            for d, text in enumerate(texts):
                self.text(text, k + d, bounds[d], 0, True)
                self.bytes += len(text)
            self.documents += j - k
            start, k = bounds[-1], j

    def _long(self, tokens, a: int, b: int, doc: int | None) -> None:
        """A document longer than a block, in pieces; with the byte table a character whose bytes a piece
        boundary cuts is decoded whole in the next piece (an incremental UTF-8 decoder keeps them)."""
        carried, byte0 = "", 0
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for p in range(a, b, PIECE_TOKENS):
            q = min(b, p + PIECE_TOKENS)
            if self.fast.table is not None:
                text = utf8.decode(self.fast.raw(tokens, p, q)[0], final=q == b)
            else:
                (text,) = self._decode(tokens, [p, q])
            self.bytes += len(text)
            carried, byte0 = self.text(carried + text, doc, p, byte0, q == b)


class ShardReader:
    """A token shard read range by range with plain reads (`reader[a:b]`): a scan keeps only the block it
    reads in memory, where a memmap's pages would stay resident as it goes (an RSS of the corpus's size)."""

    def __init__(self, path: Path, dtype: str, n: int) -> None:
        self.path, self.dtype, self.n = path, np.dtype(dtype), n
        self.file = open(path, "rb")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b = s.start or 0, min(self.n, self.n if s.stop is None else s.stop)
        self.file.seek(a * self.dtype.itemsize)
        return np.fromfile(self.file, dtype=self.dtype, count=max(0, b - a))

    def close(self) -> None:
        self.file.close()


def shard_parts(prepared) -> list:
    """The token-shard folders of a prepared corpus (a mixture's parts); another kind is one line."""
    from gptkit.data import MixedData, PreparedData

    parts = list(prepared.parts) if isinstance(prepared, MixedData) else [prepared]
    for p in parts:
        if not isinstance(p, PreparedData):
            raise GptkitError(
                f"{p.dir} is not a token-shard folder (data=files, text, hub, stdlib, tokens): "
                f"contamination reads the documents of a pretraining corpus"
            )
    return parts


def scan(prepared, grams: TaskNgrams) -> dict[str, Any]:
    """Scan the train split of every token-shard folder of `prepared`; figures of the scan."""
    from gptkit.data.prepared import SHARDS
    from gptkit.data.provenance import ShardOrigins

    t0 = time.perf_counter()
    scans = []
    for p in shard_parts(prepared):
        p.wait_checked()
        n = int(p.manifest["splits"]["train"]["tokens"])
        tokens = ShardReader(p.dir / SHARDS["train"], p.dtype, n)
        try:
            origins = ShardOrigins(p.dir, p.manifest, tokens, p.tokenizer())
            label = str(p.manifest.get("source", {}).get("description") or p.dir)
            s = Scan(grams, p.tokenizer(), origins, label)
            s.run(tokens, None if origins.docs is None else origins.docs["end"])
        finally:
            tokens.close()
        scans.append(s)
    return {
        "documents_scanned": sum(s.documents for s in scans),
        "tokens_scanned": sum(s.tokens for s in scans),
        "chars_scanned": sum(s.bytes for s in scans),
        "seconds": time.perf_counter() - t0,
    }


def report(grams: TaskNgrams, figures: dict[str, Any], data: list[str], normalize: str) -> dict[str, Any]:
    """The report (JSON): per task its items, those too short to check, the contaminated ones and their
    share; per contaminated item the training documents it occurs in."""
    tasks = {}
    for name, stats in grams.tasks.items():
        flagged = [it.doc_id for it in grams.items if it.task == name and it.matches]
        tasks[name] = {
            **stats,
            "contaminated": len(flagged),
            "share": len(flagged) / stats["items"] if stats["items"] else 0.0,
            "flagged": flagged,
        }
    items = [
        {
            "task": it.task,
            "doc_id": it.doc_id,
            "ngrams": it.ngrams,
            "matches": it.matches,
            "documents": it.documents,
        }
        for it in grams.items
        if it.matches
    ]
    return {
        "n": grams.n,
        "normalize": normalize,
        "data": data,
        **figures,
        "tasks": tasks,
        "items": items,
    }


def read_report(path: Any) -> dict[str, list[int]]:
    """decontaminate=<report>: {task: the doc ids it flagged}; a file that is not such a report is one
    line."""

    p = Path(str(path))
    try:
        r = json.loads(p.read_text(encoding="utf-8"))
        tasks = r["tasks"]
        out = {str(t): [int(i) for i in v["flagged"]] for t, v in tasks.items()}
    except OSError as exc:
        raise ConfigError(f"decontaminate={path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(
            f"decontaminate={path} is not a `gptkit contamination` report (JSON with tasks.<name>.flagged)"
        ) from None
    return out
