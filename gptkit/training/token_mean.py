"""The gradient of an optimizer step as the mean over all of its loss tokens.

The model's loss is the mean over one micro-batch's loss tokens (targets != -100). Lightning backpropagates
loss / A for each of the A micro-batches of a step (trainer.accumulate_grad_batches) and DDP / FSDP average
the gradients of the W ranks, so every micro-batch weighs 1 / (A W) whatever its number of loss tokens: with
assistant-only loss or padding, a token of a micro-batch with few loss tokens weighs more than one of a
micro-batch with many. TokenMean gives each loss token of the step the same weight, 1 / N, as one batch of
all of them would (what Hugging Face transformers fixed in late 2024):

    micro-batch i on rank r    backward of  loss_ir * n_ir / R      n_ir: its loss tokens; R = batch_size *
                               (training_step)                      seq_len, a constant that keeps the
                                                                    magnitudes of a mean (fp16 loss scaling)
    before the optimizer step  gradients *= A * W * R / N           N = sum of n_ir over the step's
                               (on_before_optimizer_step)           micro-batches and ranks: one all-reduce
                                                                    of a scalar, on the device (no host sync)

so the gradient is sum_ir grad(loss_ir * n_ir) / N, before clipping and the grad norm. With one micro-batch
on one rank (A W = 1) the mean is already per token and nothing changes. A micro-batch without loss tokens
adds nothing (its loss, NaN, is not backpropagated). train/loss is the per-token mean too: the LossWindow
gets each micro-batch's token count (training/metrics.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def loss_tokens(targets: torch.Tensor) -> torch.Tensor:
    """The number of targets that carry loss (!= -100), an int64 scalar on their device."""
    return (targets != -100).sum()


class TokenMean:
    """Weights every loss token of an optimizer step equally across micro-batches and ranks (see the module
    docstring): `micro_batch` in training_step, `finish` before the optimizer step."""

    def __init__(self, accumulation: int, world_size: int, reference_tokens: int) -> None:
        self.accumulation, self.world_size = int(accumulation), int(world_size)
        # R: batch_size * seq_len
        self.reference = float(reference_tokens)
        self.active = self.accumulation * self.world_size > 1
        # int64 scalar: this rank's loss tokens of the step
        self.step_tokens: torch.Tensor | None = None

    def micro_batch(self, loss: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        """What to backpropagate for a micro-batch whose mean loss over its n_tokens loss tokens is `loss`."""
        if not self.active:
            return loss
        self.step_tokens = n_tokens.detach() if self.step_tokens is None else self.step_tokens + n_tokens
        return torch.where(n_tokens > 0, loss, 0.0) * (n_tokens / self.reference)

    @torch.no_grad()
    def finish(self, parameters) -> None:
        """Scale the accumulated gradients of `parameters` by A * W * R / N (N: every rank's loss tokens of
        the step); then start the next step. Call it once per optimizer step, after the last backward."""
        if not self.active or self.step_tokens is None:
            return
        # exact for any count
        total = self.step_tokens.to(torch.float64)
        self.step_tokens = None
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            # stream-ordered: the host does not wait
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        factor = self.accumulation * self.world_size * self.reference
        scale = torch.where(total > 0, factor / total.clamp(min=1.0), 0.0)
        grads = [p.grad for p in parameters if p.grad is not None]
        # FSDP2: this rank's shard
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        # one foreach per device
        for device in {g.device for g in grads}:
            torch._foreach_mul_([g for g in grads if g.device == device], scale.to(device, torch.float32))
