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

import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tokenizers import Tokenizer

from gptkit.data import tokenize
from gptkit.data.cache import (
    BUILD_LOCK,
    claim_build,
    discard_build,
    note_other_partials,
    publish_build,
    remove_stale_builds,
    shards_key,
)
from gptkit.data.console import Progress, human, say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions
from gptkit.data.prepared import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    SHARDS,
    PreparedData,
    load_prepared,
    manifest_checksum,
)
from gptkit.data.provenance import DOC_ROW, DOCS_SUFFIX
from gptkit.data.ranges import RangeFeed, TextFeed
from gptkit.data.settings import allows_special_text, build_workers, keyed_special_text, shard_settings
from gptkit.data.shards import (
    PROGRESS,
    BatchFeed,
    Journal,
    logged,
    resume_documents,
    resume_shard,
    split_tail,
    write_tokens,
)
from gptkit.data.sources import Corpus, LineRange, Part, Parts, Section
from gptkit.data.tokenize import (
    BATCH_CHARS,
    Cutter,
    EncoderSpec,
    batches,
    char_like,
    choose_engine,
    matched_tokens,
    split_long,
    text_encoder,
    tiktoken_tables,
)
from gptkit.data.workers import Tokenizing, start_workers
from gptkit.errors import GptkitError, Interrupted
from gptkit.faults import fault_point
from gptkit.fsio import atomic_write_text, disk_full_error, file_crc32, is_disk_full
from gptkit.threads import cores
from gptkit.tokenizer import (
    SPECIAL_ROLES,
    TokenizerSpec,
    build_tokenizer,
    eos_id,
    file_sha256,
    load_tokenizer_file,
    spec_special_tokens,
)
from gptkit.version import __version__


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


# ---- the tokenizer ----------------------------------------------------------------------------------
def cutter_for(tok, spec: TokenizerSpec, allow_special_text: bool = False) -> Cutter:
    """How documents may be cut for this tokenizer (see gptkit.data.tokenize): special tokens' strings in the
    text are text, cut as any text is (allow_special_text: never inside one)."""
    kind = spec.kind
    specials = list(matched_tokens(tok, allow_special_text))
    if kind in ("char", "byte") or (kind == "file" and char_like(tok.to_str())):
        return Cutter("any", specials)
    # GPT-2 style byte-level BPE
    if kind == "bpe" or tiktoken_tables(tok.to_str()) is not None:
        return Cutter("gpt2", specials)
    # checked with the encoding the shards get
    own = text_encoder(Tokenizer.from_str(tok.to_str()), allow_special_text)
    return Cutter("verify", specials, lambda t: own.encode(t, add_special_tokens=False).ids)


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


def _train_tokenizer(corpus: Corpus, spec: TokenizerSpec, progress: bool):
    kind = spec.kind
    if kind == "bpe":
        texts, what = training_sample(corpus, int(spec.get("train_chars")))
        say(
            f"training byte-level BPE {spec.get('vocab_size')} on {what} (tokenizer.train_chars="
            f"{int(spec.get('train_chars')):,})"
        )
        return build_tokenizer(spec, texts=texts, progress=progress)
    if kind == "char":
        return build_tokenizer(spec, texts=lambda: (t for t, _ in corpus.all_parts()), progress=progress)
    return build_tokenizer(spec, progress=progress)


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


def resolve_bos(data: dict[str, Any], spec: TokenizerSpec) -> dict[str, Any]:
    """data.bos=auto as true or false: whether the tokenizer has a BOS of its own (own_bos), known from its
    settings (byte, char, bpe: their special_tokens) or its file, before any tokenizer is trained. The
    cache key holds this value, so auto and what it means are one cache entry (a plain `gptkit prepare`
    and a GPT-2 train, where bos_for_model makes auto false, share their shards when the tokenizer has no
    BOS)."""
    if data.get("bos") != "auto":
        return data
    if spec.kind == "file":
        specials = [t.content for t in load_tokenizer_file(spec.path).get_added_tokens_decoder().values()]
    else:
        specials = [
            *(spec.get("special_tokens") or ()),
            *([spec.eos_token] if spec.eos_token else []),
        ]
    return {**data, "bos": own_bos(specials, spec.eos_token) is not None}


