"""Runs, prepared data and exports in an S3 bucket (s3://bucket/prefix), through fsspec's s3fs (the `s3`
extra). docs/object-storage.md says how it is used; this is how it works.

Nothing is trained, prepared or exported in the bucket itself: every s3:// value is mapped to a local
staging folder, the same for every process on a machine,

    <GPTKIT_CACHE or ~/.cache/gptkit>/remote/s3/<bucket>/<prefix>      <->      s3://<bucket>/<prefix>

the verb works in that folder as it would in any other, and what it finished is uploaded. The mapping is a
pure function of the path (remote_of), so a run folder under the staging root knows its bucket without a
config key: every rank, every resume and every torchrun restart computes the same one.

A rename is not atomic on S3 (a copy, then a delete), so nothing is published by renaming. A folder (a
checkpoint, a prepared data folder, an export) is published as

    <url>/<its files>                   uploaded first, file by file
    <url>/gptkit-remote.json            then the manifest: every file's size and SHA-256
    <url>/COMPLETE                      last: the SHA-256 of the manifest's bytes

and a reader takes a folder only when COMPLETE is there, names the manifest it reads, and every file it
downloads has the manifest's size and SHA-256 (downloaded beside its place and renamed into it). A kill at any
moment of an upload (GPTKIT_FAULT=remote-upload) leaves at most a folder without COMPLETE, which no reader
takes and the next upload of the same folder replaces.

A run's checkpoints are such folders, <run>/checkpoints/step-NNNNNN/ (the step's .ckpt file or sharded
folder inside), one per published checkpoint; the run's other files (config.yaml, metrics.csv, plan.json,
tokenizer.json, ...) are copied to <run>/ each time a checkpoint is (one object each: S3 replaces an object
whole). A resume downloads the run's files and its newest complete checkpoint.

Credentials come from the environment as boto does it (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, an
AWS_PROFILE, ...), the endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; none of them is ever written to
a file or printed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from gptkit.errors import ConfigError, GptkitError
from gptkit.extras import require
from gptkit.faults import fault_point
from gptkit.fsio import check_local_path, file_sha256

SCHEME = "s3://"
MANIFEST = "gptkit-remote.json"
COMPLETE = "COMPLETE"
FORMAT = "gptkit-remote"
CHECKPOINTS = "checkpoints"
STEP_FOLDER = re.compile(r"step-(\d+)")
# a run folder's files that are not synced: the lock, Hydra's copy, partial writes
_NOT_SYNCED = re.compile(r"^\.|\.tmp$|\.pending$")


def is_remote(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(SCHEME)


# ---- the mapping: bucket <-> staging folder -------------------------------------------------------------
def staging_root() -> Path:
    """<GPTKIT_CACHE or ~/.cache/gptkit>/remote/s3: the local side of every s3:// location."""
    base = os.environ.get("GPTKIT_CACHE")
    check_local_path("GPTKIT_CACHE", base)
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "gptkit"
    return (root / "remote" / "s3").absolute()


def split_url(url: str, key: str = "path") -> tuple[str, str]:
    """s3://bucket/a/b -> ("bucket", "a/b"); a bucket name missing or a `..` in the path is one line."""
    rest = url[len(SCHEME) :].strip("/")
    bucket, _, path = rest.partition("/")
    parts = PurePosixPath(path).parts
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket) or ".." in parts or "." in parts:
        raise ConfigError(
            f"{key}={url} is not an S3 location: write s3://<bucket>/<prefix> (a bucket name of 3-63 "
            f"lower-case letters, digits, '.' or '-'; no '.' or '..' in the path)"
        )
    return bucket, "/".join(parts)


def staging_of(url: str, key: str = "path") -> Path:
    """The local folder that stands for `url`."""
    bucket, path = split_url(url, key)
    return staging_root() / bucket / path if path else staging_root() / bucket


def remote_of(path: Path | str) -> str | None:
    """The s3:// location a local path under the staging root stands for, else None (a local run)."""
    p, root = Path(path).absolute(), staging_root()
    try:
        rel = p.relative_to(root)
    except ValueError:
        return None
    return SCHEME + rel.as_posix() if rel.parts else None


# ---- the filesystem, its credentials and its errors ----------------------------------------------------
_fs: Any = None


