"""data=tokens: train on token files made elsewhere.

    gptkit train data=tokens 'data.paths=[train.bin]' 'data.val_paths=[val.bin]' data.vocab_size=50304 \
        tokenizer=file tokenizer.path=gpt2/tokenizer.json

Two formats (data.format auto tells them apart by the header):
    raw   nanoGPT's train.bin/val.bin: token ids back to back, data.dtype (auto: uint16) each
    llmc  llm.c's shards: a header of 256 int32 (magic 20240520, version 1 = uint16 tokens, the token
          count), then the tokens

On first use the files are checked (size a multiple of the dtype, magic, version, the header's count,
every id below the vocabulary) and copied into a prepared folder of the cache with a manifest, CRC-32
and the tokenizer, like `gptkit prepare`'s; later runs find it by the files' content hash.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.data.cache import BUILD_LOCK, claim_build, discard_build, publish_build, shards_key
from gptkit.data.console import say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions
from gptkit.data.files import expand_paths, files_digest, unreadable_file
from gptkit.data.prepared import (
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    SHARDS,
    PreparedData,
    copy_tail,
    load_prepared,
    manifest_checksum,
)
from gptkit.data.settings import shard_settings
from gptkit.errors import GptkitError
from gptkit.faults import fault_point
from gptkit.fsio import disk_full_error, file_crc32, is_disk_full
from gptkit.tokenizer import TokenizerSpec, build_tokenizer, eos_id, file_sha256

LLMC_MAGIC = 20240520
LLMC_HEADER = 256 * 4
FORMATS = ("auto", "raw", "llmc")
# tokens read at a time
CHUNK = 1 << 24


def _layout(f: Path, fmt: str, dtype: str) -> tuple[str, int, str, int]:
    """(format, offset of the first token, dtype, tokens) of a token file; a bad file is a one-line error."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            head = fh.read(LLMC_HEADER)
    except OSError as exc:
        raise unreadable_file(f, exc) from None
    magic = int(np.frombuffer(head[:4], "<i4")[0]) if len(head) >= 4 else None
    if fmt == "auto":
        fmt = "llmc" if magic == LLMC_MAGIC else "raw"
    if fmt == "llmc":
        if len(head) < LLMC_HEADER:
            raise GptkitError(
                f"{f}: {size:,} bytes is shorter than the {LLMC_HEADER:,}-byte header of an llm.c shard; "
                f"it is truncated, or set data.format=raw for a raw token file"
            )
        if magic != LLMC_MAGIC:
            raise GptkitError(
                f"{f}: bad magic {magic} (an llm.c shard starts with {LLMC_MAGIC}); "
                f"set data.format=raw for a raw token file"
            )
        header = np.frombuffer(head, "<i4")
        if int(header[1]) != 1:
            raise GptkitError(
                f"{f}: llm.c shard version {int(header[1])}; gptkit reads version 1 (uint16 tokens)"
            )
        n = int(header[2])
        if size != LLMC_HEADER + 2 * n:
            raise GptkitError(
                f"{f}: its header says {n:,} tokens ({LLMC_HEADER + 2 * n:,} bytes) but the file has "
                f"{size:,} bytes: it is truncated or not an llm.c shard"
            )
        return fmt, LLMC_HEADER, "uint16", n
    dtype = "uint16" if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise GptkitError(f"data.dtype={dtype!r} must be auto, uint16 or uint32")
    if size % DTYPES[dtype]:
        raise GptkitError(
            f"{f}: {size:,} bytes is not a multiple of {DTYPES[dtype]} ({dtype}); set data.dtype to "
            f"the file's dtype"
        )
    if size == 0:
        raise GptkitError(f"{f} is empty; give token files with tokens")
    return fmt, 0, dtype, size // DTYPES[dtype]


def _tokens(f: Path, layout: tuple[str, int, str, int]) -> np.ndarray:
    _, offset, dtype, n = layout
    return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(n,))  # [n]


def _copy(files: list[Path], layouts: list, out: Path, dtype: str, vocab: int | None) -> tuple[int, int]:
    """Append the files' tokens to `out` as dtype, checking every id; (tokens, largest id)."""
    n, top = 0, -1
    with open(out, "wb") as fh:
        for f, lay in zip(files, layouts):
            t = _tokens(f, lay)
            for i in range(0, len(t), CHUNK):
                part = t[i : i + CHUNK]  # [<= CHUNK]
                m = int(part.max())
                if vocab is not None and m >= vocab:
                    at = i + int(np.argmax(part >= vocab))
                    raise GptkitError(
                        f"{f}: token {at:,} is id {int(part[at - i])}, not below data.vocab_size="
                        f"{vocab}; give the vocab_size the tokens were made with"
                    )
                top = max(top, m)
                part.astype(dtype).tofile(fh)
            n += len(t)
        fh.flush()
        os.fsync(fh.fileno())
    return n, top


def prepare_tokens(s: dict[str, Any], spec: TokenizerSpec, opts: BuildOptions) -> PreparedData:
    """data=tokens: the prepared folder of the token files (from the cache, or made now)."""
    prepared = _prepare_tokens(shard_settings(s), spec, opts.cache)
    say(f"token files: {prepared.dir} ({prepared.counts()})")
    return prepared


