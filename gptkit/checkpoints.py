"""Checkpoint files: finding, loading (safely), checking against a config, and writing them atomically,
single-file or sharded (FSDP2, torch.distributed.checkpoint folders).

    <run>/checkpoints/last.ckpt          a Lightning checkpoint: {"state_dict": {"model.<name>": tensor}, ...}
    <run>/checkpoints/step-000500.ckpt   periodic checkpoints
    <run>/checkpoints/last.ckpt/         a sharded checkpoint: .metadata (the index), one file per rank,
                                         meta.pt (Lightning's non-tensor state: step, loops, callbacks)

Checkpoints are loaded with `torch.load(..., weights_only=True)` or from safetensors, and a sharded
index is unpickled by an allow-list: a checkpoint file can never run code. Nothing here knows about
Lightning's strategies or the verbs; `gptkit.runs` (run folders) and `gptkit.training` build on it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from gptkit.errors import GptkitError
from gptkit.fsio import temp_file_beside

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
STATE_PREFIX = "model."  # LightningModule attribute holding the GPT
SHARDED_INDEX = ".metadata"  # marks a sharded (torch.distributed.checkpoint) checkpoint folder
EXTRA_STATE = "meta.pt"  # Lightning's non-tensor state (step, loops, callbacks) beside the shards


# ---- writing -------------------------------------------------------------------------------------
def atomic_torch_save(obj: Any, path: Path | str) -> None:
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise



def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file or sharded checkpoint folder (nothing if absent)."""
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


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
    raise GptkitError(f"no checkpoint in {p} (looked for {CHECKPOINT_DIR}/*.ckpt and model.safetensors); "
                      f"train first or pass a checkpoint file")


def run_dir_of(checkpoint: Path) -> Path:
    """The run folder a checkpoint belongs to."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINT_DIR else checkpoint.parent


def load_checkpoint(path: Path | str) -> dict[str, Any]:
    """The whole checkpoint dict, loaded safely. One-line GptkitError if it is not a checkpoint."""
    import torch

    path = Path(path)
    if path.is_dir():  # a sharded (FSDP) checkpoint folder: consolidated in memory
        return read_sharded_checkpoint(path)
    if path.suffix == ".safetensors":
        return {"state_dict": {STATE_PREFIX + k: v for k, v in _load_safetensors(path).items()}}
    import zipfile

    if path.is_file() and path.stat().st_size == 0:
        raise GptkitError(f"{path} is empty (0 bytes), not a checkpoint (an interrupted copy?); use another one")
    try:
        # torch.save's zip archive is memory-mapped (tensors read on use); an older torch's format is not
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # truncated, not a zip, pickled code, ...
        raise unreadable_checkpoint(path, exc) from exc
    if not isinstance(obj, dict) or "state_dict" not in obj:
        raise GptkitError(f"{path} is not a gptkit checkpoint (no 'state_dict' in it)")
    return obj


def unreadable_checkpoint(path: Path, exc: Exception) -> GptkitError:
    """One complete line for a file torch.load(weights_only=True) refused."""
    return GptkitError(f"{path} {load_refusal(path, exc)}; use a checkpoint you trust")


def load_refusal(path: Path, exc: Exception) -> str:
    """Why torch.load(weights_only=True) refused `path`, as one complete phrase: the code it would run,
    another kind of file, or torch's own first sentence."""
    import pickle
    import re
    import zipfile

    text = str(exc)
    code = re.search(r"GLOBAL ([\w.]+)", text)
    if code:
        return (f"would run code when loaded ({code.group(1)}), which weights_only=True refuses: a checkpoint holds "
                f"only tensors and plain data")
    if isinstance(exc, (pickle.UnpicklingError, EOFError)) or not zipfile.is_zipfile(path):
        return "is not a torch checkpoint (not the zip archive torch.save writes: truncated, or another kind of file)"
    first = re.split(r"(?<=[.!?])\s", " ".join(text.split()), maxsplit=1)[0] if text.strip() else ""
    return f"is not a readable checkpoint ({type(exc).__name__}{': ' + first if first else ''})"


def _load_safetensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:
        raise GptkitError(f"{path} is not a readable safetensors file ({exc})") from exc


def model_state_dict(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The GPT's own state dict (the `model.` prefix of the LightningModule removed)."""
    sd = checkpoint["state_dict"]
    return {k[len(STATE_PREFIX):]: v for k, v in sd.items() if k.startswith(STATE_PREFIX)}


def checked_model_state(ckpt_path: Path, model_cfg) -> dict[str, Any]:
    """The GPT state dict of a checkpoint (tensors memory-mapped), checked against model_cfg: the same
    names and shapes, else a one-line GptkitError."""
    import torch

    from gptkit.model import GPT

    state = model_state_dict(load_checkpoint(ckpt_path))
    with torch.device("meta"):
        expected = GPT(model_cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise GptkitError(f"{ckpt_path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in expected.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise GptkitError(f"{ckpt_path} does not match its config: {k} has shape {tuple(state[k].shape)}, "
                              f"the config needs {tuple(v.shape)}")
    return state


# ---- sharded checkpoints -------------------------------------------------------------------------
def is_sharded_checkpoint(path: Path | str) -> bool:
    p = Path(path)
    return p.is_dir() and (p / SHARDED_INDEX).is_file()


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch.distributed.checkpoint index: its own dataclasses, torch sizes and dtypes,
    nothing that can run code."""

    ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}

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
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def safe_reader(path: Path):
    """A FileSystemReader whose index is read with _SafeUnpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            with open(Path(self.path) / SHARDED_INDEX, "rb") as f:
                metadata = _SafeUnpickler(f).load()
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
    try:
        extra = torch.load(path / EXTRA_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise unreadable_checkpoint(path / EXTRA_STATE, exc) from exc
    if not weights:
        return extra
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=safe_reader(path), planner=safe_planner(distributed=False),
                         no_dist=True)
    except Exception as exc:
        raise GptkitError(f"{path} is not a readable sharded checkpoint ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from exc
    if "state_dict" not in state:
        raise GptkitError(f"{path} is not a gptkit checkpoint (no 'state_dict' in it)")
    out = dict(extra)
    out["state_dict"] = state.pop("state_dict")
    optimizers = sorted(k for k in state if k.startswith("optimizer_"))
    out["optimizer_states"] = [_by_param_index(state[k]) for k in optimizers]
    return out


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
