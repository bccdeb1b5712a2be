"""FlashAttention in Triton: forward, backward, GQA/MQA, causal or not, document masking, sliding windows,
soft-capping.

    flash_attention(q, k, v, causal=True, scale=None, doc_bounds=None, window=None, softcap=None, sinks=None,
                    impl=None)
    q:   [B, H,    T, D]
    k/v: [B, H_kv, T, D]     H_kv divides H; query head h reads K/V head h // (H // H_kv)
    doc_bounds: None, or (start, end), int32 [B, T] each: token t of row b belongs to the document
                [start[b, t], end[b, t]); attention never crosses a document boundary
    window: None, or W (causal only): query i sees only the keys j > i - W, its last W positions
    softcap: None, or c: the scores s become c * tanh(s / c) before the softmax (Gemma 2); the backward
             multiplies dS by 1 - tanh^2, recomputed with the probabilities
    sinks: None, or [H]: a learned logit per head in each row's softmax denominator, with no value (gpt-oss):
           each row's online softmax starts from it (m = sink, l = 1), so the saved lse includes it
    out: [B, H, T, D]        differentiable with respect to q, k, v (and the sinks)

A window is a document bound per token (window_bounds): with causal attention, query i sees key j iff
start[i] <= j <= i, and key j is seen by the queries j <= i < end[j]; a window W makes start[i] at least
i - W + 1 and end[j] at most j + W. Both stay non-decreasing in t, which is all the tile ranges below need:
the tiles wholly outside a window are skipped exactly as those outside a document, in the forward and in
both backward kernels, so the cost of a windowed layer grows with T * W, not T^2 (forward_tiles counts it).

Forward (one program per tile of BLOCK_M queries of one head): the query tile stays on-chip
while K/V tiles stream past it; an online softmax keeps a fp32 running max `m` and sum `l`
(in base 2: exp(x) = exp2(x * log2(e)), folded into the scale), and the output is rescaled
as the max grows. The log-sum-exp of each row (natural log, fp32, [B, H, T]) is saved for
the backward pass. Each query tile visits only the key tiles some of its rows can see: with
causal masking the tiles at or left of the diagonal, with documents only those of the
documents its rows belong to (so the cost falls with the document length). Masks are applied
only on the tiles that need one: a tile every row sees entirely runs unmasked.

Backward, without the T x T matrix:
  1. preprocess: delta = rowsum(dO * O)                                   [B, H, T] fp32
  2. dK/dV: one program per tile of keys of one K/V head; it walks the (query head, query tile)
     pairs of the heads that share that K/V head (GQA), recomputing P = exp(QK^T*scale - lse):
       dV += P^T dO,   dS = P * (dO V^T - delta),   dK += dS^T Q * scale
     so the dK/dV of a shared head are summed in registers: no atomics, no K/V copies.
  3. dQ: one program per tile of queries: dQ += dS K * scale over the key tiles.

Two implementations of the same kernels (one source, a constexpr switch):
  "fa2"  pointer loads with masks; any CUDA GPU Triton supports (Ampere and newer). The default.
  "tma"  Hopper (sm_90+): K/V/Q/dO tiles through on-device TMA tensor descriptors (4-d, zero
         padding past the sequence end instead of masks), tile shapes for wgmma, its own tuning
         space; "tma-ws" also asks Triton to warp-specialize the unmasked inner loop of the forward.
         Selected with impl= or GPTKIT_FLASH_IMPL; it has run only in the interpreter so far.

Any T (ragged tails are masked), head dims 16..256 (padded to a power of two on-chip),
fp32 / fp16 / bf16 inputs with fp32 accumulation (fp32 inputs use IEEE dots, not TF32).

Block sizes are autotuned on a GPU (results cached on disk where Triton supports it);
GPTKIT_KERNELS_AUTOTUNE=0 pins one small configuration per kernel instead (the tests do), and
under the Triton interpreter (TRITON_INTERPRET=1, CPU) tiny blocks are pinned.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from gptkit_kernels._tuning import autotuned, pinned, tuning

# log2(e)
LOG2E = 1.4426950408889634
IMPLS = ("fa2", "tma", "tma-ws")


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (TRITON_INTERPRET=1, e.g. on a CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- tile helpers ---------------------------------------------------------------------------


@triton.jit
def _load_rows(
    desc,
    base,
    stride_t,
    b,
    h,
    start,
    T,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Rows start..start+BLOCK_R of one head: a [BLOCK_R, BLOCK_D] tile, zeros past T (if CHECK_ROWS)
    and past HEAD_DIM. USE_TMA: through the 4-d descriptor `desc` at (b, h); else from pointer `base`
    (already at b, h). (One function, not two: each nested call costs the interpreter ~0.2 ms.)"""
    if USE_TMA:
        x = desc.load([b, h, start, 0]).reshape([BLOCK_R, BLOCK_D])
    else:
        rows = start + offs_r
        ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
        if CHECK_ROWS:
            if BLOCK_D != HEAD_DIM:
                x = tl.load(ptrs, mask=(rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM), other=0.0)
            else:
                x = tl.load(ptrs, mask=rows[:, None] < T, other=0.0)
        else:
            if BLOCK_D != HEAD_DIM:
                x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            else:
                x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(
    desc,
    base,
    stride_t,
    b,
    h,
    start,
    x,
    T,
    offs_r,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # the descriptor clips rows past T and columns past HEAD_DIM
    if USE_TMA:
        desc.store([b, h, start, 0], x.reshape([1, 1, BLOCK_R, BLOCK_D]))
    else:
        rows = start + offs_r
        ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
        if BLOCK_D != HEAD_DIM:
            tl.store(ptrs, x, mask=(rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < T)


@triton.jit
def _descriptor(X, B, H, T, sb, sh, st, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A TMA descriptor over X viewed as [B, H, T, HEAD_DIM] (last dim dense), tiles of [1, 1, BLOCK_R,
    BLOCK_D]."""
    return tl.make_tensor_descriptor(
        X, shape=[B, H, T, HEAD_DIM], strides=[sb, sh, st, 1], block_shape=[1, 1, BLOCK_R, BLOCK_D]
    )


@triton.jit
def _tanh(x):
    """tanh from exp (every backend and the interpreter have it): 1 - 2 / (e^2x + 1), exact at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _keep(rows, cols, ds_rows, de_rows, T, CAUSAL: tl.constexpr, DOC: tl.constexpr):
    """[len(rows), len(cols)] True where query `rows` may see key `cols` (keys past T never)."""
    keep = cols[None, :] < T
    if CAUSAL:
        keep = keep & (rows[:, None] >= cols[None, :])
    if DOC:
        keep = keep & (ds_rows[:, None] <= cols[None, :])
        if not CAUSAL:
            keep = keep & (cols[None, :] < de_rows[:, None])
    return keep


@triton.jit
def _query_tile_ranges(
    DS, DE, m0, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOC: tl.constexpr
):
    """Key ranges for the query tile at m0: [lo, mid_lo) masked, [mid_lo, mid_hi) seen whole by every
    row (no mask), [mid_hi, hi) masked. Keys outside [lo, hi) are seen by no row of the tile."""
    # the tile's last valid query
    last = tl.minimum(m0 + BLOCK_M, T) - 1
    if CAUSAL:
        hi = last + 1
        # key tiles that end at or before the first query
        mid_hi = ((m0 + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = T
        mid_hi = (T // BLOCK_N) * BLOCK_N
    # rows see only their own document: start[first row] is the smallest start, start[last] the largest
    if DOC:
        lo = (tl.load(DS + m0) // BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(tl.maximum(tl.cdiv(tl.load(DS + last), BLOCK_N) * BLOCK_N, lo), hi)
        if not CAUSAL:
            hi = tl.load(DE + last)
            mid_hi = tl.minimum(mid_hi, (tl.load(DE + m0) // BLOCK_N) * BLOCK_N)
        mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    else:
        lo = 0
        mid_lo = 0
    return lo, mid_lo, mid_hi, hi


# ---- forward --------------------------------------------------------------------------------


@triton.jit
def _fwd_step(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    skt,
    svt,
    b,
    hk,
    start_n,
    rows,
    ds_rows,
    de_rows,
    offs_n,
    offs_d,
    T,
    qk_scale,
    cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold the key tile at start_n into the running (acc, l_i, m_i) of one query tile."""
    k = _load_rows(
        k_src, k_src, skt, b, hk, start_n, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, USE_TMA
    )  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    # log2 units; soft-capped: softcap * tanh(scale * qk / softcap) (cap = scale / softcap)
    qk = _tanh(qk * cap) * (qk_scale / cap) if SOFTCAP else qk * qk_scale
    if MASKED:
        qk = tl.where(_keep(rows, start_n + offs_n, ds_rows, de_rows, T, CAUSAL, DOC), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    # a row may not have reached its document yet: keep -inf - -inf from making NaN
    if DOC and MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    # without documents every row has seen at least one key by now, so m_new is finite
    else:
        m_use = m_new
    p = tl.exp2(qk - m_use[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_use)  # [BLOCK_M] rescales what was accumulated so far
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(
        v_src, v_src, svt, b, hk, start_n, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, USE_TMA
    )  # [BLOCK_N, BLOCK_D]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    skt,
    svt,
    b,
    hk,
    rows,
    ds_rows,
    de_rows,
    offs_n,
    offs_d,
    T,
    lo,
    hi,
    qk_scale,
    cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold the key tiles [lo, hi) into the running (acc, l_i, m_i) of one query tile."""
    if WARP_SPECIALIZE:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_step(
                acc,
                l_i,
                m_i,
                q,
                k_src,
                v_src,
                skt,
                svt,
                b,
                hk,
                start_n,
                rows,
                ds_rows,
                de_rows,
                offs_n,
                offs_d,
                T,
                qk_scale,
                cap,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                CAUSAL,
                DOC,
                MASKED,
                USE_TMA,
                PRECISION,
                SOFTCAP,
            )
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_step(
                acc,
                l_i,
                m_i,
                q,
                k_src,
                v_src,
                skt,
                svt,
                b,
                hk,
                start_n,
                rows,
                ds_rows,
                de_rows,
                offs_n,
                offs_d,
                T,
                qk_scale,
                cap,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_N,
                CAUSAL,
                DOC,
                MASKED,
                USE_TMA,
                PRECISION,
                SOFTCAP,
            )
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    DS,
    DE,
    SINKS,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    B,
    H,
    T,
    qk_scale,
    cap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # the longest rows first: better balance across the GPU
    if CAUSAL:
        pid_m = tl.cdiv(T, BLOCK_M) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q_src = _descriptor(Q, B, H, T, sqb, sqh, sqt, HEAD_DIM, BLOCK_M, BLOCK_D)
        k_src = _descriptor(K, B, H // GROUP, T, skb, skh, skt, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_src = _descriptor(V, B, H // GROUP, T, svb, svh, svt, HEAD_DIM, BLOCK_N, BLOCK_D)
        o_dst = _descriptor(O, B, H, T, sob, soh, sot, HEAD_DIM, BLOCK_M, BLOCK_D)
    else:
        q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_src = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        o_dst = O + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    LSE += (b.to(tl.int64) * H + h) * T
    if DOC:
        DS += b.to(tl.int64) * T
        DE += b.to(tl.int64) * T
        ds_rows = tl.load(DS + rows, mask=rows < T, other=0)  # [BLOCK_M] where each row's document starts
        if CAUSAL:
            # unused
            de_rows = ds_rows
        else:
            de_rows = tl.load(DE + rows, mask=rows < T, other=T)
    else:
        # unused
        ds_rows = rows
        de_rows = rows
    q = _load_rows(
        q_src,
        q_src,
        sqt,
        b,
        h,
        m0,
        T,
        tl.arange(0, BLOCK_M),
        offs_d,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        True,
        USE_TMA,
    )  # [BLOCK_M, BLOCK_D], stays on-chip
    if HAS_SINKS:
        # the head's sink is the first logit of every row (log2 units): its exp2(sink - m_i) = 1 starts the
        # sum, and it has no value, so acc starts at 0 (the stored lse includes it)
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + tl.load(SINKS + h) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        # running max (log2 units)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        # running sum of exp2(s - m_i)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # unnormalised output
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _query_tile_ranges(DS, DE, m0, T, BLOCK_M, BLOCK_N, CAUSAL, DOC)
    if DOC:
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_src,
            v_src,
            skt,
            svt,
            b,
            hk,
            rows,
            ds_rows,
            de_rows,
            offs_n,
            offs_d,
            T,
            lo,
            mid_lo,
            qk_scale,
            cap,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            CAUSAL,
            DOC,
            True,
            USE_TMA,
            False,
            PRECISION,
            SOFTCAP,
        )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        skt,
        svt,
        b,
        hk,
        rows,
        ds_rows,
        de_rows,
        offs_n,
        offs_d,
        T,
        mid_lo,
        mid_hi,
        qk_scale,
        cap,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        CAUSAL,
        DOC,
        False,
        USE_TMA,
        WARP_SPECIALIZE,
        PRECISION,
        SOFTCAP,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        skt,
        svt,
        b,
        hk,
        rows,
        ds_rows,
        de_rows,
        offs_n,
        offs_d,
        T,
        mid_hi,
        hi,
        qk_scale,
        cap,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        CAUSAL,
        DOC,
        True,
        USE_TMA,
        False,
        PRECISION,
        SOFTCAP,
    )

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    _store_rows(
        o_dst,
        o_dst,
        sot,
        b,
        h,
        m0,
        out.to(O.dtype.element_ty),
        T,
        tl.arange(0, BLOCK_M),
        offs_d,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        USE_TMA,
    )
    # natural log
    tl.store(LSE + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=rows < T)


# ---- backward -------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(
    O,
    DO,
    DELTA,
    sob,
    soh,
    sot,
    sdb,
    sdh,
    sdt,
    H,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta[b, h, t] = sum_d dO * O, in fp32."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(
        O, O + b * sob + h * soh, sot, b, h, m0, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, True, False
    )  # [BLOCK_M, BLOCK_D]
    do = _load_rows(
        DO, DO + b * sdb + h * sdh, sdt, b, h, m0, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, True, False
    )  # [BLOCK_M, BLOCK_D]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(DELTA + (b * H + h) * T + rows, delta, mask=rows < T)


@triton.jit
def _dkdv_tile(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    LSE,
    DELTA,
    DS,
    DE,
    sqt,
    sdt,
    b,
    h,
    T,
    start_m,
    cols,
    offs_m,
    offs_d,
    qk_scale,
    cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Add one query tile (of query head h, whose LSE/DELTA rows start at LSE/DELTA) to a tile of dK, dV."""
    rows = start_m + offs_m  # [BLOCK_M] query positions
    q = _load_rows(
        q_src, q_src, sqt, b, h, start_m, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, MASKED, USE_TMA
    )  # [BLOCK_M, BLOCK_D]
    do = _load_rows(
        do_src, do_src, sdt, b, h, start_m, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, MASKED, USE_TMA
    )  # [BLOCK_M, BLOCK_D]
    # lse = +inf past the end makes those probabilities exactly 0
    if MASKED:
        lse = tl.load(LSE + rows, mask=rows < T, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=rows < T, other=0.0)
    else:
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
    qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    if SOFTCAP:
        # the cap's tanh, kept for its derivative 1 - tanh^2
        cap_t = _tanh(qk_t * cap)
        qk_t = cap_t * (qk_scale / cap)
    # log2 units
    else:
        qk_t = qk_t * qk_scale
    p_t = tl.exp2(qk_t - lse[None, :] * 1.4426950408889634)  # [BLOCK_N, BLOCK_M] = P^T
    if MASKED:
        if DOC:
            ds_rows = tl.load(DS + rows, mask=rows < T, other=T)
            if CAUSAL:
                # unused
                de_rows = ds_rows
            else:
                de_rows = tl.load(DE + rows, mask=rows < T, other=0)
            keep_t = tl.trans(_keep(rows, cols, ds_rows, de_rows, T, CAUSAL, DOC))  # [BLOCK_N, BLOCK_M]
            p_t = tl.where(keep_t, p_t, 0.0)
        elif CAUSAL:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M] = (dO V^T)^T
    ds_t = p_t * (dp_t - delta[None, :])  # [BLOCK_N, BLOCK_M]
    if SOFTCAP:
        ds_t = ds_t * (1.0 - cap_t * cap_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    LSE,
    DELTA,
    DS,
    DE,
    sqh,
    sqt,
    sdh,
    sdt,
    b,
    h0,
    T,
    cols,
    offs_m,
    offs_d,
    lo,
    hi,
    qk_scale,
    cap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Add the query tiles [lo, hi) of the GROUP query heads h0.. that share this K/V head to dK, dV.
    GQA walks (head, tile) pairs in one flat loop: nested loops spill registers on Hopper."""
    if GROUP == 1:
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _dkdv_tile(
                dk,
                dv,
                k,
                v,
                q_src,
                do_src,
                LSE,
                DELTA,
                DS,
                DE,
                sqt,
                sdt,
                b,
                h0,
                T,
                start_m,
                cols,
                offs_m,
                offs_d,
                qk_scale,
                cap,
                HEAD_DIM,
                BLOCK_M,
                BLOCK_D,
                CAUSAL,
                DOC,
                MASKED,
                USE_TMA,
                PRECISION,
                SOFTCAP,
            )
    else:
        n_tiles = tl.cdiv(hi - lo, BLOCK_M)
        for i in range(0, GROUP * n_tiles):
            # the query head within the group
            g = i // n_tiles
            start_m = tl.multiple_of(lo + (i - g * n_tiles) * BLOCK_M, BLOCK_M)
            if USE_TMA:
                dk, dv = _dkdv_tile(
                    dk,
                    dv,
                    k,
                    v,
                    q_src,
                    do_src,
                    LSE + g * T,
                    DELTA + g * T,
                    DS,
                    DE,
                    sqt,
                    sdt,
                    b,
                    h0 + g,
                    T,
                    start_m,
                    cols,
                    offs_m,
                    offs_d,
                    qk_scale,
                    cap,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_D,
                    CAUSAL,
                    DOC,
                    MASKED,
                    USE_TMA,
                    PRECISION,
                    SOFTCAP,
                )
            else:
                dk, dv = _dkdv_tile(
                    dk,
                    dv,
                    k,
                    v,
                    q_src + g * sqh,
                    do_src + g * sdh,
                    LSE + g * T,
                    DELTA + g * T,
                    DS,
                    DE,
                    sqt,
                    sdt,
                    b,
                    h0 + g,
                    T,
                    start_m,
                    cols,
                    offs_m,
                    offs_d,
                    qk_scale,
                    cap,
                    HEAD_DIM,
                    BLOCK_M,
                    BLOCK_D,
                    CAUSAL,
                    DOC,
                    MASKED,
                    USE_TMA,
                    PRECISION,
                    SOFTCAP,
                )
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DS,
    DE,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdkb,
    sdkh,
    sdkt,
    sdvb,
    sdvh,
    sdvt,
    B,
    H,
    T,
    qk_scale,
    cap,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    # the K/V head
    hk = tl.program_id(1)
    b = tl.program_id(2)
    Hkv = H // GROUP
    # the first of the query heads that share this K/V head
    h0 = hk * GROUP
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        k_src = _descriptor(K, B, Hkv, T, skb, skh, skt, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_src = _descriptor(V, B, Hkv, T, svb, svh, svt, HEAD_DIM, BLOCK_N, BLOCK_D)
        q_src = _descriptor(Q, B, H, T, sqb, sqh, sqt, HEAD_DIM, BLOCK_M, BLOCK_D)
        do_src = _descriptor(DO, B, H, T, sdb, sdh, sdt, HEAD_DIM, BLOCK_M, BLOCK_D)
        dk_dst = _descriptor(DK, B, Hkv, T, sdkb, sdkh, sdkt, HEAD_DIM, BLOCK_N, BLOCK_D)
        dv_dst = _descriptor(DV, B, Hkv, T, sdvb, sdvh, sdvt, HEAD_DIM, BLOCK_N, BLOCK_D)
    else:
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_src = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        q_src = Q + b.to(tl.int64) * sqb + h0.to(tl.int64) * sqh
        do_src = DO + b.to(tl.int64) * sdb + h0.to(tl.int64) * sdh
        dk_dst = DK + b.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh
        dv_dst = DV + b.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh
    k = _load_rows(
        k_src, k_src, skt, b, hk, n0, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, True, USE_TMA
    )  # [BLOCK_N, BLOCK_D]
    v = _load_rows(
        v_src, v_src, svt, b, hk, n0, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, True, USE_TMA
    )  # [BLOCK_N, BLOCK_D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # query ranges: [lo, mid_lo) masked, [mid_lo, mid_hi) sees the whole key tile, [mid_hi, hi) masked
    # the tile's last valid key
    last = tl.minimum(n0 + BLOCK_N, T) - 1
    # query tiles before this one have no ragged rows
    mid_hi = (T // BLOCK_M) * BLOCK_M
    hi = T
    if CAUSAL:
        # earlier queries cannot see these keys
        lo = (n0 // BLOCK_M) * BLOCK_M
        # tiles whose first query is past the last key
        mid_lo = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid_lo = 0
    if DOC:
        DS += b.to(tl.int64) * T
        DE += b.to(tl.int64) * T
        # later queries are in later documents
        hi = tl.load(DE + last)
        # rows in the first key's document
        mid_hi = tl.minimum(mid_hi, (tl.load(DE + n0) // BLOCK_M) * BLOCK_M)
        if not CAUSAL:
            lo = (tl.load(DS + n0) // BLOCK_M) * BLOCK_M
            mid_lo = tl.cdiv(tl.load(DS + last), BLOCK_M) * BLOCK_M
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    LSE += (b.to(tl.int64) * H + h0) * T
    DELTA += (b.to(tl.int64) * H + h0) * T
    dk, dv = _dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_src,
        do_src,
        LSE,
        DELTA,
        DS,
        DE,
        sqh,
        sqt,
        sdh,
        sdt,
        b,
        h0,
        T,
        cols,
        offs_m,
        offs_d,
        lo,
        mid_lo,
        qk_scale,
        cap,
        GROUP,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        CAUSAL,
        DOC,
        True,
        USE_TMA,
        PRECISION,
        SOFTCAP,
    )
    dk, dv = _dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_src,
        do_src,
        LSE,
        DELTA,
        DS,
        DE,
        sqh,
        sqt,
        sdh,
        sdt,
        b,
        h0,
        T,
        cols,
        offs_m,
        offs_d,
        mid_lo,
        mid_hi,
        qk_scale,
        cap,
        GROUP,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        CAUSAL,
        DOC,
        False,
        USE_TMA,
        PRECISION,
        SOFTCAP,
    )
    dk, dv = _dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_src,
        do_src,
        LSE,
        DELTA,
        DS,
        DE,
        sqh,
        sqt,
        sdh,
        sdt,
        b,
        h0,
        T,
        cols,
        offs_m,
        offs_d,
        mid_hi,
        hi,
        qk_scale,
        cap,
        GROUP,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        CAUSAL,
        DOC,
        True,
        USE_TMA,
        PRECISION,
        SOFTCAP,
    )

    _store_rows(
        dk_dst,
        dk_dst,
        sdkt,
        b,
        hk,
        n0,
        (dk * scale).to(DK.dtype.element_ty),
        T,
        offs_n,
        offs_d,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_D,
        USE_TMA,
    )
    _store_rows(
        dv_dst,
        dv_dst,
        sdvt,
        b,
        hk,
        n0,
        dv.to(DV.dtype.element_ty),
        T,
        offs_n,
        offs_d,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_D,
        USE_TMA,
    )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_src,
    v_src,
    skt,
    svt,
    b,
    hk,
    rows,
    ds_rows,
    de_rows,
    offs_n,
    offs_d,
    T,
    lo,
    hi,
    qk_scale,
    cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    MASKED: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Add the contributions of key tiles [lo, hi) to a tile of dQ."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = _load_rows(
            k_src, k_src, skt, b, hk, start_n, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, USE_TMA
        )  # [BLOCK_N, BLOCK_D]
        v = _load_rows(
            v_src, v_src, svt, b, hk, start_n, T, offs_n, offs_d, HEAD_DIM, BLOCK_N, BLOCK_D, MASKED, USE_TMA
        )  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            cap_qk = _tanh(qk * cap)
            qk = cap_qk * (qk_scale / cap)
        # log2 units
        else:
            qk = qk * qk_scale
        p = tl.exp2(qk - lse[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            p = tl.where(_keep(rows, start_n + offs_n, ds_rows, de_rows, T, CAUSAL, DOC), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            ds = ds * (1.0 - cap_qk * cap_qk)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DS,
    DE,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdqb,
    sdqh,
    sdqt,
    B,
    H,
    T,
    qk_scale,
    cap,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOC: tl.constexpr,
    USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # the longest rows first
    if CAUSAL:
        pid_m = tl.cdiv(T, BLOCK_M) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if USE_TMA:
        q_src = _descriptor(Q, B, H, T, sqb, sqh, sqt, HEAD_DIM, BLOCK_M, BLOCK_D)
        do_src = _descriptor(DO, B, H, T, sdb, sdh, sdt, HEAD_DIM, BLOCK_M, BLOCK_D)
        k_src = _descriptor(K, B, H // GROUP, T, skb, skh, skt, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_src = _descriptor(V, B, H // GROUP, T, svb, svh, svt, HEAD_DIM, BLOCK_N, BLOCK_D)
        dq_dst = _descriptor(DQ, B, H, T, sdqb, sdqh, sdqt, HEAD_DIM, BLOCK_M, BLOCK_D)
    else:
        q_src = Q + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_src = DO + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        k_src = K + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
        v_src = V + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
        dq_dst = DQ + b.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
    q = _load_rows(
        q_src, q_src, sqt, b, h, m0, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, True, USE_TMA
    )  # [BLOCK_M, BLOCK_D]
    do = _load_rows(
        do_src, do_src, sdt, b, h, m0, T, offs_m, offs_d, HEAD_DIM, BLOCK_M, BLOCK_D, True, USE_TMA
    )  # [BLOCK_M, BLOCK_D]
    bh = (b.to(tl.int64) * H + h) * T
    # log2 units
    lse = tl.load(LSE + bh + rows, mask=rows < T, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + bh + rows, mask=rows < T, other=0.0)
    if DOC:
        DS += b.to(tl.int64) * T
        DE += b.to(tl.int64) * T
        ds_rows = tl.load(DS + rows, mask=rows < T, other=0)
        if CAUSAL:
            # unused
            de_rows = ds_rows
        else:
            de_rows = tl.load(DE + rows, mask=rows < T, other=T)
    else:
        # unused
        ds_rows = rows
        de_rows = rows
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, mid_lo, mid_hi, hi = _query_tile_ranges(DS, DE, m0, T, BLOCK_M, BLOCK_N, CAUSAL, DOC)
    if DOC:
        dq = _dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            k_src,
            v_src,
            skt,
            svt,
            b,
            hk,
            rows,
            ds_rows,
            de_rows,
            offs_n,
            offs_d,
            T,
            lo,
            mid_lo,
            qk_scale,
            cap,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_N,
            CAUSAL,
            DOC,
            True,
            USE_TMA,
            PRECISION,
            SOFTCAP,
        )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_src,
        v_src,
        skt,
        svt,
        b,
        hk,
        rows,
        ds_rows,
        de_rows,
        offs_n,
        offs_d,
        T,
        mid_lo,
        mid_hi,
        qk_scale,
        cap,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        CAUSAL,
        DOC,
        False,
        USE_TMA,
        PRECISION,
        SOFTCAP,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse,
        delta,
        k_src,
        v_src,
        skt,
        svt,
        b,
        hk,
        rows,
        ds_rows,
        de_rows,
        offs_n,
        offs_d,
        T,
        mid_hi,
        hi,
        qk_scale,
        cap,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        CAUSAL,
        DOC,
        True,
        USE_TMA,
        PRECISION,
        SOFTCAP,
    )
    _store_rows(
        dq_dst,
        dq_dst,
        sdqt,
        b,
        h,
        m0,
        (dq * scale).to(DQ.dtype.element_ty),
        T,
        offs_m,
        offs_d,
        HEAD_DIM,
        BLOCK_M,
        BLOCK_D,
        USE_TMA,
    )


# ---- launch configurations ------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim. BLOCK_M tiles queries and BLOCK_N
# tiles keys in every kernel. FA2 rows: chosen so that the bf16 kernels compiled for sm_90 use no
# (or, for dK/dV at head dim 128-256, little) local memory for spilled registers. TMA rows (Hopper):
# 128-row query tiles for two warpgroups of wgmma, deeper pipelines; not yet measured on a GPU.
_SPACES = {
    "fa2": {
        "fwd": {
            64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 4)],
            128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3)],
            256: [(32, 32, 4, 2), (64, 16, 4, 2), (64, 32, 8, 2)],
        },
        # key tiles stay on-chip with their dK/dV
        "dkdv": {
            64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
            128: [(32, 64, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
            256: [(32, 32, 8, 2), (16, 32, 4, 2)],
        },
        # query tiles stay on-chip with their dQ
        "dq": {
            64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2)],
            128: [(64, 32, 8, 3), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
            256: [(32, 32, 8, 2), (32, 16, 4, 2)],
        },
    },
    "tma": {
        "fwd": {
            64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
            128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3)],
            256: [(64, 32, 4, 2), (32, 32, 4, 2)],
        },
        "dkdv": {
            64: [(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 2)],
            128: [(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 2)],
            256: [(32, 32, 8, 2), (16, 32, 4, 2)],
        },
        "dq": {
            64: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)],
            128: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
            256: [(32, 32, 8, 2), (32, 16, 4, 2)],
        },
    },
}
# GPTKIT_KERNELS_AUTOTUNE=0 on a GPU: one small configuration per kernel that compiles for fp32 too
# (shared memory) on Ampere and Hopper; the tests use it so that they never autotune.
_PINNED = {
    "fwd": {128: (64, 32, 4, 2), 256: (32, 16, 4, 2)},
    "dkdv": {128: (32, 64, 4, 2), 256: (16, 32, 4, 2)},
    "dq": {128: (64, 32, 4, 2), 256: (32, 16, 4, 2)},
}
# Under the interpreter: one small configuration, with BLOCK_M != BLOCK_N so that tiles cross the
# diagonal in both directions and short sequences still span several tiles.
_INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
_PREPROCESS_BLOCK_M = 64
_AUTOTUNE_KEY = ["T", "HEAD_DIM", "GROUP", "CAUSAL", "DOC", "SOFTCAP"]
_KERNELS = {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}
_TUNED = {
    (impl, kind): autotuned(_KERNELS[kind], _SPACES["fa2" if impl == "fa2" else "tma"][kind], _AUTOTUNE_KEY)
    for impl in IMPLS
    for kind in _KERNELS
    # one tuner per implementation: their timings differ
}


def _launch(kind: str, impl: str, grid, block_d: int, *args, **meta) -> None:
    """Launch kernel `kind` (fwd|dkdv|dq): autotuned, or with pinned blocks (interpreter, or
    GPTKIT_KERNELS_AUTOTUNE=0). `grid` maps the block sizes {BLOCK_M, BLOCK_N} to a launch grid."""
    if interpreting():
        m, n = _INTERPRET_BLOCKS[kind]
        blocks = {"BLOCK_M": m, "BLOCK_N": n}
        _KERNELS[kind][grid(blocks)](*args, **meta, **blocks)
    elif tuning():
        _TUNED[(impl, kind)][grid](*args, **meta)
    else:
        m, n, warps, stages = pinned(_PINNED[kind], block_d)
        blocks = {"BLOCK_M": m, "BLOCK_N": n}
        _KERNELS[kind][grid(blocks)](*args, **meta, **blocks, num_warps=warps, num_stages=stages)


def window_bounds(
    T: int,
    window: int,
    doc_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    batch: int = 1,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end), int32 [B, T]: the document bounds (whole rows without doc_bounds) narrowed by a causal
    window of `window` positions: start[t] = max(start, t - window + 1), end[t] = min(end, t + window)."""
    t = torch.arange(T, device=device, dtype=torch.int32)  # [T]
    ws = (t - window + 1).clamp_min(0)  # [T] the first key query t sees
    # [T] one past the last query that sees key t
    we = (t + window).clamp_max(T)
    if doc_bounds is None:
        return ws.expand(batch, T).contiguous(), we.expand(batch, T).contiguous()
    start, end = doc_bounds
    return torch.maximum(start.to(torch.int32), ws), torch.minimum(end.to(torch.int32), we)


def forward_tiles(
    T: int,
    block_m: int,
    block_n: int,
    causal: bool = True,
    doc_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> int:
    """How many (query tile, key tile) products the forward kernel computes per head, summed over the
    batch rows of doc_bounds (one row without): the same ranges as _query_tile_ranges, in Python.
    Its cost model: time is about proportional to this count (tests hold it equal to the kernel's)."""
    if window is not None:
        B = 1 if doc_bounds is None else doc_bounds[0].shape[0]
        doc_bounds = window_bounds(T, window, doc_bounds, B)
    rows = [(None, None)] if doc_bounds is None else list(zip(doc_bounds[0].tolist(), doc_bounds[1].tolist()))
    cdiv = triton.cdiv
    total = 0
    for ds, de in rows:
        for m0 in range(0, T, block_m):
            last = min(m0 + block_m, T) - 1
            hi, mid_hi = (last + 1, (m0 + 1) // block_n * block_n) if causal else (T, T // block_n * block_n)
            lo = mid_lo = 0
            if ds is not None:
                lo = ds[m0] // block_n * block_n
                mid_lo = min(max(cdiv(ds[last], block_n) * block_n, lo), hi)
                if not causal:
                    hi = de[last]
                    mid_hi = min(mid_hi, de[m0] // block_n * block_n)
                mid_hi = min(max(mid_hi, mid_lo), hi)
            total += sum(
                max(0, cdiv(b - a, block_n)) for a, b in ((lo, mid_lo), (mid_lo, mid_hi), (mid_hi, hi))
            )
    return total


# ---- implementation choice ------------------------------------------------------------------


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether the TMA implementation can take these tensors: this Triton has on-device tensor
    descriptors, the device is Hopper or newer (or the interpreter runs), and every tensor has a
    dense last dim, 16-byte aligned base and strides."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    if not interpreting():
        if not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
            return False
    for x in tensors:
        size = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * size % 16 for s in x.stride()[:-1]):
            return False
    return True


def _choose_impl(impl: str | None, tensors) -> str:
    impl = impl or os.environ.get("GPTKIT_FLASH_IMPL") or "fa2"
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLS)}")
    if impl != "fa2" and not tma_supported(*tensors):
        # the TMA kernels need Hopper and aligned tensors; the FA2 kernels take anything
        return "fa2"
    return impl


def _ensure_allocator() -> None:
    """On-device tensor descriptors need a little global scratch memory from triton.set_allocator.
    Set a torch one unless the caller set their own (per thread: backward runs on another one)."""
    if interpreting():
        return
    try:
        from triton.runtime import _allocation

        if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- autograd -------------------------------------------------------------------------------


def _forward(
    q, k, v, causal: bool, scale: float, ds, de, impl: str, softcap: float = 0.0, sinks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, H, T, D], its log-sum-exp [B, H, T] fp32, the sinks' included); softcap > 0: scores
    soft-capped; sinks: None or fp32 [H]."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    block_d = max(16, triton.next_power_of_2(D))
    # O lives in a [B, T, H, D] buffer so that the model's transpose-and-merge of heads is free
    o = q.new_empty(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)  # [B, H, T], natural log
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    use_tma = impl != "fa2"
    if use_tma:
        _ensure_allocator()
    _launch(
        "fwd",
        impl,
        lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B),
        block_d,
        q,
        k,
        v,
        o,
        lse,
        ds,
        de,
        sinks,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(o),
        B,
        H,
        T,
        scale * LOG2E,
        # the tanh's argument per unit of q.k (unused without a cap)
        scale / softcap if softcap else 1.0,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        CAUSAL=causal,
        DOC=ds is not None,
        USE_TMA=use_tma,
        WARP_SPECIALIZE=impl == "tma-ws",
        PRECISION=precision,
        SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
    )
    return o, lse


def _backward(do, q, k, v, o, lse, causal: bool, scale: float, ds, de, impl: str, softcap: float = 0.0):
    """(dQ, dK, dV) from dO, recomputing the probabilities from the log-sum-exp (with sinks the lse
    includes them, and these three are unchanged: _sinks_grad is the sinks' own)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    block_d = max(16, triton.next_power_of_2(D))
    do = _last_dim_dense(do)  # [B, H, T, D]
    impl = impl if impl == "fa2" or tma_supported(do) else "fa2"
    if impl != "fa2":
        _ensure_allocator()
    delta = torch.empty_like(lse)  # [B, H, T] fp32
    dq = q.new_empty(B, T, H, D).transpose(1, 2)  # [B, H, T, D], the layout the model merges for free
    dk = k.new_empty(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    dv = v.new_empty(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    common = dict(
        GROUP=H // Hkv,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        CAUSAL=causal,
        DOC=ds is not None,
        USE_TMA=impl != "fa2",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=bool(softcap),
    )
    qk_scale = scale * LOG2E
    # the tanh's argument per unit of q.k (unused without a cap)
    cap = scale / softcap if softcap else 1.0

    _bwd_preprocess[(triton.cdiv(T, _PREPROCESS_BLOCK_M), H, B)](
        o,
        do,
        delta,
        *_strides(o),
        *_strides(do),
        H,
        T,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_M=_PREPROCESS_BLOCK_M,
    )
    _launch(
        "dkdv",
        impl,
        lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), Hkv, B),
        block_d,
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        ds,
        de,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(do),
        *_strides(dk),
        *_strides(dv),
        B,
        H,
        T,
        qk_scale,
        cap,
        scale,
        **common,
    )
    _launch(
        "dq",
        impl,
        lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B),
        block_d,
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        ds,
        de,
        *_strides(q),
        *_strides(k),
        *_strides(v),
        *_strides(do),
        *_strides(dq),
        B,
        H,
        T,
        qk_scale,
        cap,
        scale,
        **common,
    )
    return dq, dk, dv


# ---- autograd, as torch custom ops ------------------------------------------------------------
# Forward and backward are torch.library custom ops: torch.compile treats them as opaque calls (it
# neither traces into the Triton launch code nor breaks the graph around it), and autograd connects
# them. The fake implementations give torch.compile the outputs' shapes and layouts.


@torch.library.custom_op("gptkit::flash_attention_fwd", mutates_args=())
def _flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    ds: Optional[torch.Tensor],
    de: Optional[torch.Tensor],
    impl: str,
    softcap: float,
    sinks: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, scale, ds, de, impl, softcap, sinks)


@_flash_fwd.register_fake
def _(q, k, v, causal, scale, ds, de, impl, softcap, sinks):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("gptkit::flash_attention_bwd", mutates_args=())
def _flash_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    ds: Optional[torch.Tensor],
    de: Optional[torch.Tensor],
    impl: str,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal, scale, ds, de, impl, softcap)


@_flash_bwd.register_fake
def _(do, q, k, v, o, lse, causal, scale, ds, de, impl, softcap):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    return (
        q.new_empty(B, T, H, D).transpose(1, 2),
        k.new_empty(B, T, Hkv, D).transpose(1, 2),
        v.new_empty(B, T, Hkv, D).transpose(1, 2),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, ds, de, impl, softcap, sinks = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, ds, de, sinks)
    ctx.causal, ctx.scale, ctx.impl, ctx.softcap = causal, scale, impl, softcap


def _flash_backward(ctx, do, dlse):
    q, k, v, o, lse, ds, de, sinks = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, ds, de, ctx.impl, ctx.softcap)
    dsinks = None if sinks is None else _sinks_grad(do, o, lse, sinks)
    return dq, dk, dv, None, None, None, None, None, None, dsinks


def _sinks_grad(do, o, lse, sinks):
    """d sink_h = -sum over the rows of head h of p_sink * delta: a sink is one more logit with no value, so
    its dS is p_sink * (0 - delta), with p_sink = exp(sink_h - lse) (the saved lse includes the sink) and
    delta = rowsum(dO * O) (the backward's preprocess, recomputed here in torch: [B, H, T], fp32)."""
    delta = (do.float() * o.float()).sum(-1)  # [B, H, T]
    p_sink = torch.exp(sinks.view(1, -1, 1) - lse)  # [B, H, T] the sink's probability in each row
    return -(p_sink * delta).sum(dim=(0, 2))  # [H] fp32


_flash_fwd.register_autograd(_flash_backward, setup_context=_setup_context)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Exact softmax(q k^T * scale [soft-capped] [+ causal mask] [+ document mask] [+ window]) v, computed
    tile by tile.

    q [B, H, T, D], k/v [B, H_kv, T, D] with H_kv divides H (GQA/MQA, no K/V copies); fp32, fp16
    or bf16 (all three alike); 16 <= D <= 256; scale defaults to D ** -0.5. Causal means query i
    sees keys 0..i. doc_bounds=(start, end), integer [B, T] each, packs documents into a row:
    position t belongs to the document [start[b, t], end[b, t]) (start <= t < end; documents are
    contiguous runs), and query i sees only keys of its own document. window=W (causal only): query i
    also sees only keys j > i - W (a sliding window; with documents both hold). softcap=c: the scores
    become c * tanh(scores / c) (Gemma 2), in both passes. sinks: None, or [H] (gpt-oss's attention
    sinks): one more logit per head in every row's softmax denominator, with no value; differentiable.
    Fully masked tiles are skipped. impl: "fa2"
    (default), "tma" or "tma-ws" (Hopper; falls back to fa2 where it cannot run); None reads
    GPTKIT_FLASH_IMPL. Tensors must be on a CUDA device, or on the CPU under
    TRITON_INTERPRET=1. Returns [B, H, T, D] in q's dtype; differentiable (once) in q, k and v.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"flash_attention expects 4-d [B, heads, T, head_dim] tensors, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(
            f"k and v must be [B, H_kv, T, D] matching q {tuple(q.shape)}; got "
            f"k {tuple(k.shape)}, v {tuple(v.shape)} (T_q must equal T_k)"
        )
    if H % k.shape[1]:
        raise ValueError(f"the {k.shape[1]} K/V heads must divide the {H} query heads")
    if not 16 <= D <= 256:
        raise ValueError(f"head_dim must be between 16 and 256, got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"q, k, v must share one dtype among fp32, fp16, bf16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"flash_attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    ds = de = None
    if doc_bounds is not None:
        ds, de = doc_bounds
        if ds.shape != (B, T) or de.shape != (B, T) or ds.is_floating_point() or de.is_floating_point():
            raise ValueError(
                f"doc_bounds must be two integer [B, T] = [{B}, {T}] tensors, got "
                f"{tuple(ds.shape)} {ds.dtype}, {tuple(de.shape)} {de.dtype}"
            )
        ds = ds.to(device=q.device, dtype=torch.int32).contiguous()  # [B, T]
        de = de.to(device=q.device, dtype=torch.int32).contiguous()  # [B, T]
    if window is not None:
        if not causal:
            raise ValueError("a sliding window needs causal=True")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        # keys past the window are another document bound (the module docstring)
        if window < T:
            ds, de = window_bounds(T, window, None if ds is None else (ds, de), B, q.device)
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be a positive number, got {softcap!r}")
    if sinks is not None:
        if sinks.shape != (H,) or not sinks.is_floating_point():
            raise ValueError(
                f"sinks must be a float [H] = [{H}] tensor, got {tuple(sinks.shape)} {sinks.dtype}"
            )
        # fp32 in the kernel; autograd casts the gradient back to the sinks' dtype
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    scale = D**-0.5 if scale is None else float(scale)
    if B * H * T == 0:
        return q.new_empty(B, H, T, D)
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    impl = _choose_impl(impl, (q, k, v))
    return _flash_fwd(q, k, v, bool(causal), scale, ds, de, impl, float(softcap or 0.0), sinks)[0]
