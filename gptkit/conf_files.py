"""Where gptkit's YAML presets live, and a preset's defaults as a plain dict.

conf/ is the one place a default is written: code that takes a partial config from Python (a dict with a
`kind` and a few keys) fills it from the preset of that kind here, so that it means the same corpus or
tokenizer, and the same cache key, as the composed YAML.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from gptkit.errors import ConfigError

# omegaconf is imported where a preset is read: tokenization workers import the data wing without it.


def conf_dir() -> Path:
    """The conf/ tree: the `gptkit_conf` data package (conf/ itself in an editable install)."""
    spec = importlib.util.find_spec("gptkit_conf")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    # a source checkout without install
    here = Path(__file__).resolve().parent.parent / "conf"
    if here.is_dir():
        return here
    raise ConfigError("cannot find gptkit's conf/ folder; reinstall gptkit (pip install -e .)")


@functools.cache
def _preset(group: str, name: str) -> dict[str, Any] | None:
    from omegaconf import OmegaConf

    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        return None
    d = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    d.pop("defaults", None)
    # a required value (`???`) has no default: None until the user gives one
    return {k: (None if v == "???" else v) for k, v in d.items()}


def preset_defaults(group: str, name: str) -> dict[str, Any] | None:
    """The keys conf/<group>/<name>.yaml sets (`???` as None), without `kind`; None when there is no such
    preset. A fresh copy each call (the caller may change it)."""
    d = _preset(group, name)
    if d is None:
        return None
    import copy

    return {k: copy.deepcopy(v) for k, v in d.items() if k != "kind"}
