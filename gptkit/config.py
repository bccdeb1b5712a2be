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


def compose(config_name: str, overrides: list[str]):
    """conf/<config_name>.yaml with `overrides`, composed by Hydra (no run folder, no logging set-up)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name=config_name):
        return hydra_compose(config_name=config_name, overrides=overrides)


def model_config(cfg: DictConfig | dict[str, Any]) -> ModelConfig:
    """The `model` group of a composed config as a validated ModelConfig."""
    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return ModelConfig.from_dict(d)


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def verbatim(args: list[str], keys: tuple[str, ...]) -> list[str]:
    """Quote the values of `keys` (a prompt, a text) so that Hydra takes them literally: commas, quotes,
    brackets, `=` and `${...}` included, unless the user quoted them already."""
    import re

    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key in keys and not (len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]):
            value = value.replace("${", "\\${")  # no OmegaConf interpolation
            # backslashes before a quote (or before the closing quote) are doubled, quotes escaped
            value = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
            a = f"{key}='{value}'"
        out.append(a)
    return out
