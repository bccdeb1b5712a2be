"""The run's checkpoints, with a graceful stop on SIGINT/SIGTERM. (What training measures: training/metrics.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from gptkit.checkpoints import LAST_CHECKPOINT
from gptkit.training.metrics import optimizer_stepped


class RunCheckpoints(Callback):
    """The one writer of a run's checkpoints, and the graceful stop.

    Every `every` optimizer steps it writes checkpoints/step-NNNNNN.ckpt and points last.ckpt at it
    (a hard link: no second write); at the step that ends this invocation it writes last.ckpt. That
    step is the last one (max_steps), trainer.stop_at_step, or the step during which SIGINT (Ctrl-C)
    or SIGTERM (preemption) arrived: the step is finished first, then saved, then the run stops (with
    several ranks, at the next multiple of sync_every steps, so that all ranks stop together). A second
    Ctrl-C interrupts at once.

    The saves happen inside the training loop (as Lightning's own ModelCheckpoint does), so a resumed
    run continues Lightning's step counters exactly.
    """

    def __init__(self, ckpt_dir: str, every: int, stop_at_step: int | None = None, sync_every: int = 10) -> None:
        self.dir = Path(ckpt_dir)
        self.every = max(1, every)
        self.stop_at_step = stop_at_step
        self.sync_every = max(1, sync_every)  # with several ranks: agree on a signal every N steps
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def last(self) -> Path:
        return self.dir / LAST_CHECKPOINT

    def _handler(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def on_train_start(self, trainer, pl_module) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

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

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not optimizer_stepped(trainer, batch_idx):
            return
        step = trainer.global_step
        stop = self._stop_requested(trainer)
        early = self.stop_at_step is not None and step >= self.stop_at_step
        final = stop or early or step >= trainer.max_steps
        if step % self.every == 0 or final:
            pl_module.loss_window.check_finite(trainer.strategy)  # never save what a NaN step produced
        if step % self.every == 0:
            periodic = self.dir / f"step-{step:06d}.ckpt"
            trainer.save_checkpoint(periodic, weights_only=False)
            if not self._link_last(trainer, periodic):
                trainer.save_checkpoint(self.last, weights_only=False)
        elif final:
            trainer.save_checkpoint(self.last, weights_only=False)
        if stop or early:
            trainer.should_stop = True

    def _link_last(self, trainer, periodic: Path) -> bool:
        """last.ckpt as a hard link to the periodic file just written (atomically replacing the old one).
        False when that cannot be done (a sharded folder, or a filesystem without hard links)."""
        ok = True
        if trainer.is_global_zero:
            ok = periodic.is_file()
            if ok:
                tmp = self.dir / f".{LAST_CHECKPOINT}.link.tmp"
                try:
                    tmp.unlink(missing_ok=True)
                    os.link(periodic, tmp)
                    os.replace(tmp, self.last)
                except OSError:
                    tmp.unlink(missing_ok=True)
                    ok = False
        return trainer.strategy.broadcast(ok)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()
