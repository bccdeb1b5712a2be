"""loss.png: train and validation loss against the step, from the run's metrics.csv."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_bytes

# matplotlib is imported where loss.png is drawn: a run without a plot never loads it.


def read_metrics(csv_path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every filled column of a metrics.csv as (step, value) pairs, by column name."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for k, v in row.items():
                if k != "step" and v not in (None, ""):
                    series.setdefault(k, []).append((int(float(step)), float(v)))
    return series


def plot_loss(run_dir: Path | str) -> Path:
    """Draw <run>/loss.png from the run's metrics.csv."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    csv_path = run_dir / "metrics.csv"
    if not csv_path.is_file():
        raise GptkitError(
            f"{csv_path} is missing; loss.png is drawn from the CSV logger's metrics (logger=csv)"
        )
    s = read_metrics(csv_path)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if "train/loss" in s:
        steps, vals = zip(*s["train/loss"])
        ax.plot(steps, vals, lw=0.8, alpha=0.8, label="train")
    if "val/loss" in s:
        steps, vals = zip(*s["val/loss"])
        ax.plot(steps, vals, "o-", lw=1.5, ms=3, label="val")
        ax.set_title(f"{run_dir.name}: final val loss {vals[-1]:.4f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    out = run_dir / "loss.png"
    atomic_write_bytes(out, buf.getvalue())
    return out
