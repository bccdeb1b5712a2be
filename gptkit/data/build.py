"""prepare(): corpus + tokenizer -> token shards, a manifest and tokenizer.json, cached.

The cache key is a hash of (data settings, corpus content hash, tokenizer settings, tokenizer file
hash): preparing again is a no-op that says so, and a changed source file or tokenizer makes a new
folder. A folder is built under a temporary name and renamed when complete, so an interrupted or
failed preparation leaves nothing behind that could be mistaken for a result.

Documents are tokenized in batches with the tokenizer's parallel batch encoder; long documents are
cut at a newline between two non-space characters first (for the built-in kinds that cut changes
no token, see `split_long`), so one big file still keeps every core busy. The byte tokenizer's ids
are the UTF-8 bytes of the text and are taken directly. Tokens stream to disk: memory stays at
about one batch of text plus the memory-mapped shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from gptkit.data.prepared import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARDS,
    TOKENIZER,
    PreparedData,
    load_prepared,
    manifest_checksum,
)
from gptkit.data.sources import KINDS, Corpus, open_corpus
from gptkit.errors import GptkitError
from gptkit.faults import fault_point
from gptkit.fsio import DIR_MODE, disk_full_error, file_crc32, is_disk_full, lock_file
from gptkit.tokenizer import (
    SPLITTABLE_KINDS,
    build_tokenizer,
    describe_characters,
    eos_id,
    file_sha256,
    tokenizer_settings,
    unknown_characters,
)

BATCH_CHARS = 1 << 20  # text handed to one encode_batch call (its Encodings cost ~100 B per token)
PIECE_CHARS = 64 << 10  # long documents are cut into pieces of about this size
_CUT = re.compile(r"(?<=\S)\n(?=\S)")


def cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("GPTKIT_CACHE")
    return Path(base).expanduser() / "data" if base else Path.home() / ".cache" / "gptkit" / "data"


# Defaults of each kind (the same as conf/data/<kind>.yaml): settings given as a partial dict from
# Python mean the same corpus, and the same cache key, as the composed YAML.
DEFAULTS: dict[str, dict[str, Any]] = {
    "pydoc": {"val_fraction": 0.1, "dtype": "auto"},
    "shakespeare": {"val_fraction": 0.1, "dtype": "auto"},
    "stdlib": {"include_tests": True, "encoding_errors": "replace", "val_fraction": 0.05, "dtype": "auto"},
    "files": {"paths": None, "val_paths": None, "val_fraction": 0.1, "format": "auto", "text_field": "text",
              "encoding_errors": "strict", "dtype": "auto"},
    "hub": {"name": None, "config": None, "split": "train", "val_split": None, "val_fraction": 0.1,
            "text_field": "text", "revision": None, "timeout_s": 5, "dtype": "auto"},
    "prepared": {"dir": None},
}


WINDOW_KEYS = ("pack",)  # data options of how windows are drawn from the shards: they change no token


def data_settings(cfg: Any) -> dict[str, Any]:
    """The data config as a complete plain dict with its kind checked, without WINDOW_KEYS (the
    options of how windows are drawn from the shards are no part of the cache key)."""
    from omegaconf import DictConfig, OmegaConf

    from gptkit.data.windows import PACKS

    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    pack = d.pop("pack", "stream")
    for k in WINDOW_KEYS:
        d.pop(k, None)
    if pack not in PACKS:
        raise GptkitError(f"data.pack={pack!r} is not one of {', '.join(PACKS)}")
    if d.get("kind") not in KINDS:
        raise GptkitError(f"unknown data kind {d.get('kind')!r}; use data=pydoc|shakespeare|stdlib|files|hub|prepared")
    return {"kind": d["kind"], **DEFAULTS[d["kind"]], **d}


def choose_dtype(vocab_size: int, wanted: str) -> str:
    auto = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if wanted == "auto":
        return auto
    if wanted not in DTYPES:
        raise GptkitError(f"data.dtype={wanted!r} must be auto, uint16 or uint32")
    if vocab_size > 1 << (8 * DTYPES[wanted]):
        raise GptkitError(f"the tokenizer has {vocab_size} tokens, more than {wanted} can hold; "
                          f"set data.dtype=uint32 (or auto)")
    return wanted


def split_long(text: str, size: int = PIECE_CHARS) -> list[str]:
    """Cut a long text into pieces of about `size` characters at newlines between two non-space
    characters. Such a newline is a pre-token of its own for char, byte and GPT-2 style byte-level
    BPE, so encoding the pieces gives exactly the tokens of encoding the whole text."""
    pieces, start = [], 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        pieces.append(text[start:m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


# ---- writing shards --------------------------------------------------------------------------------
class _Progress:
    """A rich progress bar on stderr over the characters tokenized (silent when disabled)."""

    def __init__(self, enabled: bool, total: int | None, label: str) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.bar.start()

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _pieces(docs: Iterator[str], splittable: bool, eos: int | None) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) pairs. Without an EOS token, documents are separated by a newline."""
    for doc in docs:
        if eos is None and not doc.endswith("\n"):
            doc += "\n"
        parts = split_long(doc) if splittable else [doc]
        for i, p in enumerate(parts):
            yield p, i == len(parts) - 1


