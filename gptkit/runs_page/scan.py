"""Which folders under a folder are runs, and one summary each: the row of `gptkit runs` and of the page.

A run is a direct child of the folder that is a run folder (gptkit.runs.is_run_folder: a config.yaml or a
checkpoints/), or a child of such a child (a multirun's jobs: runs/<name>/<job>). Hidden folders are skipped.

What a summary reads, so that hundreds of runs take bounded time and memory: config.yaml (the model's name
and parameter count, trainer.max_steps), plan.json (the last invocation's max_steps), metrics.csv streamed
once row by row (constant memory: the last step, the tokens, the best val loss, the last value of each
eval/ column), the folder's file sizes (one stat each) and /proc/locks once for the whole scan.

The status of a run, from its folder alone (nothing else is recorded when a run ends):

    running   its .lock is held: `gptkit train` holds an flock on <run>/.lock while it writes the folder and
              the OS drops it when the process ends, kill -9 included (Linux: /proc/locks lists it; elsewhere
              the PID written in .lock is alive)
    done      not running, its last metrics.csv row is at max_steps (plan.json's last invocation, else
              config.yaml's trainer.max_steps) and checkpoints/last.ckpt exists; or an imported model
              (imported_from.json, no metrics.csv) or a merge of checkpoints (merge.json, no metrics.csv:
              `gptkit merge`, which no resume continues)
    stopped   not running, short of max_steps, and its last checkpoint holds its last logged step: the run
              saved where it stopped (Ctrl-C, SIGTERM, a time limit); `train resume=` continues it
    failed    not running, short of max_steps, and rows were logged after its last checkpoint (or there is
              none): it ended without saving its last step (an error, kill -9, a lost machine)

Which step checkpoints/last.ckpt holds, without reading it: a periodic checkpoint is written as
step-N.ckpt and last.ckpt is made a hard link of it (checkpoints.link_checkpoint), so a last.ckpt that is
the same file as step-N.ckpt holds step N; a save where a run stopped (or ended) is a last.ckpt of its own,
written with the run's last rows (within STOP_WRITE_S of metrics.csv's last write). A last.ckpt of its own
with metrics.csv written well after it is a periodic checkpoint copied where no hard link could be made.
    damaged   metrics.csv or config.yaml cannot be read (the problem is shown; the other runs are listed)
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptkit.checkpoints import CHECKPOINT_DIR, LAST_CHECKPOINT
from gptkit.errors import GptkitError
from gptkit.runs import (
    CONFIG_FILE,
    IMPORTED_FILE,
    LOCK_FILE,
    MERGE_FILE,
    METRICS_FILE,
    PLAN_FILE,
    is_run_folder,
)

# yaml is imported where config.yaml is read; the model's accounting where parameters are counted (no torch)

STATUSES = ("running", "done", "stopped", "failed", "damaged")


@dataclass
class MetricsSummary:
    """What the table needs of one metrics.csv (read in one pass, constant memory)."""

    columns: list[str] = field(default_factory=list)
    rows: int = 0
    last_step: int | None = None
    tokens: float | None = None
    train_loss: float | None = None
    best_val: float | None = None
    best_val_step: int | None = None
    # eval/<task>/<metric> -> its last value
    evals: dict[str, float] = field(default_factory=dict)


@dataclass
class RunRow:
    """One run's row: `gptkit runs`, the page's table and its /api/runs."""

    name: str
    path: Path
    status: str
    model: str = ""
    params: int | None = None
    max_steps: int | None = None
    size: int = 0
    # seconds since the epoch of the last write to metrics.csv (else config.yaml)
    updated: float | None = None
    metrics: MetricsSummary = field(default_factory=MetricsSummary)
    problem: str | None = None

    def as_json(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "name": self.name,
            "path": str(self.path),
            "status": self.status,
            "model": self.model,
            "params": self.params,
            "tokens": m.tokens,
            "step": m.last_step,
            "max_steps": self.max_steps,
            "train_loss": _finite(m.train_loss),
            "best_val_loss": _finite(m.best_val),
            "best_val_step": m.best_val_step,
            "evals": {k: _finite(v) for k, v in m.evals.items()},
            "size": self.size,
            "updated": self.updated,
            "problem": self.problem,
        }


def _finite(v: float | None) -> float | None:
    """JSON has no NaN or infinity: a diverged value is null there (the table shows it as nan)."""
    return v if v is not None and math.isfinite(v) else None


class Damaged(Exception):
    """A run file that cannot be read: the row is listed as damaged, with this one line."""


# ---- where the runs are ---------------------------------------------------------------------------------
def find_runs(root: Path | str) -> list[Path]:
    """The run folders under root (itself, when it is one), sorted by their path; a one-line GptkitError when
    root is not a folder or holds no run."""
    root = Path(root)
    if not root.is_dir():
        raise GptkitError(f"dir={root} is not a folder; give the folder that holds the run folders (runs/)")
    if is_run_folder(root):
        return [root]
    found: list[Path] = []
    for child in _subfolders(root):
        if is_run_folder(child):
            found.append(child)
        else:
            found.extend(g for g in _subfolders(child) if is_run_folder(g))
    if not found:
        raise GptkitError(
            f"no run folders under {root} (a run folder holds the config.yaml or checkpoints/ that "
            "`gptkit train` writes); give dir= the folder that holds them"
        )
    return sorted(found, key=lambda p: str(p.relative_to(root)))


def _subfolders(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return [
                Path(e.path) for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
    except OSError:
        return []


def run_name(run_dir: Path, root: Path) -> str:
    rel = run_dir.relative_to(root).as_posix()
    return run_dir.name if rel == "." else rel


# ---- one run ------------------------------------------------------------------------------------------
def each_row(path: Path, start: Callable[[list[str]], Callable[[list[str], int], None]]) -> None:
    """metrics.csv row by row: start(header) returns the function each row then goes to, with its line. The
    last row, when the file does not end in a newline yet (being appended), is skipped if it does not parse;
    a file that is not what training writes raises Damaged (one line)."""
    try:
        with open(path, "rb") as fb:
            fb.seek(0, os.SEEK_END)
            if fb.tell() == 0:
                raise Damaged(f"{path.name} is empty")
            fb.seek(-1, os.SEEK_END)
            complete = fb.read(1) == b"\n"
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header or "step" not in header:
                raise Damaged(f"{path.name} has no step column in its first line")
            take = start(header)
            pending: list[str] | None = None
            for row in reader:
                if pending is not None:
                    take(pending, reader.line_num - 1)
                pending = row
            if pending is not None:
                try:
                    take(pending, reader.line_num)
                except Damaged:
                    # the row being appended: the next read sees it whole
                    if complete:
                        raise
    except (UnicodeDecodeError, csv.Error) as exc:
        raise Damaged(f"{path.name} is not a CSV file ({str(exc).splitlines()[0][:80]})") from None
    except OSError as exc:
        raise Damaged(f"{path.name} cannot be read ({exc.strerror})") from None


def read_metrics(path: Path) -> MetricsSummary:
    """One pass over metrics.csv. A row being appended (the file does not end in a newline yet) is not
    counted; any other row of the wrong width or a value that is not a number raises Damaged (one line)."""
    s = MetricsSummary()

    def start(header: list[str]):
        s.columns = header
        at = {name: i for i, name in enumerate(header)}
        i_step, i_val = at["step"], at.get("val/loss")
        i_tokens, i_loss = at.get("perf/tokens"), at.get("train/loss")
        evals = [(name, i) for name, i in at.items() if name.startswith("eval/")]
        width = len(header)
        return lambda row, line: _take(s, row, line, i_step, i_val, i_tokens, i_loss, evals, width)

    each_row(path, start)
    return s


def _take(s, row, line, i_step, i_val, i_tokens, i_loss, evals, width) -> None:
    if len(row) != width:
        raise Damaged(f"metrics.csv line {line} has {len(row)} fields, its header {width}")
    try:
        values = [float(v) if v else None for v in row]
    except ValueError:
        bad = next(v for v in row if v and not _is_number(v))
        raise Damaged(f"metrics.csv line {line}: {bad[:40]!r} is not a number") from None
    step = values[i_step]
    if step is None:
        return
    s.rows += 1
    s.last_step = int(step)
    tokens = values[i_tokens] if i_tokens is not None else None
    loss = values[i_loss] if i_loss is not None else None
    val = values[i_val] if i_val is not None else None
    if tokens is not None:
        s.tokens = tokens
    if loss is not None:
        s.train_loss = loss
    if val is not None and (s.best_val is None or val < s.best_val or math.isnan(s.best_val)):
        s.best_val, s.best_val_step = val, int(step)
    for name, i in evals:
        if values[i] is not None:
            s.evals[name] = values[i]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_run_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    f = run_dir / CONFIG_FILE
    try:
        # libyaml's parser where PyYAML has it: config.yaml is most of a row's time with the pure-Python one
        cfg = yaml.load(f.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise Damaged(f"{CONFIG_FILE} is not readable YAML ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(cfg, dict):
        raise Damaged(f"{CONFIG_FILE} is not a mapping")
    return cfg


def count_parameters(model: Any) -> int | None:
    """The model's parameters from its config (accounting, no weights read); None if it does not build."""
    from gptkit.accounting import count_params
    from gptkit.model.config import ModelConfig

    try:
        return int(count_params(ModelConfig.from_dict(dict(model))).total)
    except Exception:  # noqa: BLE001 - a config this gptkit cannot build: the count is left blank
        return None


