"""Checkpoint I/O for Lightning: atomic writes (temp file + rename) and safe loads (weights_only)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.plugins.io import CheckpointIO

from gptkit.checkpoints import atomic_torch_save, load_checkpoint


class SafeAtomicCheckpointIO(CheckpointIO):
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None
    ) -> None:
        """Write the checkpoint to a temporary file, then rename it into place."""
        # a sharded checkpoint of an FSDP run that now continues with another strategy
        if Path(path).is_dir():
            shutil.rmtree(path)
        # a kill during the save leaves the previous file intact
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(
        self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a checkpoint with weights_only=True (a checkpoint cannot run code)."""
        # torch.load(weights_only=True): a checkpoint cannot run code
        return load_checkpoint(path)

    def remove_checkpoint(self, path) -> None:
        """Remove a checkpoint file."""
        Path(path).unlink(missing_ok=True)
