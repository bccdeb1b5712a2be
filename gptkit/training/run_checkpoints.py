"""The run's checkpoints, with a graceful stop on SIGINT/SIGTERM. (What training measures:
training/metrics.py.)"""

from __future__ import annotations

import re
import signal
import threading
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from gptkit.checkpoints import LAST_CHECKPOINT, link_checkpoint, remove_checkpoint, replace_checkpoint
from gptkit.faults import fault_point
from gptkit.remote import push_checkpoint
from gptkit.training.metrics import optimizer_stepped
from gptkit.training.stopping import skipped_validation

PERIODIC = re.compile(r"step-(\d+)\.ckpt")
BEST_CHECKPOINT = "best.ckpt"


def periodic_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The periodic checkpoints (files or sharded folders) of a checkpoint folder, oldest step first."""
    found = [
        (int(m.group(1)), p) for p in Path(ckpt_dir).glob("step-*.ckpt") if (m := PERIODIC.fullmatch(p.name))
    ]
    return [p for _, p in sorted(found)]


class RunCheckpoints(Callback):
    """Every `every` optimizer steps: checkpoints/step-NNNNNN.ckpt, with last.ckpt a hard link to it (no
    second write); at the step that ends this invocation: last.ckpt. That step is the last one
    (max_steps), trainer.stop_at_step, or the step during which SIGINT (Ctrl-C) or SIGTERM (preemption)
    arrived: the step is finished first, then saved, then the run stops (with several ranks, at the next
    multiple of sync_every steps, so that all ranks stop together). A validation that has not started is
    skipped: the one due at that step (every val_every steps, and at the end) and the one Lightning runs
    when a run stops early. The checkpoint records a skipped validation (`unvalidated`) and the resume runs
    it before its first step, so that the resumed run ends equal to an uninterrupted one. A signal during a
    validation lets it finish (its rows are the checkpoint's); the next step is then the one saved. A
    second Ctrl-C interrupts at once (`interrupted` is then True). keep: periodic checkpoints kept (None:
    all).

    The saves happen inside the training loop (as Lightning's own ModelCheckpoint does), so a resumed
    run continues Lightning's step counters exactly.

    A checkpoint is written in two phases. At the end of an optimizer step it is saved completely under a
    hidden name (checkpoints/.step-NNNNNN.ckpt.pending, fsynced; or a sharded folder); it is published
    (renamed to step-NNNNNN.ckpt, last.ckpt pointed at it) at the start of the next step, once the
    metrics of every step it covers and the validation that followed it are on disk (MetricsCSV.sync);
    fit publishes the final one after the final validation. So a kill at any moment leaves last.ckpt and
    metrics.csv in agreement: a resume continues exactly, with exactly the rows before its step. After a
    publication, periodic checkpoints beyond the newest `keep` are removed (the newer one is complete
    first); last.ckpt stays. A run under runs_dir=s3://... (its staging folder) then uploads the published
    checkpoint, COMPLETE last (gptkit/remote.py).

    keep_best (trainer.keep_best): after a validation whose val/loss is the lowest so far (over resumes
    too: the value travels in the checkpoint), checkpoints/best.ckpt, written under a hidden name and
    renamed into place; retention never removes it.
    """

    def __init__(
        self,
        ckpt_dir: str,
        every: int,
        stop_at_step: int | None = None,
        sync_every: int = 10,
        keep: int | None = 3,
        metrics: Any = None,
        keep_best: bool = False,
        val_every: int | None = None,
    ) -> None:
        self.dir = Path(ckpt_dir)
        self.every = max(1, every)
        self.stop_at_step = stop_at_step
        # with several ranks: agree on a signal every N steps
        self.sync_every = max(1, sync_every)
        self.keep = keep
        # MetricsCSV (or None): synced before a checkpoint is published
        self.metrics = metrics
        self.keep_best = keep_best
        # trainer.val_every (None: no validation is due between the run's ends)
        self.val_every = val_every
        # the step whose validation a signal skipped (it travels in the checkpoint; the resume runs it)
        self.unvalidated: int | None = None
        # the lowest val/loss so far (trainer.keep_best)
        self.best_val: float | None = None
        self.signal_name: str | None = None
        self.interrupted = False
        # the step of this invocation's latest validation (final_validation does not repeat it)
        self.validated_at: int | None = None
        # (written, where it is published)
        self._pending: tuple[Path, Path] | None = None
        # the optimizer step of the pending checkpoint (its name in a bucket: gptkit/remote.py)
        self._pending_step = 0
        self._previous: dict[int, Any] = {}

    @property
    def last(self) -> Path:
        """checkpoints/last.ckpt of the run."""
        return self.dir / LAST_CHECKPOINT

    # ---- signals ----
    def _handler(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self.interrupted = True
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def on_train_start(self, trainer, pl_module) -> None:
        """Install the SIGINT/SIGTERM handlers (main thread only); a resumed run whose checkpoint a signal
        saved before its validation runs that validation first."""
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handler)
        # (at trainer.max_steps fit has nothing to train: fit.final_validation runs it)
        if self.unvalidated is not None and self.unvalidated == trainer.global_step:
            self.unvalidated = None
            skipped_validation(trainer)

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _stop_requested(self, trainer) -> bool:
        stop = self.signal_name is not None
        if trainer.world_size > 1:
            # every rank stops at the same step, whichever rank got the signal; the vote is a collective
            # with a host sync, so it is taken every sync_every steps rather than every step
            if trainer.global_step % self.sync_every and trainer.global_step < trainer.max_steps:
                return False
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
            self.signal_name = self.signal_name or ("SIGTERM" if stop else None)
        return stop

    # ---- saving ----
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Publish the checkpoint saved at the end of the previous step."""
        # the previous step's rows and validation are logged by now
        self.publish(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """At a checkpoint step or a requested stop: check the NaN window, save, maybe stop."""
        if not optimizer_stepped(trainer, batch_idx):
            return
        step = trainer.global_step
        fault_point("step")
        stop = self._stop_requested(trainer)
        early = self.stop_at_step is not None and step >= self.stop_at_step
        if step % self.every == 0 or stop or early or step >= trainer.max_steps:
            # never save what a NaN step produced
            pl_module.loss_window.check_finite(trainer.strategy)
            self.publish(trainer)
            target = self.dir / f"step-{step:06d}.ckpt" if step % self.every == 0 else self.last
            written = target.with_name(f".{target.name}.pending")
            # a signal skips the validation due now: the checkpoint says so (state_dict)
            due = bool(self.val_every) and step % int(self.val_every) == 0
            self.unvalidated = step if stop and (due or step >= trainer.max_steps) else None
            trainer.save_checkpoint(written, weights_only=False)
            self._pending, self._pending_step = (written, target), step
            fault_point("ckpt-pending")
        if stop:
            # Lightning validates at a step where should_stop is set (for early stopping): not after a
            # signal, which asks for a prompt stop
            trainer.limit_val_batches = 0
        if stop or early:
            trainer.should_stop = True

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        """A fault-injection point (gptkit/faults.py): a kill or a signal during a validation."""
        fault_point("validation")

    def on_validation_end(self, trainer, pl_module) -> None:
        """trainer.keep_best: a new lowest val/loss saves checkpoints/best.ckpt (every rank saves; rank 0
        renames it into place once the rows so far are on disk)."""
        if not trainer.sanity_checking:
            self.validated_at = trainer.global_step
        val = trainer.callback_metrics.get("val/loss")
        if not self.keep_best or val is None or trainer.sanity_checking:
            return
        val = float(val)
        if self.best_val is not None and not val < self.best_val:
            return
        self.best_val = val
        best = self.dir / BEST_CHECKPOINT
        written = best.with_name(f".{best.name}.pending")
        trainer.save_checkpoint(written, weights_only=False)
        if trainer.is_global_zero:
            if self.metrics is not None:
                self.metrics.sync()
            replace_checkpoint(written, best)

    def state_dict(self) -> dict[str, Any]:
        """The lowest val/loss so far, so that a resumed run keeps best.ckpt only for a better one; the step
        whose validation a signal skipped, which the resume runs."""
        return {"best_val": self.best_val, "unvalidated": self.unvalidated}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the lowest val/loss and the skipped validation of the run being resumed."""
        self.best_val = state_dict.get("best_val")
        self.unvalidated = state_dict.get("unvalidated")

    def publish(self, trainer: L.Trainer) -> Path | None:
        """Publish the checkpoint written last, once the metrics it covers are on disk (rank 0 renames;
        the other ranks only forget it). Returns where it went."""
        if self._pending is None:
            return None
        written, target = self._pending
        self._pending = None
        if not trainer.is_global_zero:
            return target
        if self.metrics is not None:
            self.metrics.sync()
        replace_checkpoint(written, target)
        if target != self.last:
            fault_point("ckpt-published")
            link_checkpoint(target, self.last)
        fault_point("last-replaced")
        self._retain()
        # a run under an s3:// runs_dir's staging folder: uploaded (COMPLETE last), else nothing
        push_checkpoint(self.dir.parent, target, self._pending_step, self.keep)
        return target

    def _retain(self) -> None:
        if self.keep is None:
            return
        old = periodic_checkpoints(self.dir)
        for path in old[: max(0, len(old) - self.keep)]:
            remove_checkpoint(path)

    def discard(self, trainer: L.Trainer) -> None:
        """Drop a checkpoint that will not be published (the run failed before its rows were written)."""
        if self._pending is not None and trainer.is_global_zero:
            remove_checkpoint(self._pending[0])
        self._pending = None

    def on_train_end(self, trainer, pl_module) -> None:
        """Restore the signal handlers."""
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Discard an unpublished checkpoint and restore the signal handlers."""
        self._restore()
        self.discard(trainer)
