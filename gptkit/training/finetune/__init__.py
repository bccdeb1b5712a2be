"""Fine-tunes: one interface (base.Finetune), one table.

    full    every weight trains (the default)
    lora    low-rank adapters on frozen weights (lora.py; docs/lora.md)
    qlora   the same adapters on a base whose linear weights are NF4 (qlora.py; docs/qlora.md)

LitGPT, the plan, the memory estimate and the start-up lines call the interface and never ask which
fine-tune they run. A new fine-tune is a file here with its Finetune subclass, and one row of FINETUNES.
"""

from __future__ import annotations

from typing import Any

from gptkit import adapters
from gptkit.errors import ConfigError, GptkitError
from gptkit.training.finetune.base import Finetune
from gptkit.training.finetune.full import Full
from gptkit.training.finetune.lora import LoRA
from gptkit.training.finetune.qlora import QLoRA

FINETUNES: dict[str, type[Finetune]] = {"full": Full, "lora": LoRA, "qlora": QLoRA}

__all__ = [
    "FINETUNES",
    "Finetune",
    "check_finetune",
    "check_resumed_finetune",
    "finetune_class",
    "written_by",
]


def finetune_class(cfg: Any) -> type[Finetune]:
    """The fine-tune a config names (finetune=; full when unset)."""
    name = str(cfg.get("finetune") or "full")
    if name not in FINETUNES:
        raise ConfigError(
            f"finetune={name} must be full (every weight trains), lora (adapters on frozen weights) or "
            f"qlora (adapters on an NF4-quantized frozen base)"
        )
    return FINETUNES[name]


def check_finetune(cfg: Any, has_weights: bool) -> None:
    """finetune= names a fine-tune, whose settings are checked (has_weights: init_from= or resume= gives
    starting weights, which lora and qlora need)."""
    finetune_class(cfg).check_config(cfg, has_weights)


def written_by(checkpoint: dict[str, Any]) -> str:
    """The fine-tune whose run wrote a checkpoint (its non-tensor state suffices): full without an adapter
    record, else the one the record names (lora before qlora existed)."""
    record = checkpoint.get(adapters.CHECKPOINT_KEY)
    return "full" if record is None else str(record.get("finetune", "lora"))


def check_resumed_finetune(resume: Any, saved: Any, merged: Any, checkpoint: dict[str, Any]) -> None:
    """resume= continues the run's own finetune= (its checkpoint holds every weight, or the adapters only)
    and what that fine-tune fixes (lora: the adapters' rank, alpha and targets). saved: the run's config;
    merged: the resumed one."""
    asked, have = str(merged.get("finetune") or "full"), written_by(checkpoint)
    if asked != have:
        cls = FINETUNES.get(have, LoRA)
        merged_words = "" if cls.saves_every_weight else " (its base with the adapters merged)"
        raise GptkitError(
            f"resume={resume} continues a finetune={have} run (its checkpoint holds {cls.holds}); "
            f"for finetune={asked} start a new run: init_from={resume}{merged_words} finetune={asked}"
        )
    FINETUNES[have].check_resume(resume, saved, merged)