def _prepare_tokens(data: dict[str, Any], spec: TokenizerSpec, root: Path) -> PreparedData:
    if spec.kind not in ("file", "byte"):
        raise GptkitError(
            "data=tokens trains on ids made elsewhere: give the tokenizer that made them "
            "(tokenizer=file tokenizer.path=.../tokenizer.json), or tokenizer=byte for byte ids"
        )
    fmt = data["format"]
    if fmt not in FORMATS:
        raise GptkitError(f"data.format={fmt!r} is not one of {', '.join(FORMATS)} for data=tokens")
    files = expand_paths(data["paths"], "data.paths")
    if not files:
        raise GptkitError("data=tokens needs data.paths=[train.bin,...] (token files or globs)")
    val_files = expand_paths(data["val_paths"], "data.val_paths")
    layouts = [_layout(f, fmt, data["dtype"]) for f in files]
    val_layouts = [_layout(f, fmt, data["dtype"]) for f in val_files]
    tok = build_tokenizer(spec)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    vocab = data["vocab_size"]
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise GptkitError(f"data.vocab_size={vocab!r} must be a positive integer (or null: the tokenizer's)")
    vocab = int(vocab) if vocab is not None else tok_vocab
    if vocab < tok_vocab:
        raise GptkitError(f"data.vocab_size={vocab} is smaller than the tokenizer's {tok_vocab} tokens")
    content = files_digest(files) + (files_digest(val_files) if val_files else "")
    key = shards_key(data, content, spec)
    final = root / f"tokens-{spec.kind}-{key[:16]}"
    if (final / MANIFEST).is_file():
        return load_prepared(final)
    given = [("train", "data.paths", files, layouts)] + (
        [("val", "data.val_paths", val_files, val_layouts)] if val_files else []
    )
    for split, where, fs, lays in given:
        if not sum(lay[3] for lay in lays):
            raise GptkitError(
                f"the {split} split would be empty: the token files of {where} hold 0 tokens ("
                + ", ".join(map(str, fs[:3]))
                + (f" and {len(fs) - 3} more" if len(fs) > 3 else "")
                + "); give token files with tokens"
            )
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.partial"
    lock = claim_build(tmp, final)
    if lock is None:
        return load_prepared(final)
    published = False
    try:
        # what a killed builder left in the folder
        for p in tmp.iterdir():
            if p.name != BUILD_LOCK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        if val_files:
            n_train, _ = _copy(files, layouts, tmp / SHARDS["train"], dtype, vocab)
            n_val, _ = _copy(val_files, val_layouts, tmp / SHARDS["val"], dtype, vocab)
            validation = {"how": "files"}
        else:
            n, _ = _copy(files, layouts, tmp / "all.bin", dtype, vocab)
            frac = float(data["val_fraction"])
            n_val = int(round(n * frac))
            if not 0 < n_val < n:
                raise GptkitError(
                    f"the token files hold {n} tokens: too few to split off data.val_fraction={frac}"
                )
            copy_tail(tmp / "all.bin", tmp / SHARDS["val"], (n - n_val) * DTYPES[dtype])
            os.truncate(tmp / "all.bin", (n - n_val) * DTYPES[dtype])
            os.replace(tmp / "all.bin", tmp / SHARDS["train"])
            n_train, validation = n - n_val, {"how": "fraction", "fraction": frac}
        (tmp / TOKENIZER).write_text(tok.to_str(), encoding="utf-8")
        from gptkit.version import __version__

        splits = {"train": {"tokens": n_train}, "val": {"tokens": n_val}}
        for split, name in SHARDS.items():
            splits[split].update(file=name, crc32=file_crc32(tmp / name))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "gptkit_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cache_key": key,
            "source": {
                "kind": "tokens",
                "description": "token files: "
                + ", ".join(map(str, files[:3]))
                + (f" and {len(files) - 3} more" if len(files) > 3 else ""),
                "sha256": content,
                "files": [str(f) for f in files + val_files],
                "settings": data,
                "formats": [lay[0] for lay in layouts + val_layouts],
                # each file's tokens and where they start in it, in order: where a token came from
                # (`gptkit trace`)
                "tokens": [lay[3] for lay in layouts + val_layouts],
                "header_bytes": [lay[1] for lay in layouts + val_layouts],
                "dtypes": [lay[2] for lay in layouts + val_layouts],
            },
            "tokenizer": {
                "kind": spec.kind,
                "settings": spec.settings,
                "sha256": file_sha256(tmp / TOKENIZER),
                "vocab_size": vocab,
                "eos_id": eos_id(tok, spec),
                "eos_token": spec.eos_token,
                "bos_id": None,
            },
            "dtype": dtype,
            "splits": splits,
            "validation": validation,
            "python": sys.version.split()[0],
        }
        manifest["checksum"] = manifest_checksum(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        fault_point("prepare-shards")
        publish_build(tmp, final)
        published = True
    except BaseException as exc:
        if is_disk_full(exc) and not isinstance(exc, GptkitError):
            needed = sum(lay[3] for lay in layouts + val_layouts) * DTYPES[dtype]
            raise disk_full_error(final, needed, exc) from exc
        raise
    finally:
        if not published:
            discard_build(tmp)
        os.close(lock)
    return load_prepared(final)
