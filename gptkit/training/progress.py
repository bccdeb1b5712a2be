"""Progress of a training run, on stderr: a bar on a terminal, plain lines in a log file.

    trainer.progress=auto   a bar when stderr is a terminal, else one line every trainer.log_every steps
    trainer.progress=bar    always the bar;  lines: always the lines;  off: neither

A line (what a SLURM log or `tee` shows):

    step 120/600  loss 2.3456  grad norm 0.412  lr 9.80e-04  12,345 tok/s  MFU 25.1%  elapsed 1:10  ETA 4:40

The bar moves every step, but its numbers change only at log steps: nothing here reads a tensor, so
the progress display costs the GPU no synchronization.
"""

from __future__ import annotations

import sys
import time

from gptkit.errors import ConfigError

MODES = ("auto", "bar", "lines", "off")


def progress_mode(value) -> str:
    """trainer.progress as one of MODES (true/false are auto/off)."""
    if value is True:
        return "auto"
    if value is False or value is None:
        return "off"
    if value not in MODES:
        raise ConfigError(f"trainer.progress={value!r} is not one of {', '.join(MODES)} (or true/false)")
    return value


def clock(seconds: float) -> str:
    """3725 -> '1:02:05', 70 -> '1:10'."""
    s = int(round(seconds))
    h, m = divmod(s, 3600)
    m, s = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def metrics_text(metrics: dict[str, float], extra: list[str] = ()) -> str:
    """One log step's metrics as the progress line shows them; `extra`: the objective's own parts (after the
    loss)."""
    parts = []
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.4f}")
    parts += list(extra)
    if "train/grad_norm" in metrics:
        parts.append(f"grad norm {metrics['train/grad_norm']:.3g}")
    if "train/lr" in metrics:
        parts.append(f"lr {metrics['train/lr']:.2e}")
    if metrics.get("perf/tokens_per_s"):
        parts.append(f"{metrics['perf/tokens_per_s']:,.0f} tok/s")
    if "perf/mfu" in metrics:
        parts.append(f"MFU {metrics['perf/mfu']:.1%}")
    return "  ".join(parts)


class ProgressReporter:
    def __init__(self, mode: str = "auto", stream=None) -> None:
        self.stream = stream or sys.stderr
        mode = progress_mode(mode)
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self._bar = None
        self._task = None
        self._t0 = 0.0
        self._first = 0
        self._total = 0

    def start(self, step: int, total: int) -> None:
        """Start the bar (on a terminal) or the plain lines."""
        self._t0, self._first, self._total = time.perf_counter(), step, total
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("train"),
                BarColumn(bar_width=None),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=Console(file=self.stream),
                transient=False,
                expand=True,
            )
            self._task = self._bar.add_task("train", total=total, completed=step, metrics="")
            self._bar.start()

    def advance(self, step: int) -> None:
        """One more optimizer step (the bar moves; no device tensor is read)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def log(self, step: int, metrics: dict[str, float], extra: list[str] = ()) -> None:
        """A log step's metrics (and the objective's parts of the line): the bar's numbers, or one plain
        line."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, metrics=metrics_text(metrics, extra))
        elif self.mode == "lines":
            elapsed = time.perf_counter() - self._t0
            done = step - self._first
            eta = elapsed / done * (self._total - step) if done > 0 else 0.0
            self._line(
                f"step {step}/{self._total}  {metrics_text(metrics, extra)}  elapsed {clock(elapsed)}  ETA "
                f"{clock(eta)}"
            )

    def validation(self, step: int, loss: float, extra: str = "") -> None:
        """Show a validation result (`extra`: what the objective adds, e.g. DPO's reward accuracy)."""
        text = f"step {step}  val loss {loss:.4f}{extra}"
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.mode != "off":
            self._line(text)

    def note(self, text: str) -> None:
        """A line that must be seen whatever the mode (a loss spike): above the bar, or on its own line."""
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            self._line(text)

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
