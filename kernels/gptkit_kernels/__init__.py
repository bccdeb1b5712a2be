"""gptkit_kernels: Triton kernels with autograd wrappers; pure functions of tensors.

This package imports torch and triton only (never gptkit), so it can be used on its own:

    from gptkit_kernels import flash_attention
    out = flash_attention(q, k, v, causal=True)  # q [B, H, T, D], k/v [B, H_kv, T, D]

Names are imported lazily: `gptkit_kernels.linear_ce` (chunked linear + cross-entropy, pure torch)
works without triton installed.
"""

from importlib import import_module

_EXPORTS = {
    "flash_attention": "gptkit_kernels.flash",
    "chunk_gated_delta_rule": "gptkit_kernels.gated_delta",
    "interpreting": "gptkit_kernels.flash",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gptkit_kernels' has no attribute {name!r}")
