"""FlashAttention-2 in Triton: forward, backward, GQA/MQA, causal or not.

    flash_attention(q, k, v, causal=True, scale=None) -> out
    q:   [B, H,    T, D]
    k/v: [B, H_kv, T, D]     H_kv divides H; query head h reads K/V head h // (H // H_kv)
    out: [B, H,    T, D]     differentiable with respect to q, k and v

Forward (one program per tile of BLOCK_M queries of one head): the query tile stays on-chip
while K/V tiles stream past it; an online softmax keeps a fp32 running max `m` and sum `l`
(in base 2: exp(x) = exp2(x * log2(e)), folded into the scale), and the output is rescaled
as the max grows. The log-sum-exp of each row (natural log, fp32, [B, H, T]) is saved for
the backward pass. Causal attention visits only the key tiles at or left of the diagonal and
applies the mask only on the tiles that straddle it (and on the ragged tile at the end).

Backward, without the T x T matrix:
  1. preprocess: delta = rowsum(dO * O)                                   [B, H, T] fp32
  2. dK/dV: one program per tile of keys of one K/V head; it walks the (query head, query tile)
     pairs of the heads that share that K/V head (GQA), recomputing P = exp(QK^T*scale - lse):
       dV += P^T dO,   dS = P * (dO V^T - delta),   dK += dS^T Q * scale
     so the dK/dV of a shared head are summed in registers: no atomics, no K/V copies.
  3. dQ: one program per tile of queries: dQ += dS K * scale over the key tiles.

Any T (ragged tails are masked), head dims 16..256 (padded to a power of two on-chip),
fp32 / fp16 / bf16 inputs with fp32 accumulation (fp32 inputs use IEEE dots, not TF32).

Block sizes are autotuned per head dim on a GPU; under the Triton interpreter
(TRITON_INTERPRET=1, CPU) one small configuration is pinned so the tests stay fast.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e)


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (TRITON_INTERPRET=1, e.g. on a CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- tile helpers ---------------------------------------------------------------------------

@triton.jit
def _load_tile(ptrs, rows, T, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile: zeros past the sequence end (if CHECK_ROWS) and past HEAD_DIM."""
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
def _store_tile(ptrs, x, rows, T, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D != HEAD_DIM:
        tl.store(ptrs, x, mask=(rows[:, None] < T) & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(ptrs, x, mask=rows[:, None] < T)


# ---- forward --------------------------------------------------------------------------------

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, rows, offs_n, offs_d, T, lo, hi, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold the key tiles [lo, hi) into the running (acc, l_i, m_i) of one query tile."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N] key positions
        k = _load_tile(K + cols[:, None] * skt + offs_d[None, :], cols, T, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (rows[:, None] >= cols[None, :])
            qk = tl.where(keep, qk, float("-inf"))
        # every row has seen at least one unmasked key by now, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M] rescales what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V + cols[:, None] * svt + offs_d[None, :], cols, T, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                H, T, qk_scale,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: better balance across the GPU
        pid_m = tl.cdiv(T, BLOCK_M) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    Q += b * sqb + h * sqh
    K += b * skb + (h // GROUP) * skh
    V += b * svb + (h // GROUP) * svh
    O += b * sob + h * soh
    LSE += (b * H + h) * T

    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + rows[:, None] * sqt + offs_d[None, :], rows, T, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # [BLOCK_M, BLOCK_D], stays on-chip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # unnormalised output

    if CAUSAL:
        # key tiles that end at or before this tile's first query are fully visible
        full_end = ((m0 + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(m0 + BLOCK_M, T)  # keys past the last query are never visited
    else:
        full_end = (T // BLOCK_N) * BLOCK_N
        hi = T
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, rows, offs_n, offs_d, T, 0, full_end,
                               qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, False, PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, rows, offs_n, offs_d, T, full_end, hi,
                               qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, True, PRECISION)

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    _store_tile(O + rows[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty), rows, T, offs_d,
                HEAD_DIM, BLOCK_D)
    tl.store(LSE + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=rows < T)  # natural log


# ---- backward -------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess(O, DO, DELTA, sob, soh, sot, sdb, sdh, sdt, H, T,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, t] = sum_d dO * O, in fp32."""
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(O + b * sob + h * soh + rows[:, None] * sot + offs_d[None, :], rows, T, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # [BLOCK_M, BLOCK_D]
    do = _load_tile(DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :], rows, T, offs_d,
                    HEAD_DIM, BLOCK_D, True)  # [BLOCK_M, BLOCK_D]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(DELTA + (b * H + h) * T + rows, delta, mask=rows < T)


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, T, start_m, cols, offs_m, offs_d, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr):
    """Add one query tile (of the query head at Q, DO, LSE, DELTA) to a tile of dK, dV."""
    rows = start_m + offs_m  # [BLOCK_M] query positions
    q = _load_tile(Q + rows[:, None] * sqt + offs_d[None, :], rows, T, offs_d,
                   HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_M, BLOCK_D]
    do = _load_tile(DO + rows[:, None] * sdt + offs_d[None, :], rows, T, offs_d,
                    HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_M, BLOCK_D]
    if MASKED:  # lse = +inf past the end makes those probabilities exactly 0
        lse = tl.load(LSE + rows, mask=rows < T, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=rows < T, other=0.0)
    else:
        lse = tl.load(LSE + rows)
        delta = tl.load(DELTA + rows)
    qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M], log2 units
    p_t = tl.exp2(qk_t - lse[None, :] * 1.4426950408889634)  # [BLOCK_N, BLOCK_M] = P^T
    if MASKED:
        if CAUSAL:
            p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M] = (dO V^T)^T
    ds_t = p_t * (dp_t - delta[None, :])  # [BLOCK_N, BLOCK_M]
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sdh, sdt, T, cols, offs_m, offs_d, lo, hi, qk_scale,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Add the query tiles [lo, hi) of the GROUP query heads that share this K/V head to dK, dV.
    GQA walks (head, tile) pairs in one flat loop: nested loops spill registers on Hopper."""
    if GROUP == 1:
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, T, start_m, cols, offs_m, offs_d,
                                qk_scale, HEAD_DIM, BLOCK_D, CAUSAL, MASKED, PRECISION)
    else:
        n_tiles = tl.cdiv(hi - lo, BLOCK_M)
        for i in range(0, GROUP * n_tiles):
            g = i // n_tiles  # the query head within the group
            start_m = tl.multiple_of(lo + (i - g * n_tiles) * BLOCK_M, BLOCK_M)
            dk, dv = _dkdv_tile(dk, dv, k, v, Q + g * sqh, DO + g * sdh, LSE + g * T, DELTA + g * T, sqt, sdt, T,
                                start_m, cols, offs_m, offs_d, qk_scale, HEAD_DIM, BLOCK_D, CAUSAL, MASKED,
                                PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                     sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
                     H, T, qk_scale, scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1).to(tl.int64)  # the K/V head
    b = tl.program_id(2).to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * skb + hk * skh + cols[:, None] * skt + offs_d[None, :], cols, T, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # [BLOCK_N, BLOCK_D]
    v = _load_tile(V + b * svb + hk * svh + cols[:, None] * svt + offs_d[None, :], cols, T, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # [BLOCK_N, BLOCK_D]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    full_end = (T // BLOCK_M) * BLOCK_M  # query tiles before this one have no ragged rows
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M  # earlier queries cannot see these keys
        # query tiles that start past this key tile's last key see all of it: no mask
        diag_end = tl.maximum(lo, tl.minimum(tl.cdiv(n0 + BLOCK_N, BLOCK_M) * BLOCK_M, full_end))
    else:
        lo = 0
        diag_end = 0
    tail_start = tl.maximum(diag_end, full_end)
    h0 = hk * GROUP  # the first of the query heads that share this K/V head
    Q += b * sqb + h0 * sqh
    DO += b * sdb + h0 * sdh
    LSE += (b * H + h0) * T
    DELTA += (b * H + h0) * T
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sdh, sdt, T, cols, offs_m, offs_d,
                         lo, diag_end, qk_scale, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, True, PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sdh, sdt, T, cols, offs_m, offs_d,
                         diag_end, full_end, qk_scale, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, False, PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, sqh, sqt, sdh, sdt, T, cols, offs_m, offs_d,
                         tail_start, T, qk_scale, GROUP, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, True, PRECISION)

    _store_tile(DK + b * sdkb + hk * sdkh + cols[:, None] * sdkt + offs_d[None, :],
                (dk * scale).to(DK.dtype.element_ty), cols, T, offs_d, HEAD_DIM, BLOCK_D)
    _store_tile(DV + b * sdvb + hk * sdvh + cols[:, None] * sdvt + offs_d[None, :],
                dv.to(DV.dtype.element_ty), cols, T, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, offs_n, offs_d, T, lo, hi, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Add the contributions of key tiles [lo, hi) to a tile of dQ."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N] key positions
        k = _load_tile(K + cols[:, None] * skt + offs_d[None, :], cols, T, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        v = _load_tile(V + cols[:, None] * svt + offs_d[None, :], cols, T, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        p = tl.exp2(qk - lse[:, None])  # [BLOCK_M, BLOCK_N]
        if MASKED:
            keep = cols[None, :] < T
            if CAUSAL:
                keep = keep & (rows[:, None] >= cols[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sdqb, sdqh, sdqt,
                   H, T, qk_scale, scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        pid_m = tl.cdiv(T, BLOCK_M) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    K += b * skb + (h // GROUP) * skh
    V += b * svb + (h // GROUP) * svh
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh + rows[:, None] * sqt + offs_d[None, :], rows, T, offs_d,
                   HEAD_DIM, BLOCK_D, True)  # [BLOCK_M, BLOCK_D]
    do = _load_tile(DO + b * sdb + h * sdh + rows[:, None] * sdt + offs_d[None, :], rows, T, offs_d,
                    HEAD_DIM, BLOCK_D, True)  # [BLOCK_M, BLOCK_D]
    lse = tl.load(LSE + (b * H + h) * T + rows, mask=rows < T, other=0.0) * 1.4426950408889634  # log2 units
    delta = tl.load(DELTA + (b * H + h) * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        full_end = ((m0 + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(m0 + BLOCK_M, T)
    else:
        full_end = (T // BLOCK_N) * BLOCK_N
        hi = T
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, offs_n, offs_d, T, 0, full_end, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, False, PRECISION)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, rows, offs_n, offs_d, T, full_end, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, True, PRECISION)
    _store_tile(DQ + b * sdqb + h * sdqh + rows[:, None] * sdqt + offs_d[None, :],
                (dq * scale).to(DQ.dtype.element_ty), rows, T, offs_d, HEAD_DIM, BLOCK_D)


# ---- launch configurations ------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim, for Ampere/Hopper. BLOCK_M tiles
# queries and BLOCK_N tiles keys in every kernel. Chosen so that the bf16 kernels compiled for sm_90
# use no (or, for dK/dV at head dim 128-256, little) local memory for spilled registers.
_FWD_SPACE = {
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 8, 3)],
    256: [(32, 32, 4, 2), (64, 16, 4, 2), (64, 32, 8, 2)],
}
_DKDV_SPACE = {  # key tiles stay on-chip with their dK/dV
    64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    128: [(32, 64, 8, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3)],
    256: [(32, 32, 8, 2), (16, 32, 4, 2)],
}
_DQ_SPACE = {  # query tiles stay on-chip with their dQ
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2)],
    128: [(64, 32, 8, 3), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
    256: [(32, 32, 8, 2), (32, 16, 4, 2)],
}
# Under the interpreter: one small configuration, with BLOCK_M != BLOCK_N so that tiles cross the
# diagonal in both directions and short sequences still span several tiles.
_INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
_PREPROCESS_BLOCK_M = 64
_AUTOTUNE_KEY = ["T", "HEAD_DIM", "GROUP", "CAUSAL"]


def _autotuned(kernel, space):
    """Wrap `kernel` in triton.autotune over the union of `space`, pruned to the head dim's row."""
    union = sorted({c for row in space.values() for c in row})
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in union]

    def prune(configs, named_args, **kwargs):
        block_d = {**named_args, **kwargs}["BLOCK_D"]
        row = next(space[d] for d in sorted(space) if block_d <= d)
        return [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in row]

    return triton.autotune(configs, key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": prune})(kernel)


if interpreting():
    _fwd, _dkdv, _dq = _fwd_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
else:
    _fwd = _autotuned(_fwd_kernel, _FWD_SPACE)
    _dkdv = _autotuned(_bwd_dkdv_kernel, _DKDV_SPACE)
    _dq = _autotuned(_bwd_dq_kernel, _DQ_SPACE)


def _blocks(kind: str) -> dict:
    """Pinned block sizes under the interpreter; on a GPU the autotuner chooses them."""
    if not interpreting():
        return {}
    m, n = _INTERPRET_BLOCKS[kind]
    return {"BLOCK_M": m, "BLOCK_N": n}


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- autograd -------------------------------------------------------------------------------

class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        B, H, T, D = q.shape
        group = H // k.shape[1]
        block_d = max(16, triton.next_power_of_2(D))
        # O lives in a [B, T, H, D] buffer so that the model's transpose-and-merge of heads is free
        o = q.new_empty(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
        lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)  # [B, H, T], natural log
        precision = "ieee" if q.dtype == torch.float32 else "tf32"

        def grid(meta):
            return triton.cdiv(T, meta["BLOCK_M"]), H, B

        _fwd[grid](q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                   H, T, scale * LOG2E, GROUP=group, HEAD_DIM=D, BLOCK_D=block_d,
                   CAUSAL=causal, PRECISION=precision, **_blocks("fwd"))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.block_d, ctx.precision = causal, scale, group, block_d, precision
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        do = _last_dim_dense(do)  # [B, H, T, D]
        delta = torch.empty_like(lse)  # [B, H, T] fp32
        dq = torch.empty_like(q)  # [B, H, T, D]
        dk = torch.empty_like(k)  # [B, Hkv, T, D]
        dv = torch.empty_like(v)  # [B, Hkv, T, D]
        common = dict(GROUP=ctx.group, HEAD_DIM=D, BLOCK_D=ctx.block_d, CAUSAL=ctx.causal,
                      PRECISION=ctx.precision)
        qk_scale = ctx.scale * LOG2E

        _bwd_preprocess[(triton.cdiv(T, _PREPROCESS_BLOCK_M), H, B)](
            o, do, delta, *_strides(o), *_strides(do), H, T,
            HEAD_DIM=D, BLOCK_D=ctx.block_d, BLOCK_M=_PREPROCESS_BLOCK_M)
        _dkdv[lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), Hkv, B)](
            q, k, v, do, lse, delta, dk, dv,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
            H, T, qk_scale, ctx.scale, **common, **_blocks("dkdv"))
        _dq[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), H, B)](
            q, k, v, do, lse, delta, dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
            H, T, qk_scale, ctx.scale, **common, **_blocks("dq"))
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """Exact softmax(q k^T * scale [+ causal mask]) v, computed tile by tile.

    q [B, H, T, D], k/v [B, H_kv, T, D] with H_kv dividing H (GQA/MQA, no K/V copies); fp32, fp16
    or bf16 (all three alike); 16 <= D <= 256; scale defaults to D ** -0.5. Causal means query i
    sees keys 0..i. Tensors must be on a CUDA device, or on the CPU under TRITON_INTERPRET=1.
    Returns [B, H, T, D] in q's dtype; differentiable (once) with respect to q, k and v.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention expects 4-d [B, heads, T, head_dim] tensors, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"k and v must be [B, H_kv, T, D] matching q {tuple(q.shape)}; got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)} (T_q must equal T_k)")
    if H % k.shape[1]:
        raise ValueError(f"the {k.shape[1]} K/V heads must divide the {H} query heads")
    if not 16 <= D <= 256:
        raise ValueError(f"head_dim must be between 16 and 256, got {D}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one dtype among fp32, fp16, bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"flash_attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    scale = D**-0.5 if scale is None else float(scale)
    if B * H * T == 0:
        return q.new_empty(B, H, T, D)
    q, k, v = _last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v)
    return FlashAttention.apply(q, k, v, bool(causal), scale)
