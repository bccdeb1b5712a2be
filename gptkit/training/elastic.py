"""torchrun --max-restarts: the run folder a restarted worker continues. Torch-free, so that `gptkit train`
reads it before it imports torch (a refused config imports none: tests/front/test_cli_strict.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def elastic_resume(keys: dict[str, str | None]) -> Path | None:
    """The run folder a worker torchrun restarted (--max-restarts: TORCHELASTIC_RESTART_COUNT > 0) continues:
    torchrun runs the same command again, name= and all, and that run's folder holds its first attempt's
    checkpoints, which a new run there would refuse. None when this is no restart, the command names
    resume= itself, or no checkpoint was published before the failure (the run starts over).
    keys: the command line's resume, init_from, name and runs_dir."""
    from gptkit.checkpoints import CHECKPOINT_DIR, LAST_CHECKPOINT

    name = keys.get("name")
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) == 0 or not name or "${" in name:
        return None
    # resume= continues its own run again; init_from= (a fine-tune) is continued as any new run is
    if keys.get("resume") not in (None, "", "null"):
        return None
    run_dir = Path(keys.get("runs_dir") or "runs").expanduser() / name
    if not (run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT).exists():
        return None
    if int(os.environ.get("RANK") or 0) == 0:
        print(
            f"note: torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: continuing {run_dir} from "
            "its last checkpoint (resume=)",
            file=sys.stderr,
        )
    return run_dir
