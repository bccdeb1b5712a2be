"""SwiGLU in Triton: silu(gate) * up in one pass; the backward recomputes silu from gate.

    swiglu(gate, up) -> silu(gate) * up        gate/up: [..., F], same shape and dtype

Eager PyTorch keeps silu(gate) (and its input) for the backward pass as well as gate and up; this
keeps only gate and up and computes both gradients in one pass, in fp32:
    d gate = dy * up * s * (1 + gate * (1 - s)),   d up = dy * gate * s,   s = sigmoid(gate)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=inside, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(G + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=inside)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=inside)


# forward and backward as torch custom ops: opaque to torch.compile (no tracing into the launch), joined by
# autograd; see flash.py


@torch.library.custom_op("gptkit::swiglu_fwd", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
    return y


@_swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("gptkit::swiglu_bwd", mutates_args=())
def _swiglu_grad_op(
    gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up, dy = gate.contiguous(), up.contiguous(), dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, BLOCK=BLOCK)
    return dg, du


@_swiglu_grad_op.register_fake
def _(gate, up, dy):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_grad_op(gate, up, dy)


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and returned in gate's dtype; differentiable in gate and up."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must share shape and dtype, got {tuple(gate.shape)} {gate.dtype}, "
            f"{tuple(up.shape)} {up.dtype}"
        )
    return _swiglu_op(gate, up)
