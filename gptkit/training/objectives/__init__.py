"""Training objectives: one interface (base.Objective), one table.

    lm    next-token cross-entropy over the targets that carry loss: pretraining, and SFT on data=chat
    dpo   direct preference optimization on data=preference against a frozen reference
    grpo  group relative policy optimization on data=prompts: completions sampled from the model, scored by
          rewards (checkers or the user's functions)

LitGPT calls the interface and never asks which objective it runs. A new objective is a file here with its
Objective subclass, and one row of OBJECTIVES.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel, Objective, evaluating
from gptkit.training.objectives.dpo import DPO
from gptkit.training.objectives.grpo import GRPO
from gptkit.training.objectives.lm import LM

OBJECTIVES: dict[str, type[Objective]] = {"lm": LM, "dpo": DPO, "grpo": GRPO}

__all__ = ["OBJECTIVES", "FrozenModel", "Objective", "check_objective", "evaluating", "objective_class"]


def objective_class(cfg: Any) -> type[Objective]:
    """The objective a config names (objective=; lm when unset)."""
    name = str(cfg.get("objective") or "lm")
    if name not in OBJECTIVES:
        raise ConfigError(f"objective={name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def check_objective(cfg: Any) -> None:
    """objective=, its config group, and the data and start it needs, checked without data: an objective
    that names its data kinds trains on those only, and no other objective trains on them."""
    objective = objective_class(cfg)
    objective.check_config(cfg.get(objective.group) if objective.group else None)
    kind = (cfg.get("data") or {}).get("kind")
    if objective.data_kinds is not None and kind not in objective.data_kinds:
        raise ConfigError(objective.wrong_data(kind))
    owner = next((o for o in OBJECTIVES.values() if o.data_kinds and kind in o.data_kinds), None)
    if owner is not None and owner is not objective:
        raise ConfigError(owner.claimed())
    if objective.needs_start and cfg.get("init_from") in (None, "", "null"):
        raise ConfigError(objective.no_start())
    objective.check_run(cfg)
