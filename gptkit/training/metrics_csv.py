"""metrics.csv (the CSV logger): one row per logged step, exact across crashes and resumes.

    step,train/loss,lr-AdamW/pg1,lr-AdamW/pg2,perf/tokens_per_s,...,val/loss,val/ppl

A row's `step` is the number of optimizer steps done, as everywhere in gptkit (the progress line,
checkpoints/step-NNNNNN.ckpt, the loggers): row s holds the training loss of the batch that made step s
(the mean over the log window that ends there), the learning rate that batch used, its throughput, and
the validation loss of the weights after s steps. Rows are appended as they complete; a new column or a change
to the last row rewrites the file atomically (temp file + rename, never a truncation in place).

Rows and checkpoints are tied together: RunCheckpoints calls sync() (every row so far, fsynced) before
it publishes a checkpoint, so a checkpoint at step N never exists without the rows it covers: every
row up to N, the validation at N included. A resume at step N keeps exactly those rows and redoes the
rest; a new run starts a new file.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from gptkit.faults import fault_point
from gptkit.fsio import disk_full_error, is_disk_full, temp_file_beside
from gptkit.runs import METRICS_FILE

# validation, task evals: logged at step N before its checkpoint is published
VAL_PREFIX = ("val/", "eval/")


class MetricsCSV(Logger):
    """The CSV logger of a run (rank 0 writes; Lightning calls log_metrics and save on rank 0 only)."""

    def __init__(self, run_dir: Path | str, resume_step: int | None = None) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.resume_step = resume_step
        self._columns: list[str] = ["step"]
        # rows not yet on disk, or the last row if it may still grow
        self._rows: dict[int, dict[str, Any]] = {}
        # (step, row as written, its byte offset)
        self._tail: tuple[int, dict[str, Any], int] | None = None
        # bytes in the file
        self._size = 0
        # rows of earlier steps are on disk for good
        self._floor = 0
        self._started = False

    # Lightning's Logger interface
    @property
    def name(self) -> str:
        """The logger's name (Lightning's Logger interface)."""
        return "csv"

    @property
    def version(self) -> str:
        """No versions: one metrics.csv per run folder."""
        return ""

    @property
    def save_dir(self) -> str:
        """The run folder."""
        return str(self.run_dir)

    @property
    def log_dir(self) -> str:
        """The run folder."""
        return str(self.run_dir)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the run's config.yaml holds them."""
        # the run's config.yaml holds them
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add the metrics of `step` to its row."""
        self._start()
        values = {k: float(v) for k, v in metrics.items() if k not in ("step", "epoch")}
        step = int(metrics.get("step", 0) if step is None else step)
        if step < self._floor:
            # a step whose row is final on disk: not something gptkit's loop logs
            return
        self._rows.setdefault(step, {}).update(values)
        # whoever logs (Lightning, or a callback directly), rows reach the file
        self._write(complete_only=True)

    @rank_zero_only
    def save(self) -> None:
        """Write the rows so far (Lightning calls it at checkpoints)."""
        self._write(complete_only=True)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write every row at the end of the run."""
        self._write(complete_only=False)

    def sync(self) -> None:
        """Every row logged so far on disk (fsynced), the newest one too: called before a checkpoint is
        published (on rank 0)."""
        self._write(complete_only=False, fsync=True)

    # the file
    def _start(self) -> None:
        """Open the file on first use: a new run starts it empty; a resume at step N keeps the rows the
        checkpoint covers (steps up to N: the training of step N and the validation at N)."""
        if self._started:
            return
        self._started = True
        if self.resume_step is None:
            # e.g. the rows of an earlier attempt that made no checkpoint
            self.path.unlink(missing_ok=True)
            return
        columns, rows = read_rows(self.path)
        n = self.resume_step
        kept = {s: r for s, r in rows.items() if s <= n}
        # row N may still grow: a validation at N that an interrupted run did not finish
        at_n = n in kept
        if n > 0 and not kept:
            print(
                f"note: {self.path} holds no rows before step {n} (lost or removed before this resume); "
                f"it continues from step {n}",
                file=sys.stderr,
            )
        elif (gap := missing_tail(sorted(kept), n)) is not None:
            print(
                f"note: {self.path} has no rows for steps {gap[0]}-{gap[1]} (the file was cut short before "
                f"this resume); they stay missing, it continues from step {n}",
                file=sys.stderr,
            )
        self._columns = columns or ["step"]
        self._rewrite(b"", list(kept.items()), keep_last=at_n)
        if at_n:
            self._rows[n] = dict(kept[n])
        self._floor = n

    def _line(self, step: int, row: dict[str, Any]) -> bytes:
        buf = io.StringIO()
        csv.writer(buf).writerow([step] + [row.get(c, "") for c in self._columns[1:]])
        return buf.getvalue().encode()

    def _header(self) -> bytes:
        buf = io.StringIO()
        csv.writer(buf).writerow(self._columns)
        return buf.getvalue().encode()

    def _write(self, complete_only: bool, fsync: bool = False) -> None:
        """Put rows on disk: with complete_only, all but the newest (which may still grow). A full disk is one
        line naming metrics.csv."""
        try:
            self._write_rows(complete_only, fsync)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full_error(self.path, None, exc) from exc
            raise

    def _write_rows(self, complete_only: bool, fsync: bool) -> None:
        self._start()
        newest = max(self._rows, default=None)
        tail = self._tail
        if tail is not None and tail[0] != newest and self._rows.get(tail[0]) == tail[1]:
            # the last row on disk is complete, and on disk as it is
            del self._rows[tail[0]]
            self._tail = None
        steps = [s for s in sorted(self._rows) if not (complete_only and s == newest)]
        tail = self._tail
        if tail is not None and steps[:1] == [tail[0]] and self._rows[tail[0]] == tail[1]:
            # still the newest row, unchanged since it was written
            steps = steps[1:]
        if steps:
            rows = [(s, self._rows[s]) for s in steps]
            # written while it may still grow: it stays the amendable tail
            keep_last = steps[-1] == newest
            new = [k for _, r in rows for k in r if k not in self._columns]
            amend = self._tail is not None and steps[0] == self._tail[0]
            # a new column: every row is written again under the new header
            if new:
                self._columns += list(dict.fromkeys(new))
                _, old = read_rows(self.path)
                self._rewrite(
                    b"", [*((s, r) for s, r in old.items() if s not in self._rows), *rows], keep_last
                )
            # the last row on disk grew: everything before it, then the rows
            elif amend:
                with open(self.path, "rb") as f:
                    prefix = f.read(self._tail[2])
                self._rewrite(prefix, rows, keep_last, with_header=False)
            else:
                self._append(rows, keep_last)
            for s in steps:
                if not (keep_last and s == newest):
                    del self._rows[s]
                    self._floor = max(self._floor, s + 1)
        if fsync and self.path.exists():
            with open(self.path, "rb+") as f:
                os.fsync(f.fileno())

    def _encode(self, rows: list[tuple[int, dict[str, Any]]], start: int) -> tuple[bytes, int]:
        """The rows as CSV bytes, and the offset (from `start`) at which the last row begins."""
        lines = [self._line(step, row) for step, row in rows]
        data = b"".join(lines)
        return data, start + len(data) - (len(lines[-1]) if lines else 0)

    def _append(self, rows: list[tuple[int, dict[str, Any]]], keep_last: bool) -> None:
        if self._size == 0:
            return self._rewrite(b"", rows, keep_last)
        data, last = self._encode(rows, self._size)
        with open(self.path, "ab") as f:
            f.write(data)
        fault_point("metrics-append")
        self._size += len(data)
        self._tail = (rows[-1][0], dict(rows[-1][1]), last) if keep_last else None

    def _rewrite(
        self, prefix: bytes, rows: list[tuple[int, dict[str, Any]]], keep_last: bool, with_header: bool = True
    ) -> None:
        """Replace the file with prefix (or a header) + rows: a temporary file renamed over it."""
        head = self._header() if with_header else prefix
        data, last = self._encode(rows, len(head))
        fd, tmp = temp_file_beside(self.path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head + data)
                f.flush()
                os.fsync(f.fileno())
            fault_point("metrics-rewrite")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._size = len(head) + len(data)
        self._tail = (rows[-1][0], dict(rows[-1][1]), last) if keep_last and rows else None


