"""The LightningModule: a thin wrapper that trains the pure GPT."""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch

from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.runs import is_rank_zero
from gptkit.training.metrics import LossWindow
from gptkit.training.optim import build_optimizer, build_scheduler, check_muon_split

COMPILE_MODES = ("blocks", "model")


def compile_mode(value) -> str | None:
    """trainer.compile as None (none/false), "blocks" (true: each transformer block, regional) or "model" (the
    whole forward, loss included)."""
    if value in (False, None, "false", "none"):
        return None
    if value is True or value == "true":
        return "blocks"
    if value not in COMPILE_MODES:
        raise ConfigError(f"trainer.compile={value!r} is not one of none, {', '.join(COMPILE_MODES)} (or false/true)")
    return value


def apply_compile(model: GPT, mode: str, backend: str = "inductor") -> None:
    """torch.compile in place (parameter names and checkpoints unchanged). "blocks" compiles each block:
    the blocks share one compiled graph (torch inlines nn modules, so their weights are inputs), which
    keeps compile time near that of one block; "model" compiles the whole forward and its loss."""
    if mode == "model":
        model.compile(backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)


def apply_activation_checkpointing(model: GPT) -> None:
    """Recompute each transformer block in the backward pass instead of keeping its activations.

    A training decision, so it is applied here and not inside the model: each block's forward is wrapped
    (as an instance attribute, so parameter names and checkpoints stay as they are) in
    torch.utils.checkpoint whenever the block trains with gradients; evaluation and decoding are untouched.
    """
    from torch.utils.checkpoint import checkpoint

    def recomputed(block, forward):
        def run(*args, **kwargs):
            if block.training and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)
        return run

    for block in model.blocks:
        block.forward = recomputed(block, block.forward)


class LitGPT(L.LightningModule):
    def __init__(self, model_cfg: ModelConfig, optim_cfg: Any, max_steps: int,
                 compile: str | None = None, activation_checkpointing: bool = False,
                 compile_backend: str = "inductor", weights_from_rank0: bool = False) -> None:
        """weights_from_rank0 (FSDP over several processes): only global rank 0 builds and initializes the
        full model on the host; the other ranks build it on the meta device (no memory) and receive their
        shards of rank 0's weights once it is sharded (configure_model). A 7B model then takes ~28 GB of host
        memory in one process of the job instead of in every one."""
        super().__init__()
        self.weights_from_rank0 = weights_from_rank0
        self.built_on_meta = weights_from_rank0 and not is_rank_zero()
        with torch.device("meta") if self.built_on_meta else contextlib.nullcontext():
            self.model = GPT(model_cfg)
        if activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if optim_cfg.name == "muon":  # before the run folder gets its files
            check_muon_split(self.model)
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.compile_mode = compile_mode(compile)
        self.compile_backend = compile_backend
        self.loss_window = LossWindow()  # read at log steps only (training/metrics.py)
        self._val_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from gptkit.training.distributed import broadcast_weights, parallelize

        strategy = self.trainer.strategy
        full = self.model.state_dict() if self.weights_from_rank0 and not self.built_on_meta else None  # references
        if parallelize(self.model, strategy) and self.weights_from_rank0:  # FSDP2: shards per block; else no-op
            broadcast_weights(self.model, full, strategy.root_device)
            self.built_on_meta = False
        del full
        if self.compile_mode and not getattr(self, "_compiled", False):
            apply_compile(self.model, self.compile_mode, self.compile_backend)
            self._compiled = True

    def training_step(self, batch, batch_idx):
        x, y, *docs = batch  # [B, T] inputs, [B, T] next-token targets (, [B, T] doc_ids: data.pack=documents)
        loss = self.model(x, y, doc_ids=docs[0] if docs else None).loss
        self.loss_window.add(loss, self.global_step)  # on the device: no host sync (StepMetrics reads it)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, *docs = batch
        self._val_losses.append(self.model(x, y, doc_ids=docs[0] if docs else None).loss.detach())

    def on_validation_epoch_end(self) -> None:
        if not self._val_losses:
            return
        loss = torch.stack(self._val_losses).mean()
        self._val_losses.clear()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)
        self.log("step", float(self.global_step))  # validation after N optimizer steps is logged at step N

    def configure_optimizers(self):
        opt = build_optimizer(self.model, self.optim_cfg)
        sched = build_scheduler(opt, self.optim_cfg, self.max_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # RNG state travels with the checkpoint so that dropout continues exactly after a resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["gptkit_rng"] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            checkpoint["gptkit_rng"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get("gptkit_rng")
        if rng:
            self._rng_to_restore = rng

    def on_train_start(self) -> None:
        rng = getattr(self, "_rng_to_restore", None)
        if rng:
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

