"""Ctrl-C (SIGINT) and SIGTERM during the final validation, which runs after Lightning's fit: handled as
during training. The checkpoint of the finished last step is kept (published as last.ckpt), the validation
stops, and the run ends with the signal's exit status (130 / 143); a resume then runs the final validation.
And the validation a signal skipped during training (RunCheckpoints), which a resume runs first."""

from __future__ import annotations

import signal
import threading
from typing import Any


class _Stop(BaseException):
    """Raised by the handler to leave trainer.validate (a KeyboardInterrupt would make Lightning exit 1)."""


def final_validation(trainer: Any, module: Any, datamodule: Any, checkpoints: Any) -> None:
    """trainer.validate with SIGINT/SIGTERM stopping it: `checkpoints` (RunCheckpoints) then names the signal
    (signal_name) and still holds the last step's checkpoint for its publication. A step already validated
    is not validated again: Lightning validates the step at which trainer.stop_at_step sets should_stop."""
    # every rank skips it alike: each saw the same validations
    if checkpoints.validated_at == trainer.global_step:
        return
    # Lightning's on_exception would discard it
    pending, checkpoints._pending = checkpoints._pending, None

    def stop(signum, frame) -> None:
        checkpoints.signal_name = signal.Signals(signum).name
        raise _Stop

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    except _Stop:
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        checkpoints._pending = pending


def skipped_validation(trainer: Any) -> None:
    """Inside fit, before the first step of a resumed run: the validation at the checkpoint's step that a
    signal skipped (RunCheckpoints.unvalidated), run as Lightning runs one between two steps, and logged at
    that step. Lightning's own resume takes a checkpoint saved at the end of a step as validated."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    # a fresh validation, not the continuation of the restored one
    loop.restarting = False
    trainer.validating = True
    try:
        loop.run()
    finally:
        trainer.training = True
