"""Finding and composing the Hydra config tree, and turning its parts into typed configs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gptkit.errors import ConfigError
from gptkit.model.config import ModelConfig


def conf_dir() -> Path:
    """The conf/ tree: the `gptkit_conf` data package (conf/ itself in an editable install)."""
    spec = importlib.util.find_spec("gptkit_conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    here = Path(__file__).resolve().parent.parent / "conf"  # a source checkout without install
    if here.is_dir():
        return here
    raise ConfigError("cannot find gptkit's conf/ folder; reinstall gptkit (pip install -e .)")


def model_config(cfg: DictConfig | dict[str, Any]) -> ModelConfig:
    """The `model` group of a composed config as a validated ModelConfig."""
    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return ModelConfig.from_dict(d)


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
