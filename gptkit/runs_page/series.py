"""A run's curves from its metrics.csv: streamed once, each curve thinned to at most `max_points` points.

The x axes: `step` (the row's optimizer steps), `tokens` (perf/tokens, the tokens trained so far) and `time`
(seconds of training, summed row by row as the tokens since the previous row over that row's
perf/tokens_per_s: validation and start-up are not counted; metrics.csv records no clock). Thinning keeps
every k-th point of a curve, k doubling whenever the curve holds 2 x max_points, so memory stays bounded
however long the run and the first and the latest points are always kept.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gptkit.runs_page.scan import Damaged, each_row

# the page's and the PNG's panels, in order: title -> does a metrics.csv column belong to it
PANELS: tuple[tuple[str, Any], ...] = (
    ("loss", lambda c: c == "train/loss"),
    ("val loss", lambda c: c == "val/loss"),
    ("lr", lambda c: c == "train/lr" or c.startswith("lr-")),
    ("grad norm", lambda c: c == "train/grad_norm"),
    ("throughput (tokens/s)", lambda c: c == "perf/tokens_per_s"),
    ("evals", lambda c: c.startswith("eval/")),
)
AXES = ("step", "tokens", "time")


def panel_of(column: str) -> str | None:
    return next((title for title, belongs in PANELS if belongs(column)), None)


class _Curve:
    """The points of one column, thinned as they come."""

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self.stride = 1
        self.seen = 0
        self.points: list[tuple[int, float | None, float | None, float]] = []
        self.last: tuple[int, float | None, float | None, float] | None = None

    def add(self, point: tuple[int, float | None, float | None, float]) -> None:
        if self.seen % self.stride == 0:
            self.points.append(point)
            if len(self.points) >= 2 * self.max_points:
                self.points = self.points[::2]
                self.stride *= 2
        self.seen += 1
        self.last = point

    def as_json(self) -> dict[str, list]:
        pts = list(self.points)
        if self.last is not None and (not pts or pts[-1] is not self.last):
            pts.append(self.last)

        def clean(v):
            return v if v is not None and math.isfinite(v) else None

        return {
            "step": [p[0] for p in pts],
            "tokens": [p[1] for p in pts],
            "time": [p[2] for p in pts],
            "value": [clean(p[3]) for p in pts],
        }


def read_series(path: Path | str, max_points: int = 1000) -> dict[str, dict[str, list]]:
    """{column: {"step": [...], "tokens": [...], "time": [...], "value": [...]}} for every column of the
    panels (PANELS) that has a value; Damaged (one line) for a file that is not what training writes."""
    path = Path(path)
    curves: dict[str, _Curve] = {}

    def start(header: list[str]):
        at = {name: i for i, name in enumerate(header)}
        wanted = [(name, i) for name, i in at.items() if panel_of(name)]
        i_step, i_tok, i_tps = at["step"], at.get("perf/tokens"), at.get("perf/tokens_per_s")
        clock = [0.0, None]  # seconds so far, the tokens of the previous row

        def take(row: list[str], line: int) -> None:
            if len(row) != len(header):
                raise Damaged(f"{path.name} line {line} has {len(row)} fields, its header {len(header)}")
            try:
                if row[i_step] == "":
                    return
                step = int(float(row[i_step]))
                tokens = float(row[i_tok]) if i_tok is not None and row[i_tok] else None
                tps = float(row[i_tps]) if i_tps is not None and row[i_tps] else None
                values = [(name, float(row[i])) for name, i in wanted if row[i] != ""]
            except ValueError:
                raise Damaged(f"{path.name} line {line} holds a value that is not a number") from None
            seconds = None
            if tokens is not None and tps:
                before = clock[1] if clock[1] is not None else 0.0
                clock[0] += max(tokens - before, 0.0) / tps
                clock[1] = tokens
                seconds = clock[0]
            for name, v in values:
                curves.setdefault(name, _Curve(max_points)).add((step, tokens, seconds, v))

        return take

    each_row(path, start)
    return {name: c.as_json() for name, c in curves.items()}
