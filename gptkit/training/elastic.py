"""torchrun: the run folder a restarted worker continues (--max-restarts), and the ranks of a job told when
one of them stops with an error (watch_peers). Torch-free outside a torchrun job, so that `gptkit train` reads
it before it imports torch (a refused config imports none: tests/front/test_cli_strict.py)."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# the agent store's key where a rank that stopped leaves its line (one per torchrun attempt)
STOPPED_KEY = "gptkit/stopped"
# how often a rank looks
WATCH_S = 0.5


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


def _shares_agent_store() -> bool:
    """A torchrun worker of several ranks whose agent's TCPStore the workers share
    (TORCHELASTIC_USE_AGENT_STORE=True: plain torchrun, static or c10d rendezvous)."""
    env = os.environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(env.get("WORLD_SIZE") or 1) > 1


def _agent_store():
    """A client of the torchrun agent's TCPStore (_shares_agent_store), or None."""
    env = os.environ
    if not _shares_agent_store():
        return None
    from datetime import timedelta

    import torch.distributed as dist

    try:
        return dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=10),
            wait_for_workers=False,
        )
    except (KeyError, ValueError, RuntimeError):
        return None


@contextmanager
def watch_peers() -> Iterator[None]:
    """Around a torchrun worker's run: when another rank stops with an error (its one line, left in the
    agent's store as it exits), this rank says so in one line and exits 2 too, instead of waiting for it in a
    collective until the process group's timeout (30 min): a rank that refuses its data before training
    never joins the process group, and under a static rendezvous (a PyTorchJob's PET_* variables) nothing
    else ends the others. This rank's own GptkitError is left there for the others. A no-op outside such a
    job."""
    from gptkit.errors import GptkitError

    if not _shares_agent_store():
        yield
        return
    key = f"{STOPPED_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}"
    done = threading.Event()

    def watch() -> None:
        # a client of its own: a store client is not shared across threads
        mine = _agent_store()
        while mine is not None and not done.wait(WATCH_S):
            try:
                if not mine.check([key]):
                    continue
                line = mine.get(key).decode()
            except RuntimeError:
                return
            print(f"error: {line}; this rank stops too", file=sys.stderr, flush=True)
            os._exit(2)
            # (reached only where os._exit is a test's stand-in)
            return

    threading.Thread(target=watch, daemon=True, name="watch-peers").start()
    try:
        yield
    except GptkitError as exc:
        done.set()
        # a client made now: one per rank while all is well (the watcher's)
        store = _agent_store()
        try:
            if store is not None:
                store.set(key, f"rank {os.environ.get('RANK')} stopped: {exc}")
        except RuntimeError:
            pass
        raise
    finally:
        done.set()
