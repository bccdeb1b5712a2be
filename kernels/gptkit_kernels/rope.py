"""Rotary position embedding for q and k in one Triton pass (forward and backward).

    rope(q, k, cos, sin, positions=None, start=0) -> (q_rot, k_rot)
    q: [B, H, T, D], k: [B, H_kv, T, D]   any strides with a dense last dim (views of one projection)
    cos, sin: [max_seq_len, D] fp32, the "rotate half" layout: cos = cat(c, c), sin = cat(s, s)
    positions: None (token t sits at start + t) or an integer [B, T] tensor (e.g. restarting at every
               document: model.position_reset)
    out: x * cos[pos] + rotate_half(x) * sin[pos], computed in fp32, in x's dtype; rotate_half(x) =
         cat(-x2, x1). The outputs live in [B, T, heads, D] buffers (free to merge heads later).

One program per (b, t) reads the position and its cos/sin row once and rotates every head of q
and k. The backward pass is the inverse rotation (sin negated) of the output gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X,
    Y,
    sxb,
    sxh,
    sxt,
    syb,
    syh,
    syt,
    b,
    t,
    n_heads,
    c,
    s,
    cols,
    half_cols,
    sign,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    inside = (heads[:, None] < n_heads) & (cols[None, :] < D)
    base = X + b * sxb + t * sxt + heads[:, None] * sxh
    x = tl.load(base + cols[None, :], mask=inside, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    # x at (d + D/2) % D
    x_other = tl.load(base + half_cols[None, :], mask=inside, other=0.0).to(tl.float32)
    # rotate_half(x)
    rotated = tl.where(cols[None, :] < HALF, -x_other, x_other)
    y = x * c[None, :] + rotated * (s[None, :] * sign)
    tl.store(
        Y + b * syb + t * syt + heads[:, None] * syh + cols[None, :], y.to(Y.dtype.element_ty), mask=inside
    )


@triton.jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    POS,
    start,
    T,
    H,
    HKV,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    sqob,
    sqoh,
    sqot,
    skob,
    skoh,
    skot,
    sign,
    HAS_POS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    t = bt % T
    if HAS_POS:
        pos = tl.load(POS + bt).to(tl.int64)
    else:
        pos = start + t
    cols = tl.arange(0, BLOCK_D)
    half_cols = (cols + D // 2) % D
    c = tl.load(COS + pos * D + cols, mask=cols < D, other=0.0)
    s = tl.load(SIN + pos * D + cols, mask=cols < D, other=0.0)
    _rotate_heads(
        Q,
        QO,
        sqb,
        sqh,
        sqt,
        sqob,
        sqoh,
        sqot,
        b,
        t,
        H,
        c,
        s,
        cols,
        half_cols,
        sign,
        D // 2,
        BLOCK_HQ,
        BLOCK_D,
        D,
    )
    _rotate_heads(
        K,
        KO,
        skb,
        skh,
        skt,
        skob,
        skoh,
        skot,
        b,
        t,
        HKV,
        c,
        s,
        cols,
        half_cols,
        sign,
        D // 2,
        BLOCK_HK,
        BLOCK_D,
        D,
    )


def _rotate(q, k, cos, sin, positions, start, sign):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qo = q.new_empty(B, T, H, D).transpose(1, 2)  # [B, H, T, D] in a [B, T, H, D] buffer
    ko = k.new_empty(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    if B * T:
        _rope_kernel[(B * T,)](
            q,
            k,
            qo,
            ko,
            cos,
            sin,
            positions,
            start,
            T,
            H,
            Hkv,
            *q.stride()[:3],
            *k.stride()[:3],
            *qo.stride()[:3],
            *ko.stride()[:3],
            sign,
            HAS_POS=positions is not None,
            D=D,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_HQ=triton.next_power_of_2(H),
            BLOCK_HK=triton.next_power_of_2(Hkv),
        )
    return qo, ko


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# one torch custom op for both directions (the backward is the inverse rotation, sign -1): opaque to
# torch.compile, joined by autograd; see flash.py


@torch.library.custom_op("gptkit::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor],
    start: int,
    sign: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(_dense_last(q), _dense_last(k), cos, sin, positions, start, sign)


@_rope_op.register_fake
def _(q, k, cos, sin, positions, start, sign):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2), k.new_empty(B, T, k.shape[1], D).transpose(1, 2)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, positions, start, sign = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.start, ctx.sign = start, sign


def _rope_backward(ctx, dq, dk):
    cos, sin, positions = ctx.saved_tensors
    dq, dk = _rope_op(dq, dk, cos, sin, positions, ctx.start, -ctx.sign)
    return dq, dk, None, None, None, None, None


_rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, H, T, D] and k [B, H_kv, T, D] by their positions (see the module docstring)."""
    B, H, T, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[2:] != (T, D) or D % 2:
        raise ValueError(
            f"q [B, H, T, D] and k [B, H_kv, T, D] with an even D, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D:
        raise ValueError(
            f"cos and sin must be [max_seq_len, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    if positions is not None:
        if positions.shape != (B, T):
            raise ValueError(f"positions must be [B, T] = [{B}, {T}], got {tuple(positions.shape)}")
        positions = positions.contiguous()
    return _rope_op(q, k, cos, sin, positions, int(start), 1.0)
