"""The curves of several runs overlaid in one PNG, a panel per curve they have (loss, val loss, lr, grad
norm, throughput, each eval/ column): the runs page's overlay without a browser (docs/runs-page.md).

Examples:
  gptkit compare runs=[runs/a,runs/b] out=compare.png
  gptkit compare runs=[a,b,c] x=tokens
"""

from __future__ import annotations

from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.errors import ConfigError
    from gptkit.runs import is_run_folder
    from gptkit.runs_page.compare import draw_compare

    names = cfg.runs
    if isinstance(names, str):
        names = [names]
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"runs={names!r} must be a list of run folders, e.g. runs=[runs/a,runs/b]")
    runs = []
    for name in names:
        path = Path(name)
        if not path.is_dir() and (Path(str(cfg.runs_dir)) / name).is_dir():
            path = Path(str(cfg.runs_dir)) / name
        if not is_run_folder(path):
            raise ConfigError(f"runs=: {name} is not a run folder (none there, nor under {cfg.runs_dir}/)")
        runs.append((name, path))
    # the legend names a run by its folder's name, or as given where two names would be the same
    short = [Path(n).name for n, _ in runs]
    if len(set(short)) == len(short):
        runs = [(s, p) for s, (_, p) in zip(short, runs)]
    print(draw_compare(runs, str(cfg.out), x=str(cfg.x)))
    return 0