def _has_credentials() -> bool:
    """Whether boto finds credentials: the environment's keys at once, else its own chain (a profile, a web
    identity, a container or instance role, ~/.aws/credentials)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return True
    import botocore.session

    try:
        return botocore.session.get_session().get_credentials() is not None
    except Exception:  # noqa: BLE001 - a broken profile is as good as none: the one line says what to set
        return False


# buckets found to exist (each asked once per process)
_buckets: set[str] = set()


def filesystem(url: str, key: str) -> Any:
    """The s3fs filesystem (one per process), once the `s3` extra, credentials and the bucket of `url` are
    there: each missing is one line."""
    global _fs
    require("s3", f"{key}={url} needs")
    if not _has_credentials():
        raise GptkitError(
            f"{key}={url}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            f"AWS_PROFILE) in the environment, and AWS_ENDPOINT_URL for a server other than AWS"
        )
    if _fs is None:
        import s3fs

        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        _fs = s3fs.S3FileSystem(
            endpoint_url=endpoint or None, use_listings_cache=False, skip_instance_cache=True
        )
    bucket, _ = split_url(url, key)
    if bucket in _buckets:
        return _fs
    try:
        found = _fs.exists(bucket)
    except Exception as exc:  # noqa: BLE001 - botocore's errors are many; each becomes one line
        raise GptkitError(f"{key}={url}: the bucket {bucket} cannot be reached ({_why(exc)})") from None
    if not found:
        raise GptkitError(
            f"{key}={url}: the bucket {bucket} does not exist (or these credentials cannot see it)"
        )
    _buckets.add(bucket)
    return _fs


def _why(exc: BaseException) -> str:
    """An error's first line, short, with nothing of the environment in it."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        secret = os.environ.get(name)
        if secret:
            text = text.replace(secret, "***")
    return text or type(exc).__name__


def reset() -> None:
    """Forget the filesystem (tests change the endpoint between servers)."""
    global _fs
    _fs = None
    _buckets.clear()


