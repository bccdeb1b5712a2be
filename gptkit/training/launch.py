"""Where a training runs: in this process (and the ranks its launcher started), or, with trainer.launcher=ray,
in Ray Train's workers with this process their driver (gptkit/training/ray_train.py). `gptkit train` and
`gptkit.train(cfg)` come here; fit.py is the run itself, which the Ray workers call too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

if TYPE_CHECKING:
    from gptkit.options import Option
    from gptkit.training.config_checks import Checked
    from gptkit.training.fit import TrainResult


def train(
    cfg: DictConfig,
    *,
    run_dir: Optional[Path] = None,
    overrides: Optional[list[str]] = None,
    checked: Optional["Checked"] = None,
    options: Optional[list["Option"]] = None,
) -> "TrainResult":
    """One training run (fit.train's arguments): trainer.launcher=ray (the command's, or the saved config's of
    the run resume= continues) runs it in Ray Train's workers; otherwise fit.train runs it here."""
    from gptkit.training import fit
    from gptkit.training.ray_train import launcher_config, train_on_ray

    launch = launcher_config(cfg, fit.invocation(cfg, run_dir, overrides, options))
    if launch is not None:
        return train_on_ray(cfg, launch, run_dir=run_dir, overrides=overrides, options=options)
    return fit.train(cfg, run_dir=run_dir, overrides=overrides, checked=checked, options=options)
