"""The LightningModule: a thin wrapper that trains the pure GPT."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from gptkit.errors import GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.training.optim import build_optimizer, build_scheduler


class NonFiniteLossError(GptkitError):
    """The training loss became NaN or inf."""


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
                 compile: bool = False, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.model = GPT(model_cfg)
        if activation_checkpointing:
            apply_activation_checkpointing(self.model)
        self.optim_cfg = optim_cfg
        self.max_steps = max_steps
        self.compile_model = compile
        self._val_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from gptkit.training.distributed import parallelize

        parallelize(self.model, self.trainer.strategy)  # FSDP2 shards per block under trainer=fsdp; else no-op
        if self.compile_model and not getattr(self, "_compiled", False):
            self.model.compile()  # compiles forward in place; state_dict keys stay unchanged
            self._compiled = True

    def training_step(self, batch, batch_idx):
        x, y, *docs = batch  # [B, T] inputs, [B, T] next-token targets (, [B, T] doc_ids: data.pack=documents)
        loss = self.model(x, y, doc_ids=docs[0] if docs else None).loss
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss became {loss.item()} at step {self.global_step}; the run stopped and kept its "
                f"last good checkpoint; lower optim.lr, raise warmup, or check the data"
            )
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, sync_dist=True)  # global mean
        # loggers' x-axis = optimizer steps completed before this batch (Lightning's own counter
        # drifts by one across some resumes)
        self.log("step", float(self.global_step), on_step=True, on_epoch=False)
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