# ---- publishing and reading a folder -------------------------------------------------------------------
def _files(folder: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of every file under `folder` (a single file: its own name)."""
    if folder.is_file():
        return [(folder.name, folder)]
    return sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file())


def _remove(fs: Any, url: str) -> None:
    """Remove a remote folder, its COMPLETE first (so a reader never takes it half-removed)."""
    if fs.exists(f"{url}/{COMPLETE}"):
        fs.rm(f"{url}/{COMPLETE}")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def upload(fs: Any, files: list[tuple[str, Path]], url: str) -> dict[str, Any]:
    """Publish `files` (relative name, local path) as the folder `url`: what was there goes (its COMPLETE
    first), the files, the manifest, then COMPLETE. Returns the manifest."""
    _remove(fs, url)
    manifest = {"format": FORMAT, "version": 1, "files": {}}
    for i, (name, path) in enumerate(files):
        fs.put_file(str(path), f"{url}/{name}")
        manifest["files"][name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
        if i == 0:
            # a kill in the middle of an upload (tests: the previous checkpoint stays the newest complete one)
            fault_point("remote-upload")
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    fs.pipe_file(f"{url}/{MANIFEST}", body)
    fs.pipe_file(f"{url}/{COMPLETE}", hashlib.sha256(body).hexdigest().encode())
    return manifest


def complete_manifest(fs: Any, url: str) -> dict[str, Any] | None:
    """The manifest of a complete folder (COMPLETE names its SHA-256), else None."""
    try:
        mark = fs.cat_file(f"{url}/{COMPLETE}").decode().strip()
        body = fs.cat_file(f"{url}/{MANIFEST}")
    except FileNotFoundError:
        return None
    if hashlib.sha256(body).hexdigest() != mark:
        return None
    try:
        manifest = json.loads(body)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


# files this process found to match a manifest: (path, size, mtime, SHA-256), hashed once
_verified: set[tuple[str, int, int, str]] = set()


def _fits(path: Path, entry: dict[str, Any]) -> bool:
    """The file is there with the manifest's size and SHA-256 (each file hashed once per process)."""
    if not path.is_file():
        return False
    st = path.stat()
    key = (str(path.absolute()), st.st_size, st.st_mtime_ns, str(entry["sha256"]))
    if key in _verified:
        return True
    if st.st_size != entry["size"] or file_sha256(path) != entry["sha256"]:
        return False
    _verified.add(key)
    return True


def download(fs: Any, url: str, manifest: dict[str, Any], dest: Path) -> None:
    """The files of a complete folder into `dest` (a file already there with the manifest's size and SHA-256
    is kept), each checked against the manifest before it is renamed into place. A mismatch is one line."""
    for name, entry in sorted(manifest["files"].items()):
        parts = PurePosixPath(name).parts
        if not parts or ".." in parts or name.startswith("/"):
            raise GptkitError(f"{url}/{MANIFEST} names {name!r}, which is not a file inside the folder")
        target = dest.joinpath(*parts)
        if _fits(target, entry):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.download.tmp")
        try:
            fs.get_file(f"{url}/{name}", str(tmp))
            if not _fits(tmp, entry):
                raise GptkitError(
                    f"{url}/{name} does not match its manifest ({MANIFEST}: size {entry['size']}, SHA-256 "
                    f"{entry['sha256'][:12]}...): the copy in the bucket is damaged; publish it again"
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One process at a time fills a staging folder (the ranks of a node wait for the first)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.parent / f".{folder.name}.remote-lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def publish_folder(folder: Path, url: str, key: str = "out") -> bool:
    """Upload a finished local folder to `url` once: a complete folder there with the same files (sizes and
    SHA-256) is left as it is (False); else it is replaced (True)."""
    fs = filesystem(url, key)
    files = _files(Path(folder))
    there = complete_manifest(fs, url)
    if there is not None and set(there["files"]) == {n for n, _ in files}:
        if all(_fits(p, there["files"][n]) for n, p in files):
            return False
    upload(fs, files, url)
    return True


def fetch_folder(url: str, key: str = "path") -> Path:
    """The local copy of a complete published folder (downloaded and checked; one line when `url` holds
    none)."""
    fs = filesystem(url, key)
    manifest = complete_manifest(fs, url)
    if manifest is None:
        raise GptkitError(
            f"{key}={url}: no complete folder there ({COMPLETE} and {MANIFEST} missing or not matching: "
            f"never published, or its upload did not finish)"
        )
    dest = staging_of(url, key)
    with _locked(dest):
        download(fs, url, manifest, dest)
    return dest


def fetch_staged(path: Any, key: str = "data.dir") -> None:
    """A folder under the staging root (a resumed run's data.dir=, saved as its local copy): downloaded and
    checked again on this machine, every rank, before training; any other path: nothing."""
    url = remote_of(path) if isinstance(path, (str, Path)) and str(path) else None
    if url is not None:
        fetch_folder(url, key)


# ---- runs -----------------------------------------------------------------------------------------------
def staging_runs_dir(url: str, key: str = "runs_dir") -> Path:
    """runs_dir=s3://...: its staging folder, once credentials and the bucket are checked."""
    filesystem(url, key)
    return staging_of(url, key)


def run_files(run_dir: Path) -> list[tuple[str, Path]]:
    """The run folder's own files that are synced (not checkpoints/, not hidden or temporary ones)."""
    return sorted(
        (p.name, p) for p in Path(run_dir).iterdir() if p.is_file() and not _NOT_SYNCED.search(p.name)
    )


def push_run_files(run_dir: Path) -> None:
    """Copy the run's files (config.yaml, metrics.csv, ...) to its remote folder, each one object."""
    url = remote_of(run_dir)
    if url is None:
        return
    fs = filesystem(url, "runs_dir")
    for name, path in run_files(run_dir):
        fs.put_file(str(path), f"{url}/{name}")


def push_checkpoint(run_dir: Path, ckpt: Path, step: int, keep: int | None) -> str | None:
    """Upload a published checkpoint of a staged run as <run>/checkpoints/step-NNNNNN/ (COMPLETE last), after
    the run's files; then only the newest `keep` complete ones stay (None: all). Returns its URL (None: a
    local run)."""
    url = remote_of(run_dir)
    if url is None:
        return None
    fs = filesystem(url, "runs_dir")
    push_run_files(run_dir)
    ckpt = Path(ckpt)
    name = f"step-{step:06d}"
    folder = f"{url}/{CHECKPOINTS}/{name}"
    files = [(f"{name}.ckpt/{n}" if ckpt.is_dir() else f"{name}.ckpt", p) for n, p in _files(ckpt)]
    upload(fs, files, folder)
    if keep is not None:
        steps = complete_steps(fs, url)
        for old in steps[: max(0, len(steps) - max(1, keep))]:
            _remove(fs, f"{url}/{CHECKPOINTS}/step-{old:06d}")
    return folder


def complete_steps(fs: Any, url: str) -> list[int]:
    """The steps of a remote run's checkpoints whose COMPLETE is there, oldest first."""
    try:
        found = fs.ls(f"{url}/{CHECKPOINTS}", detail=False)
    except FileNotFoundError:
        return []
    steps = []
    for entry in found:
        m = STEP_FOLDER.fullmatch(PurePosixPath(entry).name)
        if m and fs.exists(f"{entry}/{COMPLETE}"):
            steps.append(int(m.group(1)))
    return sorted(steps)


def fetch_run(url: str, key: str = "resume") -> Path:
    """A remote run in its staging folder: its files and its newest complete checkpoint whose files match
    the manifest (a damaged one is skipped with a note), that checkpoint as checkpoints/step-NNNNNN.ckpt and
    checkpoints/last.ckpt. One line when there is none."""
    fs = filesystem(url, key)
    bucket, path = split_url(url, key)
    if not path:
        raise ConfigError(f"{key}={url} names a bucket; give the run's folder: s3://{bucket}/<prefix>/<run>")
    dest = staging_of(url, key)
    steps = complete_steps(fs, url)
    if not steps:
        raise GptkitError(
            f"{key}={url}: no complete checkpoint there (none of {url}/{CHECKPOINTS}/step-*/ has "
            f"{COMPLETE}); train first, or give the run's folder"
        )
    with _locked(dest):
        for name in fs.ls(url, detail=False):
            rel = PurePosixPath(name).name
            if rel not in (CHECKPOINTS,) and fs.isfile(name) and not _NOT_SYNCED.search(rel):
                tmp = dest / f".{rel}.download.tmp"
                fs.get_file(name, str(tmp))
                os.replace(tmp, dest / rel)
        for step in reversed(steps):
            folder = f"{url}/{CHECKPOINTS}/step-{step:06d}"
            manifest = complete_manifest(fs, folder)
            if manifest is None:
                continue
            try:
                download(fs, folder, manifest, dest / CHECKPOINTS)
            except GptkitError as exc:
                print(f"note: {exc}; the checkpoint before it is taken", file=sys.stderr)
                continue
            _point_last(dest / CHECKPOINTS, dest / CHECKPOINTS / f"step-{step:06d}.ckpt")
            return dest
    raise GptkitError(
        f"{key}={url}: no checkpoint there matches its manifest; the bucket's copies are damaged"
    )


def _point_last(ckpt_dir: Path, ckpt: Path) -> None:
    """checkpoints/last.ckpt: the downloaded checkpoint, hard-linked (a copy where links fail)."""
    last = ckpt_dir / "last.ckpt"
    tmp = ckpt_dir / ".last.ckpt.download.tmp"
    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    if ckpt.is_dir():
        shutil.copytree(ckpt, tmp, copy_function=_link_or_copy)
        if last.is_dir():
            shutil.rmtree(last)
        os.replace(tmp, last)
        return
    _link_or_copy(ckpt, tmp)
    os.replace(tmp, last)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# ---- the command line: s3:// values made local before the verb parses them -----------------------------
# what a key's s3:// value becomes: a runs folder (train runs_dir=), a run downloaded (resume=, run=), a
# published folder downloaded (data.dir=, hf=), or a staging folder the verb fills and uploads afterwards
# (out=, cache_dir=)
KINDS = ("runs_dir", "run", "folder", "staging")


def localize_args(args: list[str], keys: dict[str, str]) -> list[str]:
    """The command line with each s3:// value of `keys` (key -> one of KINDS) replaced by its local folder
    (checked, downloaded or emptied as its kind says); every other argument as it is. The errors (the `s3`
    extra, credentials, a missing bucket, nothing complete there) are one line each."""
    out = []
    for a in args:
        key, sep, value = a.partition("=")
        kind = keys.get(key.lstrip("+")) if sep else None
        if kind is None or not is_remote(value):
            out.append(a)
            continue
        if kind == "runs_dir":
            local = staging_runs_dir(value, key)
        elif kind == "run":
            local = fetch_run(value, key)
        elif kind == "folder":
            local = fetch_folder(value, key)
        else:
            filesystem(value, key)
            local = staging_of(value, key)
            # a staging folder of an earlier upload: the verb writes it anew; never a run's
            if key.lstrip("+") == "out" and local.exists():
                if (local / "config.yaml").exists() or (local / CHECKPOINTS).exists():
                    raise ConfigError(
                        f"{key}={value} is where a run is kept (its staging folder {local} holds one); "
                        f"choose another {key.lstrip('+')}="
                    )
                shutil.rmtree(local)
        out.append(f"{key}={local}")
    return out
