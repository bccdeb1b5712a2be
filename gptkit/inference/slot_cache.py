"""The KV cache of continuous batching: one slot per sequence, each slot with its own length.

    k, v per layer    [slots, k heads, max_len, k width] and [slots, v heads, max_len, v width] (the layer's
                      cache layout, gptkit/model/attention_kinds.py; multi-head attention: n_kv_heads x
                      head_dim); slot s holds one sequence at positions 0..lengths[s]-1 (keys stored after
                      RoPE, as gptkit.model.kv_cache.KVCache stores them)
    states per layer  [slots, *state] instead, for a layer whose layout keeps a recurrent state

The model reads it through two views, each a cache as GPT.forward takes one (positions, update,
mask_for(layer), advance):

    prefill(slot)    one sequence's T prompt tokens [1, T] at positions lengths[slot]..+T-1: exactly the
                     growing KVCache's pass (causal over the slot's prefix, no mask), written into the slot
    decode(n)        one new token for each of the slots 0..n-1 [n, 1], each at its own position
                     (positions [n, 1] = lengths); attention reads the slots up to the longest under a
                     [n, 1, 1, L] mask that hides every slot past a row's own position (and, in a local layer
                     of model.sliding_window W, every slot at or before its position - W)

Active sequences live in slots 0..n-1 (the scheduler moves the last one into a hole when one leaves:
`move`), so a decode step reads a prefix of the cache and never gathers it.
"""

from __future__ import annotations

import torch

from gptkit.model.attention_kinds import cache_layouts
from gptkit.model.config import ModelConfig


class SlotCache:
    def __init__(
        self,
        cfg: ModelConfig,
        slots: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.slots = slots
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {self.max_len} exceeds model.max_seq_len={cfg.max_seq_len}")
        # per layer: what it keeps (gptkit/model/attention_kinds.py: K and V, or a recurrent state)
        layouts = cache_layouts(cfg)

        def zeros(*shape, dtype=dtype):
            return torch.zeros(shape, device=device, dtype=dtype)

        # [S, k heads, max_len, k width] and [S, v heads, max_len, v width] per layer (None: a state layer)
        L = self.max_len
        self.k = [None if lay.k is None else zeros(slots, lay.k[0], L, lay.k[1]) for lay in layouts]
        self.v = [None if lay.v is None else zeros(slots, lay.v[0], L, lay.v[1]) for lay in layouts]
        # [S, *state] per layer (None: a K/V layer), fp32 where the layout says so
        self.states = [
            None
            if lay.state is None
            else zeros(slots, *lay.state, dtype=torch.float32 if lay.state_fp32 else dtype)
            for lay in layouts
        ]
        # every tensor a slot owns a row of
        self._tensors = [t for t in self.k + self.v + self.states if t is not None]
        # tokens cached per slot (= the position of the slot's next token)
        self.lengths = [0] * slots
        self.device = self._tensors[0].device
        self.positions_all = torch.arange(self.max_len, device=self.device)  # [max_len]
        # per layer: None (global) or its sliding window (the slots keep every position; the mask narrows)
        self.windows = [lay.window for lay in layouts]

    def prefill(self, slot: int) -> "PrefillView":
        """The cache of one slot, for a forward pass of that sequence's next tokens."""
        return PrefillView(self, slot)

    def decode(self, n: int) -> "DecodeView":
        """The cache of slots 0..n-1, for a forward pass of one new token each."""
        return DecodeView(self, n)

    def move(self, src: int, dst: int) -> None:
        """Slot src's sequence into slot dst (src is free afterwards)."""
        self.copy(src, dst)
        self.free(src)

    def copy(self, src: int, dst: int) -> None:
        """A copy of slot src's sequence in slot dst (the n choices of one prompt share its prefill)."""
        n = self.lengths[src]
        for t in self.k + self.v:
            if t is not None:
                t[dst, :, :n] = t[src, :, :n]
        for t in self.states:
            if t is not None:
                t[dst] = t[src]
        self.lengths[dst] = n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        for t in self.states:
            if t is not None:
                t[slot].zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)


class PrefillView:
    """One slot as a growing KVCache: positions is an int, attention is causal over the slot's prefix."""

    mask = None

    def __init__(self, cache: SlotCache, slot: int) -> None:
        self.cache, self.slot = cache, slot

    def mask_for(self, layer: int) -> None:
        """None: causal (and the layer's window) over the slot's prefix, as attention applies it."""
        return None

    @property
    def positions(self) -> int:
        return self.cache.lengths[self.slot]

    def state(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """[1, *state]: the slot's recurrent state of `layer` (a view: written in place)."""
        return self.cache.states[layer][self.slot : self.slot + 1]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, n_kv_heads, T, head_dim] after the slot's prefix; return the slot's keys and values
        so far, [1, n_kv_heads, length + T, head_dim]."""
        c, s = self.cache, self.slot
        start, T = c.lengths[s], k.shape[2]
        if start + T > c.max_len:
            raise ValueError(f"KV cache slot full: {start} + {T} tokens > {c.max_len}")
        c.k[layer][s : s + 1, :, start : start + T] = k
        c.v[layer][s : s + 1, :, start : start + T] = v
        return c.k[layer][s : s + 1, :, : start + T], c.v[layer][s : s + 1, :, : start + T]

    def advance(self, n: int) -> None:
        self.cache.lengths[self.slot] += n


class DecodeView:
    """Slots 0..n-1, one token each at its own position."""

    def __init__(self, cache: SlotCache, n: int) -> None:
        self.cache, self.n = cache, n
        lengths = cache.lengths[:n]
        if max(lengths) >= cache.max_len:
            raise ValueError(f"KV cache slot full: a sequence already holds {cache.max_len} tokens")
        # keys read: up to the longest sequence's new token
        self.span = max(lengths) + 1
        device = cache.device
        self.rows = torch.arange(n, device=device)  # [n]
        self._positions = torch.tensor(lengths, dtype=torch.long, device=device)[:, None]  # [n, 1]
        # [n, 1, 1, span] bool: row i reads the slots up to its own position (its new token included)
        self.mask = (cache.positions_all[: self.span] <= self._positions)[:, None, None, :]
        # window -> the mask of the local layers of that window
        self._windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, layer: int) -> torch.Tensor:
        """[n, 1, 1, span] bool for `layer`: `mask`, and for a local layer only the slots after its
        position - W."""
        w = self.cache.windows[layer]
        if w is None:
            return self.mask
        if w not in self._windowed:
            recent = self.cache.positions_all[: self.span] > self._positions - w  # [n, span]
            self._windowed[w] = self.mask & recent[:, None, None, :]
        return self._windowed[w]

    @property
    def positions(self) -> torch.Tensor:
        """[n, 1]: the position of each row's new token."""
        return self._positions

    def state(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """[n, *state]: the recurrent states of `layer` of slots 0..n-1 (a view: written in place)."""
        return self.cache.states[layer][: self.n]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, n_kv_heads, 1, head_dim] at each row's position; return the keys and values of
        slots 0..n-1 up to the longest, [n, n_kv_heads, span, head_dim] (read under `mask`)."""
        c, pos = self.cache, self._positions[:, 0]
        c.k[layer][self.rows, :, pos] = k[:, :, 0]
        c.v[layer][self.rows, :, pos] = v[:, :, 0]
        return c.k[layer][: self.n, :, : self.span], c.v[layer][: self.n, :, : self.span]

    def advance(self, n: int) -> None:
        for i in range(self.n):
            self.cache.lengths[i] += n
