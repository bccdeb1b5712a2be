"""The interface every fine-tune implements: which weights train, how the model gets them, what a checkpoint
holds. A fine-tune is applied to a built model from outside it (the model never asks which one it runs).

LitGPT (gptkit/training/module.py), the plan, the memory estimate, the start-up lines and the checkpoint
loaders call it and never ask which fine-tune they run:

    plan time (classmethods, from the config alone)
        check_config(cfg, has_weights)     its settings, and whether it needs starting weights (one line)
        check_model(cfg, model_cfg)        its settings against the model they apply to
        adapters(cfg)                      the adapters' settings (plan.lora; None: no adapters)
        base_checkpoint(cfg, init, resume) the checkpoint of its frozen base (plan.lora_base; None: none)
        check_resume(resume, saved, now)   what a resume may not change (the checkpoint would not fit)
        flops(model, adapters, counts, dense, causal), flops_convention   FLOPs per token and their words
        memory(plan, mem)                  the count-params estimate's tensors, as it keeps them
        describe(plan, trainable, n)       its start-up line; checkpoint_bytes(plan, trainable)
    run time (an instance per run, given the plan)
        apply(model) -> trainable          in LitGPT.__init__, on the freshly built model (meta with
                                           `materializes`, whose weights materialize() puts in place later)
        materialize(module, device)        configure_model: the weights, after FSDP2 sharded the model
        reference()                        the frozen starting model an objective measures against, when the
                                           fine-tune has one of its own (LoRA: the adapters off)
        checkpoint_state(state, prefix)    what of a state dict a checkpoint holds
        on_save_checkpoint, on_load_checkpoint

A new fine-tune is one file with a subclass and one row of gptkit/training/finetune/__init__.py. torchtune's
peft/ (adapters as modules beside the weights, NF4 bases) and PEFT's adapter format are the models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Optional

from gptkit.errors import ConfigError


class Finetune:
    """One way to fine-tune (see the module docstring). The defaults are full fine-tuning's: every weight
    trains, a checkpoint holds every weight, nothing to check."""

    name: ClassVar[str] = ""
    # what a checkpoint holds, for the one-line errors of a resume (a run's own finetune= only)
    holds: ClassVar[str] = "every weight"
    # a checkpoint holds every weight (strict loading); else only checkpoint_state()'s
    saves_every_weight: ClassVar[bool] = True
    # the base trains (a mixture's expert bias moves with it); else it is frozen
    trains_base: ClassVar[bool] = True
    # an objective's reference is the fine-tune's own (reference()), not a second copy of the weights
    own_reference: ClassVar[bool] = False
    # the model is built on the meta device and materialize() puts its weights in place (configure_model)
    materializes: ClassVar[bool] = False
    # the start-up words of the FLOPs count
    flops_convention: ClassVar[str] = "6N + 12·L·T·d_attn, as count-params"

    # ---- plan time ----------------------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: Any, has_weights: bool) -> None:
        """Its settings, before any model is known; has_weights: init_from= or resume= gives weights."""

    @classmethod
    def check_model(cls, cfg: Any, model_cfg: Any) -> None:
        """Its settings against the model (one-line ConfigErrors)."""

    @classmethod
    def adapters(cls, cfg: Any) -> Optional[dict]:
        """The adapters' settings (rank, alpha, dropout, targets): plan.lora; None without adapters."""
        return None

    @classmethod
    def base_checkpoint(
        cls, cfg: Any, model_cfg: Any, init_ckpt: Optional[Path], resume_ckpt: Optional[Path]
    ) -> Optional[Path]:
        """The checkpoint of the frozen weights (plan.lora_base), checked; None when every weight trains."""
        return None

    @classmethod
    def check_resume(cls, resume: Any, saved: Any, now: Any) -> None:
        """A resume (of a run of this fine-tune) may not change what its checkpoint's shape depends on:
        `saved` is the run's config, `now` the resumed one; a difference is a one-line GptkitError."""

    @classmethod
    def flops(
        cls, model_cfg: Any, adapters: Optional[dict], counts: Any, dense: float, causal: float
    ) -> tuple[float, float]:
        """Training FLOPs per token (full-attention and causal conventions) for what it trains."""
        return dense, causal

    @classmethod
    def memory(cls, plan: Any, mem: dict[str, float]) -> dict[str, float]:
        """The count-params estimate's tensors (weights, gradients, optimizer) as it keeps them."""
        return mem

    @classmethod
    def describe(cls, plan: Any, trainable: int, n: int) -> Optional[str]:
        """Its start-up line (None: nothing to say)."""
        return None

    @classmethod
    def checkpoint_bytes(cls, plan: Any, trainable: Optional[int]) -> Optional[int]:
        """One checkpoint's size; None: the count-params estimate of every weight and its AdamW moments."""
        return None

    # ---- run time -----------------------------------------------------------------------------------------
    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def apply(self, model: Any) -> Optional[int]:
        """Prepare the freshly built model (in place); the trainable parameters (None: every one)."""
        return None

    def materialize(self, module: Any, device: Any) -> None:
        """(materializes only) Put the weights into the meta-built module.model on `device`, FSDP2's shards
        where it is sharded."""
        raise NotImplementedError

    def reference(self) -> Any:
        """(own_reference only) The objective's reference (a FrozenModel): the frozen starting model."""
        raise NotImplementedError

    def checkpoint_state(self, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        """What a checkpoint holds of `state` (names carrying `prefix`, e.g. "model.")."""
        return state

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add what a resume and the loaders need to a checkpoint being saved."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any], model_cfg: Any) -> None:
        """Check a checkpoint a resume loads (one-line GptkitErrors)."""


def check_needs_weights(name: str, has_weights: bool) -> None:
    """A fine-tune of frozen weights without weights to start from: one line."""
    if not has_weights:
        raise ConfigError(
            f"finetune={name} trains adapters on frozen weights, so it needs the weights to start "
            "from: init_from=<run folder | checkpoint | hf:owner/name>; without one the frozen "
            "model would be random (train it first with finetune=full)"
        )
