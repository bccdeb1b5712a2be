"""Key/value caches for generation.

KVCache: one K and one V tensor per layer, each [B, n_kv_heads, max_len, head_dim], filled front to back:
GQA shrinks the cache by n_heads / n_kv_heads. Keys are stored after RoPE, so a cached key never needs
re-rotating; the model reads `cache.positions` (= `cache.length`, an int: the first of the positions the
next forward pass feeds, as GPT.forward names positions) and attends over the filled prefix.

StaticKVCache: the same tensors, for decoding with fixed shapes (a compiled step, a CUDA graph). The caller
sets `cache.positions`, a [T] tensor holding the positions of the T tokens it feeds; they are written in
place there (index_put_), and attention reads the whole cache under `cache.mask`, which hides every slot
after a token's own position. No shape and no Python number changes from one step to the next.
"""

from __future__ import annotations

from typing import Optional

import torch

from gptkit.model.config import ModelConfig


class KVCache:
    # attention over the filled prefix is causal as it stands
    mask = None

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {self.max_len} exceeds model.max_seq_len={cfg.max_seq_len}")
        shape = (batch_size, cfg.n_kv_heads, self.max_len, cfg.head_dim)  # [B, n_kv_heads, max_len, head_dim]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        # tokens already cached (= absolute position of the next token)
        self.length = 0

    @property
    def positions(self) -> int:
        """The absolute position of the first token of the next forward pass."""
        return self.length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at positions length..length+T-1 of `layer`;
        return the keys and values of all positions so far, [B, n_kv_heads, length+T, head_dim]."""
        start, T = self.length, k.shape[2]
        if start + T > self.max_len:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {self.max_len}")
        self.k[layer][:, :, start : start + T] = k
        self.v[layer][:, :, start : start + T] = v
        return self.k[layer][:, :, : start + T], self.v[layer][:, :, : start + T]

    def advance(self, n: int) -> None:
        """Count n more cached tokens (after a forward pass that wrote them)."""
        self.length += n

    def reset(self) -> None:
        """Empty the cache (the tensors are kept and overwritten)."""
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors of every layer."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class StaticKVCache(KVCache):
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(cfg, batch_size, max_len, device, dtype)
        self.slots = torch.arange(self.max_len, device=device)  # [max_len]
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
        """[T, max_len] bool: the token at positions[t] may attend to the slots up to its own position."""
        return self.slots <= self._positions[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv_heads, T, head_dim] at `positions` of `layer`; return the whole cache of that
        layer, [B, n_kv_heads, max_len, head_dim] (read under `mask`)."""
        # index_put_: in place, also once compiled
        self.k[layer][:, :, self._positions] = k
        self.v[layer][:, :, self._positions] = v
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        """Nothing to count: the caller moves `positions`."""
        # the caller moves `positions`
        pass

    def reset(self) -> None:
        """Nothing to reset: `mask` hides every slot after a token's own position."""
        pass
