"""Reads every rank's shard of an FSDP checkpoint in one process (no GPUs, no process group) and
writes a single file: the same format as a single-device checkpoint, optimizer state included, so
it resumes (any strategy, any world size), samples, evaluates and exports anywhere.
`sample`, `eval`, `export` and `train resume=` also read a sharded folder directly.

Examples:
  gptkit consolidate runs/my-fsdp-run                     (-> checkpoints/last.consolidated.ckpt)
  gptkit consolidate runs/my-fsdp-run/checkpoints/step-001000.ckpt out=/tmp/step1000.ckpt
"""

from __future__ import annotations

import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.checkpoints import consolidate, is_sharded_checkpoint
    from gptkit.errors import GptkitError
    from gptkit.fsio import remove_dead_temps
    from gptkit.runs import find_run_checkpoint

    ckpt = find_run_checkpoint(str(cfg.run), need="sharded")
    if not is_sharded_checkpoint(ckpt):
        raise GptkitError(f"{ckpt} is already a single-file checkpoint; there is nothing to consolidate")
    out = Path(str(cfg.out)) if cfg.out else ckpt.with_name(ckpt.stem + ".consolidated.ckpt")
    if out.exists() and not cfg.force:
        raise GptkitError(f"{out} already exists; pass force=true to replace it or choose another out=")
    # what a killed earlier consolidation of `out` left
    remove_dead_temps(out)
    written = consolidate(ckpt, out)
    print(f"consolidated {ckpt} -> {written} ({written.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)
    print(written)
    return 0