def read_rows(path: Path) -> tuple[list[str], dict[int, dict[str, str]]]:
    """(columns, {step: row}) of a metrics.csv; rows of the same step are merged (older gptkit wrote the
    learning rate on a row of its own), a last line without its newline (a write cut short) is dropped."""
    if not path.is_file():
        return [], {}
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    columns = next(reader, [])
    if "step" not in columns:
        return [], {}
    rows: dict[int, dict[str, str]] = {}
    for values in reader:
        if len(values) != len(columns):
            continue
        row = dict(zip(columns, values))
        try:
            step = int(float(row.pop("step")))
        except ValueError:
            continue
        rows.setdefault(step, {}).update({k: v for k, v in row.items() if v != ""})
    columns = ["step"] + [c for c in columns if c != "step"]
    return columns, dict(sorted(rows.items()))


def missing_tail(steps: list[int], resume_step: int) -> tuple[int, int] | None:
    """(first, last) step of the rows missing at the end of a metrics.csv that a resume at `resume_step` keeps
    (`steps`, sorted, up to the resume step), judged by the file's own spacing (its most common gap: 1, or
    trainer.log_every); None when the rows reach the resume step (a row lies within one gap of it)."""
    if not steps:
        return None
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    stride = max(set(gaps), key=gaps.count) if gaps else 1
    if resume_step - steps[-1] < stride:
        return None
    return steps[-1] + 1, resume_step
