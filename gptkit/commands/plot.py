"""Training writes loss.png at the end; this redraws it on demand (for example while a run is going).

Example:
  gptkit plot run=runs/my-run
"""

from __future__ import annotations

VERB = "plot"
HELP = "draw <run>/loss.png (train and val loss) from the run's metrics.csv"
CONFIG = "plot"
HYDRA_APP = False


def run(cfg) -> int:
    from pathlib import Path

    from gptkit.errors import GptkitError
    from gptkit.training.plots import plot_loss

    run_dir = Path(str(cfg.run))
    if not run_dir.is_dir():
        raise GptkitError(f"{run_dir} is not a run folder; pass run=runs/<name>")
    print(plot_loss(run_dir))
    return 0
