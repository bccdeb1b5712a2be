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
        # int32 [B, T] each
        self.start, self.end = document_bounds(doc_ids)
        self._masks: dict[torch.dtype, torch.Tensor] = {}  # [B, 1, T, T] per dtype (mask)
        self._cu: torch.Tensor | None = None  # [n_docs + 1] (cu_seqlens)

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] int64: the position of each token inside its own document."""
        t = torch.arange(self.start.shape[1], device=self.start.device)
        return t - self.start.long()

    def mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """[B, 1, T, T], causal and inside each document, built once per forward (every layer shares it):
        bool (True where query i may attend key j), or additive in `dtype` (0 there, -inf elsewhere), the
        form SDPA's kernels add to the scores; a bool mask would be converted in every layer."""
        if dtype not in self._masks:
            if dtype == torch.bool:
                T = self.start.shape[1]
                j = torch.arange(T, device=self.start.device)
                causal = j[None, :] <= j[:, None]  # [T, T]
                allowed = (j[None, None, :] >= self.start[:, :, None]) & causal  # [B, T, T]
                self._masks[dtype] = allowed[:, None]  # [B, 1, T, T]
            else:
                allowed = self.mask()
                zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                self._masks[dtype] = zeros.masked_fill_(~allowed, float("-inf"))  # [B, 1, T, T]
        return self._masks[dtype]

    def cu_seqlens(self) -> torch.Tensor:
        """int32 [n_docs + 1]: where each document starts in the B*T tokens taken row after row, then B*T
        (the cumulative lengths of FlashAttention's variable-length kernels). Computed once per forward; it
        reads the number of documents from the device (one host sync)."""
        if self._cu is None:
            B, T = self.start.shape
            t = torch.arange(T, device=self.start.device)  # [T]
            first = (self.start == t).flatten()  # [B*T]: a document starts here (every row starts one)
            starts = first.nonzero().flatten().to(torch.int32)  # [n_docs]
            self._cu = torch.cat([starts, starts.new_tensor([B * T])])  # [n_docs + 1]
        return self._cu
