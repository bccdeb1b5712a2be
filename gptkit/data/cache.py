"""The data cache: where prepared folders live, the locks of the builders, and how a finished folder is
published.

    <cache>/<kind>-<tokenizer kind>-<key>/      a prepared folder (its manifest written last)
    <cache>/<kind>-<tokenizer kind>-<key>-rows<N>/   the same chat or preference data with its rows longer
                                                than N tokens kept as their first N (templated_folder)
    <cache>/.<name>.partial/                    a resumable build of token shards (gptkit.data.build),
                                                locked by its builder (BUILD_LOCK)
    <cache>/.<name>.<random>.tmp/               a chat or preference folder being written (publish_folder)
    <cache>/.<name>.lock                        held by the one process that builds a chat or preference
                                                folder (one_builder); the others wait, then read its folder
    <cache>/tokenizers/                         tokenizers a data=mix trained on all its sources

The OS drops a builder's lock when it dies (kill -9 included): a folder whose lock nobody holds is a dead
build, continued (.partial) or removed (.tmp) by the next prepare.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from gptkit.chat_templates import CHAT_FILE
from gptkit.data.console import human, say
from gptkit.data.face import MANIFEST
from gptkit.data.prepared import FORMAT_VERSION, manifest_checksum
from gptkit.errors import GptkitError
from gptkit.fsio import (
    DIR_MODE,
    check_local_path,
    disk_full_error,
    file_crc32,
    is_disk_full,
    lock_file,
    wait_unlocked,
)
from gptkit.tokenizer import TokenizerSpec, file_sha256


def cache_root(cache_dir: str | Path | None) -> Path:
    """The folder that holds prepared data: cache_dir=, else $GPTKIT_CACHE/data, else ~/.cache/gptkit/data."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    base = os.environ.get("GPTKIT_CACHE")
    check_local_path("GPTKIT_CACHE", base)
    return Path(base).expanduser() / "data" if base else Path.home() / ".cache" / "gptkit" / "data"


def note_other_partials(root: Path, mine: Path) -> None:
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
        say(
            f"note: {p} is an interrupted build of other data ({human(size)}); the prepare that started it "
            f"continues it, or delete it"
        )


# in a build folder: locked (fcntl) by the process that builds it
BUILD_LOCK = ".building"
# a build folder without a lock file (a kill right after mkdtemp) is stale after this
STALE_AFTER_S = 3600


def claim_build(tmp: Path, final: Path) -> int | None:
    """The lock (an open descriptor) of the build folder `tmp`, made, or taken over from a builder that died
    (the OS drops its lock); while another process builds in it, wait for that one. None: `final` is complete
    (built by another process meanwhile), and `tmp` is not ours. What a dead builder left in `tmp` is the
    caller's to continue or remove."""
    said = False
    while True:
        tmp.mkdir(mode=DIR_MODE, exist_ok=True)
        try:
            # held while building: the OS drops it when the builder dies
            lock = lock_file(tmp / BUILD_LOCK)
        # renamed or removed by its builder just now
        except FileNotFoundError:
            continue
        if lock is not None and (final / "manifest.json").is_file():
            discard_build(tmp)
            os.close(lock)
            return None
        if lock is not None:
            return lock
        if not said:
            say(f"another prepare is building {final.name}; waiting for it")
            said = True
        wait_unlocked(tmp / BUILD_LOCK)


def publish_build(tmp: Path, final: Path) -> None:
    """Rename a complete build folder (its manifest written last) to its final name, with its lock file still
    inside: while the folder has its building name, its lock is the one this process holds, so no other
    process can lock it and start over in it; the lock file goes after the rename."""
    os.rename(tmp, final)
    (final / BUILD_LOCK).unlink(missing_ok=True)


def discard_build(tmp: Path) -> None:
    """Remove a build folder whose lock this process holds: renamed first (to a name that remove_stale_builds
    removes should this process die now), so that a process that comes for it meanwhile makes a new one
    instead of writing into the one being removed."""
    trash = tmp.with_name(f"{tmp.name}.{secrets.token_hex(4)}.tmp")
    try:
        os.rename(tmp, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


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


@contextmanager
def one_builder(root: Path, name: str) -> Iterator[None]:
    """Held while this process builds the chat or preference folder `name` of the cache `root`: a process that
    comes for the same folder meanwhile (another node on a shared cache) says so and waits, then finds the
    folder built (the caller looks again). The OS drops the lock when its holder dies (kill -9 included). The
    lock file goes once the folder is published: a process still waiting on it then finds the folder, and
    one that comes later finds the folder before any lock."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".{name}.lock"
    said = False
    while (fd := lock_file(path)) is None:
        if not said:
            say(f"another prepare is building {name}; waiting for it")
            said = True
        wait_unlocked(path)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def files_hash(files: list[Path]) -> str:
    """SHA-256 over the files' resolved paths and contents, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.resolve()).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def templated_folder(
    prefix: str,
    s: dict[str, Any],
    row_keys,
    format_version: int,
    tok: TokenizerSpec,
    template,
    files: list[Path],
    root: Path,
    force: bool,
    row_limit: int | None = None,
) -> tuple[list[Path], str, str]:
    """(folders, cache key, content hash) of a chat or preference build, keyed by the files' content, the
    settings but those that only choose rows (row_keys), the tokenizer (a tokenizer.json's content too),
    the template and the format; force=true removes the cached folders first.

    folders: where the data may be, in the order they are looked for: with a row_limit first the folder of
    the data with its rows longer than row_limit tokens kept as their first row_limit tokens (all a run
    whose rows are at most that long needs of them), then (last) the folder of every row whole: written
    when no row is longer than row_limit, or without a limit, it serves every run."""
    content = files_hash(files)
    cache_s = {k: v for k, v in s.items() if k not in row_keys}
    key_src = json.dumps(
        [cache_s, content, tok.settings, template.text, template.variables, format_version],
        sort_keys=True,
        default=str,
    )
    if tok.kind == "file":
        key_src += file_sha256(tok.path)
    key = hashlib.sha256(key_src.encode()).hexdigest()
    whole = root / f"{prefix}-{tok.kind}-{key[:16]}"
    folders = ([whole.with_name(f"{whole.name}-rows{row_limit}")] if row_limit else []) + [whole]
    for folder in folders:
        if folder.exists() and force:
            shutil.rmtree(folder)
    return folders, key, content


