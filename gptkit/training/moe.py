"""Training a mixture of experts (model.moe): the feed-forwards' auxiliary loss joins every objective's loss,
the router figures are logged, and the expert bias moves once per optimizer step.

The model returns its auxiliary terms beside its output (GPTOutput.aux, gptkit/model/feedforward.py) and
writes no state in a forward. RouterWatch is what a run does with them, whatever the objective:

    forward     a hook on the GPT keeps the ModelAux of each training forward (eval forwards have none: the
                validation, a frozen reference, the samples)
    loss        LitGPT.training_step adds the kept terms' loss (aux_loss_coef * balance + z_loss_coef * z,
                summed over the MoE layers) to the objective's loss before the token weighting
                (training/token_mean.py), so it rides with it: with equal loss tokens per micro-batch (every
                pretraining window) it is the plain mean over the step's micro-batches and ranks, as one
                process with the whole batch has it (the balance loss is per sequence: aux_loss_group). The
                objective's own loss alone is train/loss
    bias        after each optimizer step (LitGPT.optimizer_step, before any callback saves a checkpoint):
                the step's tokens per expert, summed over its micro-batches and all-reduced over the ranks
                (one collective on the device), move every layer's expert_bias (MoE.update_bias;
                moe.bias_update_rate > 0), the same on every rank; the bias is a buffer of the state dict,
                so a checkpoint holds it and a resume continues it exactly (finetune=lora freezes it with
                the rest of the base: a LoRA checkpoint holds the adapters only)
    log         at log steps (StepMetrics; one reduction over the ranks, a host sync as the loss has):
                train/aux_loss, the mean over the window's training forwards of what was added; moe/balance,
                the mean balance figure of the layers (1 balanced, E / k collapsed: aux_loss_coef 0 included);
                per MoE layer i, moe/max_load/<i>, the most loaded expert's tokens over the mean (1: balanced,
                E / k: every token on the same k experts), and moe/entropy/<i>, the router's mean entropy in
                nats (log E uniform, 0 collapsed). The progress line shows the aux loss, the worst layer's
                max load and the lowest entropy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gptkit.model import GPT


class RouterWatch:
    """The auxiliary terms and router figures of a run's training forwards (see the module docstring). A
    dense model gets one too: `active` is False and every method does nothing."""

    def __init__(self, model: GPT, world_size: int, move_bias: bool = True) -> None:
        """move_bias False (finetune=lora: the base is frozen, its bias with it): the bias stays."""
        cfg = model.cfg
        blocks = [(i, model.blocks[i]) for i in (cfg.moe_layers if cfg.moe is not None else [])]
        # the multi-token prediction blocks after them (model.mtp, MoE like the last layer): "mtp<k>"
        if cfg.moe is not None and cfg.mtp_depth and cfg.feed_forward(cfg.n_layers - 1) == "moe":
            blocks += [(f"mtp{k}", m.block) for k, m in enumerate(model.mtp.layers, start=1)]
        self.layers: list[int | str] = [name for name, _ in blocks]
        self.active = bool(self.layers)
        self.world_size = int(world_size)
        # the MoE feed-forwards, in the order of GPTOutput.aux; whether any has an expert bias to move
        self.moes = [block.mlp for _, block in blocks]
        self.biased = move_bias and any(m.expert_bias is not None for m in self.moes)
        # ModelAux of the training forwards since the last take()
        self._pending: list[Any] = []
        # [L, E]: this rank's tokens per expert of the current optimizer step (the bias update)
        self._step_counts: torch.Tensor | None = None
        # the log window, on the device: [L * E counts, L entropies, aux loss, balance, forwards]
        self._window: torch.Tensor | None = None
        if self.active:
            model.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        aux = getattr(output, "aux", None)
        if aux is not None and module.training and torch.is_grad_enabled():
            self._pending.append(aux)

    def take(self) -> torch.Tensor | None:
        """The summed auxiliary loss of the training forwards since the last call (None: none had any); their
        figures go to the log window and the step's counts (no host sync)."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        loss = pending[0].loss
        for aux in pending[1:]:
            loss = loss + aux.loss
        for aux in pending:
            counts = torch.stack([s.counts for s in aux.layers])  # [L, E]
            entropy = torch.stack([s.entropy.float() for s in aux.layers])  # [L]
            balance = torch.stack([s.balance.float() for s in aux.layers]).mean()
            one = torch.ones((), device=counts.device)
            row = torch.cat([counts.flatten(), entropy, aux.loss.detach().float().view(1), balance.view(1)])
            row = torch.cat([row, one.view(1)])
            self._window = row if self._window is None else self._window + row
            if self.biased:
                self._step_counts = counts if self._step_counts is None else self._step_counts + counts
        return loss

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Move the expert biases by the step's loads over every micro-batch and rank; then start the next
        step."""
        counts, self._step_counts = self._step_counts, None
        if not self.biased or counts is None:
            return
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            # stream-ordered: the host does not wait
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        for moe, row in zip(self.moes, counts):
            moe.update_bias(row)

    def read(self, strategy) -> dict[str, float]:
        """The window's figures over every rank (a reduction; read at log steps), then start afresh."""
        if not self.active or self._window is None:
            return {}
        window = strategy.reduce(self._window.clone(), reduce_op="sum")  # [L*E + L + 3]
        self._window.zero_()
        L = len(self.layers)
        E = (window.numel() - L - 3) // L
        counts = window[: L * E].view(L, E)
        entropy, (aux, balance, forwards) = window[L * E : L * E + L], window[L * E + L :].tolist()
        if not forwards:
            return {}
        out = {"train/aux_loss": aux / forwards, "moe/balance": balance / forwards}
        max_load = (counts.max(-1).values / counts.mean(-1).clamp_min(1e-20)).tolist()
        for i, load, h in zip(self.layers, max_load, (entropy / forwards).tolist()):
            out[f"moe/max_load/{i}"] = load
            out[f"moe/entropy/{i}"] = h
        return out


def progress_parts(metrics: dict[str, float]) -> list[str]:
    """The progress line's MoE parts: the aux loss, the highest max load and the lowest router entropy over
    the layers (with the layer)."""
    if "train/aux_loss" not in metrics:
        return []
    loads = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("moe/max_load/")}
    entropies = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("moe/entropy/")}
    parts = [f"aux {metrics['train/aux_loss']:.4f}"]
    if loads:
        worst = max(loads, key=loads.get)
        parts.append(f"max load {loads[worst]:.2f} (L{worst})")
    if entropies:
        low = min(entropies, key=entropies.get)
        parts.append(f"router H {entropies[low]:.2f} (L{low})")
    return parts
