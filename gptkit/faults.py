"""Fault injection for the crash tests: GPTKIT_FAULT=<point>[@<n>] makes this process kill itself with
SIGKILL (as `kill -9` would) the n-th time (default: the first) it passes the named point.
GPTKIT_FAULT=<point>[@<n>]:<SIGNAL> (SIGTERM, SIGINT, ...) sends that signal instead, as a scheduler or a
terminal's Ctrl-C would: to the whole process group when this process leads its group (a terminal's Ctrl-C
reaches a prepare's workers too), else to this process alone. SIGKILL goes to this process alone.
Nothing happens unless the variable is set; tests/reliability/test_faults.py,
tests/reliability/test_signals.py, tests/reliability/test_object_storage.py, .ci/fault-loop and .ci/multinode
use it. Under torchrun only the first attempt faults: a worker torchrun restarts (--max-restarts,
TORCHELASTIC_RESTART_COUNT > 0) inherits the variable but runs clean, as a job whose fault was transient
would; so does a worker Ray Train restarted (trainer.launcher=ray: GPTKIT_RESTART_COUNT > 0).
GPTKIT_FAULT_RANK=<r> limits the fault to the process of global rank r (RANK), as .ci/ray kills one worker
of two.

Points (where the writers call fault_point):
  step             RunCheckpoints, after each optimizer step (before that step's checkpoint, if any)
  ckpt-tmp         atomic_torch_save: the temporary file written, not yet renamed
  ckpt-pending     RunCheckpoints: a complete checkpoint waiting to be published (its rows not yet synced)
  ckpt-published   RunCheckpoints: step-N.ckpt renamed into place, last.ckpt still the previous one
  last-replaced    RunCheckpoints: last.ckpt replaced, older checkpoints not yet removed
  metrics-rewrite  MetricsCSV: the rewritten metrics.csv in its temporary file, not yet renamed
  metrics-append   MetricsCSV: rows appended to metrics.csv (not yet fsynced)
  prepare-batch    prepare(): a batch of tokens appended to the shard being built, not yet synced
  prepare-shard    prepare(): the shard synced and progress.json recording it replaced (a complete shard)
  prepare-shards   prepare() (data=tokens too): token shards and manifest written in the build folder, not yet
                   renamed
  staged           staged_dir (export, import): the folder complete under its temporary name, not yet renamed
  remote-upload    gptkit/remote.py: a folder's first file uploaded to the bucket, no manifest or COMPLETE yet
  validation       RunCheckpoints: before each validation batch (the final validation's too)
  rollout          objective=grpo: a micro-batch's completions sampled and scored, its loss not yet computed
"""

from __future__ import annotations

import os
import signal

ENV = "GPTKIT_FAULT"
# set by torchrun in each worker: how many times it has restarted the workers
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
# the same count in a Ray Train worker (gptkit/training/ray_train.py)
RAY_RESTART_ENV = "GPTKIT_RESTART_COUNT"
# only the process of this global rank faults
RANK_ENV = "GPTKIT_FAULT_RANK"
_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec or any(int(os.environ.get(k) or 0) > 0 for k in (RESTART_ENV, RAY_RESTART_ENV)):
        return
    rank = os.environ.get(RANK_ENV)
    if rank not in (None, "") and rank != (os.environ.get("RANK") or "0"):
        return
    where, _, sig = spec.partition(":")
    point, _, nth = where.partition("@")
    if point != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] != int(nth or 1):
        return
    signum = signal.Signals[sig] if sig else signal.SIGKILL
    if signum != signal.SIGKILL and os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signum)
    else:
        os.kill(os.getpid(), signum)
