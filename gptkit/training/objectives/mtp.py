"""objective=lm with model.mtp: next-token cross-entropy plus DeepSeek-V3's multi-token prediction losses.

A model with multi-token prediction modules (model.mtp.depth D > 0; gptkit/model/mtp.py) trains with this
variant of objective=lm (objectives/__init__.py picks it; an objective without one refuses such a model):

    loss = L_main + loss_scale / D * (L_1 + ... + L_D)

L_main is the next-token loss of objective=lm, L_k depth k's mean cross-entropy over its targets (the token
k + 1 places after the next one; none across a packed document's boundary). The weight of a micro-batch is
its next-token loss tokens, as lm's. train/loss is the whole loss; each depth's own loss is logged as
train/mtp_loss_<k> (the mean over the log window's micro-batches, over the ranks). Validation is lm's:
val/loss is the next-token head's alone, so runs with and without MTP compare on it.
"""

from __future__ import annotations

from typing import Any

import torch

from gptkit.training.objectives.lm import LM
from gptkit.training.token_mean import loss_tokens


class MTPLM(LM):
    """Next-token prediction with multi-token prediction depths (see the module docstring)."""

    name = "lm"

    @classmethod
    def describe(cls, plan: Any) -> str | None:
        m = plan.model.mtp
        return (
            f"multi-token prediction: {m.depth} depth(s), loss = next-token + {m.loss_scale:g} / {m.depth} x "
            f"their losses (train/mtp_loss_1..{m.depth}); val/loss is the next-token head's"
        )

    def __init__(self, plan: Any, frozen=None) -> None:
        super().__init__(plan, frozen)
        self.depth = plan.model.mtp.depth
        self.scale = float(plan.model.mtp.loss_scale) / self.depth
        # the log window on the device: [each depth's summed loss..., micro-batches]
        self._window: torch.Tensor | None = None

    def loss(self, model, batch):
        # [B, T] inputs, [B, T] next-token targets (, [B, T] doc_ids: data.pack=documents)
        x, y, *docs = batch
        out = model(x, y, doc_ids=docs[0] if docs else None, mtp=True)
        depths = torch.stack(out.mtp_losses)  # [D] fp32
        row = torch.cat([depths.detach().float(), torch.ones(1, device=depths.device)])  # [D + 1]
        self._window = row if self._window is None else self._window + row
        return out.loss + self.scale * depths.sum(), loss_tokens(y)

    def train_metrics(self, strategy) -> dict[str, float]:
        """train/mtp_loss_<k>: each depth's mean loss over the window's micro-batches and the ranks."""
        if self._window is None:
            return {}
        window = strategy.reduce(self._window.clone(), reduce_op="sum")
        self._window.zero_()
        sums, n = window[:-1].tolist(), float(window[-1])
        if not n:
            return {}
        return {f"train/mtp_loss_{k}": s / n for k, s in enumerate(sums, start=1)}

    def progress(self, metrics: dict[str, float]) -> list[str]:
        losses = [
            metrics[f"train/mtp_loss_{k}"]
            for k in range(1, self.depth + 1)
            if f"train/mtp_loss_{k}" in metrics
        ]
        return [f"mtp {' '.join(f'{v:.4f}' for v in losses)}"] if losses else []