# ---- prepare ---------------------------------------------------------------------------------------
def prepare_corpus(
    s: dict[str, Any],
    tok: TokenizerSpec,
    opts: BuildOptions,
    *,
    open_corpus: Callable[[dict[str, Any]], Corpus],
) -> PreparedData:
    """Token shards of a text corpus (pydoc, shakespeare, stdlib, files, hub: `open_corpus` opens the kind's
    text) for one tokenizer: from the cache when present, else built now (or the build a killed prepare
    left continued)."""
    data = shard_settings(s)
    workers = build_workers(s)
    frac = float(data["val_fraction"])
    if not 0.0 < frac < 1.0:
        raise GptkitError(f"data.val_fraction={frac} must be between 0 and 1 (exclusive)")
    if "bos" in data:
        data = resolve_bos(data, tok)
    corpus = open_corpus(data)
    content = corpus.sha256()
    key = shards_key(keyed_special_text(data, lambda: spells_special(corpus, tok)), content, tok)
    root = opts.cache
    if root.is_dir():
        # folders of builds that were killed (before builds were resumable)
        remove_stale_builds(root)
    final = root / f"{data['kind']}-{tok.kind}-{key[:16]}"
    if final.exists() and opts.force:
        shutil.rmtree(final)
    if final.exists():
        return _cache_hit(final, key)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.partial"
    note_other_partials(root, tmp)
    # held while building (the OS drops it when the builder dies); None: another process finished it meanwhile
    lock = claim_build(tmp, final)
    if lock is None:
        return _cache_hit(final, key)
    keep = False
    try:
        _build(tmp, corpus, content, data, tok, key, opts.progress, workers)
        fault_point("prepare-shards")
        (tmp / PROGRESS).unlink()
        publish_build(tmp, final)
    except KeyboardInterrupt:
        # a Ctrl-C keeps the complete shards: the same prepare continues from them (the CLI prints this line
        # instead of its own "interrupted")
        keep = True
        raise Interrupted(
            f"interrupted: the complete shards are kept in {tmp}; run the same command again to continue"
        ) from None
    except BaseException as exc:
        # an estimate: at most 4 bytes per token, at most one token per byte of text
        if is_disk_full(exc):
            discard_build(tmp)
            raise disk_full_error(final, 4 * corpus.n_bytes if corpus.n_bytes else None, exc) from exc
        raise
    finally:
        # bad input (or a bug): nothing of it is worth resuming
        if not keep:
            discard_build(tmp)
        os.close(lock)
    prepared = load_prepared(final)
    say(f"prepared {final} ({prepared.counts()})")
    return prepared


def spells_special(corpus: Corpus, tok: TokenizerSpec) -> bool:
    """Whether the corpus may spell a special token of the tokenizer (Corpus.spells; a corpus that cannot
    tell, e.g. a hub dataset, may)."""
    specials = spec_special_tokens(tok)
    if not specials:
        return False
    return corpus.spells is None or corpus.spells(specials)


def _cache_hit(final: Path, key: str) -> PreparedData:
    prepared = load_prepared(final)
    if prepared.manifest.get("cache_key") != key:
        raise GptkitError(
            f"{final / MANIFEST} belongs to other data or another tokenizer; delete {final} and prepare again"
        )
    say(f"cache hit: {final} ({prepared.counts()})")
    return prepared


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
            ok = ok and resume_shard(tmp / _shard_file(split), sp)
            if ok:
                resume_documents(tmp / _docs_file(split), sp)
        if not ok:
            say(f"note: the interrupted build in {tmp} does not match its record; building it again")
    # a shard is kept only when the record covers it: one the killed build began but never committed (its
    # split not yet in progress.json) holds only uncommitted batches, which the build would append after
    recorded = {f(split) for split in state["splits"] for f in (_shard_file, _docs_file)} if ok else set()
    if ok and state.get("val_written"):
        # the split of all.bin into train and val is being finished
        recorded |= {"all.bin", *SHARDS.values(), _docs_file("all"), _docs_file("train")}
    keep = {BUILD_LOCK, PROGRESS, TOKENIZER, *recorded} if ok else {BUILD_LOCK}
    # leftovers of the killed build (half-written temporary files), or all of it
    for p in tmp.iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return (load_tokenizer_file(tmp / TOKENIZER), Journal(tmp, state)) if ok else None


def _shard_file(split: str) -> str:
    return "all.bin" if split == "all" else SHARDS[split]


def _docs_file(split: str) -> str:
    return str(Path(_shard_file(split)).with_suffix(DOCS_SUFFIX))


def documents_record(folder: Path, journal: Journal) -> dict[str, Any] | None:
    """The manifest's `documents`: the sources' names and, per split whose documents were all recorded, its
    documents file (count, CRC-32; `covers` all: the train split's file holds the validation tokens' too);
    None when no split has them (a build continued from one that recorded none)."""
    out: dict[str, Any] = {"sources": list(journal.state.get("sources", []))}
    for split, sp in journal.state["splits"].items():
        if sp.get("doc_bytes") is None:
            continue
        name = "train" if split == "all" else split
        f = folder / SHARDS[name]
        f = f.with_suffix(DOCS_SUFFIX)
        if not f.is_file() or f.stat().st_size != sp["doc_bytes"]:
            continue
        out[name] = {
            "file": f.name,
            "documents": sp["doc_bytes"] // DOC_ROW.itemsize,
            "crc32": file_crc32(f),
            "covers": "all" if split == "all" else split,
        }
    return out if len(out) > 1 else None


