"""Training objectives: one interface (base.Objective), one table.

    lm    next-token cross-entropy over the targets that carry loss: pretraining, and SFT on data=chat
    dpo   direct preference optimization on data=preference against a frozen reference
    kto   Kahneman-Tversky optimization on data=unpaired (labelled single completions) against a frozen
          reference
    distill  next-token distillation from frozen.teacher (forward/reverse KL, generalized JSD) mixed with the
          labels' cross-entropy
    gkd   on-policy distillation: the student's own continuations of its rows' starts scored per token by
          frozen.teacher (reverse KL by default), a share lmbda of the steps
    grpo  group relative policy optimization on data=prompts: completions sampled from the model, scored by
          rewards (checkers, the user's functions or a reward model)
    reward Bradley-Terry reward model on data=preference: a scalar score head (model.score_head) trained to
          score the chosen answer above the rejected one

LitGPT calls the interface and never asks which objective it runs. A new objective is a file here with its
Objective subclass, and one row of OBJECTIVES.

A model with multi-token prediction modules (model.mtp.depth > 0) trains with its objective's MTP variant,
MTP_VARIANTS (lm: mtp.py's MTPLM); an objective without one refuses the model in one line.
"""

from __future__ import annotations

from typing import Any

from gptkit.errors import ConfigError
from gptkit.training.objectives.base import FrozenModel, Objective, evaluating
from gptkit.training.objectives.distill import Distill
from gptkit.training.objectives.dpo import DPO
from gptkit.training.objectives.gkd import GKD
from gptkit.training.objectives.grpo import GRPO
from gptkit.training.objectives.kto import KTO
from gptkit.training.objectives.lm import LM
from gptkit.training.objectives.mtp import MTPLM
from gptkit.training.objectives.reward import Reward

OBJECTIVES: dict[str, type[Objective]] = {
    "lm": LM,
    "dpo": DPO,
    "grpo": GRPO,
    "kto": KTO,
    "distill": Distill,
    "gkd": GKD,
    "reward": Reward,
}
# objective= -> the objective that trains a model with model.mtp.depth > 0 (its MTP losses added)
MTP_VARIANTS: dict[str, type[Objective]] = {"lm": MTPLM}

__all__ = ["OBJECTIVES", "FrozenModel", "Objective", "check_objective", "evaluating", "objective_class"]


def objective_class(cfg: Any) -> type[Objective]:
    """The objective a config names (objective=; lm when unset), its MTP variant for a model with
    multi-token prediction (model.mtp.depth > 0)."""
    name = str(cfg.get("objective") or "lm")
    if name not in OBJECTIVES:
        raise ConfigError(f"objective={name!r} is not one of {', '.join(OBJECTIVES)}")
    mtp = (cfg.get("model") or {}).get("mtp")
    depth = mtp.get("depth", 0) if hasattr(mtp, "get") else 0
    if not depth:
        return OBJECTIVES[name]
    if name not in MTP_VARIANTS:
        raise ConfigError(
            f"model.mtp.depth={depth}: objective={name} cannot train multi-token prediction modules (only "
            f"{', '.join(MTP_VARIANTS)} can); set model.mtp=null"
        )
    return MTP_VARIANTS[name]


def check_objective(cfg: Any) -> None:
    """objective=, its config group, and the data and start it needs, checked without data: an objective
    that names its data kinds trains on those only, and an objective that does not name a kind does not train
    on it (data=preference: dpo's and reward's)."""
    objective = objective_class(cfg)
    objective.check_config(cfg.get(objective.group) if objective.group else None)
    kind = (cfg.get("data") or {}).get("kind")
    if objective.data_kinds is not None and kind not in objective.data_kinds:
        raise ConfigError(objective.wrong_data(kind))
    owner = next((o for o in OBJECTIVES.values() if o.data_kinds and kind in o.data_kinds), None)
    if owner is not None and kind not in (objective.data_kinds or ()):
        raise ConfigError(owner.claimed())
    if objective.needs_start and cfg.get("init_from") in (None, "", "null"):
        raise ConfigError(objective.no_start())
    objective.check_run(cfg)
