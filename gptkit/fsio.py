"""Atomic file and folder writes: nothing a user keeps is ever left half-written.

A file is written to a temporary name in its own folder, flushed to disk and renamed over the target
(rename is atomic within a filesystem); a folder is built under a temporary name and renamed when
complete. Files get the permissions the process's umask gives an ordinary file. A write that fails
because the disk is full becomes one line naming the file and the space it needs (disk_full_error).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import os
import re
import shutil
import sys
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from gptkit.errors import ConfigError, GptkitError
from gptkit.faults import fault_point

# scheme://: what names a place in another store (s3://, gs://, hf://, https://), never a folder here
URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_local_path(key: str, value: Any) -> None:
    """A path option's value (a string, or a list of them) names this machine's files: a URL (`s3://bucket/x`)
    is a one-line ConfigError, never a folder named `s3:` that a user would think is in the bucket."""
    for v in value if isinstance(value, (list, tuple)) else [value]:
        m = URL.match(v) if isinstance(v, str) else None
        if m is None:
            continue
        scheme = m.group(1)
        # the keys whose value may be hf:<...>
        if (key == "init_from" or key.startswith("frozen.")) and scheme == "hf":
            raise ConfigError(f"{key}={v}: write {key}=hf:<owner/name or a transformers folder>, no //")
        noun = "folder" if key.rsplit(".", 1)[-1].endswith("dir") else "path"
        raise ConfigError(f"{key}={v}: URLs ({scheme}://) are not supported yet; give a local {noun}")


def _read_umask() -> int:
    # the only way to read it is to set it: done once, at import
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()
# what open() would give a new file
FILE_MODE = 0o666 & ~UMASK
DIR_MODE = 0o777 & ~UMASK


def temp_file_beside(path: Path) -> tuple[int, str]:
    """A temporary file (fd, name) in path's folder, so that the final rename is atomic."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes it private
    os.chmod(tmp, FILE_MODE)
    return fd, tmp


def locked_temp(path: Path, folder: bool = False) -> tuple[int, Path]:
    """A temporary file (or folder) `.<name>.<random>.tmp` beside `path`, and an open descriptor holding an
    exclusive fcntl lock on it for as long as it stays open (the OS drops it when the process ends, kill -9
    included): remove_dead_temps tells a live writer's temporary from a killed one's by it. It is made as
    `.new`, locked, then renamed to `.tmp`, so no cleaner ever sees an unlocked `.tmp` of a live writer."""
    if folder:
        new = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent))
        # mkdtemp makes it private; the result is an ordinary folder
        os.chmod(new, DIR_MODE)
        fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent)
        new = Path(name)
        os.chmod(new, FILE_MODE)
    fcntl.flock(fd, fcntl.LOCK_EX)
    tmp = new.with_name(new.name[: -len(".new")] + ".tmp")
    os.replace(new, tmp)
    return fd, tmp


def remove_dead_temps(path: Path | str) -> list[Path]:
    """Remove the `.<name>.*.tmp` files and folders that writers of `path` killed before they finished left
    beside it (those made by locked_temp whose lock no live process holds); a note says what was freed."""
    path = Path(path)
    gone, freed = [], 0
    for p in sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp")) if path.parent.is_dir() else []:
        try:
            fd = os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() else 0) | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            # a live writer's
            continue
        try:
            files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
            freed += sum(f.stat().st_size for f in files)
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            gone.append(p)
        finally:
            os.close(fd)
    if gone:
        print(
            f"note: removed {len(gone)} temporary {'copy' if len(gone) == 1 else 'copies'} of {path} that "
            f"an interrupted earlier run left ({human_bytes(freed)})",
            file=sys.stderr,
        )
    return gone


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path, len(data), exc) from exc
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# ---- locks -----------------------------------------------------------------------------------------
def lock_file(path: Path | str, create: bool = True) -> int | None:
    """An exclusive fcntl lock on `path`: the open descriptor (keep it open to keep the lock; the OS releases
    it when the process ends, kill -9 included), or None when another process holds it. With create=False
    a missing file is FileNotFoundError. A symbolic link at `path` is never followed (its target would be
    truncated): GptkitError."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0), FILE_MODE)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise GptkitError(f"{path} is a symbolic link; a lock file is never followed: remove it") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def wait_unlocked(path: Path | str) -> None:
    """Block until the process holding the lock_file lock at `path` releases it (or ends); at once when there
    is no file at `path`."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


# ---- what a file names stays in its folder -----------------------------------------------------------
def confined(folder: Path | str, name: Any, named_by: Path | str, links: bool = False) -> Path:
    """`folder/name` for a file name that an index or checkpoint (`named_by`) gives, if it stays inside
    `folder`: an empty or absolute name, or a `..` that climbs out, is a one-line GptkitError naming
    `named_by`. links=True also refuses a symbolic link that leaves the folder (not for a Hugging Face cache
    snapshot, whose files are links to ../../blobs)."""
    root = Path(folder).absolute()
    text = str(name)
    target = Path(os.path.normpath(root / text))
    inside = target != root and root in target.parents
    if links and inside:
        real, real_root = target.resolve(), root.resolve()
        inside = real != real_root and real_root in real.parents
    if not text or Path(text).is_absolute() or not inside:
        raise GptkitError(
            f"{named_by} names the file {text!r}, which lies outside {root}; the files of a "
            f"checkpoint or model folder stay inside it: use a checkpoint or folder you trust"
        )
    return target


