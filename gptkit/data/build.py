"""prepare(): corpus + tokenizer -> token shards, a manifest and tokenizer.json, cached; resumable.

The cache key is a hash of (data settings, corpus content hash, tokenizer settings, tokenizer file
hash): preparing again is a no-op that says so, and a changed source file or tokenizer makes a new
folder.

The text streams through in bounded pieces (gptkit.data.sources, gptkit.data.tokenize): documents
are cut where the cut changes no token, tokenized in batches by `data.workers` processes with the
fastest encoder that gives the tokenizer's ids, and the ids are appended to the shard in input order
(so the shards do not depend on the worker count). Memory stays at a few batches of text per worker.
A BPE tokenizer is trained on at most `tokenizer.train_chars` characters, an evenly spread sample.

A build happens in `.<name>.partial/` next to its final folder, locked by its builder. Every
SHARD_TOKENS tokens the shard written so far is synced and recorded in `progress.json` (its length,
CRC-32 and how many batches of the input it holds): a shard of the build is complete. A build killed
at any moment (kill -9 included) is continued by the next prepare of the same data: the shard is cut
back to its last complete length, that prefix is checked against its CRC-32, the input batches it
holds are skipped, and the rest is tokenized as before; the result is bit-identical to an uninterrupted
build. Only a complete build (manifest written last) is renamed to its final name, so nothing
half-written is ever taken for a result. A build that fails on bad input is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from gptkit.data import tokenize
from gptkit.data.prepared import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SHARDS,
    TOKENIZER,
    PreparedData,
    copy_tail,
    load_prepared,
    manifest_checksum,
)
from gptkit.data.ranges import RangeFeed, TextFeed
from gptkit.data.sources import KINDS, Corpus, LineRange, Part, Parts, open_corpus
from gptkit.data.tokenfiles import prepare_tokens
from gptkit.data.tokenize import (
    BATCH_CHARS,
    Cutter,
    EncoderSpec,
    Tokenizing,
    batches,
    char_like,
    choose_engine,
    encode_task,
    split_long,
    start_workers,
    text_bytes,
    tiktoken_tables,
)
from gptkit.data.windows import PACKS
from gptkit.errors import GptkitError
from gptkit.faults import fault_point
from gptkit.fsio import DIR_MODE, atomic_write_text, disk_full_error, file_crc32, is_disk_full, lock_file
from gptkit.threads import cores
from gptkit.tokenizer import (
    SPECIAL_ROLES,
    build_tokenizer,
    eos_id,
    file_sha256,
    load_tokenizer_file,
    tokenizer_settings,
)
from gptkit.version import __version__

# rich is imported for the progress bar of a terminal only.

__all__ = ["prepare", "split_long", "data_settings", "use_prepared", "check_tokenizer", "remove_stale_builds"]

# tokens between two commits of a build (a kill loses at most this much work)
SHARD_TOKENS = 16 << 20
# in a build folder: what is complete
PROGRESS = "progress.json"


def layout() -> dict[str, Any]:
    """The shape of the input tasks: a build is continued only with the same. jsonl_tasks: a JSON-lines
    corpus is tokenized in byte ranges of the files (gptkit.data.ranges; before, in batches of pieces like
    any corpus), text_tasks: text files too: the journal's task count of a build killed before either change
    means other tasks."""
    return {
        "piece_chars": tokenize.PIECE_CHARS,
        "hard_chars": tokenize.HARD_CHARS,
        "batch_chars": tokenize.BATCH_CHARS,
        "verify_first": tokenize.VERIFY_FIRST,
        "jsonl_tasks": "byte ranges",
        "text_tasks": "byte ranges",
    }


def cache_root(cache_dir: str | Path | None) -> Path:
    """The folder that holds prepared data: cache_dir=, else $GPTKIT_CACHE/data, else ~/.cache/gptkit/data."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("GPTKIT_CACHE")
    return Path(base).expanduser() / "data" if base else Path.home() / ".cache" / "gptkit" / "data"


