"""The runs under a folder: `gptkit runs` prints their table (name, model, parameters, tokens, steps, best val
loss, last evals, status, size on disk); `gptkit runs serve` shows them on a local page, curves overlaid,
configs side by side, live runs updating (docs/runs-page.md). Both read the run folders only.

Examples:
  gptkit runs
  gptkit runs dir=sweeps --json
  gptkit runs serve port=0
"""

from __future__ import annotations

import json
import sys
from datetime import datetime

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

ACTIONS = ("table", "serve")


def run(cfg) -> int:
    from gptkit.errors import ConfigError

    if cfg.action not in ACTIONS:
        raise ConfigError(f"{cfg.action!r} is not something `gptkit runs` does: gptkit runs [table|serve]")
    if cfg.format not in ("table", "json"):
        raise ConfigError(f"format={cfg.format!r} must be table or json")
    if cfg.action == "serve":
        port = cfg.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port={port!r} must be an integer in [0, 65535]")
        from gptkit.extras import require

        require("serve")
        from gptkit.runs_page.app import serve_runs

        hosts = cfg.allowed_hosts
        if isinstance(hosts, str):
            hosts = [hosts]
        if hosts is None or not all(isinstance(h, str) and h.strip() for h in hosts):
            raise ConfigError(
                f"allowed_hosts={hosts!r} must be a list of host names, e.g. [box.lan] ([*]: any)"
            )
        return serve_runs(
            str(cfg.dir),
            host=str(cfg.host),
            port=int(port),
            access_log=bool(cfg.access_log),
            allowed_hosts=tuple(str(h).strip() for h in hosts),
        )
    from gptkit.runs_page.scan import scan

    rows = scan(str(cfg.dir))
    if cfg.format == "json":
        print(json.dumps([r.as_json() for r in rows], indent=1))
        return 0
    print_table(rows, str(cfg.dir))
    return 0


def _human(n) -> str:
    if n is None:
        return ""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def print_table(rows, root: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from gptkit.fsio import human_bytes

    counts = {s: sum(r.status == s for r in rows) for s in dict.fromkeys(r.status for r in rows)}
    title = f"{len(rows)} run(s) under {root}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    table = Table(title=escape(title))
    for col, justify in (
        ("run", "left"),
        ("model", "left"),
        ("params", "right"),
        ("tokens", "right"),
        ("steps", "right"),
        ("best val loss", "right"),
        ("last evals", "left"),
        ("status", "left"),
        ("size", "right"),
        ("updated", "left"),
    ):
        table.add_column(col, justify=justify)
    style = {"running": "green", "failed": "red", "damaged": "red", "stopped": "yellow"}
    for r in rows:
        m = r.metrics
        steps = "" if m.last_step is None else f"{m.last_step}" + (f"/{r.max_steps}" if r.max_steps else "")
        best = "" if m.best_val is None else f"{m.best_val:.4f} @{m.best_val_step}"
        evals = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.evals.items())
        status = r.status + (f": {r.problem}" if r.problem else "")
        when = datetime.fromtimestamp(r.updated).strftime("%Y-%m-%d %H:%M") if r.updated else ""
        table.add_row(
            escape(r.name),
            escape(r.model),
            _human(r.params),
            _human(m.tokens),
            steps,
            best,
            escape(evals),
            f"[{style[r.status]}]{escape(status)}[/]" if r.status in style else escape(status),
            human_bytes(r.size),
            when,
        )
    # a pipe or a file gets every column whole; a terminal, its own width
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 220).print(table)
