"""Averages step checkpoints of a run (uniformly or with given weights) into a new run folder that
evaluates, samples and exports like any run; merge.json in it records the sources (paths, steps, sizes,
CRC-32, weights). Single-file and sharded (FSDP) checkpoints alike, in bounded memory: one tensor of each
source at a time. The optimizer state is not carried (a merged run does not resume). ema=true: the EMA of
the weights a run trained with trainer.ema keeps in its checkpoints, in place of the weights (one checkpoint:
the EMA as a run folder, which `eval`, `sample` and `export` read). docs/merging.md.

Examples:
  gptkit merge run=runs/my-run last=3                          (-> runs/my-run-merge-400-600-k3)
  gptkit merge run=runs/my-run steps=[400,500,600] weights=[1,2,3] out=runs/my-run-weighted
  gptkit merge run=runs/my-run ema=true            (trainer.ema's average -> runs/my-run-ema-<step>)
"""

from __future__ import annotations

from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from omegaconf import OmegaConf

    from gptkit.errors import GptkitError
    from gptkit.merge import MERGE_FILE, choose_sources, merge_run, parse_merge_options
    from gptkit.runs import METRICS_FILE, check_not_source, resolve_latest

    def plain(v):
        return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v

    ema = cfg.ema
    if not isinstance(ema, bool):
        raise GptkitError(f"ema={ema} must be true or false")
    steps, last, weights = parse_merge_options(plain(cfg.steps), plain(cfg.last), plain(cfg.weights), ema)
    run_dir = resolve_latest(str(cfg.run))
    if not run_dir.is_dir():
        raise GptkitError(f"run={cfg.run}: {run_dir} is not a run folder; pass runs/<name>")
    chosen = choose_sources(run_dir, steps, last)
    if ema and len(chosen) == 1:
        default = f"{run_dir.name}-ema-{chosen[0][0]}"
    else:
        kind = "ema-merge" if ema else "merge"
        default = f"{run_dir.name}-{kind}-{chosen[0][0]}-{chosen[-1][0]}-k{len(chosen)}"
    out = Path(str(cfg.out)).expanduser() if cfg.out else run_dir.parent / default
    # an earlier merge (merge.json, no training in it) may be replaced with force=true; any other run never
    if not ((out / MERGE_FILE).is_file() and not (out / METRICS_FILE).exists()):
        check_not_source(out, run_dir)
    if out.exists() and not cfg.force:
        raise GptkitError(f"{out} already exists; pass force=true to replace it or choose another out=")
    merge_run(run_dir, out, steps, last, weights, ema)
    print(out)
    return 0