def links_leaving(folder: Path | str) -> list[tuple[Path, Path]]:
    """(link, target) for every symbolic link under `folder` (not followed) whose target is not inside it."""
    root = Path(folder).resolve()
    found = []
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink():
                target = p.resolve()
                if target != root and root not in target.parents:
                    found.append((p, target))
    return found


# ---- checksums -------------------------------------------------------------------------------------
# bytes read at a time while checking a file: memory stays flat, whatever its size
CHUNK = 8 << 20


def crc32_of(f, n: int, buf: memoryview) -> int | None:
    """CRC-32 of the next n bytes of the open file f; None when the file ends first."""
    crc = 0
    while n:
        k = f.readinto(buf[: min(n, len(buf))])
        if not k:
            return None
        crc = zlib.crc32(buf[:k], crc)
        n -= k
    return crc


def file_sha256(path: Path | str) -> str:
    """A file's SHA-256, hex, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_crc32(path: Path | str) -> str:
    """The CRC-32 of a whole file as 8 hex digits."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return f"{crc32_of(f, size, memoryview(bytearray(max(1, min(CHUNK, size))))) or 0:08x}"


# ---- a full disk ------------------------------------------------------------------------------------
def human_bytes(x: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as memory and disks are sized)."""
    for scale, s in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= scale:
            return f"{x / scale:.2f} {s}"
    return f"{x:.0f} B"


def free_bytes(path: Path | str) -> int:
    """Free space on the filesystem that holds `path` (or would hold it: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def is_disk_full(exc: BaseException) -> bool:
    """An error that means the disk (or the user's quota) is full: ENOSPC/EDQUOT, torch's zip writer
    ("unexpected pos", "file write failed") or numpy's short write ("N requested and M written", "Not
    enough free space to write N bytes")."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return (
        ("inline_container" in text and ("unexpected pos" in text or "write failed" in text))
        or ("requested and" in text and "written" in text)
        or "No space left on device" in text
        # numpy's tofile when it cannot reserve the space first (an OSError without errno)
        or "Not enough free space to write" in text
    )


def disk_full_error(what: Path | str | None, needed: float | None, exc: BaseException) -> GptkitError:
    """One line for a write that ran out of space: what was being written, the space it needs, the space free.
    `what` None: an error that names no file (the free space is then the current folder's disk's)."""
    if what is None:
        return GptkitError(
            "no space left on the disk (the failed write names no file: "
            f"{' '.join(str(exc).split())[:120]})"
            f"; {human_bytes(free_bytes(Path.cwd()))} is free on the disk of {Path.cwd()}; "
            "free some "
            f"space (old runs, checkpoints or the data cache) and run the command again"
        )
    need = f"it needs about {human_bytes(needed)}, " if needed else ""
    return GptkitError(
        f"no space left on the disk writing {what}: {need}{human_bytes(free_bytes(what))} is "
        "free; free some space (old runs, checkpoints or the data cache) and run the command "
        "again"
    )


def check_out_dir(out: Path | str, force: bool = False) -> Path:
    """`out` as a Path if a command may write a folder there: new, empty, or force=True."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise GptkitError(
            f"{out} already exists and is not empty; choose another out= or pass force=true to replace it"
        )
    above = next((p for p in out.parents if p.exists()), Path("."))
    if not above.is_dir():
        raise GptkitError(
            f"out={out}: {above} is a file, so no folder can be made in it; choose another out="
        )
    return out


@contextmanager
def staged_dir(out: Path | str, force: bool = False) -> Iterator[Path]:
    """Write a whole folder atomically: yields a temporary folder next to `out`, renamed to `out` when
    the block succeeds and removed when it fails, so `out` is never left half-written. A non-empty
    `out` is refused unless force=True (then it is replaced, only after the new folder is complete)."""
    out = check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    # what a killed earlier write of `out` left
    remove_dead_temps(out)
    lock, tmp = locked_temp(out, folder=True)
    try:
        yield tmp
        fault_point("staged")
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException as exc:
        failed = _newest_file(tmp) if is_disk_full(exc) and not isinstance(exc, GptkitError) else None
        shutil.rmtree(tmp, ignore_errors=True)
        # the file being written when the disk filled, by the name it was to have
        if failed is not None:
            raise disk_full_error(out / failed.relative_to(tmp), None, exc) from exc
        raise
    finally:
        os.close(lock)


def _newest_file(folder: Path) -> Path | None:
    files = [f for f in folder.rglob("*") if f.is_file()]
    return max(files, key=lambda f: f.stat().st_mtime_ns) if files else folder
