"""finetune=full: every weight trains and every checkpoint holds them all (the interface's defaults)."""

from __future__ import annotations

from gptkit.training.finetune.base import Finetune


class Full(Finetune):
    """Every weight trains (the default)."""

    name = "full"
