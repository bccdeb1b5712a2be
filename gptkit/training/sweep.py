"""The end of a multirun (`gptkit train -m ...`): one table of its jobs, printed and written as summary.csv.

    job  overrides          final val loss  tokens/s
    0    optim.lr=1e-3      2.1034          19,812
    1    optim.lr=3e-3      1.9876          19,640

Hydra calls SweepSummary (registered in conf/train.yaml under hydra.callbacks) once every job has run; the
numbers come from each job's own folder (.hydra/overrides.yaml, metrics.csv), so a job that failed shows
as such instead of stopping the summary.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from gptkit.fsio import atomic_write_text

SUMMARY_FILE = "summary.csv"
COLUMNS = ("job", "overrides", "final_val_loss", "tokens_per_s", "steps")


def job_row(job_dir: Path) -> dict[str, Any]:
    """One job's overrides, last val loss, mean logged tokens/s and last step, from its folder."""
    row: dict[str, Any] = {
        "job": job_dir.name,
        "overrides": "",
        "final_val_loss": "",
        "tokens_per_s": "",
        "steps": "",
    }
    overrides = job_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        row["overrides"] = " ".join(yaml.safe_load(overrides.read_text()) or [])
    metrics = job_dir / "metrics.csv"
    if not metrics.is_file():
        row["final_val_loss"] = "failed: no metrics.csv"
        return row
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    val = [r for r in rows if r.get("val/loss")]
    speed = [float(r["perf/tokens_per_s"]) for r in rows if r.get("perf/tokens_per_s")]
    steps = [int(float(r["step"])) for r in rows if r.get("step")]
    if val:
        row["final_val_loss"] = f"{float(val[-1]['val/loss']):.4f}"
    if speed:
        row["tokens_per_s"] = f"{sum(speed) / len(speed):.0f}"
    if steps:
        row["steps"] = str(max(steps))
    return row


def write_summary(sweep_dir: Path) -> Path | None:
    """Write the sweep folder's summary.csv: one row per job with its overrides and results."""
    jobs = sorted(
        (d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)
    )
    if not jobs:
        return None
    rows = [job_row(d) for d in jobs]
    common = set.intersection(*(set(r["overrides"].split()) for r in rows))
    # only what the jobs differ in
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"].split() if o not in common)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    out = sweep_dir / SUMMARY_FILE
    atomic_write_text(out, buf.getvalue())

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(f"multirun: {len(rows)} job(s) in {sweep_dir}"))
    for col, justify in zip(
        ("job", "overrides", "final val loss", "tokens/s"), ("right", "left", "right", "right")
    ):
        table.add_column(col, justify=justify)
    for r in rows:
        tps = f"{float(r['tokens_per_s']):,.0f}" if r["tokens_per_s"] else ""
        table.add_row(r["job"], escape(r["overrides"]), escape(r["final_val_loss"]), tps)
    Console(file=sys.stderr).print(table)
    print(f"summary: {out}", file=sys.stderr)
    return out


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs: Any) -> None:
        """After the last job of a multirun: the table and summary.csv."""
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            write_summary(sweep_dir)
