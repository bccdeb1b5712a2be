"""trainer.launcher=ray: gptkit's own training run in each worker of Ray Train's TorchTrainer.

    gptkit train trainer=ddp trainer.launcher=ray trainer.ray.num_workers=2 trainer.ray.max_failures=2 name=r

The driver (this process: `gptkit train`, or gptkit.train from Python) checks the config, claims the run
folder (its lock, held for the whole job) and starts `ray.train.torch.TorchTrainer` with
trainer.ray.num_workers workers (ScalingConfig: one device each), FailureConfig(max_failures) and its
storage in a temporary folder (trainer.ray.storage_path: a shared one for a multi-node cluster). Ray starts
the processes and their process group (gloo on the CPU, NCCL on GPUs); each worker runs fit.plan_run +
fit.run_plan, the same run as any other launcher's, with trainer.devices = the number of workers and Ray's
own Lightning cluster environment (ray.train.lightning.RayLightningEnvironment: the ranks Ray gave) as a
plugin of gptkit's Trainer, whose strategies (trainer=ddp, trainer=fsdp) are gptkit's. Global rank 0 writes
the run folder, as always.

A worker that dies (a kill, a lost node) fails Ray's worker group; Ray starts a new group (up to max_failures
times) and each worker of it continues the run folder from checkpoints/last.ckpt, as resume= would (the
steps since that checkpoint are done again). A gptkit error (a bad config, bad data) is not retried: it is
the driver's one line. Without address, Ray itself is started for the run (no dashboard, a small object
store) and stopped after it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from gptkit.checkpoints import CHECKPOINT_DIR, LAST_CHECKPOINT
from gptkit.errors import GptkitError
from gptkit.extras import MissingExtra, pip, require
from gptkit.faults import RAY_RESTART_ENV
from gptkit.runs import LOCK_HOLDER_ENV, check_run_dir, claim_run_dir, unused

# Ray's smallest object store is 75 MiB; gptkit passes no objects through it (the workers read the data)
OBJECT_STORE_BYTES = 80 * 1024 * 1024
# the keys a restarted worker takes from the command line (the rest: the run's saved config), as torchrun's
KEPT_ON_RESTART = ("trainer", "logger")


def is_ray(t: Any) -> bool:
    """Whether trainer.launcher is ray."""
    return str(t.get("launcher") or "") == "ray"


def launcher_config(cfg: DictConfig, inv) -> Optional[DictConfig]:
    """The trainer settings of a run trainer.launcher=ray launches (a resume's: its saved config with the
    command line's), or None when the run is not Ray's. inv: the run's fit.Invocation."""
    from gptkit.training.start import resumed_config

    t = cfg.trainer
    if cfg.get("resume") not in (None, ""):
        t = resumed_config(cfg, inv.overrides).trainer
    return t if is_ray(t) else None


def train_on_ray(
    cfg: DictConfig, t: DictConfig, *, run_dir: Optional[Path] = None, overrides=None, options=None
):
    """The driver: the run in trainer.ray.num_workers Ray Train workers; returns rank 0's TrainResult.
    t: the run's trainer settings (launcher_config)."""
    from gptkit.training.distributed import accelerator_type
    from gptkit.training.fit import TrainResult, _refuse_checkpoints, invocation

    require("ray", "trainer.launcher=ray needs")
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as exc:
        raise MissingExtra(
            f"trainer.launcher=ray needs ray.train, which cannot be imported ({exc}): {pip('ray')}"
        ) from None
    inv = invocation(cfg, run_dir, overrides, options)
    run_dir = inv.run_dir.resolve()
    claim_run_dir(run_dir, remove_if_unused=unused(run_dir))
    check_run_dir(run_dir, cfg.runs_dir, job=inv.multirun_job)
    if cfg.get("resume") in (None, ""):
        _refuse_checkpoints(run_dir)
    # (a run saved before trainer.ray existed, resumed with trainer.launcher=ray: the defaults)
    r = t.get("ray") or {}
    workers = int(r.get("num_workers") or 1)
    cfg = cfg.copy()
    # the world is Ray's workers (the run's config.yaml says so; a resume's too); the folder, as the driver
    # resolved it
    cfg.trainer.devices = workers
    cfg.name, cfg.runs_dir = run_dir.name, str(run_dir.parent)
    given = [o.arg for o in inv.overrides if o.key != "trainer.devices"]
    gpu = accelerator_type(t) == "cuda"
    with tempfile.TemporaryDirectory(prefix="gptkit-ray-", dir=r.get("storage_path")) as store:
        job = {
            "cfg": OmegaConf.to_container(cfg, resolve=False),
            "run_dir": str(run_dir),
            "overrides": [*given, f"trainer.devices={workers}"],
            "store": store,
            "cwd": os.getcwd(),
            "env": {k: v for k, v in os.environ.items() if k.startswith("GPTKIT_")},
            "lock_holder": str(os.getpid()),
        }
        started_here = not ray.is_initialized()
        if started_here:
            _start_ray(ray, r, workers)
        relay = _Relay(Path(store) / "rank0.log")
        try:
            trainer = TorchTrainer(
                _worker,
                train_loop_config=job,
                torch_config=TorchConfig(
                    backend="nccl" if gpu else "gloo", timeout_s=int(t.get("process_group_timeout_s") or 1800)
                ),
                scaling_config=ScalingConfig(
                    num_workers=workers,
                    use_gpu=gpu,
                    resources_per_worker={"CPU": float(r.get("cpus_per_worker") or 1)},
                ),
                run_config=RunConfig(
                    name=f"gptkit-{run_dir.name}",
                    storage_path=str(Path(store) / "ray"),
                    failure_config=FailureConfig(max_failures=int(r.get("max_failures") or 0)),
                ),
            )
            failure = None
            try:
                trainer.fit()
            except Exception as exc:  # Ray's TrainingFailedError and the like: its first line, below
                failure = exc
        finally:
            relay.stop()
            if started_here:
                ray.shutdown()
        error = _read(Path(store), "error")
        if error is not None:
            raise GptkitError(error)
        if failure is not None:
            raise GptkitError(
                f"Ray Train's workers failed (trainer.ray.max_failures={r.get('max_failures') or 0} restarts "
                f"allowed): {_summary(failure)}; the run folder keeps its checkpoints: continue with gptkit "
                f"train resume={run_dir}"
            )
        result = _read(Path(store), "result")
    if result is None:
        raise GptkitError(f"Ray Train's job ended without a result from rank 0 ({run_dir})")
    done = json.loads(result)
    return TrainResult(
        Path(done["run_dir"]),
        int(done["step"]),
        Path(done["last_checkpoint"]),
        done["stopped_by"],
        done["val_loss"],
        done["tokens_per_s"],
        True,
    )


def _summary(exc: BaseException) -> str:
    """Ray's failure in a few words: each failed rank's first line (a WorkerGroupError's), else the
    exception's first line."""

    def first(e: BaseException) -> str:
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
        line = line or type(e).__name__
        return line if len(line) <= 200 else line[:197] + "..."

    failures = getattr(exc, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {first(err)}" for rank, err in sorted(failures.items()))
    return first(exc)


def _start_ray(ray, r: Any, workers: int) -> None:
    """Ray for this run: the cluster at trainer.ray.address, else a local one sized for the workers (no
    dashboard, the smallest object store). The workers' output reaches this terminal: gptkit's own lines are
    there."""
    import logging

    # Ray Train's own settings, which it passes on to its controller and workers: print() as print (gptkit's
    # lines reach this terminal through _Relay), no preemption watcher polling the cluster
    for key in ("RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"):
        os.environ.setdefault(key, "0")
    address = r.get("address")
    if address:
        ray.init(address=str(address), logging_level=logging.WARNING, log_to_driver=False)
        return
    ray.init(
        num_cpus=max(1, int(workers * float(r.get("cpus_per_worker") or 1) + 0.999)),
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


class _Relay:
    """Rank 0's output (gptkit's own lines: the plan, progress, the summary), copied from the file the worker
    writes it to onto this process's stderr while the job runs; Ray's own actors' logs stay in Ray's session
    folder (log_to_driver=False)."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path, self.offset = path, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            self._copy()

    def _copy(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        if data:
            sys.stderr.write(data.decode(errors="replace"))
            sys.stderr.flush()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self._copy()


def _worker(job: dict) -> None:
    """One Ray Train worker: gptkit's run (fit.plan_run + run_plan) in the run folder; a restarted worker (a
    later attempt of Ray's FailureConfig) continues it from checkpoints/last.ckpt. A gptkit error is recorded
    for the driver's line and ends the worker normally (Ray does not retry what would fail again)."""
    import ray.train

    from gptkit.training.fit import plan_run, run_plan

    rank = ray.train.get_context().get_world_rank()
    store = Path(job["store"])
    # this worker's output (stdout and stderr, Python's and torch's alike) in a file; the driver copies rank
    # 0's onto its terminal
    out = os.open(store / f"rank{rank}.log", os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(job["cwd"])
    os.environ.update(job["env"])
    attempt = _attempt(store, rank)
    os.environ[RAY_RESTART_ENV] = str(attempt)
    # the driver holds the run folder's lock for the job
    os.environ[LOCK_HOLDER_ENV] = job["lock_holder"]
    cfg = OmegaConf.create(job["cfg"])
    run_dir = Path(job["run_dir"])
    overrides = list(job["overrides"])
    if attempt > 0 and (run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT).exists():
        cfg.resume = str(run_dir)
        kept = [a for a in overrides if a.lstrip("+~").startswith(KEPT_ON_RESTART)]
        overrides = [f"resume={run_dir}", *kept]
        if rank == 0:
            print(
                f"note: Ray Train restart {attempt}: continuing {run_dir} from its last checkpoint (resume=)",
                file=sys.stderr,
                flush=True,
            )
    try:
        result = run_plan(plan_run(cfg, run_dir=run_dir, overrides=overrides))
    except GptkitError as exc:
        _record(store, "error", str(exc))
        return
    if rank == 0:
        done = {
            "run_dir": str(result.run_dir),
            "step": result.step,
            "last_checkpoint": str(result.last_checkpoint),
            "stopped_by": result.stopped_by,
            "val_loss": result.val_loss,
            "tokens_per_s": result.tokens_per_s,
        }
        _record(store, "result", json.dumps(done))


def _attempt(store: Path, rank: int) -> int:
    """Which attempt of the job this worker is (0: the first): each rank runs once per attempt, so the
    number of this rank's earlier starts, each a file made once (O_EXCL)."""
    folder = store / "attempts"
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    while True:
        try:
            os.close(os.open(folder / f"rank{rank}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return n
        except FileExistsError:
            n += 1


def _record(store: Path, kind: str, text: str) -> None:
    """A line for the driver (the first one of each kind stays)."""
    try:
        fd = os.open(store / kind, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _read(store: Path, kind: str) -> Optional[str]:
    path = store / kind
    return path.read_text() if path.is_file() else None
