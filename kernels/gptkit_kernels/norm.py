"""RMSNorm and LayerNorm in Triton: one pass forward, one pass backward, fp32 statistics.

    rms_norm(x, weight, eps)         -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
                                        (the Llama reference: the normalised x is rounded to x's dtype,
                                        the product has the promoted dtype of weight and x)
    layer_norm(x, weight, bias, eps) -> layer_norm(x.float(), weight, bias).to(x.dtype); bias may be None
    x: [..., D] (rows of D), weight/bias: [D]

Forward: one program per row keeps the row on-chip, computes the statistics in fp32 and saves
1/std (and the mean) per row, [rows] fp32: the backward pass recomputes x_hat from x instead of
keeping it. Backward: each program walks a slice of rows, writes dx per row and sums dweight
(and dbias) for its slice in fp32 registers; torch adds the per-program partial sums.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from gptkit_kernels.flash import interpreting


@triton.jit
def _norm_fwd(
    X,
    Y,
    W,
    Bias,
    MEAN,
    RSTD,
    sx,
    sy,
    D,
    eps,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(X + row * sx + cols, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        # rounded to x's dtype, as the reference does
        xn = (xf * rstd).to(x.dtype).to(tl.float32)
        y = xn * w
    else:
        mean = tl.sum(xf, 0) / D
        xc = tl.where(inside, xf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / D + eps)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(Bias + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _norm_bwd(
    X,
    DY,
    DX,
    W,
    MEAN,
    RSTD,
    DW,
    DB,
    sx,
    sdy,
    sdx,
    N,
    D,
    rows_per_program,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    X += first * sx
    DY += first * sdy
    DX += first * sdx
    RSTD += first
    if not RMS:
        MEAN += first
    for _ in range(0, tl.minimum(rows_per_program, N - first)):
        x = tl.load(X + cols, mask=inside, other=0.0)
        xf = x.to(tl.float32)
        dy = tl.load(DY + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD)
        if RMS:
            xhat = xf * rstd
            dw += dy * xhat.to(x.dtype).to(tl.float32)
            wdy = dy * w
            dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, 0) / D))
        else:
            xhat = tl.where(inside, (xf - tl.load(MEAN)) * rstd, 0.0)
            dw += dy * xhat
            if HAS_BIAS:
                db += dy
            wdy = tl.where(inside, dy * w, 0.0)
            dx = rstd * (wdy - xhat * (tl.sum(wdy * xhat, 0) / D) - tl.sum(wdy, 0) / D)
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=inside)
        X += sx
        DY += sdy
        DX += sdx
        RSTD += 1
        if not RMS:
            MEAN += 1
    tl.store(DW + pid * D + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(DB + pid * D + cols, db, mask=inside)


def _warps(block_d: int) -> int:
    return 4 if block_d <= 1024 else 8 if block_d <= 4096 else 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # [N, D]
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# forward and backward as torch custom ops: opaque to torch.compile (no tracing into the launch), joined by
# autograd; see flash.py. A custom op returns tensors only: LayerNorm's bias and RMSNorm's mean are
# empty [0] tensors where absent.


@torch.library.custom_op("gptkit::norm_fwd", mutates_args=())
def _norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [..., D], mean [N] fp32 (empty for RMSNorm), rstd [N] fp32)."""
    D = x.shape[-1]
    x2 = _rows(x)  # [N, D]
    N = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if rms else x.dtype
    y = torch.empty(*x.shape, device=x.device, dtype=out_dtype)  # [..., D]
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)  # [N]
    mean = torch.empty(0 if rms else N, device=x.device, dtype=torch.float32)  # [N] (LayerNorm) or [0]
    block_d = triton.next_power_of_2(D)
    if N:
        _norm_fwd[(N,)](
            x2,
            y,
            weight,
            bias,
            None if rms else mean,
            rstd,
            x2.stride(0),
            D,
            D,
            eps,
            RMS=rms,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            num_warps=_warps(block_d),
        )
    return y, mean, rstd


@_norm_op.register_fake
def _(x, weight, bias, eps, rms):
    N = x.numel() // x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype) if rms else x.dtype
    return (
        x.new_empty(x.shape, dtype=out_dtype),
        x.new_empty(0 if rms else N, dtype=torch.float32),
        x.new_empty(N, dtype=torch.float32),
    )


@torch.library.custom_op("gptkit::norm_bwd", mutates_args=())
def _norm_grad_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias (empty [0] without a bias))."""
    x2 = _rows(x)  # [N, D]
    N, D = x2.shape
    dy2 = _rows(dy)  # [N, D]
    dx = torch.empty_like(x2)  # [N, D]
    if interpreting() or not x2.is_cuda:
        programs = min(N, 4)
    else:
        programs = min(N, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
    programs = max(programs, 1)
    per = triton.cdiv(max(N, 1), programs)
    dw = torch.zeros(programs, D, device=x2.device, dtype=torch.float32)  # [programs, D] partial sums
    db = None if bias is None else torch.zeros(programs, D, device=x2.device, dtype=torch.float32)
    block_d = triton.next_power_of_2(D)
    if N:
        _norm_bwd[(programs,)](
            x2,
            dy2,
            dx,
            weight,
            None if rms else mean,
            rstd,
            dw,
            db,
            x2.stride(0),
            dy2.stride(0),
            dx.stride(0),
            N,
            D,
            per,
            RMS=rms,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            num_warps=_warps(block_d),
        )
    dbias = x.new_empty(0) if bias is None else db.sum(0).to(bias.dtype)
    return dx.view(x.shape), dw.sum(0).to(weight.dtype), dbias


@_norm_grad_op.register_fake
def _(dy, x, weight, bias, mean, rstd, rms):
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape),
        x.new_empty(0) if bias is None else bias.new_empty(bias.shape),
    )


def _norm_setup(ctx, inputs, output):
    x, weight, bias, eps, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.rms = rms


def _norm_backward(ctx, dy, dmean, drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = _norm_grad_op(dy, x, weight, bias, mean, rstd, ctx.rms)
    return dx, dweight, None if bias is None else dbias, None, None


_norm_op.register_autograd(_norm_backward, setup_context=_norm_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 statistics; differentiable in x and weight."""
    return _norm_op(x, weight, None, float(eps), True)[0]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics, output in x's dtype; differentiable in x, weight,
    bias."""
    return _norm_op(x, weight, bias, float(eps), False)[0]
