"""Atomic file and folder writes: nothing a user keeps is ever left half-written.

A file is written to a temporary name in its own folder, flushed to disk and renamed over the target
(rename is atomic within a filesystem); a folder is built under a temporary name and renamed when
complete. Files get the permissions the process's umask gives an ordinary file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from gptkit.errors import GptkitError


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: done once, at import
    os.umask(mask)
    return mask


UMASK = _read_umask()
FILE_MODE = 0o666 & ~UMASK  # what open() would give a new file
DIR_MODE = 0o777 & ~UMASK


def temp_file_beside(path: Path) -> tuple[int, str]:
    """A temporary file (fd, name) in path's folder, so that the final rename is atomic."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, FILE_MODE)  # mkstemp makes it private
    return fd, tmp


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
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def check_out_dir(out: Path | str, force: bool = False) -> Path:
    """`out` as a Path if a command may write a folder there: new, empty, or force=True."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise GptkitError(f"{out} already exists and is not empty; choose another out= or pass force=true to replace it")
    above = next((p for p in out.parents if p.exists()), Path("."))
    if not above.is_dir():
        raise GptkitError(f"out={out}: {above} is a file, so no folder can be made in it; choose another out=")
    return out


@contextmanager
def staged_dir(out: Path | str, force: bool = False) -> Iterator[Path]:
    """Write a whole folder atomically: yields a temporary folder next to `out`, renamed to `out` when
    the block succeeds and removed when it fails, so `out` is never left half-written. A non-empty
    `out` is refused unless force=True (then it is replaced, only after the new folder is complete)."""
    out = check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    os.chmod(tmp, DIR_MODE)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
