"""objective=lm: next-token cross-entropy over the targets that carry loss.

One objective for pretraining (every target of a window), SFT (data=chat: targets -100 outside the
assistant's turns) and packed documents (doc_ids keep attention inside each document): the model's loss is
the fp32 mean over a micro-batch's loss tokens, and its weight is their count, so that every loss token of an
optimizer step weighs the same across micro-batches and ranks (gptkit/training/token_mean.py).

Validation: val/loss is the exact token mean over the distinct validation windows, each counted once over
the ranks (a DDP run reports what one process does); with data=mix also val/loss/<source> over that source's
windows. Items without an index (data=chat's rows) give the mean of the batch means over batches and ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from gptkit.training.objectives.base import Objective
from gptkit.training.token_mean import loss_tokens


class LM(Objective):
    """Next-token prediction (pretraining and supervised fine-tuning)."""

    name = "lm"

    def __init__(self, plan: Any, frozen=None) -> None:
        super().__init__(plan, frozen)
        self._losses: list[torch.Tensor] = []
        # [2, n_sources] token-loss sums, target counts
        self._sums: torch.Tensor | None = None

    def loss(self, model, batch):
        # [B, T] inputs, [B, T] next-token targets (, [B, T] doc_ids: data.pack=documents)
        x, y, *docs = batch
        loss = model(x, y, doc_ids=docs[0] if docs else None).loss
        # int64 scalar on the device
        return loss, loss_tokens(y)

    def validate(self, model, batch, rank: int, world_size: int, val_sources) -> None:
        """The loss of one validation batch, kept on the device; with tagged windows (val_sources given)
        each source's summed token loss and target count over this batch's windows (see _source_sums)."""
        x, y, *rest = batch
        # [B]: each window's index in the val set
        index = rest.pop() if val_sources is not None else None
        docs = rest[0] if rest else None
        loss = model(x, y, doc_ids=docs).loss.detach()
        self._losses.append(loss)
        if index is not None:
            self._source_sums(model, x, y, docs, index, loss, val_sources[1], rank, world_size)

    def _source_sums(self, model, x, y, docs, index, loss, source_of, rank: int, world: int) -> None:
        """Add each source's summed token loss and target count of this batch to _sums. A window is counted
        on the rank where DistributedSampler put it first (rank == index % world_size; its padding repeats
        land elsewhere), so the sums over ranks are those of one process. A batch of one source, every window
        counted, reuses the batch's loss; otherwise one forward per source, the other targets masked
        (-100)."""
        src = source_of.to(index.device)[index]  # [B]
        counted = (index % world) == rank  # [B]
        n_src = int(source_of.max()) + 1
        if self._sums is None:
            self._sums = torch.zeros(2, n_src, dtype=torch.float64, device=loss.device)
        if bool(counted.all()) and bool((src == src[0]).all()):
            n = (y != -100).sum()
            if int(n):
                self._sums[0, src[0]] += loss.double() * n
                self._sums[1, src[0]] += n
            return
        for s in range(n_src):
            rows = counted & (src == s)
            if not bool(rows.any()):
                continue
            masked = torch.where(rows[:, None], y, torch.full_like(y, -100))
            n = (masked != -100).sum()
            if int(n):
                self._sums[0, s] += model(x, masked, doc_ids=docs).loss.detach().double() * n
                self._sums[1, s] += n

    def val_metrics(self, strategy, val_sources) -> dict[str, Any]:
        """val/loss and val/ppl (and val/loss/<source> for a mixture), the same on every rank."""
        if not self._losses:
            return {}
        loss = torch.stack(self._losses).mean()
        self._losses.clear()
        if val_sources is None:
            loss = strategy.reduce(loss, reduce_op="mean")
            return {"val/loss": loss, "val/ppl": torch.exp(loss)}
        n_src = int(val_sources[1].max()) + 1 if len(val_sources[1]) else 1
        sums = (
            self._sums
            if self._sums is not None
            else torch.zeros(2, n_src, dtype=torch.float64, device=loss.device)
        )
        self._sums = None
        # [2, n_sources], over the ranks
        sums = strategy.reduce(sums, reduce_op="sum")
        total = (sums[0].sum() / sums[1].sum().clamp(min=1)).float()
        out = {"val/loss": total, "val/ppl": torch.exp(total)}
        for name, s, n in zip(val_sources[0], sums[0].tolist(), sums[1].tolist()):
            if n:
                out[f"val/loss/{name}"] = s / n
        return out
