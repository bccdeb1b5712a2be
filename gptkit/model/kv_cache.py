"""Key/value caches for generation.

A cache is what GPT.forward takes as `cache`: `positions` (the positions of the tokens it feeds),
`update(layer, k, v)` (store them, return the keys and values the layer's queries attend over),
`mask_for(layer)` (None: causal and the layer's sliding window, bottom-right aligned; or the bool mask that
replaces both) and `advance(T)`. gptkit/inference/slot_cache.py's views are caches too.

KVCache: what each layer's cache layout says (gptkit/model/attention_kinds.py, cache_layout): one K and one
V tensor per layer, [B, k heads, slots, k width] and [B, v heads, slots, v width] (multi-head attention:
n_kv_heads x head_dim each, so GQA shrinks the cache by n_heads / n_kv_heads), or a layer's recurrent state
[B, *state] instead (read and written in place through `state(layer, like)`; fp32 where its layout says
state_fp32, else the cache's dtype; such a cache cannot rewind).
Keys are stored after RoPE, so a cached key never needs re-rotating; the model reads `cache.positions`
(= `cache.length`, an int: the first of the positions the next forward pass feeds, as GPT.forward names
positions). A global layer's slots are max_len positions, filled front to back, and it attends over the
filled prefix. A local layer (model.layer_types, model.sliding_window W < max_len) keeps only its last W
positions (rolling=True, the default): position p lives in slot p % W, so its memory is W / max_len of a
global layer's. Its `update` returns what its queries may see, in one of two forms:
  - one new token: the ring itself after the write (every slot it holds lies in the token's window; the
    order of the keys does not matter to attention), no copy;
  - T > 1 new tokens: the last W - 1 cached positions in order, then the T new ones (a copy), for the
    bottom-right causal window the attention call applies; then the last W of the new ones go into the ring.
The window itself is part of the attention call (GPT attends with the layer's window either way), so a full
cache (rolling=False) gives the same tokens: the rolling cache only saves memory.

StaticKVCache: the same tensors, for decoding with fixed shapes (a compiled step, a CUDA graph). The caller
sets `cache.positions`, a [T] tensor holding the positions of the T tokens it feeds; they are written in
place there (index_put_; a local layer at positions % W), and attention reads the whole cache of a layer
under `cache.mask_for(layer)`, which hides every slot after a token's own position, before its window, and
a ring's slots not yet written. No shape and no Python number changes from one step to the next.
"""

from __future__ import annotations

from typing import Optional

import torch

from gptkit.model.attention_kinds import cache_layouts
from gptkit.model.config import ModelConfig