# Defaults of each kind (the same as conf/data/<kind>.yaml): settings given as a partial dict from
# Python mean the same corpus, and the same cache key, as the composed YAML.
DEFAULTS: dict[str, dict[str, Any]] = {
    "pydoc": {"val_fraction": 0.1, "dtype": "auto", "bos": "auto"},
    "shakespeare": {"val_fraction": 0.1, "dtype": "auto", "bos": "auto"},
    "stdlib": {
        "include_tests": True,
        "encoding_errors": "replace",
        "val_fraction": 0.05,
        "dtype": "auto",
        "bos": "auto",
    },
    "files": {
        "paths": None,
        "val_paths": None,
        "val_fraction": 0.1,
        "format": "auto",
        "text_field": "text",
        "encoding_errors": "strict",
        "dtype": "auto",
        "bos": "auto",
    },
    "hub": {
        "name": None,
        "config": None,
        "split": "train",
        "val_split": None,
        "val_fraction": 0.1,
        "text_field": "text",
        "revision": None,
        "timeout_s": 5,
        "dtype": "auto",
        "bos": "auto",
    },
    "prepared": {"dir": None},
    "mix": {"sources": None, "max_epochs": 4},
    "tokens": {
        "paths": None,
        "val_paths": None,
        "val_fraction": 0.1,
        "vocab_size": None,
        "format": "auto",
        "dtype": "auto",
    },
}


# data options of how windows are drawn from the shards: they change no token
WINDOW_KEYS = ("pack",)
# data options of how the shards are built: they change no token either
BUILD_KEYS = ("workers",)


def data_settings(cfg: Any) -> dict[str, Any]:
    """The data config as a complete plain dict with its kind checked, without WINDOW_KEYS and BUILD_KEYS
    (how windows are drawn from the shards, and how the shards are built, are no part of the cache key)."""
    from omegaconf import DictConfig, OmegaConf

    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    pack = d.pop("pack", "stream")
    for k in (*WINDOW_KEYS, *BUILD_KEYS):
        d.pop(k, None)
    if pack not in PACKS:
        raise GptkitError(f"data.pack={pack!r} is not one of {', '.join(PACKS)}")
    if d.get("kind") not in KINDS:
        raise GptkitError(
            f"unknown data kind {d.get('kind')!r}; "
            f"use data=pydoc|shakespeare|stdlib|files|hub|prepared|mix|tokens"
        )
    return {"kind": d["kind"], **DEFAULTS[d["kind"]], **d}


def choose_dtype(vocab_size: int, wanted: str) -> str:
    """The shard dtype for a vocabulary: uint16 when it fits (auto), else uint32; too small a dtype: error."""
    auto = "uint16" if vocab_size <= 1 << 16 else "uint32"
    if wanted == "auto":
        return auto
    if wanted not in DTYPES:
        raise GptkitError(f"data.dtype={wanted!r} must be auto, uint16 or uint32")
    if vocab_size > 1 << (8 * DTYPES[wanted]):
        raise GptkitError(
            f"the tokenizer has {vocab_size} tokens, more than {wanted} can hold; "
            f"set data.dtype=uint32 (or auto)"
        )
    return wanted


def build_workers(cfg: Any) -> int | None:
    """data.workers: the tokenization processes (None: every core this process may use, fewer for a small
    corpus)."""
    w = cfg.get("workers") if hasattr(cfg, "get") else None
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise GptkitError(f"data.workers={w!r} must be an integer >= 1 (or null for every usable core)")
    return w


# ---- progress ---------------------------------------------------------------------------------------
def human(n: float, unit: str = "B") -> str:
    """n with an SI prefix and unit, for progress lines: 466.1 kB, 54.0 MB."""
    for p in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or p == "T":
            return f"{n:.1f} {p}{unit}" if p else f"{n:.0f} {unit}"
        n /= 1000
    return f"{n} {unit}"


