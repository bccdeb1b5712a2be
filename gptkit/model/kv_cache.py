"""A preallocated key/value cache for generation.

One K and one V tensor per layer, each [B, n_kv_heads, max_len, head_dim]: GQA shrinks the cache
by n_heads / n_kv_heads. Keys are stored after RoPE, so a cached key never needs re-rotating;
the model reads `cache.length` as the absolute position of the next token.
"""

from __future__ import annotations

import torch

from gptkit.model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.max_len = max_len or cfg.max_seq_len
        if self.max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {self.max_len} exceeds model.max_seq_len={cfg.max_seq_len}")
        shape = (batch_size, cfg.n_kv_heads, self.max_len, cfg.head_dim)  # [B, n_kv_heads, max_len, head_dim]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0  # tokens already cached (= absolute position of the next token)

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
        self.length += n

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
