"""`gptkit compare runs=[a,b,...] out=compare.png`: the runs' curves overlaid in one picture, a panel per
curve the runs have (loss, val loss, lr, grad norm, throughput, each eval/ column), by step, tokens or time:
the page's overlay without a browser. Drawn with matplotlib, as loss.png is."""

from __future__ import annotations

import io
from pathlib import Path

from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_bytes
from gptkit.runs import METRICS_FILE
from gptkit.runs_page.scan import Damaged
from gptkit.runs_page.series import AXES, PANELS, panel_of, read_series

# matplotlib is imported where the picture is drawn.

X_LABELS = {"step": "step", "tokens": "tokens", "time": "training time (s)"}


def draw_compare(runs: list[tuple[str, Path]], out: Path | str, x: str = "step") -> Path:
    """Draw the runs' curves (name, run folder) into out (PNG, written atomically); a one-line GptkitError
    for a run without a readable metrics.csv or an x that is not one of AXES."""
    if x not in AXES:
        raise GptkitError(f"x={x!r} must be one of {', '.join(AXES)}")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise GptkitError(f"out={out} must name a .png file")
    if not out.parent.is_dir():
        raise GptkitError(f"out={out}: the folder {out.parent} does not exist")
    series = {}
    for name, run_dir in runs:
        metrics = run_dir / METRICS_FILE
        if not metrics.is_file():
            raise GptkitError(f"{run_dir} has no {METRICS_FILE}: nothing to draw for run {name}")
        try:
            series[name] = read_series(metrics)
        except Damaged as exc:
            raise GptkitError(f"{run_dir}: {exc}") from None
    # a panel per curve: the fixed panels, then one per eval column
    panels: list[tuple[str, list[str]]] = []
    columns = sorted({c for s in series.values() for c in s})
    for title, _ in PANELS:
        cols = [c for c in columns if panel_of(c) == title]
        if title == "evals":
            panels.extend((c, [c]) for c in cols)
        elif cols:
            panels.append((title, cols))
    if not panels:
        raise GptkitError("the runs' metrics.csv files hold no curve to draw (no loss, lr, eval rows)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.2 * nrows), dpi=110, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, cols) in zip(axes.flat, panels):
        for k, (name, s) in enumerate(series.items()):
            for c in cols:
                if c not in s:
                    continue
                pts = [(a, v) for a, v in zip(s[c][x], s[c]["value"]) if a is not None and v is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                label = name if len(cols) == 1 else f"{name} {c}"
                style = "o-" if len(xs) < 30 else "-"
                ax.plot(xs, ys, style, ms=3, lw=1.2, color=colors[k % len(colors)], label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(X_LABELS[x], fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out
