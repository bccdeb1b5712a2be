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

import torch
import triton
import triton.language as tl

from gptkit_kernels.flash import interpreting


@triton.jit
def _norm_fwd(X, Y, W, Bias, MEAN, RSTD, sx, sy, D, eps,
              RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(X + row * sx + cols, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        xn = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded to x's dtype, as the reference does
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
def _norm_bwd(X, DY, DX, W, MEAN, RSTD, DW, DB, sx, sdy, sdx, N, D, rows_per_program,
              RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
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


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool):
        D = x.shape[-1]
        x2 = _rows(x)  # [N, D]
        N = x2.shape[0]
        out_dtype = torch.promote_types(weight.dtype, x.dtype) if rms else x.dtype
        y = torch.empty(N, D, device=x.device, dtype=out_dtype)  # [N, D]
        rstd = torch.empty(N, device=x.device, dtype=torch.float32)  # [N]
        mean = None if rms else torch.empty(N, device=x.device, dtype=torch.float32)  # [N]
        block_d = triton.next_power_of_2(D)
        if N:
            _norm_fwd[(N,)](x2, y, weight, bias, mean, rstd, x2.stride(0), y.stride(0), D, eps,
                            RMS=rms, HAS_BIAS=bias is not None, BLOCK_D=block_d, num_warps=_warps(block_d))
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.rms, ctx.shape = rms, x.shape
        return y.view(*x.shape[:-1], D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        N, D = x2.shape
        dy2 = _rows(dy)  # [N, D]
        dx = torch.empty_like(x2)  # [N, D]
        if interpreting() or not x2.is_cuda:
            programs = min(N, 4)
        else:
            programs = min(N, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
        programs = max(programs, 1)
        per = triton.cdiv(max(N, 1), programs)
        dw = torch.empty(programs, D, device=x2.device, dtype=torch.float32)  # [programs, D] partial sums
        db = None if bias is None else torch.empty(programs, D, device=x2.device, dtype=torch.float32)
        block_d = triton.next_power_of_2(D)
        if N:
            _norm_bwd[(programs,)](x2, dy2, dx, weight, mean, rstd, dw, db, x2.stride(0), dy2.stride(0),
                                   dx.stride(0), N, D, per, RMS=ctx.rms, HAS_BIAS=bias is not None,
                                   BLOCK_D=block_d, num_warps=_warps(block_d))
        else:
            dw.zero_()
            if db is not None:
                db.zero_()
        dweight = dw.sum(0).to(weight.dtype)
        dbias = None if bias is None else db.sum(0).to(bias.dtype)
        return dx.view(ctx.shape), dweight, dbias, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 statistics; differentiable in x and weight."""
    return _Norm.apply(x, weight, None, float(eps), True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics, output in x's dtype; differentiable in x, weight, bias."""
    return _Norm.apply(x, weight, bias, float(eps), False)
