"""Checkpoint files: finding, verifying, loading (safely), checking against a config, and writing them
atomically, single-file or sharded (FSDP2, torch.distributed.checkpoint folders).

    <run>/checkpoints/last.ckpt          a Lightning checkpoint: {"state_dict": {"model.<name>": tensor}, ...}
    <run>/checkpoints/step-000500.ckpt   periodic checkpoints
    <run>/checkpoints/last.ckpt/         a sharded checkpoint: .metadata (the index), one file per rank,
                                         meta.pt (Lightning's non-tensor state: step, loops, callbacks),
                                         checksums.json (the CRC-32 of every other file, written last)

Checkpoints are loaded with `torch.load(..., weights_only=True)` or from safetensors, and a sharded
index is unpickled by an allow-list: a checkpoint file can never run code. Before a checkpoint is
loaded its content is checked against the checksums written with it (once per process): a
single-file checkpoint is a zip archive whose every record carries the CRC-32 torch.save computed
(so checkpoints of every gptkit version are checked), a sharded folder has checksums.json. A
mismatch is a one-line GptkitError naming the file. Nothing here knows about Lightning's
strategies or the verbs; `gptkit.runs` (run folders) and `gptkit.training` build on it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

from gptkit import adapters, quant
from gptkit.errors import GptkitError
from gptkit.faults import fault_point
from gptkit.fsio import (
    CHUNK,
    atomic_write_text,
    confined,
    crc32_of,
    disk_full_error,
    file_crc32,
    is_disk_full,
    locked_temp,
)

# torch and safetensors are imported inside the functions: commands/train.py imports this module (via
# training/fit.py) to check the command line, a one-line error in ~0.4 s of CPU (docs/layout.md).

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
# LightningModule attribute holding the GPT
STATE_PREFIX = "model."
# marks a sharded (torch.distributed.checkpoint) checkpoint folder
SHARDED_INDEX = ".metadata"
# Lightning's non-tensor state (step, loops, callbacks) beside the shards
EXTRA_STATE = "meta.pt"
# a sharded folder's {"crc32": {file: crc}}, written after every shard
CHECKSUMS = "checksums.json"
# .<name>.<...> leftovers of a write that was killed
STALE_SUFFIXES = (".tmp", ".pending", ".old")


# ---- writing -------------------------------------------------------------------------------------
def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def atomic_torch_save(obj: Any, path: Path | str) -> None:
    """torch.save to a temporary file beside `path`, fsync, rename. A full disk is a one-line GptkitError
    naming the file and the space it needs; `path` is left as it was either way."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # locked while written: remove_dead_temps leaves it alone
    lock, tmp = locked_temp(path)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        fault_point("ckpt-tmp")
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path, _tensor_bytes(obj), exc) from exc
        raise
    finally:
        os.close(lock)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file or sharded checkpoint folder (nothing if absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_checkpoint(src: Path, dst: Path) -> None:
    """Rename the complete checkpoint `src` (file or sharded folder) to `dst`, replacing what is there.
    A file replaces a file atomically; a folder (or a change between file and folder) is swapped through
    .<dst>.old, so a kill leaves either the old or the new checkpoint at `dst` plus a leftover that the
    next run removes (remove_stale)."""
    src, dst = Path(src), Path(dst)
    if (dst.is_dir() and not dst.is_symlink()) or (src.is_dir() and dst.exists()):
        old = dst.with_name(f".{dst.name}.old")
        remove_checkpoint(old)
        os.replace(dst, old)
        os.replace(src, dst)
        remove_checkpoint(old)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


def link_checkpoint(src: Path, dst: Path) -> None:
    """Make `dst` the same checkpoint as `src` without writing it again: a hard link (a folder of hard
    links for a sharded checkpoint), or a copy where the filesystem has no hard links; then swapped in
    with replace_checkpoint."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.link.tmp")
    remove_checkpoint(tmp)
    try:
        if src.is_dir():
            shutil.copytree(src, tmp, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, tmp)
        replace_checkpoint(tmp, dst)
    except BaseException as exc:
        remove_checkpoint(tmp)
        if is_disk_full(exc):
            raise disk_full_error(dst, _size(src), exc) from exc
        raise


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    # no hard links here (or across filesystems): a real copy
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def remove_stale(folder: Path | str) -> list[Path]:
    """Remove the leftovers of writes that were killed (.<name>.<...>.tmp/.pending/.old files and folders)
    from a checkpoint folder; only its owner (the process holding the run's lock) may call this."""
    folder = Path(folder)
    gone = [p for p in folder.glob(".*") if p.name.endswith(STALE_SUFFIXES)] if folder.is_dir() else []
    for p in gone:
        remove_checkpoint(p)
    return gone


# ---- verifying -----------------------------------------------------------------------------------
_verified: set[tuple] = set()


def _corrupted(path: Path, what: str) -> GptkitError:
    """The one line for a checkpoint whose bytes differ from their checksum. last.ckpt is a hard link to the
    newest step-N.ckpt, so the advice names only the run's other checkpoints that are not the same file."""
    same, others = _checkpoint_copies(path)
    alias = f" ({', '.join(p.name for p in same)}: the same file, corrupted too)" if same else ""
    newest = ", ".join(str(p) for p in others[-2:][::-1])
    advice = (
        f"take an earlier checkpoint of the run ({newest})"
        if others
        else "the run has no other checkpoint: train again"
    )
    return GptkitError(
        f"{path} is corrupted ({what} does not match the checksum written with it){alias}; do "
        f"not use it: {advice}"
    )


def _checkpoint_copies(path: Path) -> tuple[list[Path], list[Path]]:
    """(the checkpoints beside `path` that are hard links to it, the other ones, oldest first)."""
    try:
        me = path.stat()
    except OSError:
        return [], []
    same, others = [], []
    for p in sorted(path.parent.glob("*.ckpt")) if path.parent.name == CHECKPOINT_DIR else []:
        if p.name == path.name:
            continue
        st = p.stat()
        (same if (st.st_ino, st.st_dev) == (me.st_ino, me.st_dev) else others).append(p)
    # last.ckpt the newest
    return same, sorted(others, key=lambda p: p.name == LAST_CHECKPOINT)


def _identity(path: Path) -> tuple:
    """What makes a file version: its inode, size and mtime (every file's, for a sharded folder)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return str(path.resolve()), tuple(
        (f.name, (st := f.stat()).st_ino, st.st_size, st.st_mtime_ns) for f in files
    )


def verify_checkpoint(path: Path | str, part: tuple[int, int] = (0, 1), only: str | None = None) -> None:
    """Check a checkpoint's bytes against the checksums written with it; a one-line GptkitError naming the
    file when they differ. Each file version is checked once per process. For a sharded folder,
    part=(rank, world) checks only this rank's share of its files (every rank checks a share), only=<name>
    only that file."""
    path = Path(path)
    if not path.exists() or path.suffix == ".safetensors":
        return
    if path.is_dir() and not (path / CHECKSUMS).is_file():
        if is_sharded_checkpoint(path):
            print(
                f"note: {path} has no {CHECKSUMS} (written by an older gptkit); loaded without a check",
                file=sys.stderr,
            )
        return
    ident = _identity(path)
    if (*ident, part, only) in _verified or (*ident, (0, 1), None) in _verified:
        return
    if path.is_dir():
        _verify_folder(path, part, only)
    else:
        _verify_zip(path)
    _verified.add((*ident, part, only))


def _verify_zip(path: Path) -> None:
    """Every record of a torch.save zip archive against the CRC-32 in its central directory."""
    buf = memoryview(bytearray(CHUNK))
    with open(path, "rb") as f:
        try:
            records = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, OSError, ValueError):
            # not a zip archive at all: torch.load says what it is
            return
        for r in records:
            # saved with torch's compute_crc32 off: nothing to check against
            if r.CRC == 0 and r.file_size:
                continue
            f.seek(r.header_offset)
            head = f.read(30)
            # torch names the archive's folder after the file
            record = r.filename.split("/", 1)[-1]
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise _corrupted(path, f"the header of record {record}")
            n_name, n_extra = struct.unpack("<HH", head[26:30])
            if f.read(n_name) != r.filename.encode():
                raise _corrupted(path, f"the header of record {record}")
            f.seek(n_extra, 1)
            # torch stores records; zipfile checks others itself
            if r.compress_type != zipfile.ZIP_STORED:
                try:
                    with zipfile.ZipFile(path).open(r) as z:
                        while z.read(CHUNK):
                            pass
                except zipfile.BadZipFile:
                    raise _corrupted(path, f"record {record}") from None
                continue
            if crc32_of(f, r.compress_size, buf) != r.CRC:
                raise _corrupted(path, f"record {record}")


def _verify_folder(path: Path, part: tuple[int, int], only: str | None) -> None:
    rank, world = part
    try:
        sums = json.loads((path / CHECKSUMS).read_text())["crc32"]
    except (ValueError, KeyError, TypeError):
        raise _corrupted(path, CHECKSUMS) from None
    for i, (name, crc) in enumerate(sorted(sums.items())):
        if i % world != rank or only not in (None, name):
            continue
        f = path / name
        if not f.is_file() or file_crc32(f) != crc:
            raise _corrupted(path, name)


def write_checksums(folder: Path | str, crcs: dict[str, str] | None = None) -> None:
    """checksums.json of a sharded folder, written after every other file: `crcs` as the writers computed
    them (each rank its own shards), completed with the CRC-32 of any file they did not cover."""
    folder = Path(folder)
    crcs = dict(crcs or {})
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name != CHECKSUMS and f.name not in crcs:
            crcs[f.name] = file_crc32(f)
    atomic_write_text(folder / CHECKSUMS, json.dumps({"crc32": crcs}, indent=1, sort_keys=True))


# ---- finding and reading -------------------------------------------------------------------------
def find_checkpoint(path: Path | str) -> Path:
    """The checkpoint of a run folder (checkpoints/last.ckpt, else the newest), or `path` itself when it
    is a checkpoint file or a sharded checkpoint folder. (`run=latest` is resolved by gptkit.runs.)"""
    p = Path(path).expanduser()
    if not p.exists():
        raise GptkitError(f"{p} does not exist; pass a run folder (runs/<name>) or a checkpoint file")
    if p.is_file() or is_sharded_checkpoint(p):
        return p
    ckdir = p / CHECKPOINT_DIR
    if (ckdir / LAST_CHECKPOINT).exists():
        return ckdir / LAST_CHECKPOINT
    found = sorted(ckdir.glob("*.ckpt"), key=lambda f: f.stat().st_mtime) if ckdir.is_dir() else []
    if found:
        return found[-1]
    if (p / "model.safetensors").is_file():
        return p / "model.safetensors"
    raise GptkitError(
        f"no checkpoint in {p} (looked for {CHECKPOINT_DIR}/*.ckpt and model.safetensors); "
        f"train first or pass a checkpoint file"
    )


def run_dir_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint belongs to."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINT_DIR else checkpoint.parent


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    """The whole checkpoint dict, loaded safely. One-line GptkitError if it is not a checkpoint."""
    import torch

    path = Path(path)
    # a sharded (FSDP) checkpoint folder: consolidated in memory
    if path.is_dir():
        return read_sharded_checkpoint(path)
    if path.suffix == ".safetensors":
        return {"state_dict": {STATE_PREFIX + k: v for k, v in _load_safetensors(path).items()}}

    if path.is_file() and path.stat().st_size == 0:
        raise GptkitError(
            f"{path} is empty (0 bytes), not a checkpoint (an interrupted copy?); use another one"
        )
    verify_checkpoint(path)
    try:
        # torch.save's zip archive is memory-mapped (tensors read on use); an older torch's format is not
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    # truncated, not a zip, pickled code, ...
    except Exception as exc:
        raise unreadable_checkpoint(path, exc) from exc
    if not isinstance(obj, dict) or "state_dict" not in obj:
        raise GptkitError(f"{path} is not a gptkit checkpoint (no 'state_dict' in it)")
    return _fused(obj)


def _fused(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel run's checkpoint (trainer.tensor_parallel) in the layout every reader expects: its
    q, k, v projections fused back into each qkv_proj (gptkit.model.mha.fuse_qkv_state)."""
    from gptkit.model.mha import fuse_qkv_state

    checkpoint["state_dict"] = fuse_qkv_state(checkpoint["state_dict"])
    return checkpoint


def _fused_optim(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name in the one-process layout (q, k, v fused, as _fused fuses
    the weights: gptkit.model.mha.fuse_qkv_optim_state)."""
    from gptkit.model.mha import fuse_qkv_optim_state

    return fuse_qkv_optim_state(osd)


def unreadable_checkpoint(path: Path, exc: Exception) -> GptkitError:
    """One complete line for a file torch.load(weights_only=True) refused."""
    return GptkitError(f"{path} {load_refusal(path, exc)}; use a checkpoint you trust")


def load_refusal(path: Path, exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused `path`, as one complete phrase: the code it would run,
    another kind of file, or torch's own first sentence."""
    text = str(exc)
    code = re.search(r"GLOBAL ([\w.]+)", text)
    if code:
        return (
            f"would run code when loaded ({code.group(1)}), which weights_only=True refuses: a "
            f"checkpoint holds only tensors and plain data"
        )
    if isinstance(exc, (pickle.UnpicklingError, EOFError)) or not zipfile.is_zipfile(path):
        return (
            "is not a torch checkpoint (not the zip archive torch.save writes: truncated, or another "
            "kind of file)"
        )
    first = re.split(r"(?<=[.!?])\s", " ".join(text.split()), maxsplit=1)[0] if text.strip() else ""
    return f"is not a readable checkpoint ({type(exc).__name__}{': ' + first if first else ''})"


def checkpoint_step(path: Path | str) -> int:
    """The global step a checkpoint (file or sharded folder) was saved at, without reading its tensors."""
    path = Path(path)
    state = read_sharded_checkpoint(path, weights=False) if path.is_dir() else load_checkpoint(path)
    return int(state.get("global_step", 0))


# written by transformers or `import`: no checksum
def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:
        raise GptkitError(f"{path} is not a readable safetensors file ({exc})") from exc


def model_state_dict(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The GPT's own state dict (the `model.` prefix of the LightningModule removed)."""
    sd = checkpoint["state_dict"]
    return {k[len(STATE_PREFIX) :]: v for k, v in sd.items() if k.startswith(STATE_PREFIX)}


def lora_base(checkpoint: dict[str, Any], where: Path | str) -> Path:
    """The base checkpoint a LoRA run's checkpoint (`checkpoint`, read from `where`) adapts, as recorded when
    the run started: it must still be there with the same content (its fingerprint), else a one-line
    GptkitError."""
    record = checkpoint[adapters.CHECKPOINT_KEY]
    base = Path(record["base"])
    if not base.exists():
        raise GptkitError(
            f"{where} holds LoRA adapters of the base checkpoint {base}, which is gone; put "
            f"that checkpoint back where it was (the adapters alone are not a model)"
        )
    if adapters.fingerprint(base) != record["base_fingerprint"]:
        raise GptkitError(
            f"{where} holds LoRA adapters of {base}, whose content changed since the LoRA run "
            f"started (fingerprint {record['base_fingerprint']}); restore that checkpoint (the "
            f"adapters only fit the weights they were trained on)"
        )
    return base


def checked_model_state(ckpt_path: Path, model_cfg, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The GPT state dict of a checkpoint (tensors memory-mapped), checked against model_cfg: the same
    names and shapes, else a one-line GptkitError. A LoRA run's checkpoint (adapters only) gives its base's
    weights with the adapters merged in (gptkit.adapters.merge); a QLoRA run's, its base's block projections
    through the NF4 round trip it trained on (gptkit.quant.nf4_round_trip), then merged. `optional`: tensors
    of model_cfg's model the checkpoint may lack (a score head that init_from= of objective=reward adds)."""
    import torch

    from gptkit.model import GPT

    checkpoint = load_checkpoint(ckpt_path)
    if adapters.CHECKPOINT_KEY in checkpoint:
        record = checkpoint[adapters.CHECKPOINT_KEY]
        # a reward model's score head trains in full beside the adapters: its base (a policy) may lack it
        whole = adapters.whole_keys(model_cfg)
        base = checked_model_state(lora_base(checkpoint, ckpt_path), model_cfg, (*optional, *whole))
        # finetune=qlora: the adapters trained on dequantize(NF4(W)), which is what they merge into
        q = record.get("quantized")
        if q is not None:
            base = quant.nf4_round_trip(
                base, model_cfg, int(q["block_size"]), q["scaler_block_size"], str(q["dtype"])
            )
        state = model_state_dict(checkpoint)
        adapters.check_adapters(state, model_cfg, record, str(ckpt_path))
        return adapters.merge({**base, **state}, model_cfg, float(record["alpha"]) / int(record["rank"]))
    state = model_state_dict(checkpoint)
    with torch.device("meta"):
        expected = GPT(model_cfg).state_dict()
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise GptkitError(
            f"{ckpt_path} does not match its config ({run_dir_of(ckpt_path) / 'config.yaml'}): "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for k, v in expected.items():
        if k in state and tuple(v.shape) != tuple(state[k].shape):
            raise GptkitError(
                f"{ckpt_path} does not match its config "
                f"({run_dir_of(ckpt_path) / 'config.yaml'}): "
                f"{k} has shape {tuple(state[k].shape)}, "
                f"the config needs {tuple(v.shape)}"
            )
    return state


# ---- sharded checkpoints -------------------------------------------------------------------------
def is_sharded_checkpoint(path: Path | str) -> bool:
    p = Path(path)
    return p.is_dir() and (p / SHARDED_INDEX).is_file()


UNREADABLE_INDEX = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError)


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch.distributed.checkpoint index: its own dataclasses, torch sizes and dtypes,
    nothing that can run code."""

    ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    ALLOWED = {
        ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }

    def find_class(self, module: str, name: str):
        import torch

        if module.startswith(self.ALLOWED_PREFIXES):
            import dataclasses
            import enum

            found = super().find_class(module, name)
            # data only: the index's dataclasses and enums; a function (callable by REDUCE) is refused
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def safe_reader(path: Path):
    """A FileSystemReader whose index is read with _SafeUnpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            index = Path(self.path) / SHARDED_INDEX
            try:
                with open(index, "rb") as f:
                    metadata = _SafeUnpickler(f).load()
            except UNREADABLE_INDEX as exc:
                raise GptkitError(
                    f"{index} is not a readable checkpoint index ({str(exc)[:160]}); "
                    f"use a checkpoint you trust"
                ) from None
            # each shard a file inside
            for info in (getattr(metadata, "storage_data", None) or {}).values():
                confined(self.path, getattr(info, "relative_path", ""), index, links=True)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def safe_planner(distributed: bool):
    """A load planner that reads non-tensor values with torch.load(weights_only=True): into the given
    (sharded) state when `distributed`, else into an empty dict that takes everything (consolidation)."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

    class SafePlanner(DefaultLoadPlanner if distributed else _EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def read_sharded_checkpoint(path: Path | str, weights: bool = True) -> dict[str, Any]:
    """A sharded checkpoint folder as one Lightning checkpoint dict, in this process (no process group):
    {"state_dict": {"model.<name>": full tensor}, "optimizer_states": [torch-style, keyed by parameter
    index], "global_step": ..., ...}. weights=False reads only the small non-tensor state."""
    import torch

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise GptkitError(f"{path} is not a sharded checkpoint folder (no {SHARDED_INDEX} in it)")
    verify_checkpoint(path, only=None if weights else EXTRA_STATE)
    try:
        extra = torch.load(path / EXTRA_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise unreadable_checkpoint(path / EXTRA_STATE, exc) from exc
    if not weights:
        return extra
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    from torch.distributed.checkpoint.api import CheckpointException

    # a bad index is one line here, not a traceback logged by torch
    safe_reader(path).read_metadata()
    try:
        _load_state_dict(
            state, storage_reader=safe_reader(path), planner=safe_planner(distributed=False), no_dist=True
        )
    # CheckpointException is a BaseException
    except (Exception, CheckpointException) as exc:
        raise sharded_refusal(path, exc) from None
    if "state_dict" not in state:
        raise GptkitError(f"{path} is not a gptkit checkpoint (no 'state_dict' in it)")
    out = dict(extra)
    out["state_dict"] = state.pop("state_dict")
    optimizers = sorted(k for k in state if k.startswith("optimizer_"))
    out["optimizer_states"] = [_by_param_index(_fused_optim(state[k])) for k in optimizers]
    return _fused(out)


def sharded_refusal(path: Path, exc: BaseException) -> GptkitError:
    """One line for a sharded folder torch.distributed.checkpoint could not read: the first rank's own error
    (a CheckpointException wraps each rank's), a GptkitError as it is."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        # (exception, its stack summary)
        exc = first[0] if isinstance(first, tuple) and first else first
    if isinstance(exc, GptkitError):
        return exc
    text = " ".join(str(exc).split())
    cut = isinstance(exc, (EOFError, pickle.UnpicklingError))
    if cut or "PytorchStreamReader" in text or "zip archive" in text:
        why = "a shard is truncated or not what torch.save writes"
    else:
        why = f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
    return GptkitError(
        f"{path} is not a readable sharded checkpoint ({why}); use another checkpoint of the "
        f"run (checkpoints/step-*.ckpt) or train again"
    )


def _by_param_index(osd: dict[str, Any]) -> dict[str, Any]:
    """torch.distributed.checkpoint keys optimizer state by parameter name; torch.optim (and a
    single-device or DDP resume) keys it by the parameter's index across the param groups."""
    names = [n for g in osd["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in osd["param_groups"]]
    return {"state": {index[n]: s for n, s in osd.get("state", {}).items()}, "param_groups": groups}


def consolidate(path: Path | str, out: Path | str | None = None) -> Path:
    """Write a sharded checkpoint folder as one file (atomically); default: <folder>.consolidated.ckpt
    beside it. The file resumes, samples, evaluates and exports like any single-device checkpoint."""
    path = Path(path)
    target = Path(out) if out else path.with_name(path.stem + ".consolidated.ckpt")
    atomic_torch_save(read_sharded_checkpoint(path), target)
    return target
