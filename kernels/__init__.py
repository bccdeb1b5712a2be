"""gptkit_kernels: Triton kernels with autograd wrappers; pure functions of tensors.

This package imports torch and triton only (never gptkit), so it can be used on its own:

    from gptkit_kernels import flash_attention
    out = flash_attention(q, k, v, causal=True)  # q [B, H, T, D], k/v [B, H_kv, T, D]
"""

from gptkit_kernels.flash import flash_attention, interpreting

__all__ = ["flash_attention", "interpreting"]