def _build(
    tmp: Path,
    corpus: Corpus,
    content: str,
    data: dict[str, Any],
    spec: TokenizerSpec,
    key: str,
    progress: bool,
    workers: int | None,
) -> dict[str, Any]:
    t0 = time.time()
    n_workers = workers or max(1, min(cores(), (corpus.n_bytes or 1 << 40) // (4 * BATCH_CHARS)))
    # A byte-level BPE (bpe, or a tokenizer.json) is encoded by worker processes: start them now, so that
    # their start-up overlaps training the tokenizer and checking the encoder. (byte and char: in-process.)
    pool = start_workers(n_workers) if n_workers > 1 and spec.kind in ("bpe", "file") else None
    try:
        return _build_with(tmp, corpus, content, data, spec, key, progress, n_workers, pool, t0)
    finally:
        if pool is not None:
            # a no-op once Tokenizing has shut it down
            pool.shutdown(wait=True, cancel_futures=True)


def _build_with(
    tmp: Path,
    corpus: Corpus,
    content: str,
    data: dict[str, Any],
    spec: TokenizerSpec,
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
        say(f"continuing the interrupted build in {tmp} from its last complete shard ({done:,} tokens)")
    else:
        tok = _train_tokenizer(corpus, spec, progress)
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
    eos = eos_id(tok, spec)
    bos = bos_id(tok, data["bos"], eos)
    allow = allows_special_text(data)
    cutter = cutter_for(tok, spec, allow)
    specials = matched_tokens(tok, allow)

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

    engine, why = choose_engine(tok.to_str(), spec.kind, check, allow)
    encoder = EncoderSpec(
        tok.to_str(),
        engine,
        specials,
        eos,
        dtype,
        bos,
        tokenizer_path=str(tmp / TOKENIZER),
        allow_special_text=allow,
    )
    if engine in ("utf8", "chars"):
        # ids from the bytes or a table: sending text to a worker costs more than encoding it
        n_workers = 1
    ranged = corpus.train_ranges is not None
    # text files: in byte ranges where the Cutter's cuts need no encoding (any, gpt2); verify: as before
    texts = corpus.train_text is not None and cutter.mode in ("any", "gpt2")
    what = "JSON-lines" if ranged else "text" if texts else ""
    say(
        f"tokenizing with {engine} ({why}), {n_workers} worker process{'es' if n_workers > 1 else ''} "
        f"(data.workers)"
        + (f", each reading its own byte ranges of the {what} files" if what and n_workers > 1 else "")
    )

    feeds: list[BatchFeed | RangeFeed | TextFeed] = []

    def work(
        parts: Parts,
        ranges: Callable[[int], Iterator[LineRange]] | None,
        text: list[Path] | None,
        sections: Callable[[], Iterator[Section]] | None,
    ) -> BatchFeed | RangeFeed | TextFeed:
        # JSON lines: whoever encodes a range reads, parses and cuts it
        if ranges is not None:
            feeds.append(RangeFeed(ranges, cutter, corpus.description))
        # text files: whoever encodes a range reads, decodes and cuts it
        elif texts and text is not None:
            feeds.append(
                TextFeed(text, corpus.text_errors, corpus.text_blank, cutter, eos, corpus.description)
            )
        # the sections (files, topics) say where each document comes from
        elif sections is not None:
            log: deque[str] = deque()
            pieces = cutter.pieces(logged(sections(), log), eos, corpus.description)
            feeds.append(BatchFeed(batches(pieces), log))
        else:
            feeds.append(BatchFeed(batches(cutter.pieces(parts(), eos, corpus.description))))
        return feeds[-1]

    bar = Progress(progress, corpus.n_bytes, "tokenizing")
    t_tok, c_tok = time.perf_counter(), time.process_time()
    try:
        with Tokenizing(encoder, n_workers, pool) as tokenizing:
            if corpus.val_parts is None:
                n, docs = write_tokens(
                    tokenizing,
                    work(corpus.train_parts, corpus.train_ranges, corpus.train_text, corpus.train_sections),
                    tmp / "all.bin",
                    journal,
                    "all",
                    bar,
                )
                if n == 0:
                    raise GptkitError(f"{corpus.description} holds no text; give a corpus with some text")
                n_train, n_val = split_tail(
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
                for split, parts, ranges, text, sections in (
                    (
                        "train",
                        corpus.train_parts,
                        corpus.train_ranges,
                        corpus.train_text,
                        corpus.train_sections,
                    ),
                    ("val", corpus.val_parts, corpus.val_ranges, corpus.val_text, corpus.val_sections),
                ):
                    n, docs = write_tokens(
                        tokenizing,
                        work(parts, ranges, text, sections),
                        tmp / SHARDS[split],
                        journal,
                        split,
                        bar,
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
        say(
            f"note: {forced} cut(s) fell inside a run of over {tokenize.HARD_CHARS:,} characters "
            f"that the tokenizer would keep as one pre-token (e.g. a file of NUL bytes); ids differ only "
            f"there"
        )
    for split, name in SHARDS.items():
        splits[split]["file"] = name
        # checked whenever the folder is loaded
        splits[split]["crc32"] = file_crc32(tmp / name)
    documents = documents_record(tmp, journal)
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
            "kind": spec.kind,
            "settings": spec.settings,
            "sha256": file_sha256(tmp / TOKENIZER),
            "vocab_size": vocab,
            "eos_id": eos,
            "eos_token": spec.eos_token,
            "bos_id": bos,
        },
        "dtype": dtype,
        "splits": splits,
        "validation": val,
        "documents": documents,
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