def batch_encoder(tok, kind: str, special_tokens: list[str]) -> Callable[[list[str]], list[Any]]:
    """texts -> their id sequences, with the tokenizer's parallel batch encoder. The byte tokenizer's
    ids are the UTF-8 bytes of the text, so those are taken directly (two orders of magnitude
    faster), except for a text that contains a special token's string, which the tokenizer maps to
    that token."""
    import numpy as np

    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (tokenizers >= 0.21): no offsets

    def hf(texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        except Exception as exc:  # e.g. a character a file (or fine-tuned char) tokenizer cannot represent
            unknown = unknown_characters(tok, "".join(texts))
            what = (f"{len(unknown)} character(s) it has never seen: {describe_characters(unknown)}" if unknown
                    else str(exc).splitlines()[0][:160])
            raise GptkitError(f"the tokenizer cannot encode the corpus: {what}; use a tokenizer that covers "
                              f"its characters (byte or bpe), or remove them from the text") from exc

    def utf8(texts: list[str]) -> list[Any]:
        return [hf([t])[0] if any(s in t for s in special_tokens) else np.frombuffer(t.encode(), np.uint8)
                for t in texts]

    return utf8 if kind == "byte" else hf


def write_tokens(encode: Callable[[list[str]], list[Any]], docs: Iterator[str], out: Path, dtype: str,
                 eos: int | None, splittable: bool, progress: _Progress) -> tuple[int, int]:
    """Tokenize docs into `out` (appended raw ids). Returns (tokens, documents)."""
    import numpy as np

    n_tokens = n_docs = 0
    with open(out, "ab") as f:
        def flush(batch: list[tuple[str, bool]]) -> None:
            nonlocal n_tokens, n_docs
            for ids, (text, ends) in zip(encode([t for t, _ in batch]), batch):
                if ends and eos is not None:
                    ids = [*ids, eos]
                arr = np.asarray(ids, dtype=dtype)  # [len(ids)]
                arr.tofile(f)
                n_tokens += len(arr)
                n_docs += ends
                progress.advance(len(text))

        batch: list[tuple[str, bool]] = []
        chars = 0
        for piece in _pieces(docs, splittable, eos):
            batch.append(piece)
            chars += len(piece[0])
            if chars >= BATCH_CHARS:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
    return n_tokens, n_docs


def _split_tail(all_bin: Path, train_bin: Path, val_bin: Path, n: int, dtype: str, fraction: float) -> tuple[int, int]:
    """Move the last `fraction` of the tokens of all_bin into val_bin; the rest becomes train_bin."""
    import numpy as np

    n_val = int(round(n * fraction))
    if n_val < 1 or n - n_val < 1:
        raise GptkitError(f"the corpus has only {n} tokens: too short to split off data.val_fraction={fraction}; "
                          f"give more text")
    tokens = np.memmap(all_bin, dtype=dtype, mode="r", shape=(n,))  # [n]
    tokens[n - n_val:].tofile(val_bin)
    del tokens
    os.truncate(all_bin, (n - n_val) * DTYPES[dtype])
    os.replace(all_bin, train_bin)
    return n - n_val, n_val


# ---- prepare ---------------------------------------------------------------------------------------
def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(msg)


def _key(data: dict[str, Any], content: str, tok: dict[str, Any]) -> str:
    extra = {}
    if tok["kind"] == "file":  # the file's content decides the tokens, not where it lies
        tok, extra = {**tok, "path": None}, {"tokenizer_file": file_sha256(tok["path"])}
    body = {"format_version": FORMAT_VERSION, "data": data, "content": content, "tokenizer": tok, **extra}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def prepare(data_cfg: Any, tokenizer_cfg: Any, cache_dir: str | Path | None = None, progress: bool = True,
            force: bool = False) -> PreparedData:
    """Token shards for (corpus, tokenizer): from the cache when present, else built now."""
    data = data_settings(data_cfg)
    tok_s = tokenizer_settings(tokenizer_cfg)
    if data["kind"] == "prepared":
        return use_prepared(data, tok_s)
    frac = float(data["val_fraction"])
    if not 0.0 < frac < 1.0:
        raise GptkitError(f"data.val_fraction={frac} must be between 0 and 1 (exclusive)")
    corpus = open_corpus(data)
    content = corpus.sha256()
    key = _key(data, content, tok_s)
    root = cache_root(cache_dir)
    if root.is_dir():
        remove_stale_builds(root)  # folders of builds that were killed
    final = root / f"{data['kind']}-{tok_s['kind']}-{key[:16]}"
    if final.exists() and force:
        shutil.rmtree(final)
    if final.exists():
        prepared = load_prepared(final)
        if prepared.manifest.get("cache_key") != key:
            raise GptkitError(f"{final / MANIFEST} belongs to other data or another tokenizer; "
                              f"delete {final} and prepare again")
        _say(f"cache hit: {final} ({_counts(prepared.manifest)})")
        return prepared
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    lock = lock_file(tmp / BUILD_LOCK)  # held while building: a build folder without a holder is stale
    try:
        manifest = _build(tmp, corpus, content, data, tok_s, key, progress)
        fault_point("prepare-shards")
        os.chmod(tmp, DIR_MODE)  # mkdtemp makes it private
        (tmp / BUILD_LOCK).unlink()
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same folder first: keep theirs
            if not (final / MANIFEST).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):  # an estimate: at most 4 bytes per token, at most one token per byte of text
            raise disk_full_error(final, 4 * corpus.n_bytes if corpus.n_bytes else None, exc) from exc
        raise
    finally:
        os.close(lock)
    prepared = load_prepared(final)
    _say(f"prepared {final} ({_counts(manifest)})")
    return prepared


