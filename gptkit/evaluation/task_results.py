"""The results of `gptkit eval tasks=...`: one row per metric (task, metric, value, stderr), and the JSON
files they are written to (out=, else <run>/evals/<task>-<date>.json). The tasks themselves are found,
loaded and run by gptkit.evaluation.tasks."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from gptkit.errors import ConfigError
from gptkit.fsio import atomic_write_text


def result_rows(results: dict) -> list[dict[str, Any]]:
    """One row (task, metric, value, stderr) per metric of every task and group, in lm-eval's order."""
    rows = []
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            if section == "groups" and task in (results.get("results") or {}):
                continue
            for key, value in metrics.items():
                if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                    continue
                metric, filt = key.split(",", 1)
                stderr = metrics.get(f"{metric}_stderr,{filt}")
                rows.append(
                    {
                        "task": task,
                        "metric": metric if filt == "none" else f"{metric} ({filt})",
                        "value": float(value),
                        "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                        "n": (results.get("n-samples") or {}).get(task, {}).get("effective"),
                    }
                )
    return rows


def check_out(out: Any) -> Path | None:
    """out= names a results file (not a folder) whose folder exists or can be made (write_results makes it);
    checked before anything runs."""
    if out is None:
        return None
    path = Path(str(out)).expanduser()
    if path.is_dir():
        raise ConfigError(f"out={out} is a folder; give a file name (e.g. out={path / 'results.json'})")
    # the nearest folder that exists: the results' folder is made in it
    above = path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"out={out}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ConfigError(f"out={out}: {above} is not a writable folder")
    return path


def write_results(
    results: dict,
    rows: list[dict],
    run,
    stats,
    out: Any,
    *,
    limit=None,
    seconds: float = 0.0,
    skipped: dict[str, str] | None = None,
) -> list[Path]:
    """The results as JSON: out= (all tasks in one file), else <run>/evals/<task>-<date>.json per task; each
    names the tasks of the invocation that were skipped (no scores), and why. Each file is written to a
    temporary name and renamed."""
    from lm_eval import __version__ as lm_eval_version

    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    common = {
        "run": str(run.dir),
        "checkpoint": str(run.checkpoint),
        "date": now.isoformat(timespec="seconds"),
        "scored_by": "gptkit (gptkit.evaluation.lm_eval_adapter)",
        "lm_eval": lm_eval_version,
        "limit": limit,
        "requests": dict(stats.requests),
        "truncated": stats.truncated,
        "seconds": seconds,
        "skipped": dict(skipped or {}),
    }

    def one(task: str) -> dict:
        return {
            "task": task,
            "rows": [r for r in rows if r["task"] == task],
            "results": ((results.get("results") or {}).get(task) or (results.get("groups") or {}).get(task)),
            "n_shot": (results.get("n-shot") or {}).get(task),
            "n_samples": (results.get("n-samples") or {}).get(task),
            "version": (results.get("versions") or {}).get(task),
            "config": (results.get("configs") or {}).get(task),
        }

    tasks = list(dict.fromkeys(r["task"] for r in rows)) or list(results.get("results") or {})
    if out is not None:
        path = check_out(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {**common, "tasks": [one(t) for t in tasks]}
        atomic_write_text(path, json.dumps(doc, indent=2, default=str) + "\n")
        return [path]
    written = []
    for task in tasks:
        path = Path(run.dir) / "evals" / f"{task}-{stamp}.json"
        path.parent.mkdir(exist_ok=True)
        atomic_write_text(path, json.dumps({**common, **one(task)}, indent=2, default=str) + "\n")
        written.append(path)
    return written


def run_results(run_dir: Path | str) -> list[dict[str, Any]]:
    """The rows (task, metric, value, stderr, n) of a run's results files (<run>/evals/*.json, as
    write_results writes them), the newest file of each task winning; a file that is not such JSON is
    skipped (the run's own eval table, for a model card)."""
    newest: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for f in sorted(Path(run_dir, "evals").glob("*.json")):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        for one in doc.get("tasks") or [doc]:
            rows = one.get("rows") if isinstance(one, dict) else None
            if not isinstance(rows, list) or not one.get("task"):
                continue
            date = str(doc.get("date") or "")
            if one["task"] not in newest or date >= newest[one["task"]][0]:
                newest[one["task"]] = (date, [r for r in rows if isinstance(r, dict) and "metric" in r])
    return [r for task in sorted(newest) for r in newest[task][1]]