# what a damaged chat or preference folder's one line ends with
REBUILD = "delete it and prepare again"


def publish_folder(
    root: Path,
    final: Path,
    arrays: dict[str, dict[str, Any]],
    tokenizer,
    template,
    manifest: dict[str, Any],
    extra: dict[str, str] | None = None,
) -> None:
    """Write a chat or preference folder atomically: its .npz files ({file name: arrays}), `extra` text files,
    tokenizer.json, the template and manifest.json (last) into a temporary folder beside `final`, then renamed
    into place. The manifest records the size and CRC-32 of every other file and its own checksum
    (check_folder reads them). A folder another process finished first is kept; any failure removes the
    temporary folder, and a full disk is one line naming `final` and the free space of its disk."""
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        for name, content in arrays.items():
            np.savez(tmp / name, **content)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
        (tmp / CHAT_FILE).write_text(template.to_json(), encoding="utf-8")
        manifest = {
            **manifest,
            "files": {
                f.name: {"bytes": f.stat().st_size, "crc32": file_crc32(f)} for f in sorted(tmp.iterdir())
            },
        }
        manifest["checksum"] = manifest_checksum(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False), encoding="utf-8")
        os.chmod(tmp, DIR_MODE)
        try:
            os.rename(tmp, final)
        # another process finished the same folder first: keep theirs
        except OSError:
            if not (final / MANIFEST).is_file():
                if final.is_dir():
                    raise GptkitError(
                        f"{final} is not a complete prepared folder (it has no {MANIFEST}); {REBUILD}"
                    ) from None
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc) and not isinstance(exc, GptkitError):
            # the arrays and the tokenizer: what the folder holds, near enough
            needed = sum(a.nbytes for c in arrays.values() for a in c.values()) + len(tokenizer.to_str())
            raise disk_full_error(final, needed, exc) from exc
        raise


def check_folder(folder: Path, fmt: str, what: str) -> dict[str, Any]:
    """The manifest of a chat or preference folder, checked: valid JSON of format `fmt`, its checksum, and
    every file it lists present with its size and CRC-32. Whatever is wrong is one line naming the folder
    and saying to delete it and prepare again."""
    mf = folder / MANIFEST
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptkitError(
            f"{folder} is not a complete prepared {what} folder (no {MANIFEST}); {REBUILD}"
        ) from None
    except (OSError, ValueError) as exc:
        raise GptkitError(f"{folder} is damaged ({MANIFEST} is not valid JSON: {exc}); {REBUILD}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise GptkitError(
            f"{folder} is not a prepared {what} folder ({mf} is not a {fmt} manifest); {REBUILD}"
        )
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise GptkitError(
            f"{folder} is damaged ({MANIFEST} was edited or corrupted: its checksum does not match its "
            f"content); {REBUILD}"
        )
    for name, want in manifest["files"].items():
        f = folder / name
        if not f.is_file():
            raise GptkitError(f"{folder} is damaged ({name} is missing); {REBUILD}")
        if f.stat().st_size != want["bytes"] or file_crc32(f) != want["crc32"]:
            raise GptkitError(
                f"{folder} is damaged ({name} does not match the size and CRC-32 in its {MANIFEST}); "
                f"{REBUILD}"
            )
    return manifest


def shards_key(data: dict[str, Any], content: str, tok: TokenizerSpec) -> str:
    """The cache key of a token-shard folder: (the data settings, the content hash of the input, the
    tokenizer's settings (a tokenizer.json by its content, not where it lies), the format)."""
    settings, extra = tok.settings, {}
    if tok.kind == "file":
        settings, extra = {**settings, "path": None}, {"tokenizer_file": file_sha256(tok.path)}
    body = {
        "format_version": FORMAT_VERSION,
        "data": data,
        "content": content,
        "tokenizer": settings,
        **extra,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