BUILD_LOCK = ".building"  # in a build folder: locked (fcntl) by the process that builds it
STALE_AFTER_S = 3600  # a build folder without a lock file (a kill right after mkdtemp) is stale after this


def remove_stale_builds(root: Path) -> list[Path]:
    """Remove build folders (.<name>.<random>.tmp) whose builder died: their lock file is not held by
    anyone (the OS releases it when the process dies, kill -9 included)."""
    gone = []
    for tmp in root.glob(".*.tmp"):
        if not tmp.is_dir():
            continue
        try:
            fd = lock_file(tmp / BUILD_LOCK, create=False)
        except FileNotFoundError:  # between mkdtemp and the lock, or renamed a moment ago
            fd = None if time.time() - tmp.stat().st_mtime < STALE_AFTER_S else -1
        except OSError:
            continue
        if fd is None:  # a live build
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
        gone.append(tmp)
    return gone


def _counts(m: dict[str, Any]) -> str:
    s = m["splits"]
    return (f"{s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens, {m['dtype']}, "
            f"vocab {m['tokenizer']['vocab_size']:,}")


def _build(tmp: Path, corpus: Corpus, content: str, data: dict[str, Any], tok_s: dict[str, Any], key: str,
           progress: bool) -> dict[str, Any]:
    from gptkit.version import __version__

    t0 = time.time()
    tok = build_tokenizer(tok_s, texts=corpus.all_docs, progress=progress)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = choose_dtype(vocab, data["dtype"])
    eos = eos_id(tok, tok_s)
    (tmp / TOKENIZER).write_text(tok.to_str(), encoding="utf-8")  # hash == tokenizer_sha256(tok)
    splittable = tok_s["kind"] in SPLITTABLE_KINDS
    encode = batch_encoder(tok, tok_s["kind"], tok_s.get("special_tokens", []))
    bar = _Progress(progress, corpus.n_bytes, "tokenizing")
    try:
        if corpus.val_docs is None:
            n, docs = write_tokens(encode, corpus.train_docs(), tmp / "all.bin", dtype, eos, splittable, bar)
            if n == 0:
                raise GptkitError(f"{corpus.description} holds no text; give a corpus with some text")
            n_train, n_val = _split_tail(tmp / "all.bin", tmp / SHARDS["train"], tmp / SHARDS["val"], n, dtype,
                                         float(data["val_fraction"]))
            splits = {"train": {"tokens": n_train}, "val": {"tokens": n_val}}
            val = {"how": "fraction", "fraction": float(data["val_fraction"]), "documents": docs}
        else:
            splits = {}
            for split, docs_fn in (("train", corpus.train_docs), ("val", corpus.val_docs)):
                n, docs = write_tokens(encode, docs_fn(), tmp / SHARDS[split], dtype, eos, splittable, bar)
                if n == 0:
                    raise GptkitError(f"the {split} files of {corpus.description} hold no text")
                splits[split] = {"tokens": n, "documents": docs}
            val = {"how": "files"}
    finally:
        bar.close()
    for split, name in SHARDS.items():
        splits[split]["file"] = name
        splits[split]["crc32"] = file_crc32(tmp / name)  # checked whenever the folder is loaded
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gptkit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - t0, 3),
        "cache_key": key,
        "source": {"kind": data["kind"], "description": corpus.description, "sha256": content,
                   "files": corpus.files, "settings": data},
        "tokenizer": {"kind": tok_s["kind"], "settings": tok_s, "sha256": file_sha256(tmp / TOKENIZER),
                      "vocab_size": vocab, "eos_id": eos, "eos_token": tok_s["eos_token"]},
        "dtype": dtype,
        "splits": splits,
        "validation": val,
        "python": sys.version.split()[0],
    }
    manifest["checksum"] = manifest_checksum(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def use_prepared(data: dict[str, Any], tok_s: dict[str, Any]) -> PreparedData:
    """data=prepared data.dir=...: an existing prepared folder, which must match the configured tokenizer."""
    if not data.get("dir"):
        raise GptkitError("data=prepared needs data.dir=<a folder written by gptkit prepare>")
    folder = Path(str(data["dir"])).expanduser()
    if not folder.is_dir():
        raise GptkitError(f"data.dir={folder} does not exist; point it at a folder written by gptkit prepare")
    prepared = load_prepared(folder)
    check_tokenizer(prepared, tok_s)
    _say(f"using prepared data {folder} ({_counts(prepared.manifest)})")
    return prepared


def check_tokenizer(prepared: PreparedData, tokenizer_cfg: Any) -> None:
    """The shards must have been written by the configured tokenizer."""
    want = tokenizer_settings(tokenizer_cfg)
    have = prepared.manifest["tokenizer"]
    if want["kind"] == "file":
        from gptkit.tokenizer import load_tokenizer_file, tokenizer_sha256

        same = tokenizer_sha256(load_tokenizer_file(want["path"])) == have["sha256"]
    else:
        same = want == have["settings"]
    if not same:
        raise GptkitError(f"the shards in {prepared.dir} were written with tokenizer {have['kind']} "
                          f"({have['settings']}), not the configured {want['kind']} ({want}); use the same "
                          f"tokenizer or prepare the corpus again with this one")