class _Progress:
    """Tokenization progress on stderr: a bar on a terminal, else a plain line every PLAIN_EVERY_S seconds;
    MB/s of text, tokens so far, an ETA where the size is known. Silent when disabled."""

    PLAIN_EVERY_S = 10.0

    def __init__(self, enabled: bool, total: int | None, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self.done = self.tokens = self.skipped = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[tokens]} tokens"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task(label, total=total, tokens="0")
            self.bar.start()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        # of the text tokenized now, not of a killed build's
        rate = (self.done - self.skipped) / dt
        where = human(self.done)
        eta = ""
        if self.total:
            where += f" of {human(self.total)} ({100 * min(self.done / self.total, 1):.0f}%)"
            left = max(self.total - self.done, 0) / rate if rate > 0 else 0
            eta = f", ETA {int(left // 60)}m{int(left % 60):02d}s"
        return f"{self.label}: {where}, {rate / 1e6:.1f} MB/s, {self.tokens:,} tokens{eta}"

    def advance(self, n_bytes: int, n_tokens: int = 0, skipped: bool = False) -> None:
        self.done += n_bytes
        self.skipped += n_bytes if skipped else 0
        self.tokens += n_tokens
        if self.bar is not None:
            self.bar.update(self.task, advance=n_bytes, tokens=f"{self.tokens:,}")
        elif self.enabled and time.perf_counter() - self.last >= self.PLAIN_EVERY_S:
            self.last = time.perf_counter()
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.enabled and self.done:
            print(self.line().replace(", ETA 0m00s", ""), file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(msg)


# ---- the tokenizer ----------------------------------------------------------------------------------
def cutter_for(tok, tok_s: dict[str, Any]) -> Cutter:
    """How documents may be cut for this tokenizer (see gptkit.data.tokenize)."""
    kind = tok_s["kind"]
    specials = [t.content for t in tok.get_added_tokens_decoder().values()]
    if kind in ("char", "byte") or (kind == "file" and char_like(tok.to_str())):
        return Cutter("any", specials)
    # GPT-2 style byte-level BPE
    if kind == "bpe" or tiktoken_tables(tok.to_str()) is not None:
        return Cutter("gpt2", specials)
    return Cutter("verify", specials, lambda t: tok.encode(t, add_special_tokens=False).ids)


def training_sample(corpus: Corpus, chars: int) -> tuple[Callable[[], Iterator[str]], str]:
    """(texts, what they are): at most about `chars` characters of the corpus for training a BPE, in pieces
    of at most a few hundred kB: the whole corpus when it is smaller, else an evenly spread sample."""
    gpt2 = Cutter("gpt2")

    def cut(parts: Iterator[Part]) -> Iterator[str]:
        return (p for p, _ in gpt2.pieces(parts, eos=0))

    size = corpus.n_bytes
    if size is not None and size <= chars:
        return lambda: cut(corpus.all_parts()), f"all {human(size)} of the corpus"
    if corpus.sample is not None:

        def sampled() -> Iterator[str]:
            n = 0
            for window in corpus.sample(chars):
                for p in split_long(window):
                    if n >= chars:
                        return
                    yield p[: chars - n]
                    n += min(len(p), chars - n)

        where = f"of {human(size)}" if size else "(size unknown)"
        return sampled, f"a sample of {human(chars, 'chars')} {where}, read at evenly spaced places"
    if size is not None:
        # every piece whose share of the sample is due: an even spread
        def strided() -> Iterator[str]:
            credit = 0.0
            for p in cut(corpus.all_parts()):
                credit += len(p) * chars / size
                if credit >= len(p):
                    credit -= len(p)
                    yield p

        return strided, f"a sample of {human(chars, 'chars')} of {human(size)}, spread evenly over the stream"

    def first() -> Iterator[str]:
        n = 0
        for p in cut(corpus.all_parts()):
            if n >= chars:
                return
            yield p
            n += len(p)

    return first, f"the first {human(chars, 'chars')} (the corpus's size is unknown)"


def _train_tokenizer(corpus: Corpus, tok_s: dict[str, Any], progress: bool):
    kind = tok_s["kind"]
    if kind == "bpe":
        texts, what = training_sample(corpus, int(tok_s["train_chars"]))
        _say(
            f"training byte-level BPE {tok_s['vocab_size']} on {what} (tokenizer.train_chars="
            f"{int(tok_s['train_chars']):,})"
        )
        return build_tokenizer(tok_s, texts=texts, progress=progress)
    if kind == "char":
        return build_tokenizer(tok_s, texts=lambda: (t for t, _ in corpus.all_parts()), progress=progress)
    return build_tokenizer(tok_s, progress=progress)


BOS = ("auto", True, False)


def own_bos(specials: Iterable[str], eos_token: str | None) -> str | None:
    """The text of a tokenizer's own BOS among its special tokens: the first of the usual spellings (e.g.
    Llama's <s> or <|begin_of_text|>); not GPT-2's <|endoftext|> (its EOS), nor the EOS token."""
    have = set(specials)
    found = next((n for n in SPECIAL_ROLES["bos_token"] if n in have), None)
    return None if found in (None, "<|endoftext|>", eos_token) else found


def bos_id(tok, bos: Any, eos: int | None) -> int | None:
    """data.bos (auto already resolved for the model family by bos_for_model, when train knows it): the id
    put before every document, or None. auto: the tokenizer's own BOS token (own_bos) when it has one;
    true: that token, which must exist; false: none."""
    if bos not in BOS:
        raise GptkitError(f"data.bos={bos!r} must be auto, true or false")
    if bos is False:
        return None
    own = own_bos(
        (t.content for t in tok.get_added_tokens_decoder().values()),
        None if eos is None else tok.id_to_token(eos),
    )
    if own is None and bos is True:
        raise GptkitError(
            "data.bos=true but the tokenizer has no BOS token of its own; add one, e.g. "
            "tokenizer.special_tokens=[<|bos|>], or set data.bos=auto"
        )
    return None if own is None else tok.token_to_id(own)


def resolve_bos(data: dict[str, Any], tok_s: dict[str, Any]) -> dict[str, Any]:
    """data.bos=auto as true or false: whether the tokenizer has a BOS of its own (own_bos), known from its
    settings (byte, char, bpe: their special_tokens) or its file, before any tokenizer is trained. The
    cache key holds this value, so auto and what it means are one cache entry (a plain `gptkit prepare`
    and a GPT-2 train, where bos_for_model makes auto false, share their shards when the tokenizer has no
    BOS)."""
    if data.get("bos") != "auto":
        return data
    if tok_s["kind"] == "file":
        specials = [t.content for t in load_tokenizer_file(tok_s["path"]).get_added_tokens_decoder().values()]
    else:
        specials = [
            *(tok_s.get("special_tokens") or ()),
            *([tok_s["eos_token"]] if tok_s.get("eos_token") else []),
        ]
    return {**data, "bos": own_bos(specials, tok_s.get("eos_token")) is not None}


def bos_for_model(data: dict[str, Any], position: str) -> dict[str, Any]:
    """data.bos=auto for the model that trains on it: a model family that wants a BOS (Llama-style, RoPE
    positions) keeps auto (the tokenizer's own BOS if it has one); a GPT-2-style model (learned positions)
    gets false. Every source of a data=mix likewise (a source without bos is auto). Other values stay."""
    if position == "rope":
        return data
    if data.get("kind") == "mix":
        sources = {
            n: bos_for_model({**DEFAULTS.get(s.get("kind"), {}), **s}, position) if isinstance(s, dict) else s
            for n, s in (data.get("sources") or {}).items()
        }
        return {**data, "sources": sources}
    return {**data, "bos": False} if data.get("bos") == "auto" else data


# ---- writing shards ---------------------------------------------------------------------------------
class Journal:
    """progress.json of a build folder: what of each split's shard is complete (synced)."""

    def __init__(self, folder: Path, state: dict[str, Any]) -> None:
        self.folder, self.state = folder, state

    def split(self, name: str) -> dict[str, Any]:
        return self.state["splits"].setdefault(
            name, {"batches": 0, "bytes": 0, "crc32": 0, "tokens": 0, "documents": 0, "done": False}
        )

    def save(self) -> None:
        atomic_write_text(self.folder / PROGRESS, json.dumps(self.state, indent=1))


def _resume_shard(path: Path, sp: dict[str, Any]) -> bool:
    """Cut the shard back to its last complete length and check that prefix's CRC-32."""
    if not path.is_file() or path.stat().st_size < sp["bytes"]:
        return False
    os.truncate(path, sp["bytes"])
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc == sp["crc32"]


class BatchFeed:
    """The tasks of one split of any corpus for write_tokens: batches of pieces that this process reads and
    cuts, which the workers encode (encode_task). (JSON-lines corpora: gptkit.data.ranges.RangeFeed.)"""

    run = staticmethod(encode_task)
    # counted by the Cutter of this process
    forced = 0

    def __init__(self, work: Iterator[list[tuple[str, bool, bool]]]) -> None:
        self.work = work

    def tasks(self) -> Iterator[list[tuple[str, bool, bool]]]:
        return self.work

    def skipped(self, batch: list[tuple[str, bool, bool]]) -> int:
        """A batch a killed build already wrote: its bytes, for the progress."""
        return text_bytes(batch)

    def done(self, result: tuple) -> None:
        """Nothing to check: the reading and cutting here raised any error already."""


def write_tokens(
    tokenizing: Tokenizing,
    feed: BatchFeed | RangeFeed,
    out: Path,
    journal: Journal,
    split: str,
    progress: _Progress,
) -> tuple[int, int]:
    """Tokenize the feed's tasks into `out` (appended raw ids), committing every SHARD_TOKENS tokens and
    skipping the tasks a killed build already committed. Returns (tokens, documents) of the split."""
    sp = journal.split(split)
    if sp["done"]:
        return sp["tokens"], sp["documents"]
    # tasks, whichever the feed's (layout() says which)
    skip = sp["batches"]
    # a killed build's complete shards
    progress.advance(0, sp["tokens"])

    def todo() -> Iterator[Any]:
        for i, b in enumerate(feed.tasks()):
            # already in the shard
            if i < skip:
                progress.advance(feed.skipped(b), skipped=True)
                continue
            yield b

    since = 0
    with open(out, "ab") as f:
        for result in tokenizing.map(todo(), feed.run):
            feed.done(result)
            arr, docs, n_bytes = result[:3]
            data = arr.tobytes()
            f.write(data)
            sp["crc32"] = zlib.crc32(data, sp["crc32"])
            sp["bytes"] += len(data)
            sp["tokens"] += len(arr)
            sp["documents"] += docs
            sp["batches"] += 1
            since += len(arr)
            progress.advance(n_bytes, len(arr))
            fault_point("prepare-batch")
            if since >= SHARD_TOKENS:
                _commit(f, journal)
                since = 0
        sp["done"] = True
        _commit(f, journal)
    return sp["tokens"], sp["documents"]


def _commit(f, journal: Journal) -> None:
    f.flush()
    os.fsync(f.fileno())
    journal.save()
    fault_point("prepare-shard")


def _split_tail(
    all_bin: Path, train_bin: Path, val_bin: Path, n: int, dtype: str, fraction: float, journal: Journal
) -> tuple[int, int]:
    """Move the last `fraction` of the tokens of all_bin into val_bin; the rest becomes train_bin. Each step
    is recorded, so that a build killed in between finishes it."""
    n_val = int(round(n * fraction))
    if n_val < 1 or n - n_val < 1:
        raise GptkitError(
            f"the corpus has only {n} tokens: too short to split off "
            f"data.val_fraction={fraction}; give more text"
        )
    itemsize = DTYPES[dtype]
    if not journal.state.get("val_written"):
        copy_tail(all_bin, val_bin, (n - n_val) * itemsize)
        journal.state["val_written"] = True
        journal.save()
        fault_point("prepare-shard")
    if all_bin.is_file():
        os.truncate(all_bin, (n - n_val) * itemsize)
        os.replace(all_bin, train_bin)
    return n - n_val, n_val


# ---- prepare ---------------------------------------------------------------------------------------
def _key(data: dict[str, Any], content: str, tok: dict[str, Any]) -> str:
    extra = {}
    # the file's content decides the tokens, not where it lies
    if tok["kind"] == "file":
        tok, extra = {**tok, "path": None}, {"tokenizer_file": file_sha256(tok["path"])}
    body = {"format_version": FORMAT_VERSION, "data": data, "content": content, "tokenizer": tok, **extra}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def prepare(
    data_cfg: Any,
    tokenizer_cfg: Any,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    force: bool = False,
) -> PreparedData:
    """Token shards for (corpus, tokenizer): from the cache when present, else built now (or the build a
    killed prepare left continued)."""
    data = data_settings(data_cfg)
    workers = build_workers(data_cfg)
    tok_s = tokenizer_settings(tokenizer_cfg)
    if data["kind"] == "prepared":
        return use_prepared(data, tok_s)
    if data["kind"] == "mix":
        raise GptkitError(
            "data=mix is prepared by gptkit.data.prepare (gptkit.data.mixture), source by source"
        )
    if data["kind"] == "tokens":
        tok = build_tokenizer(tok_s) if tok_s["kind"] in ("byte", "file") else None
        prepared = prepare_tokens(data, tok_s, cache_root(cache_dir), tok, _key)
        _say(f"token files: {prepared.dir} ({_counts(prepared.manifest)})")
        return prepared
    frac = float(data["val_fraction"])
    if not 0.0 < frac < 1.0:
        raise GptkitError(f"data.val_fraction={frac} must be between 0 and 1 (exclusive)")
    if "bos" in data:
        data = resolve_bos(data, tok_s)
    corpus = open_corpus(data)
    content = corpus.sha256()
    key = _key(data, content, tok_s)
    root = cache_root(cache_dir)
    if root.is_dir():
        # folders of builds that were killed (before builds were resumable)
        remove_stale_builds(root)
    final = root / f"{data['kind']}-{tok_s['kind']}-{key[:16]}"
    if final.exists() and force:
        shutil.rmtree(final)
    if final.exists():
        return _cache_hit(final, key)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.partial"
    _note_other_partials(root, tmp)
    said = False
    while True:
        tmp.mkdir(mode=DIR_MODE, exist_ok=True)
        # held while building: the OS drops it when the builder dies
        lock = lock_file(tmp / BUILD_LOCK)
        # another process finished it meanwhile
        if lock is not None and final.exists():
            os.close(lock)
            shutil.rmtree(tmp, ignore_errors=True)
            return _cache_hit(final, key)
        if lock is not None:
            break
        if not said:
            _say(f"another prepare is building {final.name}; waiting for it")
            said = True
        _wait_unlocked(tmp / BUILD_LOCK)
    keep = False
    try:
        manifest = _build(tmp, corpus, content, data, tok_s, key, progress, workers)
        fault_point("prepare-shards")
        (tmp / PROGRESS).unlink()
        (tmp / BUILD_LOCK).unlink()
        os.rename(tmp, final)
    except KeyboardInterrupt:
        # a Ctrl-C keeps the complete shards: the same prepare continues from them
        keep = True
        _say(f"interrupted: the complete shards are kept in {tmp}; run the same command again to continue")
        raise
    except BaseException as exc:
        # an estimate: at most 4 bytes per token, at most one token per byte of text
        if is_disk_full(exc):
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full_error(final, 4 * corpus.n_bytes if corpus.n_bytes else None, exc) from exc
        raise
    finally:
        if not keep and tmp.exists():
            # bad input (or a bug): nothing of it is worth resuming
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    prepared = load_prepared(final)
    _say(f"prepared {final} ({_counts(manifest)})")
    return prepared


def _note_other_partials(root: Path, mine: Path) -> None:
    """One note per interrupted build of other data (kept: the same prepare continues it)."""
    for p in sorted(root.glob(".*.partial")):
        if p == mine or not p.is_dir():
            continue
        try:
            fd = lock_file(p / BUILD_LOCK, create=False)
        except OSError:
            continue
        # being built right now
        if fd is None:
            continue
        os.close(fd)
        size = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
        _say(
            f"note: {p} is an interrupted build of other data ({human(size)}); the prepare that started it "
            f"continues it, or delete it"
        )


def _cache_hit(final: Path, key: str) -> PreparedData:
    prepared = load_prepared(final)
    if prepared.manifest.get("cache_key") != key:
        raise GptkitError(
            f"{final / MANIFEST} belongs to other data or another tokenizer; delete {final} and prepare again"
        )
    _say(f"cache hit: {final} ({_counts(prepared.manifest)})")
    return prepared


def _wait_unlocked(path: Path) -> None:
    """Block until the builder holding the lock at `path` is done (or the lock file is gone)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


# in a build folder: locked (fcntl) by the process that builds it
BUILD_LOCK = ".building"
# a build folder without a lock file (a kill right after mkdtemp) is stale after this
STALE_AFTER_S = 3600


def remove_stale_builds(root: Path) -> list[Path]:
    """Remove build folders of an older gptkit (.<name>.<random>.tmp) whose builder died: their lock file is
    not held by anyone (the OS releases it when the process dies, kill -9 included). Resumable builds
    (.<name>.partial) are continued, not removed, by the next prepare of the same data."""
    gone = []
    for tmp in root.glob(".*.tmp"):
        if not tmp.is_dir():
            continue
        try:
            fd = lock_file(tmp / BUILD_LOCK, create=False)
        # between mkdtemp and the lock, or renamed a moment ago
        except FileNotFoundError:
            fd = None if time.time() - tmp.stat().st_mtime < STALE_AFTER_S else -1
        except OSError:
            continue
        # a live build
        if fd is None:
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        if fd >= 0:
            os.close(fd)
        gone.append(tmp)
    return gone


def _counts(m: dict[str, Any]) -> str:
    s = m["splits"]
    return (
        f"{s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens, {m['dtype']}, "
        f"vocab {m['tokenizer']['vocab_size']:,}"
    )


def _open_build(tmp: Path, key: str) -> tuple[Any, Journal] | None:
    """The tokenizer and journal of a killed build of the same data in `tmp`, its shards cut back to their
    last complete length and checked; None (and the folder emptied) when there is none to continue."""
    state = None
    try:
        state = json.loads((tmp / PROGRESS).read_text())
    except (OSError, ValueError):
        pass
    ok = (
        isinstance(state, dict)
        and state.get("cache_key") == key
        and state.get("layout") == layout()
        and (tmp / TOKENIZER).is_file()
        and file_sha256(tmp / TOKENIZER) == state.get("tokenizer_sha256")
    )
    if ok:
        for split, sp in state["splits"].items():
            if split == "all" and state.get("val_written"):
                # finishing the split is idempotent (val.bin is complete)
                continue
            ok = ok and _resume_shard(tmp / _shard_file(split), sp)
        if not ok:
            _say(f"note: the interrupted build in {tmp} does not match its record; building it again")
    # a shard is kept only when the record covers it: one the killed build began but never committed (its
    # split not yet in progress.json) holds only uncommitted batches, which the build would append after
    recorded = {_shard_file(split) for split in state["splits"]} if ok else set()
    if ok and state.get("val_written"):
        # the split of all.bin into train and val is being finished
        recorded |= {"all.bin", *SHARDS.values()}
    keep = {BUILD_LOCK, PROGRESS, TOKENIZER, *recorded} if ok else {BUILD_LOCK}
    # leftovers of the killed build (half-written temporary files), or all of it
    for p in tmp.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return (load_tokenizer_file(tmp / TOKENIZER), Journal(tmp, state)) if ok else None


def _shard_file(split: str) -> str:
    return "all.bin" if split == "all" else SHARDS[split]


def _build(
    tmp: Path,
    corpus: Corpus,
    content: str,
    data: dict[str, Any],
    tok_s: dict[str, Any],
    key: str,
    progress: bool,
    workers: int | None,
) -> dict[str, Any]:
    t0 = time.time()
    n_workers = workers or max(1, min(cores(), (corpus.n_bytes or 1 << 40) // (4 * BATCH_CHARS)))
    # A byte-level BPE (bpe, or a tokenizer.json) is encoded by worker processes: start them now, so that
    # their start-up overlaps training the tokenizer and checking the encoder. (byte and char: in-process.)
    pool = start_workers(n_workers) if n_workers > 1 and tok_s["kind"] in ("bpe", "file") else None
    try:
        return _build_with(tmp, corpus, content, data, tok_s, key, progress, n_workers, pool, t0)
    finally:
        if pool is not None:
            # a no-op once Tokenizing has shut it down
            pool.shutdown(wait=True, cancel_futures=True)


def _build_with(
    tmp: Path,
    corpus: Corpus,
    content: str,
    data: dict[str, Any],
    tok_s: dict[str, Any],
    key: str,
    progress: bool,
    n_workers: int,
    pool: Any,
    t0: float,
) -> dict[str, Any]:
    resumed = _open_build(tmp, key)
    if resumed is not None:
        tok, journal = resumed
        done = sum(sp["tokens"] for sp in journal.state["splits"].values())
        _say(f"continuing the interrupted build in {tmp} from its last complete shard ({done:,} tokens)")
    else:
        tok = _train_tokenizer(corpus, tok_s, progress)
        # hash == tokenizer_sha256(tok)
        atomic_write_text(tmp / TOKENIZER, tok.to_str())
        journal = Journal(
            tmp,
            {
                "cache_key": key,
                "layout": layout(),
                "splits": {},
                "tokenizer_sha256": file_sha256(tmp / TOKENIZER),
            },
        )
        journal.save()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = choose_dtype(vocab, data["dtype"])
    eos = eos_id(tok, tok_s)
    bos = bos_id(tok, data["bos"], eos)
    cutter = cutter_for(tok, tok_s)
    specials = tuple(t.content for t in tok.get_added_tokens_decoder().values())

    # about 1 MB of the corpus, on which tiktoken must give HF's ids
    def check() -> Iterator[str]:
        if corpus.sample is not None:
            yield from (p for w in corpus.sample(1 << 20) for p in split_long(w))
            return
        n = 0
        for p, _ in cutter.pieces(corpus.train_parts(), eos):
            yield p
            n += len(p)
            if n >= 1 << 20:
                return

    engine, why = choose_engine(tok.to_str(), tok_s["kind"], check)
    spec = EncoderSpec(tok.to_str(), engine, specials, eos, dtype, bos, tokenizer_path=str(tmp / TOKENIZER))
    if engine in ("utf8", "chars"):
        # ids from the bytes or a table: sending text to a worker costs more than encoding it
        n_workers = 1
    ranged = corpus.train_ranges is not None
    # text files: in byte ranges where the Cutter's cuts need no encoding (any, gpt2); verify: as before
    texts = corpus.train_text is not None and cutter.mode in ("any", "gpt2")
    what = "JSON-lines" if ranged else "text" if texts else ""
    _say(
        f"tokenizing with {engine} ({why}), {n_workers} worker process{'es' if n_workers > 1 else ''} "
        f"(data.workers)"
        + (f", each reading its own byte ranges of the {what} files" if what and n_workers > 1 else "")
    )

    feeds: list[BatchFeed | RangeFeed | TextFeed] = []

    def work(
        parts: Parts, ranges: Callable[[int], Iterator[LineRange]] | None, text: list[Path] | None
    ) -> BatchFeed | RangeFeed | TextFeed:
        # JSON lines: whoever encodes a range reads, parses and cuts it
        if ranges is not None:
            feeds.append(RangeFeed(ranges, cutter, corpus.description))
        # text files: whoever encodes a range reads, decodes and cuts it
        elif texts and text is not None:
            feeds.append(
                TextFeed(text, corpus.text_errors, corpus.text_blank, cutter, eos, corpus.description)
            )
        else:
            feeds.append(BatchFeed(batches(cutter.pieces(parts(), eos, corpus.description))))
        return feeds[-1]

    bar = _Progress(progress, corpus.n_bytes, "tokenizing")
    t_tok, c_tok = time.perf_counter(), time.process_time()
    try:
        with Tokenizing(spec, n_workers, pool) as tokenizing:
            if corpus.val_parts is None:
                n, docs = write_tokens(
                    tokenizing,
                    work(corpus.train_parts, corpus.train_ranges, corpus.train_text),
                    tmp / "all.bin",
                    journal,
                    "all",
                    bar,
                )
                if n == 0:
                    raise GptkitError(f"{corpus.description} holds no text; give a corpus with some text")
                n_train, n_val = _split_tail(
                    tmp / "all.bin",
                    tmp / SHARDS["train"],
                    tmp / SHARDS["val"],
                    n,
                    dtype,
                    float(data["val_fraction"]),
                    journal,
                )
                splits = {"train": {"tokens": n_train}, "val": {"tokens": n_val}}
                val = {"how": "fraction", "fraction": float(data["val_fraction"]), "documents": docs}
            else:
                splits = {}
                for split, parts, ranges, text in (
                    ("train", corpus.train_parts, corpus.train_ranges, corpus.train_text),
                    ("val", corpus.val_parts, corpus.val_ranges, corpus.val_text),
                ):
                    n, docs = write_tokens(
                        tokenizing, work(parts, ranges, text), tmp / SHARDS[split], journal, split, bar
                    )
                    if n == 0:
                        raise GptkitError(f"the {split} files of {corpus.description} hold no text")
                    splits[split] = {"tokens": n, "documents": docs}
                val = {"how": "files"}
    finally:
        bar.close()
    t_tok, c_tok = time.perf_counter() - t_tok, time.process_time() - c_tok
    # cut here, and cut by whoever ran a range
    forced = cutter.forced + sum(f.forced for f in feeds)
    # text files not cut in ranges
    read_here = sum(getattr(f, "read_here", 0) for f in feeds)
    if forced:
        _say(
            f"note: {forced} cut(s) fell inside a run of over {tokenize.HARD_CHARS:,} characters "
            f"that the tokenizer would keep as one pre-token (e.g. a file of NUL bytes); ids differ only "
            f"there"
        )
    for split, name in SHARDS.items():
        splits[split]["file"] = name
        # checked whenever the folder is loaded
        splits[split]["crc32"] = file_crc32(tmp / name)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "gptkit_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - t0, 3),
        "cache_key": key,
        "source": {
            "kind": data["kind"],
            "description": corpus.description,
            "sha256": content,
            "files": corpus.files,
            "settings": data,
        },
        "tokenizer": {
            "kind": tok_s["kind"],
            "settings": tok_s,
            "sha256": file_sha256(tmp / TOKENIZER),
            "vocab_size": vocab,
            "eos_id": eos,
            "eos_token": tok_s["eos_token"],
            "bos_id": bos,
        },
        "dtype": dtype,
        "splits": splits,
        "validation": val,
        "encoder": engine,
        "workers": n_workers,
        "tasks": (f"byte ranges of the {what} files" if what else "batches of pieces")
        + (
            f" ({read_here} file(s) read here: no safe cut for {tokenize.HARD_CHARS // 2:,} bytes)"
            if read_here
            else ""
        ),
        # reading, cutting, encoding and writing the shards
        "tokenize_seconds": round(t_tok, 3),
        # of this process (with workers: all but encoding)
        "tokenize_main_cpu_seconds": round(c_tok, 3),
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
        raise GptkitError(
            f"the shards in {prepared.dir} were written with tokenizer {have['kind']} "
            f"({have['settings']}), not the configured {want['kind']} ({want}); use the same "
            f"tokenizer or prepare the corpus again with this one"
        )
