"""The seam to the fused kernels in gptkit_kernels, switched on per name with model.kernels.

    norm    RMSNorm / LayerNorm in one Triton pass each way (fp32 statistics)
    swiglu  silu(gate) * up in one Triton pass each way (keeps only gate and up for the backward)
    rope    q and k rotated in one Triton pass each way (positions may restart per document)
    loss    lm_head + cross-entropy chunked over the tokens: the [B*T, vocab] logits never exist
            (pure torch: runs everywhere)

The Triton ones need triton and CUDA tensors (or TRITON_INTERPRET=1); elsewhere the model uses its
eager torch code, with one warning per process. The names live in gptkit.model.config.KERNELS.
"""

from __future__ import annotations

import warnings

import torch

_warned: set[str] = set()


def usable(x: torch.Tensor, name: str) -> bool:
    """Whether the Triton kernel `name` can run on x; warns once per process when it cannot."""
    from gptkit.model.attention import triton_available

    if triton_available(x.device):
        return True
    if not _warned:
        warnings.warn(f"model.kernels [{name}, ...] needs triton and CUDA tensors (or TRITON_INTERPRET=1); "
                      f"using the eager torch versions", stacklevel=3)
    _warned.add(name)
    return False


def rms_norm(x, weight, eps):
    from gptkit_kernels.norm import rms_norm

    return rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    from gptkit_kernels.norm import layer_norm

    return layer_norm(x, weight, bias, eps)


def swiglu(gate, up):
    from gptkit_kernels.swiglu import swiglu

    return swiglu(gate, up)


def rope(q, k, cos, sin, positions, start):
    from gptkit_kernels.rope import rope

    return rope(q, k, cos, sin, positions, start)


def linear_cross_entropy(x, weight, targets):
    from gptkit_kernels.linear_ce import linear_cross_entropy

    return linear_cross_entropy(x, weight, targets, ignore_index=-100)
