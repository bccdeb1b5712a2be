"""The seam to the fused kernels in gptkit_kernels, switched on per name with model.kernels.

    norm    RMSNorm / LayerNorm in one Triton pass each way (fp32 statistics)
    swiglu  silu(gate) * up in one Triton pass each way (keeps only gate and up for the backward)
    rope    q and k rotated in one Triton pass each way (positions may restart per document)
    loss    lm_head + cross-entropy chunked over the tokens: the [B*T, vocab] logits never exist
            (pure torch: runs everywhere)

and, always on (not a model.kernels name), `linear_log_probs`: lm_head + the per-token log-probs of given
targets, chunked the same way in both passes (GPT.forward(..., token_logps=True): DPO, KTO, GRPO), and
`linear_distill`: two models' heads + the distillation loss, chunked over the label positions in both passes
(objective=distill, through GPT.forward(..., head=...)), and `linear_topk_distill`: the student's head + the
loss against a precomputed teacher's top-k (distill.teacher=precomputed), chunked the same way.

The Triton ones need triton and CUDA tensors (or TRITON_INTERPRET=1); elsewhere the model uses its
eager torch code, with one warning per process. The names live in gptkit.model.config.KERNELS.

This module is also where the model asks whether Triton can run (`triton_available`, used by the
attention backends too) and where it keeps the one registry of warnings given once per process
(`warn_once`). It imports nothing of the model, so layers.py and attention.py both import it and no
circle forms.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

# the kernels are imported on use: they need triton (optional); the model runs without it.

# keys of the warnings already given in this process (warn_once): one registry for the whole model
_warned: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """warnings.warn(message) the first time `key` is seen in this process; later calls are silent."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=stacklevel)


def triton_available(device: torch.device | None = None) -> bool:
    """Our kernels run when triton is installed, on CUDA tensors, or on any tensor under the
    interpreter (TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.is_available() and (device is None or device.type == "cuda")


def usable(x: torch.Tensor, name: str) -> bool:
    """Whether the Triton kernel `name` can run on x; warns once per process when it cannot."""
    if triton_available(x.device):
        return True
    warn_once(
        "kernels",
        f"model.kernels [{name}, ...] needs triton and CUDA tensors "
        f"(or TRITON_INTERPRET=1); using the eager torch versions",
        stacklevel=4,
    )
    return False


# The kernels are imported on first use: gptkit_kernels imports triton (~1 s), which a model on the CPU
# without model.kernels never needs.
def rms_norm(x, weight, eps):
    """RMSNorm of x over its last dimension (Triton, fp32 statistics)."""
    from gptkit_kernels.norm import rms_norm

    return rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps):
    """LayerNorm of x over its last dimension (Triton, fp32 statistics)."""
    from gptkit_kernels.norm import layer_norm

    return layer_norm(x, weight, bias, eps)


def swiglu(gate, up):
    """silu(gate) * up in one Triton pass."""
    from gptkit_kernels.swiglu import swiglu

    return swiglu(gate, up)


def rope(q, k, cos, sin, positions):
    """q and k rotated in one Triton pass; positions: an int (the first of T consecutive) or [B, T]."""
    from gptkit_kernels.rope import rope

    if isinstance(positions, int):
        return rope(q, k, cos, sin, None, positions)
    return rope(q, k, cos, sin, positions, 0)


def linear_cross_entropy(x, weight, targets, softcap=None):
    """Mean cross-entropy of x @ weight.T (soft-capped when softcap is given) against targets, chunked: the
    logits never exist whole."""
    from gptkit_kernels.linear_ce import linear_cross_entropy

    return linear_cross_entropy(x, weight, targets, ignore_index=-100, softcap=softcap)


def linear_log_probs(x, weight, targets, softcap=None, temperature=1.0):
    """Log-probs [...] (fp32) of targets under x @ weight.T (soft-capped when softcap is given, then divided
    by temperature), chunked: the logits never exist whole, in the forward or the backward pass."""
    from gptkit_kernels.linear_ce import linear_log_probs

    return linear_log_probs(x, weight, targets, ignore_index=-100, softcap=softcap, temperature=temperature)


def linear_distill(x, weight, teacher_x, teacher_weight, targets, **settings):
    """(alpha * CE + (1 - alpha) * D, CE, D) of the student's x @ weight.T against the teacher's teacher_x @
    teacher_weight.T (settings: beta, temperature, alpha, softcap, teacher_softcap), chunked over the label
    positions: neither model's logits exist whole, in the forward or the backward pass."""
    from gptkit_kernels.linear_distill import linear_distill

    return linear_distill(x, weight, teacher_x, teacher_weight, targets, ignore_index=-100, **settings)


def linear_topk_distill(x, weight, teacher_ids, teacher_logps, targets, **settings):
    """(alpha * CE + (1 - alpha) * D_k, CE, D_k) of the student's x @ weight.T against a teacher's top-k ids
    and log-probs (settings: temperature, alpha, softcap), chunked over the label positions: the student's
    logits never exist whole, in the forward or the backward pass."""
    from gptkit_kernels.linear_distill import linear_topk_distill

    return linear_topk_distill(x, weight, teacher_ids, teacher_logps, targets, ignore_index=-100, **settings)
