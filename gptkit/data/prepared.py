"""A prepared corpus: one folder of token shards, its manifest and its tokenizer (the Prepared of every
kind whose data is one token stream: the built-in corpora, files, hub, tokens, and data=prepared, which
names such a folder).

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

from gptkit.data.console import say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions, Feed, Origin, Prepared
from gptkit.data.provenance import ShardOrigins
from gptkit.data.windows import TaggedWindows, ValWindows, WindowSampler, check_pack
from gptkit.errors import GptkitError
from gptkit.fsio import file_crc32
from gptkit.tokenizer import TokenizerSpec, file_sha256, load_tokenizer_file, tokenizer_sha256, tokenizer_spec

# torch is imported by the sampler's module (gptkit.data.windows).

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
class PreparedData(Prepared):
    """A prepared data folder: its manifest and shards, checked against the manifest's CRC-32s."""

    dir: Path
    manifest: dict[str, Any]
    _check: threading.Thread | None = field(default=None, repr=False, compare=False)
    _problem: list[GptkitError] = field(default_factory=list, repr=False, compare=False)
    _origins: ShardOrigins | None = field(default=None, repr=False, compare=False)

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

    def counts(self) -> str:
        s = self.manifest["splits"]
        return (
            f"{s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens, {self.dtype}, "
            f"vocab {self.vocab_size:,}"
        )

    def table(self) -> list[tuple[str, str]]:
        rows = super().table()
        return rows[:2] + [("dtype", self.dtype)] + rows[2:]

    def val_windows(self, seq_len: int, n_windows: int | None, eos_id: int | None) -> ValWindows:
        """The fixed validation windows of this folder (a one-line error when it holds none)."""
        return ValWindows(self.val_tokens(), seq_len, n_windows, eos_id, vocab_size=self.vocab_size)

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Windows of the shards: random for training (WindowSampler), evenly spread for validation, each
        val window tagged with its index (one source: no per-source figures). data.pack=documents adds
        doc_ids (needs the EOS between documents)."""
        import torch

        pack = pack or "stream"
        check_pack(pack, self.eos_id)
        eos = self.eos_id if pack == "documents" else None
        sampler = WindowSampler(
            self.train_tokens(), batch_size, seq_len, seed, eos, vocab_size=self.vocab_size
        )
        val = self.val_windows(seq_len, val_windows, eos)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            origins = self.origins()
            return [
                origins.origin(i, None, int(s), seq_len, chars)
                for i, s in enumerate(sampler.mine(step, rank, world_size))
            ]

        return Feed(
            sampler,
            TaggedWindows(val),
            val_sources=([], torch.zeros(len(val), dtype=torch.long)),
            tracer=tracer,
        )

    def origins(self) -> ShardOrigins:
        """Where the train split's windows came from (gptkit.data.provenance; read on first use)."""
        if self._origins is None:
            self._origins = ShardOrigins(self.dir, self.manifest, self.train_tokens(), self.tokenizer())
        return self._origins


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


def copy_tail(src: Path, dst: Path, offset: int) -> None:
    """Copy src from byte `offset` on into dst (synced), 8 MiB at a time: a memory map of the tail would count
    its pages as this process's resident memory."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        f.seek(offset)
        for block in iter(lambda: f.read(8 << 20), b""):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())


def use_prepared(data: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> PreparedData:
    """data=prepared data.dir=...: an existing prepared folder, which must match the configured tokenizer."""
    if not data.get("dir"):
        raise GptkitError("data=prepared needs data.dir=<a folder written by gptkit prepare>")
    folder = Path(str(data["dir"])).expanduser()
    if not folder.is_dir():
        raise GptkitError(f"data.dir={folder} does not exist; point it at a folder written by gptkit prepare")
    prepared = load_prepared(folder)
    check_tokenizer(prepared, tok)
    say(f"using prepared data {folder} ({prepared.counts()})")
    return prepared


def check_tokenizer(prepared: PreparedData, tokenizer_cfg: Any) -> None:
    """The shards must have been written by the configured tokenizer (a TokenizerSpec or its config)."""
    tok = tokenizer_spec(tokenizer_cfg)
    want = tok.settings
    have = prepared.manifest["tokenizer"]
    if tok.kind == "file":
        same = tokenizer_sha256(load_tokenizer_file(tok.path)) == have["sha256"]
    else:
        same = want == have["settings"]
    if not same:
        raise GptkitError(
            f"the shards in {prepared.dir} were written with tokenizer {have['kind']} "
            f"({have['settings']}), not the configured {tok.kind} ({want}); use the same "
            f"tokenizer or prepare the corpus again with this one"
        )
