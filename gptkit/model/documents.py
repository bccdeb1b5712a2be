"""Packed documents: one training window holds several documents, and attention stays inside each.

    doc_ids [B, T]: equal ids in a contiguous run form one document, e.g. the number of EOS tokens
                    before each position (the EOS ends its own document: data.pack=documents).

Every backend applies the same rule, taken from (start, end) per position: query i sees key j
iff start[i] <= j <= i (causal). `positions` restart at 0 with each document (model.position_reset).
"""

from __future__ import annotations

import torch


def document_bounds(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end), int32 [B, T]: position t lies in the document [start[b, t], end[b, t])."""
    B, T = doc_ids.shape
    t = torch.arange(T, device=doc_ids.device).expand(B, T)  # [B, T]
    first = torch.ones(B, T, dtype=torch.bool, device=doc_ids.device)  # [B, T] a document starts here
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.cummax(torch.where(first, t, 0), dim=1).values  # [B, T]
    last = torch.ones_like(first)  # [B, T] a document ends after this position
    last[:, :-1] = first[:, 1:]
    end = torch.where(last, t + 1, T).flip(1).cummin(dim=1).values.flip(1)  # [B, T]
    return start.to(torch.int32), end.to(torch.int32)


class Documents:
    """The document structure of a batch of windows, computed once per forward and shared by every layer."""

    def __init__(self, doc_ids: torch.Tensor) -> None:
        self.start, self.end = document_bounds(doc_ids)  # int32 [B, T] each
        self._mask: torch.Tensor | None = None

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] int64: the position of each token inside its own document."""
        t = torch.arange(self.start.shape[1], device=self.start.device)
        return t - self.start.long()

    def mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool, True where query i may attend key j (causal, same document)."""
        if self._mask is None:
            T = self.start.shape[1]
            j = torch.arange(T, device=self.start.device)
            causal = j[None, :] <= j[:, None]  # [T, T]
            self._mask = (j[None, None, :] >= self.start[:, :, None]) & causal  # [B, T, T]
            self._mask = self._mask[:, None]  # [B, 1, T, T]
        return self._mask
