"""Run folders: what `train` writes and what `sample`, `eval`, `export` and `resume` read.

    runs/<name>/
      config.yaml          the resolved config of the run (the `model` section builds the model)
      tokenizer.json       the exact tokenizer used for training (HF `tokenizers` format)
      manifest.json        the data manifest (when trained by gptkit)
      checkpoints/
        last.ckpt          the newest checkpoint (a Lightning checkpoint: {"state_dict": {"model.<name>": tensor}, ...})
        step-000500.ckpt   periodic checkpoints
      metrics.csv, loss.png, ...

Checkpoints are loaded with `torch.load(..., weights_only=True)` (or from safetensors): a checkpoint
file can never run code. Everything a user keeps is written to a temporary name and renamed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gptkit.errors import GptkitError

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
STATE_PREFIX = "model."  # LightningModule attribute holding the GPT
SHARDED_INDEX = ".metadata"  # marks a sharded (torch.distributed.checkpoint) checkpoint folder


# ---- atomic writes -------------------------------------------------------------------------------
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temporary file in path's folder (so the final rename is atomic), with normal permissions."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~_umask())
    return fd, tmp


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
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


def atomic_torch_save(obj: Any, path: Path | str) -> None:
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- finding and reading -------------------------------------------------------------------------
LATEST = "latest"  # run=latest: the most recently written run folder under ./runs


def resolve_latest(path: Path | str, runs_dir: Path | str = "runs") -> Path:
    """`latest` means the run folder under runs_dir whose config.yaml was written last (multirun
    job folders included); any other path is returned as it is."""
    if str(path) != LATEST:
        return Path(path).expanduser()
    root = Path(runs_dir)
    configs = [f for pattern in (f"*/{CONFIG_FILE}", f"*/*/{CONFIG_FILE}") for f in root.glob(pattern)
               if not any(part.startswith(".") for part in f.relative_to(root).parts)]  # not Hydra's .hydra/
    if not configs:
        raise GptkitError(f"`latest` found no run folder under {runs_dir}/; train first or give a run folder")
    return max(configs, key=lambda f: f.stat().st_mtime).parent


def find_checkpoint(path: Path | str) -> Path:
    """A checkpoint file from a run folder (checkpoints/last.ckpt, else the newest) or a file path;
    `latest` is the newest run folder under ./runs."""
    p = resolve_latest(path)
    if not p.exists():
        raise GptkitError(f"{p} does not exist; pass a run folder (runs/<name>) or a checkpoint file")
    if p.is_file() or (p / SHARDED_INDEX).is_file():  # a file, or a sharded (FSDP) checkpoint folder
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
        from gptkit.training.distributed import read_sharded_checkpoint

        return read_sharded_checkpoint(path)
    if path.suffix == ".safetensors":
        return {"state_dict": {STATE_PREFIX + k: v for k, v in _load_safetensors(path).items()}}
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors read on use
    except Exception as exc:  # truncated, not a zip, pickled code, ...
        raise GptkitError(f"{path} is not a readable gptkit checkpoint ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]})") from exc
    if not isinstance(obj, dict) or "state_dict" not in obj:
        raise GptkitError(f"{path} is not a gptkit checkpoint (no 'state_dict' in it)")
    return obj


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


def read_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    f = Path(run_dir) / CONFIG_FILE
    if not f.is_file():
        if (Path(run_dir) / "config.json").is_file():
            raise GptkitError(f"{run_dir} is a transformers folder, not a run folder; make it one first: "
                              f"gptkit import hf={run_dir} out=runs/<name>")
        raise GptkitError(f"{f} is missing; a run folder needs the {CONFIG_FILE} that `gptkit train` writes")
    try:
        cfg = yaml.safe_load(f.read_text())
    except yaml.YAMLError as exc:
        raise GptkitError(f"{f} is not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise GptkitError(f"{f} has no `model` section")
    return cfg


@dataclass
class Run:
    dir: Path
    checkpoint: Path
    config: dict[str, Any]  # the resolved run config (plain dict)
    model_cfg: Any  # ModelConfig
    model: Any  # GPT, eval mode, on the requested device and dtype
    tokenizer: Any  # tokenizers.Tokenizer


def load_tokenizer(run_dir: Path):
    from tokenizers import Tokenizer

    f = Path(run_dir) / TOKENIZER_FILE
    if not f.is_file():
        raise GptkitError(f"{f} is missing; the run folder must hold the training tokenizer")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:
        raise GptkitError(f"{f} is not a valid tokenizer.json ({str(exc)[:160]})") from exc


def load_run(path: Path | str, device: str = "cpu", dtype: str | None = None, attention: str | None = None) -> Run:
    """Load config, tokenizer and weights of a run folder (or of the run a checkpoint belongs to)."""
    run_dir, ckpt_path, cfg, model_cfg, model = load_model(path, device, dtype, attention)
    return Run(run_dir, ckpt_path, cfg, model_cfg, model, load_tokenizer(run_dir))


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


def load_model(path: Path | str, device: str = "cpu", dtype: str | None = None, attention: str | None = None):
    """load_run without the tokenizer: (run_dir, checkpoint, config, model_cfg, model), the model in eval mode."""
    import torch

    from gptkit.model import GPT, ModelConfig

    path = resolve_latest(path)
    ckpt_path = find_checkpoint(path)
    run_dir = run_dir_of(ckpt_path) if ckpt_path == path else path  # a checkpoint given
    cfg = read_config(run_dir)
    mdict = dict(cfg["model"])
    if attention:
        mdict["attention"] = attention
    model_cfg = ModelConfig.from_dict(mdict)
    state = checked_model_state(ckpt_path, model_cfg)
    with torch.device("meta"):
        model = GPT(model_cfg)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    if model_cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    if dtype:
        model = model.to(dtype=_torch_dtype(dtype))
    model.eval()
    return run_dir, ckpt_path, cfg, model_cfg, model


def _torch_dtype(name: str):
    import torch

    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise GptkitError(f"dtype={name!r} is not one of fp32, bf16, fp16")
    return table[name]


def write_run_folder(run_dir: Path | str, config: dict[str, Any], model, tokenizer=None,
                     manifest: dict[str, Any] | None = None) -> Path:
    """Write a minimal complete run folder (config, tokenizer, checkpoints/last.ckpt) for `model`.

    Used by `import` and by tests; `train` writes the same layout through Lightning.
    """
    import json

    import yaml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    config["model"] = model.cfg.to_dict()
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
    if tokenizer is not None:
        atomic_write_text(run_dir / TOKENIZER_FILE, tokenizer.to_str())
    if manifest is not None:
        atomic_write_text(run_dir / MANIFEST_FILE, json.dumps(manifest, indent=2))
    state = {STATE_PREFIX + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    atomic_torch_save({"state_dict": state, "global_step": 0}, run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT)
    return run_dir


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is present, else cpu; a GPU asked for but absent is a GptkitError."""
    import torch

    device = str(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptkitError(f"device={device} but no CUDA GPU is visible; use device=cpu (or auto)")
    if device != "cpu" and not device.startswith(("cuda", "mps")):
        raise GptkitError(f"device={device!r} is not one of auto, cpu, cuda, cuda:<n>")
    return device


def load_for_inference(path: Path | str, device: str = "auto", dtype: str = "fp32",
                       attention: str | None = None) -> Run:
    """load_run for sample/eval/attention, with device `auto` allowed (RotaryEmbedding keeps its
    cos/sin tables in fp32 whatever dtype the model is cast to)."""
    dev = resolve_device(device)
    torch_dtype = _torch_dtype(str(dtype))
    run = load_run(path, dev, None, attention)
    run.model.to(dtype=torch_dtype)
    return run


def check_out_dir(out: Path | str, force: bool = False) -> Path:
    """`out` as a Path if a command may write a folder there: new, empty, or force=True."""
    out = Path(out)
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise GptkitError(f"{out} already exists and is not empty; choose another out= or pass force=true to replace it")
    return out


@contextmanager
def staged_dir(out: Path | str, force: bool = False) -> Iterator[Path]:
    """Write a whole folder atomically: yields a temporary folder next to `out`, renamed to `out` when
    the block succeeds and removed when it fails, so `out` is never left half-written. A non-empty
    `out` is refused unless force=True (then it is replaced, only after the new folder is complete)."""
    out = check_out_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
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