class KVCache:
    # attention over the filled prefix is causal (and windowed) as it stands
    mask = None

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        rolling: bool = True,
    ) -> None:
        self.cfg = cfg
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {self.max_len} exceeds model.max_seq_len={cfg.max_seq_len}")
        self.device, self.dtype, self.rolling = device, dtype, rolling
        # per layer: what it keeps (gptkit/model/attention_kinds.py: K and V, or a recurrent state)
        self.layouts = cache_layouts(cfg)
        # per layer: None (global) or its sliding window
        self.windows = [lay.window for lay in self.layouts]
        # per layer: the positions it keeps: max_len, or its window when a rolling cache makes that shorter
        # (0: a layer with a state keeps no position)
        self.slots = [
            0 if lay.k is None else w if rolling and w is not None and w < self.max_len else self.max_len
            for lay, w in zip(self.layouts, self.windows)
        ]
        # [B, k heads, slots, k width] and [B, v heads, slots, v width] per layer (None: a state layer)
        self.k = [self._zeros(batch_size, n, lay.k) for lay, n in zip(self.layouts, self.slots)]
        self.v = [self._zeros(batch_size, n, lay.v) for lay, n in zip(self.layouts, self.slots)]
        # [B, *state] per layer (None: a K/V layer), fp32 where the layout says so
        self.states = [
            None
            if lay.state is None
            else torch.zeros(
                (batch_size, *lay.state), device=device, dtype=torch.float32 if lay.state_fp32 else dtype
            )
            for lay in self.layouts
        ]
        # tokens already cached (= absolute position of the next token)
        self.length = 0

    def _zeros(self, batch_size: int, slots: int, shape: tuple[int, int] | None) -> torch.Tensor | None:
        """[batch_size, heads, slots, width] zeros for shape (heads, width); None for None."""
        if shape is None:
            return None
        return torch.zeros((batch_size, shape[0], slots, shape[1]), device=self.device, dtype=self.dtype)

    def state(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """[B, *state]: the recurrent state of `layer` (a kind whose layout has one), read and written in
        place by its module; `like` is a tensor of the compute dtype and device (the layer's input)."""
        return self.states[layer]

    def rolls(self, layer: int) -> bool:
        """Whether `layer` keeps only its window (a ring of slots) rather than every position."""
        return 0 < self.slots[layer] < self.max_len

    @property
    def positions(self) -> int:
        """The absolute position of the first token of the next forward pass."""
        return self.length

    def mask_for(self, layer: int) -> Optional[torch.Tensor]:
        """The mask attention reads over what `update` returned for `layer`: None (causal, the layer's window,
        bottom-right aligned)."""
        return self.mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at positions length..length+T-1 of `layer`; return the keys
        and values its queries attend over: a global layer's every position so far, [B, n_kv_heads, length+T,
        head_dim]; a rolling layer's, see the module docstring."""
        start, T = self.length, k.shape[2]
        if start + T > self.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {self.max_len}")
        if not self.rolls(layer):
            self.k[layer][:, :, start : start + T] = k
            self.v[layer][:, :, start : start + T] = v
            return self.k[layer][:, :, : start + T], self.v[layer][:, :, : start + T]
        W = self.slots[layer]
        if T == 1:
            self.k[layer][:, :, start % W] = k[:, :, 0]
            self.v[layer][:, :, start % W] = v[:, :, 0]
            # positions max(0, start - W + 1)..start, in ring order
            n = min(start + 1, W)
            return self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        # the W - 1 positions before `start` that its queries can still see, in order
        held_k, held_v, _ = self._held(layer, W - 1)
        out_k = torch.cat([held_k, k], dim=2)  # [B, n_kv_heads, held + T, head_dim]
        out_v = torch.cat([held_v, v], dim=2)
        self._put(layer, k, v, start)
        return out_k, out_v

    def _held(self, layer: int, most: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(k, v, first): the last `most` (default: all kept) cached positions of `layer` in order,
        [B, n_kv_heads, n, head_dim] each, and the position of the first."""
        n = min(self.length, self.slots[layer] if most is None else most)
        first = self.length - n
        if not self.rolls(layer):
            return self.k[layer][:, :, first : self.length], self.v[layer][:, :, first : self.length], first
        idx = torch.arange(first, self.length, device=self.k[layer].device) % self.slots[layer]  # [n]
        return self.k[layer].index_select(2, idx), self.v[layer].index_select(2, idx), first

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k, v [B, n_kv_heads, T, head_dim] as positions start..start+T-1 of `layer` (a ring: its last
        slots of them, each at position % slots)."""
        T = k.shape[2]
        if not self.rolls(layer):
            self.k[layer][:, :, start : start + T] = k
            self.v[layer][:, :, start : start + T] = v
            return
        W = self.slots[layer]
        n = min(T, W)
        idx = torch.arange(start + T - n, start + T, device=self.k[layer].device) % W  # [n]
        self.k[layer].index_copy_(2, idx, k[:, :, T - n :])
        self.v[layer].index_copy_(2, idx, v[:, :, T - n :])

    def advance(self, n: int) -> None:
        """Count n more cached tokens (after a forward pass that wrote them)."""
        self.length += n

    def reset(self) -> None:
        """Empty the cache (the tensors are kept and overwritten; the states start again from zero)."""
        self.length = 0
        self._clear_states()

    def _clear_states(self) -> None:
        for t in self.states:
            if t is not None:
                t.zero_()

    def rewind(self, n: int) -> int:
        """Forget the positions from n on (0 <= n <= length), so that the next forward feeds position n, and
        return n; or return 0 (the cache emptied) when a rolling layer no longer holds the W - 1 positions
        before n (they were overwritten: at most the last token can be taken back once a ring has wrapped)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} positions to {n}")
        wrapped = [
            self.slots[i] for i in range(len(self.slots)) if self.rolls(i) and self.length > self.slots[i]
        ]
        # a recurrent state holds every position folded in: none can be taken back
        stateful = n < self.length and any(t is not None for t in self.states)
        self.length = 0 if stateful or (wrapped and n < self.length - 1) else n
        if self.length == 0:
            self._clear_states()
        return self.length

    def select(self, rows: torch.Tensor, max_len: int) -> "KVCache":
        """A new cache (room for max_len positions) of len(rows) batch rows, row r holding this cache's row
        rows[r] and every position it holds."""
        out = type(self)(self.cfg, len(rows), max_len, self.device, self.dtype, self.rolling)
        for layer in range(len(self.k)):
            if self.states[layer] is not None:
                out.states[layer] = self.states[layer].index_select(0, rows)
                continue
            k, v, first = self._held(layer)
            out._put(layer, k.index_select(0, rows), v.index_select(0, rows), first)
        out.length = self.length
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's K and V tensors and states."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.states if t is not None)


class StaticKVCache(KVCache):
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        rolling: bool = True,
    ) -> None:
        super().__init__(cfg, batch_size, max_len, device, dtype, rolling)
        # slots -> arange(slots) (the max_len slots of a global layer, the W of a ring)
        self.slot_ids = {n: torch.arange(n, device=device) for n in set(self.slots) | {self.max_len}}
        # [T] long: the positions of the tokens being fed (the caller sets them)
        self._positions: Optional[torch.Tensor] = None

    @property
    def positions(self) -> torch.Tensor:
        """[T]: the positions of the tokens of the next forward pass (set by the caller)."""
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self._positions = value

    @property
    def mask(self) -> torch.Tensor:
        """[T, max_len] bool: the token at positions[t] may attend to the slots up to its own position (a
        global layer's mask)."""
        return self.slot_ids[self.max_len] <= self._positions[:, None]

    def mask_for(self, layer: int) -> torch.Tensor:
        """[T, keys] bool over what update returned for `layer`: slots up to each token's own position and,
        for a local layer, after its position - W; a ring's unwritten slots hidden."""
        pos = self._positions[:, None]  # [T, 1]
        W = self.windows[layer]
        if not self.rolls(layer):
            slot = self.slot_ids[self.max_len]  # [max_len]: slot = position
            return (slot <= pos) if W is None else (slot <= pos) & (slot > pos - W)
        key_pos = self._ring_positions(layer)  # [keys]
        return (key_pos >= 0) & (key_pos <= pos) & (key_pos > pos - W)  # [T, keys]

    def _ring_positions(self, layer: int) -> torch.Tensor:
        """The positions of the keys update returns for a rolling `layer`, -1 or less for a slot never
        written: T = 1, the ring after the write; T > 1, the ring before it, then the T new positions."""
        W = self.slots[layer]
        slot = self.slot_ids[W]  # [W]
        T = self._positions.shape[0]
        # the last position the ring holds: slot s holds the latest position <= last that is s modulo W
        last = self._positions[-1] if T == 1 else self._positions[0] - 1
        ring = last - torch.remainder(last - slot, W)  # [W]
        return ring if T == 1 else torch.cat([ring, self._positions])  # [W] or [W + T]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at `positions` of `layer`; return the whole cache of that
        layer, [B, n_kv_heads, slots, head_dim] (a rolling layer with T > 1: the ring before the write, then
        k, v), read under `mask_for(layer)`."""
        if not self.rolls(layer):
            # index_put_: in place, also once compiled
            self.k[layer][:, :, self._positions] = k
            self.v[layer][:, :, self._positions] = v
            return self.k[layer], self.v[layer]
        W, T = self.slots[layer], k.shape[2]
        if T == 1:
            slot = torch.remainder(self._positions, W)  # [1]
            self.k[layer][:, :, slot] = k
            self.v[layer][:, :, slot] = v
            return self.k[layer], self.v[layer]
        # the ring as it was (a copy), then the new tokens
        out_k = torch.cat([self.k[layer], k], dim=2)  # [B, n_kv_heads, W + T, head_dim]
        out_v = torch.cat([self.v[layer], v], dim=2)
        # the last W of the new positions, each at position % W (no slot twice)
        n = min(T, W)
        slot = torch.remainder(self._positions[T - n :], W)  # [n]
        self.k[layer][:, :, slot] = k[:, :, T - n :]
        self.v[layer][:, :, slot] = v[:, :, T - n :]
        return out_k, out_v

    def advance(self, n: int) -> None:
        """Nothing to count: the caller moves `positions`."""
        # the caller moves `positions`
        pass

    def reset(self) -> None:
        """Nothing to reset of K and V: `mask_for` hides every slot after a token's own position and every
        ring slot not written since positions restarted at 0. The states start again from zero."""
        self._clear_states()
