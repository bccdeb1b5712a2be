"""Finding and composing the Hydra config tree, and turning its parts into typed configs."""

from __future__ import annotations

import math
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gptkit.conf_files import conf_dir
from gptkit.errors import ConfigError
from gptkit.model.config import ModelConfig

# hydra is imported on use: `gptkit --help` imports this module and needs no Hydra.


def model_config(cfg: DictConfig | dict[str, Any]) -> ModelConfig:
    """The `model` group of a composed config as a validated ModelConfig."""
    d = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return ModelConfig.from_dict(d)


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def verbatim(args: list[str], keys: tuple[str, ...]) -> list[str]:
    """Quote the values of `keys` (a prompt, a text) so that Hydra takes them literally: commas, quotes,
    brackets, `=` and `${...}` included, unless the user quoted them already."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key in keys and not (len(value) > 1 and value[0] in "'\"" and value[-1] == value[0]):
            # no OmegaConf interpolation
            value = value.replace("${", "\\${")
            # backslashes before a quote (or before the closing quote) are doubled, quotes escaped
            value = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
            a = f"{key}='{value}'"
        out.append(a)
    return out


def compose(config_name: str, overrides: list[str]) -> DictConfig:
    """The verb's config `config_name` (conf/<config_name>.yaml) with Hydra overrides applied."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name=config_name):
        return hydra_compose(config_name=config_name, overrides=overrides)


# ---- numbers given as options ----------------------------------------------------------------------
# B: billion, as token counts are written
SI = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
_COUNT = re.compile(r"([0-9][0-9_]*\.?[0-9_]*|\.[0-9]+)(e[+-]?[0-9]+)?\s*([kmbgtp])?", re.IGNORECASE)


def count(value: Any, option: str) -> float:
    """A positive count such as a number of tokens: 300000, 1.5e12, or with an SI suffix 300B, 2T, 20M, 4k
    (K, M, B or G, T, P; B = G = 1e9). Anything else is a ConfigError naming the option."""
    x = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str) and (m := _COUNT.fullmatch(value.strip())):
        x = float(m.group(1).replace("_", "") + (m.group(2) or "")) * SI.get((m.group(3) or "").lower(), 1.0)
    if x is None or not math.isfinite(x) or x <= 0:
        raise ConfigError(f"{option}={value} is not a positive count; write e.g. {option}=300B, 2T or 1.5e12")
    return x


def number(value: Any, option: str, kind: type = float, minimum: float | None = None) -> Any:
    """`value` as an int or a finite float (`kind`), at least `minimum`; else a ConfigError naming the
    option."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int and not float(value).is_integer():
        ok = False
    if not ok:
        raise ConfigError(f"{option}={value} is not {'an integer' if kind is int else 'a number'}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{option}={value} must be >= {minimum}")
    return kind(value)
