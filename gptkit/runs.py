"""Run folders: what `train` writes and what `sample`, `eval`, `export` and `resume` read.

    runs/<name>/
      config.yaml          the resolved config of the run (the `model` section builds the model)
      tokenizer.json       the exact tokenizer used for training (HF `tokenizers` format)
      manifest.json        the data manifest (when trained by gptkit)
      checkpoints/         last.ckpt and periodic step-NNNNNN.ckpt (see gptkit.checkpoints)
      metrics.csv, loss.png, ...

`run=latest` means the run folder under ./runs whose config.yaml was written last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkit.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    STATE_PREFIX,
    atomic_torch_save,
    checked_model_state,
    find_checkpoint,
    run_dir_of,
)
from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_text
from gptkit.precision import torch_dtype

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"


# ---- finding and reading run folders ---------------------------------------------------------------
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


def find_run_checkpoint(path: Path | str, runs_dir: Path | str = "runs") -> Path:
    """The checkpoint a `run=` / `resume=` / `init_from=` value names: a run folder, a checkpoint file or
    sharded folder, or `latest`."""
    return find_checkpoint(resolve_latest(path, runs_dir))


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


def load_model(path: Path | str, device: str = "cpu", dtype: str | None = None, attention: str | None = None):
    """load_run without the tokenizer: (run_dir, checkpoint, config, model_cfg, model), the model in eval
    mode. The checkpoint's tensors are memory-mapped and copied once, into the model on `device`."""
    from gptkit.model import GPT, ModelConfig

    path = resolve_latest(path)
    ckpt_path = find_checkpoint(path)
    run_dir = run_dir_of(ckpt_path) if ckpt_path == path else path  # a checkpoint given
    cfg = read_config(run_dir)
    mdict = dict(cfg["model"])
    if attention:
        mdict["attention"] = attention
    model_cfg = ModelConfig.from_dict(mdict)
    model = GPT.from_state(model_cfg, checked_model_state(ckpt_path, model_cfg), device)
    if dtype:
        model = model.to(dtype=torch_dtype(dtype))
    return run_dir, ckpt_path, cfg, model_cfg, model


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
    return load_run(path, resolve_device(device), str(dtype), attention)


