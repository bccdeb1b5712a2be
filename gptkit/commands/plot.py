"""Training redraws loss.png at every validation and at the end; this draws it on demand from the run's
metrics.csv (a run trained without validation, or one whose drawing failed).

Example:
  gptkit plot run=runs/my-run
  gptkit plot run=latest
"""

from __future__ import annotations

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.errors import GptkitError
    from gptkit.runs import resolve_latest
    from gptkit.training.plots import plot_loss

    run_dir = resolve_latest(str(cfg.run), need="metrics")
    if not run_dir.is_dir():
        raise GptkitError(f"{run_dir} is not a run folder; pass run=runs/<name>")
    print(plot_loss(run_dir))
    return 0