def target_steps(run_dir: Path, cfg: dict[str, Any]) -> int | None:
    """max_steps of the run's last invocation (plan.json), else config.yaml's trainer.max_steps."""
    try:
        invocations = json.loads((run_dir / PLAN_FILE).read_text()).get("invocations") or []
        steps = invocations[-1].get("max_steps")
        if isinstance(steps, int) and not isinstance(steps, bool):
            return steps
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        pass
    steps = (cfg.get("trainer") or {}).get("max_steps") if isinstance(cfg.get("trainer"), dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def folder_size(folder: Path) -> int:
    """Bytes on disk of every file under folder (as `du` counts them), links not followed."""
    total = 0
    stack = [folder]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(Path(e.path))
                        else:
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:
                        pass
        except OSError:
            pass
    return total


# ---- the lock: is a process writing the run now? --------------------------------------------------------
def held_locks() -> set[tuple[int, int, int]] | None:
    """(device major, minor, inode) of every flock held on this machine (Linux's /proc/locks, read once per
    scan); None where there is no such file (the PID in .lock is asked instead)."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    held = set()
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF"; "1: -> FLOCK ..." is a waiter
        if len(parts) >= 6 and parts[1] == "FLOCK":
            dev = parts[5].split(":")
            if len(dev) == 3:
                try:
                    held.add((int(dev[0], 16), int(dev[1], 16), int(dev[2])))
                except ValueError:
                    pass
    return held


def is_locked(run_dir: Path, held: set[tuple[int, int, int]] | None) -> bool:
    lock = run_dir / LOCK_FILE
    try:
        st = lock.stat()
    except OSError:
        return False
    if held is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_status(run_dir: Path, last_step: int | None, max_steps: int | None, running: bool) -> str:
    """The rule of the module docstring."""
    if running:
        return "running"
    made = (run_dir / IMPORTED_FILE).is_file() or (run_dir / MERGE_FILE).is_file()
    if made and not (run_dir / METRICS_FILE).exists():
        # `gptkit import` or `gptkit merge`: weights and no training, nothing left to run
        return "done"
    last = run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT
    has_last = last.exists()
    if has_last and last_step is not None and max_steps is not None and last_step >= max_steps:
        return "done"
    if not has_last:
        return "failed"
    # last.ckpt as a hard link of checkpoints/step-N.ckpt: the periodic checkpoint of step N (a save where
    # the run stopped, or at its end, is a file of its own)
    linked = linked_step(last)
    if linked is not None:
        return "stopped" if last_step is None or linked >= last_step else "failed"
    try:
        gap = (run_dir / METRICS_FILE).stat().st_mtime - last.stat().st_mtime
    except FileNotFoundError:
        # a checkpoint and no rows (a run that logs nothing)
        return "stopped"
    # the rows a stop saves are written with its checkpoint, within a moment; a file of its own with rows
    # logged well after it is a periodic checkpoint copied where hard links are not to be had
    return "failed" if gap > STOP_WRITE_S else "stopped"


# seconds between a stopping run's last.ckpt and its last metrics.csv write (36 ms measured on a SIGTERM)
STOP_WRITE_S = 2.0


def linked_step(last: Path) -> int | None:
    """N when last.ckpt is the same file as checkpoints/step-N.ckpt (a hard link), else None."""
    try:
        st = last.stat()
        if not last.is_file() or st.st_nlink < 2:
            return None
        with os.scandir(last.parent) as it:
            for e in it:
                name = e.name
                if name.startswith("step-") and name.endswith(".ckpt") and name[5:-5].isdigit():
                    other = e.stat(follow_symlinks=False)
                    if (other.st_ino, other.st_dev) == (st.st_ino, st.st_dev):
                        return int(name[5:-5])
    except OSError:
        return None
    return None


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def summarize(
    run_dir: Path, root: Path, held: set[tuple[int, int, int]] | None, cache: dict | None = None
) -> RunRow:
    """One run's row; a file that cannot be read makes the row damaged, never an exception. cache (the
    page's, kept between polls): a metrics.csv not changed since (same inode, size, mtime) is not read
    again."""
    row = RunRow(run_name(run_dir, root), run_dir, "damaged")
    row.size = folder_size(run_dir)
    running = is_locked(run_dir, held)
    try:
        key = tuple(_stat_key(run_dir / f) for f in (CONFIG_FILE, PLAN_FILE))
        hit = cache.get(run_dir) if cache is not None else None
        if hit is not None and hit[0] == key:
            row.model, row.params, row.max_steps = hit[1]
        else:
            cfg = read_run_config(run_dir) if (run_dir / CONFIG_FILE).is_file() else {}
            model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
            row.model = str(model.get("name") or "")
            row.params = count_parameters(model) if model else None
            row.max_steps = target_steps(run_dir, cfg)
            if cache is not None:
                cache[run_dir] = (key, (row.model, row.params, row.max_steps))
        metrics = run_dir / METRICS_FILE
        if metrics.is_file():
            st = metrics.stat()
            row.updated = st.st_mtime
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            hit = cache.get(metrics) if cache is not None else None
            if hit is not None and hit[0] == key:
                row.metrics = hit[1]
            else:
                row.metrics = read_metrics(metrics)
                if cache is not None:
                    cache[metrics] = (key, row.metrics)
        elif (run_dir / CONFIG_FILE).is_file():
            row.updated = (run_dir / CONFIG_FILE).stat().st_mtime
    except Damaged as exc:
        row.problem = str(exc)
        return row
    except OSError as exc:
        row.problem = f"cannot be read ({exc.strerror})"
        return row
    row.status = run_status(run_dir, row.metrics.last_step, row.max_steps, running)
    return row


def scan(root: Path | str, cache: dict | None = None) -> list[RunRow]:
    """Every run under root, summarized (find_runs' errors: one line)."""
    root = Path(root)
    runs = find_runs(root)
    held = held_locks()
    return [summarize(r, root, held, cache) for r in runs]
