"""A prepared corpus: one folder of token shards, its manifest and its tokenizer.

    <cache>/<data kind>-<tokenizer kind>-<key>/
      train.bin       contiguous token ids (uint16 when the vocab fits, else uint32)
      val.bin         the same for validation
      tokenizer.json  the exact tokenizer that wrote the shards
      manifest.json   source and its content hash, tokenizer hash and vocab size, dtype, EOS id,
                      token counts and the CRC-32 of each shard, gptkit version, and a checksum of
                      the manifest itself

Loading checks everything a later run relies on: the manifest's checksum (a hand edit or a
truncated write is an error), the shard sizes against the token counts, the tokenizer's hash; and
it starts checking the shards' bytes against their CRC-32 in a background thread (zlib releases
the GIL), which the first read of the tokens waits for. Each shard is checked once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.errors import GptkitError
from gptkit.fsio import file_crc32
from gptkit.tokenizer import file_sha256, load_tokenizer_file

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SHARDS = {"train": "train.bin", "val": "val.bin"}
FORMAT = "gptkit-token-shards"
# 2: each split has the CRC-32 of its shard ("crc32"); 1 (read, unchecked) had none
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
DTYPES = {"uint16": 2, "uint32": 4}


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of a manifest's content without its own checksum field (sorted keys)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# shards found intact by this process: (path, inode, size, mtime)
_checked: set[tuple] = set()


def _shard_identity(f: Path) -> tuple:
    st = f.stat()
    return str(f.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class PreparedData:
    """A prepared data folder: its manifest and shards, checked against the manifest's CRC-32s."""

    dir: Path
    manifest: dict[str, Any]
    _check: threading.Thread | None = field(default=None, repr=False, compare=False)
    _problem: list[GptkitError] = field(default_factory=list, repr=False, compare=False)

    def start_check(self) -> None:
        """Check the shards' bytes against the manifest's CRC-32 in a background thread (see wait_checked)."""
        todo = [
            (self.dir / SHARDS[s], sp["crc32"]) for s, sp in self.manifest["splits"].items() if "crc32" in sp
        ]
        todo = [(f, crc) for f, crc in todo if _shard_identity(f) not in _checked]
        if todo and self._check is None:
            self._check = threading.Thread(
                target=self._run_check, args=(todo,), daemon=True, name="shard-check"
            )
            self._check.start()

    def _run_check(self, todo: list[tuple[Path, str]]) -> None:
        for f, crc in todo:
            if file_crc32(f) != crc:
                self._problem.append(
                    GptkitError(
                        f"{f} is corrupted (its CRC-32 does not match {self.dir / MANIFEST}); it cannot be "
                        f"trained on: delete {self.dir} and run `gptkit prepare` (or train) again"
                    )
                )
                return
            _checked.add(_shard_identity(f))

    def wait_checked(self) -> None:
        """Wait for the shard check started by load_prepared; a corrupted shard is a one-line GptkitError."""
        if self._check is not None:
            self._check.join()
        if self._problem:
            raise self._problem[0]

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / TOKENIZER

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        return self.manifest["tokenizer"]["eos_id"]

    @property
    def bos_id(self) -> int | None:
        return self.manifest["tokenizer"].get("bos_id")

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    def _tokens(self, split: str):
        self.wait_checked()
        n = int(self.manifest["splits"][split]["tokens"])
        return np.memmap(self.dir / SHARDS[split], dtype=self.dtype, mode="r", shape=(n,))  # [n]

    def train_tokens(self):
        return self._tokens("train")

    def val_tokens(self):
        return self._tokens("val")

    def tokenizer(self):
        return load_tokenizer_file(self.tokenizer_path)


def load_prepared(folder: Path | str) -> PreparedData:
    """Open a prepared folder, checking the manifest, the shards and the tokenizer against each other."""
    d = Path(folder)
    fix = f"delete {d} and run `gptkit prepare` again"
    mf = d / MANIFEST
    if not mf.is_file():
        raise GptkitError(f"{d} has no {MANIFEST}; it is not a prepared corpus (gptkit prepare writes one)")
    try:
        m = json.loads(mf.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GptkitError(f"{mf} is corrupted (not valid JSON: {exc}); {fix}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise GptkitError(f"{mf} is not a gptkit token-shard manifest; {fix}")
    if m.get("checksum") != manifest_checksum(m):
        raise GptkitError(f"{mf} was edited or corrupted (its checksum does not match its content); {fix}")
    if m.get("format_version") not in READABLE_VERSIONS:
        raise GptkitError(
            f"{mf} has format version {m.get('format_version')}, this gptkit reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}; {fix}"
        )
    if m["format_version"] < 2:
        print(
            f"note: {d} was prepared by an older gptkit and has no shard checksums, so corruption would go "
            f"unnoticed; prepare it again to add them",
            file=sys.stderr,
        )
    itemsize = DTYPES.get(m["dtype"])
    if itemsize is None:
        raise GptkitError(f"{mf} names an unknown dtype {m['dtype']!r}; {fix}")
    for split, name in SHARDS.items():
        f = d / name
        want = int(m["splits"][split]["tokens"]) * itemsize
        if not f.is_file() or f.stat().st_size != want:
            have = f.stat().st_size if f.is_file() else "no file"
            raise GptkitError(f"{f} does not match its manifest ({have} bytes, expected {want}); {fix}")
    tf = d / TOKENIZER
    if not tf.is_file() or file_sha256(tf) != m["tokenizer"]["sha256"]:
        raise GptkitError(
            f"{tf} is missing or is not the tokenizer that wrote these shards "
            f"(its hash differs from the manifest's); {fix}"
        )
    prepared = PreparedData(dir=d, manifest=m)
    prepared.start_check()
    return prepared


def check_vocab(prepared: PreparedData, model_vocab_size: int) -> None:
    """The model's embedding must have a row for every token id the shards can hold."""
    if prepared.vocab_size > int(model_vocab_size):
        raise GptkitError(
            f"the tokenizer has {prepared.vocab_size} tokens but "
            f"model.vocab_size={model_vocab_size}; set model.vocab_size>={prepared.vocab_size} "
            "(or let train take it from the tokenizer)"
        )


def copy_tail(src: Path, dst: Path, offset: int) -> None:
    """Copy src from byte `offset` on into dst (synced), 8 MiB at a time: a memory map of the tail would count
    its pages as this process's resident memory."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        f.seek(offset)
        for block in iter(lambda: f.read(8 << 20), b""):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
