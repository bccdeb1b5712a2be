"""The chunked gated delta rule (Gated DeltaNet) in Triton: forward and backward, document resets, a state
carried in and out.

    chunk_gated_delta_rule(q, k, v, g, beta, chunk=64, initial_state=None, seg=None)
    q, k:  [B, H, T, K]  fp32, already L2-normalized (q scaled) and repeated over the value heads
    v:     [B, H, T, V]  fp32
    g:     [B, H, T]     fp32, the log decay (<= 0);  beta [B, H, T] fp32
    initial_state: None (zeros) or [B, H, K, V] fp32
    seg:   None, or int32 [B, T]: the document index of each position (the running count of document starts,
           so a document's first position bumps it); the state restarts from zero where it changes, and at
           position 0 when seg[:, 0] > 0
    -> o [B, H, T, V] fp32, the final state [B, H, K, V] fp32; differentiable in q, k, v, g, beta and the
       initial state

It computes S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T, o_t = S_t^T q_t, chunk by
chunk (gptkit/model/gated_deltanet.py's chunk_gated_delta_rule is the readable PyTorch form it equals). Per
chunk of C positions (G the cumulative log decay from the chunk's start, D[i, j] = exp(G_i - G_j) for j <= i
in one document, else 0):

    A  = strictly_lower((beta k) k^T * D);  Tinv = (I + A)^-1   the UT transform (forward substitution)
    U  = Tinv (beta v),  W = Tinv (beta k exp(G))                the WY representation of the C updates
    V' = U - W S                                                 the corrections against the carried state
    O  = (q exp(G)) S + ((q k^T) * D) V'                         the inter-chunk read + intra-chunk attention
    S <- exp(G_C) S + (k exp(G_C - G))^T V'                      the state passed to the next chunk

A document start at position i of a chunk cuts the carried state's reach (exp(G) zeroed from i on, e_in), the
writes before i to the chunk's end (exp(G_C - G) zeroed before i, e_out), the state across the chunk (e_c)
and the pairs across it (D).

The steps are split over kernels as flash-linear-attention splits them, and no product takes a whole head
as an operand (key and value columns 16 at a time; the passes over the chunks also sum over a chunk's
positions 16 at a time), so that each kernel fits an sm_90 block's shared memory at C = 64 and 128-wide heads
and spills little (.ci/gdn_sm90_compile.py; launch settings in LAUNCH):

    forward   _wy_kernel      (sequence and head, chunk)            A, Tinv, W, U; saves the decays
              _state_kernel   (sequence and head, value block)      the chunks in order: V', the state at each
                                                                    chunk's start ([B, H, N, K, V], fla's `h`)
              _output_kernel  (sequence and head, chunk)            O
    backward  _dvn_local_kernel (sequence and head, chunk)          the chunk's own part of dV'
              _dstate_kernel  (sequence and head, value block)      the chunks in reverse carrying dS: dV',
                                                                    dS at each chunk's end, dS0
              _dqk_kernel     (sequence and head, chunk, key block) dq, dk through O and S, dW, a part of dG
              _dwy_kernel     (sequence and head, chunk)            through W, U and Tinv: dv, dbeta, the rest
                                                                    of dk; dg from dG by a reverse cumsum

The forward saves Tinv, W, U, V', the decays and the states for the backward (nothing is recomputed).

Limits: C a power of two in 16..64, K and V at most 128 (padded on-chip to a power of two >= 16). All
arithmetic in fp32 (IEEE dots, not TF32). Written after flash-linear-attention's chunk_gated_delta_rule
(fla/ops/gated_delta_rule).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

CHUNKS = (16, 32, 64)
MAX_HEAD_DIM = 128
# the kernels in the order a forward and a backward launch them, each with its (num_warps, num_stages), chosen
# by the offline sm_90 compile (.ci/gdn_sm90_compile.py) for the fewest spills at chunk 64 and 128-wide heads:
# 8 warps for the chunk-parallel kernels (their [C, C] tiles spread over more threads), one stage (no prefetch
# of the next chunk's tiles) for the two passes over the chunks. Not timed on a GPU.
LAUNCH = {
    "_wy_kernel": (8, 3),
    "_state_kernel": (4, 1),
    "_output_kernel": (8, 3),
    "_dvn_local_kernel": (8, 3),
    "_dstate_kernel": (4, 1),
    "_dqk_kernel": (8, 3),
    "_dwy_kernel": (8, 3),
}


def unsupported(chunk: int, key_dim: int, value_dim: int) -> Optional[str]:
    """Why the kernel cannot take this chunk size or these head dims, or None when it can."""
    if chunk not in CHUNKS:
        return f"chunk size {chunk} (the kernel takes {', '.join(map(str, CHUNKS))})"
    for name, d in (("key", key_dim), ("value", value_dim)):
        if d > MAX_HEAD_DIM:
            return f"{name} head dim {d} (the kernel takes at most {MAX_HEAD_DIM})"
    return None


@triton.jit
def _decays(g_ptr, seg_ptr, bh, b, n, T, BT: tl.constexpr):
    """Chunk n of sequence b, head row bh: its positions t [BT], their mask, and the decay factors of the
    module docstring (D [BT, BT]; e_in, e_out [BT]; e_c a scalar)."""
    t = n * BT + tl.arange(0, BT)
    ok = t < T
    g = tl.load(g_ptr + bh * T + t, mask=ok, other=0.0)
    # documents: seg of each position, of the position before the chunk (0 before the sequence) and the last
    s = tl.load(seg_ptr + b * T + t, mask=ok, other=-1)
    s_prev = tl.load(seg_ptr + b * T + tl.maximum(n * BT - 1, 0))
    s_prev = tl.where(n > 0, s_prev, 0)
    s_last = tl.max(tl.where(ok, s, -1), axis=0)
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    G = tl.sum(tl.where(j <= i, g[None, :], 0.0), axis=1)  # cumulative log decay [BT]
    G_C = tl.sum(tl.where(tl.arange(0, BT) == BT - 1, G, 0.0), axis=0)
    same = (j <= i) & (s[:, None] == s[None, :])
    D = tl.exp(tl.where(same, G[:, None] - G[None, :], float("-inf")))  # [BT, BT]; exp(-inf) = 0 elsewhere
    e_in = tl.where(s == s_prev, tl.exp(G), 0.0)  # the carried state reaches position i
    e_out = tl.where(s == s_last, tl.exp(G_C - G), 0.0)  # position j's write reaches the chunk's end
    e_c = tl.where(s_last == s_prev, tl.exp(G_C), 0.0)  # the carried state survives the chunk
    return t, ok, D, e_in, e_out, e_c


@triton.jit
def _rows(ptr, bh, t, ok, cols, width, T):
    """The tile [rows t, columns cols] of a [B, H, T, width] tensor (zeros outside)."""
    mask = ok[:, None] & (cols[None, :] < width)
    return tl.load(ptr + (bh * T + t[:, None]) * width + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _put_rows(ptr, x, bh, t, ok, cols, width, T):
    mask = ok[:, None] & (cols[None, :] < width)
    tl.store(ptr + (bh * T + t[:, None]) * width + cols[None, :], x, mask=mask)


@triton.jit
def _state_tile(ptr, bh, n, N, rows, cols, K, V):
    """The tile [rows, cols] of chunk n's state in a [B, H, N, K, V] tensor (zeros outside)."""
    mask = (rows[:, None] < K) & (cols[None, :] < V)
    return tl.load(ptr + (bh * N + n) * K * V + rows[:, None] * V + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _wy_kernel(k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, tinv_ptr, w_ptr, u_ptr, ein_ptr, eout_ptr, ec_ptr, T, H,
               N, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Per (sequence and head, chunk): Tinv = (I + A)^-1 and the WY representation W, U of the chunk's C
    updates (nothing here depends on the state, so every chunk runs at once); saves the decays e_in, e_out
    and e_c for the passes over the chunks."""
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B * H * T * K can pass 2^31
    n = tl.program_id(1)
    t, ok, D, e_in, e_out, e_c = _decays(g_ptr, seg_ptr, bh, bh // H, n, T, BT)
    tl.store(ein_ptr + bh * T + t, e_in, mask=ok)
    tl.store(eout_ptr + bh * T + t, e_out, mask=ok)
    tl.store(ec_ptr + bh * N + n, e_c)
    beta = tl.load(b_ptr + bh * T + t, mask=ok, other=0.0)  # [BT]
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    # A = strictly_lower((beta k) k^T * D)  [BT, BT], summed over the key dim a block of BC columns at a time
    KK = tl.zeros([BT, BT], dtype=tl.float32)
    for c in range(0, K, BC):
        k = _rows(k_ptr, bh, t, ok, c + tl.arange(0, BC), K, T)  # [BT, BC]
        KK += tl.dot(k * beta[:, None], tl.trans(k), input_precision="ieee")
    A = tl.where(j < i, KK * D, 0.0)
    # Tinv = (I + A)^-1 by forward substitution, a row at a time (row r = e_r - A[r, :] Tinv)  [BT, BT]
    Tinv = tl.where(i == j, 1.0, 0.0)
    for r in range(1, BT):
        a_r = tl.sum(tl.where(i == r, A, 0.0), axis=0)  # row r of A, indexed by column m
        row = tl.sum(a_r[:, None] * Tinv, axis=0)  # sum_m A[r, m] Tinv[m, :] (rows m < r are final)
        Tinv = tl.where(i == r, Tinv - row[None, :], Tinv)
    _put_rows(tinv_ptr, Tinv, bh, t, ok, tl.arange(0, BT), BT, T)
    # W = Tinv (beta k e_in)  [BT, K],  U = Tinv (beta v)  [BT, V], a block of BC columns at a time
    for c in range(0, K, BC):
        ck = c + tl.arange(0, BC)
        k = _rows(k_ptr, bh, t, ok, ck, K, T)
        W = tl.dot(Tinv, k * (beta * e_in)[:, None], input_precision="ieee")
        _put_rows(w_ptr, W, bh, t, ok, ck, K, T)
    for c in range(0, V, BC):
        cv = c + tl.arange(0, BC)
        v = _rows(v_ptr, bh, t, ok, cv, V, T)
        U = tl.dot(Tinv, v * beta[:, None], input_precision="ieee")
        _put_rows(u_ptr, U, bh, t, ok, cv, V, T)


@triton.jit
def _state_kernel(k_ptr, w_ptr, u_ptr, eout_ptr, ec_ptr, s0_ptr, hs_ptr, vn_ptr, sf_ptr, T, N,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BC: tl.constexpr, BR: tl.constexpr, HAS_S0: tl.constexpr):  # fmt: skip
    """Per (sequence and head, block of BV value columns): the chunks in order, carrying those columns of the
    state S [K, BV]; saves the state at each chunk's start and the corrections V'. Each product is summed a
    block at a time (BC keys, BR positions) over tiles read back from what this program just wrote, so no
    operand is a whole [C, K] tile."""
    bh = tl.program_id(0).to(tl.int64)
    ck, cv = (
        tl.arange(0, BK),
        tl.program_id(1) * BV + tl.arange(0, BV),
    )  # the whole key dim, this block's values
    kv = ck[:, None] * V + cv[None, :]
    kv_ok = (ck[:, None] < K) & (cv[None, :] < V)
    if HAS_S0:
        S = tl.load(s0_ptr + bh * K * V + kv, mask=kv_ok, other=0.0)  # [BK, BV]
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(0, N):
        tl.store(hs_ptr + (bh * N + n) * K * V + kv, S, mask=kv_ok)  # the state at the chunk's start
        tl.debug_barrier()  # written by every thread before any reads it back
        # V' = U - W S  [BT, BV]
        t = n * BT + tl.arange(0, BT)
        ok = t < T
        Vn = _rows(u_ptr, bh, t, ok, cv, V, T)
        for c in range(0, K, BC):
            kc = c + tl.arange(0, BC)
            W = _rows(w_ptr, bh, t, ok, kc, K, T)  # [BT, BC]
            Vn -= tl.dot(W, _state_tile(hs_ptr, bh, n, N, kc, cv, K, V), input_precision="ieee")
        _put_rows(vn_ptr, Vn, bh, t, ok, cv, V, T)
        tl.debug_barrier()
        # S <- e_c S + (k e_out)^T V'  [BK, BV]
        S = S * tl.load(ec_ptr + bh * N + n)
        for r in range(0, BT, BR):
            tr = n * BT + r + tl.arange(0, BR)
            okr = tr < T
            e_out = tl.load(eout_ptr + bh * T + tr, mask=okr, other=0.0)  # [BR]
            k = _rows(k_ptr, bh, tr, okr, ck, K, T) * e_out[:, None]  # [BR, BK]
            S += tl.dot(tl.trans(k), _rows(vn_ptr, bh, tr, okr, cv, V, T), input_precision="ieee")
    tl.store(sf_ptr + bh * K * V + kv, S, mask=kv_ok)


@triton.jit
def _output_kernel(q_ptr, k_ptr, g_ptr, seg_ptr, hs_ptr, vn_ptr, o_ptr, T, H, N, K: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Per (sequence and head, chunk): O = (q e_in) S + ((q k^T) * D) V', a block of BC value columns at a
    time."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    t, ok, D, e_in, e_out, e_c = _decays(g_ptr, seg_ptr, bh, bh // H, n, T, BT)
    P = tl.zeros([BT, BT], dtype=tl.float32)  # q k^T
    for c in range(0, K, BC):
        ck = c + tl.arange(0, BC)
        q = _rows(q_ptr, bh, t, ok, ck, K, T)  # [BT, BC]
        P += tl.dot(q, tl.trans(_rows(k_ptr, bh, t, ok, ck, K, T)), input_precision="ieee")
    PD = P * D
    for cv0 in range(0, V, BC):
        cv = cv0 + tl.arange(0, BC)
        qS = tl.zeros([BT, BC], dtype=tl.float32)
        for c in range(0, K, BC):
            ck = c + tl.arange(0, BC)
            q = _rows(q_ptr, bh, t, ok, ck, K, T)
            qS += tl.dot(q, _state_tile(hs_ptr, bh, n, N, ck, cv, K, V), input_precision="ieee")
        Vn = _rows(vn_ptr, bh, t, ok, cv, V, T)  # [BT, BC]
        O = qS * e_in[:, None] + tl.dot(PD, Vn, input_precision="ieee")
        _put_rows(o_ptr, O, bh, t, ok, cv, V, T)


@triton.jit
def _dvn_local_kernel(q_ptr, k_ptr, g_ptr, seg_ptr, do_ptr, dvn_ptr, T, H, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Per (sequence and head, chunk): the chunk's own part of dV', ((q k^T) * D)^T dO, a block of BC value
    columns at a time (the state's part is _dstate_kernel's)."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    t, ok, D, e_in, e_out, e_c = _decays(g_ptr, seg_ptr, bh, bh // H, n, T, BT)
    P = tl.zeros([BT, BT], dtype=tl.float32)  # q k^T
    for c in range(0, K, BC):
        ck = c + tl.arange(0, BC)
        q = _rows(q_ptr, bh, t, ok, ck, K, T)  # [BT, BC]
        P += tl.dot(q, tl.trans(_rows(k_ptr, bh, t, ok, ck, K, T)), input_precision="ieee")
    PDt = tl.trans(P * D)
    for c in range(0, V, BC):
        cv = c + tl.arange(0, BC)
        dO = _rows(do_ptr, bh, t, ok, cv, V, T)  # [BT, BC]
        _put_rows(dvn_ptr, tl.dot(PDt, dO, input_precision="ieee"), bh, t, ok, cv, V, T)


@triton.jit
def _dstate_kernel(q_ptr, k_ptr, w_ptr, ein_ptr, eout_ptr, ec_ptr, do_ptr, dsf_ptr, dvn_ptr, dhs_ptr, ds0_ptr,
                   T, N, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, HAS_DSF: tl.constexpr):  # fmt: skip
    """Per (sequence and head, block of BV value columns): the chunks in reverse, carrying dS [K, BV], the
    gradient reaching the state at the chunk's end; saves it per chunk and completes dV' (summed a block at a
    time as _state_kernel does)."""
    bh = tl.program_id(0).to(tl.int64)
    ck, cv = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    kv = ck[:, None] * V + cv[None, :]
    kv_ok = (ck[:, None] < K) & (cv[None, :] < V)
    if HAS_DSF:
        dS = tl.load(dsf_ptr + bh * K * V + kv, mask=kv_ok, other=0.0)  # the gradient of the final state
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    for m in range(0, N):
        n = N - 1 - m
        tl.store(dhs_ptr + (bh * N + n) * K * V + kv, dS, mask=kv_ok)
        tl.debug_barrier()
        # S_next = e_c S + (k e_out)^T V':  dV' = (the chunk's own part) + (k e_out) dS  [BT, BV]
        t = n * BT + tl.arange(0, BT)
        ok = t < T
        e_out = tl.load(eout_ptr + bh * T + t, mask=ok, other=0.0)  # [BT]
        dVn = _rows(dvn_ptr, bh, t, ok, cv, V, T)
        for c in range(0, K, BC):
            kc = c + tl.arange(0, BC)
            k = _rows(k_ptr, bh, t, ok, kc, K, T) * e_out[:, None]  # [BT, BC]
            dVn += tl.dot(k, _state_tile(dhs_ptr, bh, n, N, kc, cv, K, V), input_precision="ieee")
        _put_rows(dvn_ptr, dVn, bh, t, ok, cv, V, T)
        tl.debug_barrier()
        # O = (q e_in) S + ...,  V' = U - W S:  dS_prev = e_c dS + (q e_in)^T dO - W^T dV'  [BK, BV]
        dS = dS * tl.load(ec_ptr + bh * N + n)
        for r in range(0, BT, BR):
            tr = n * BT + r + tl.arange(0, BR)
            okr = tr < T
            e_in = tl.load(ein_ptr + bh * T + tr, mask=okr, other=0.0)  # [BR]
            q = _rows(q_ptr, bh, tr, okr, ck, K, T) * e_in[:, None]  # [BR, BK]
            W = _rows(w_ptr, bh, tr, okr, ck, K, T)
            dS += tl.dot(tl.trans(q), _rows(do_ptr, bh, tr, okr, cv, V, T), input_precision="ieee")
            dS -= tl.dot(tl.trans(W), _rows(dvn_ptr, bh, tr, okr, cv, V, T), input_precision="ieee")
    tl.store(ds0_ptr + bh * K * V + kv, dS, mask=kv_ok)


@triton.jit
def _dqk_kernel(q_ptr, k_ptr, g_ptr, seg_ptr, hs_ptr, dhs_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr,
                dw_ptr, dgp_ptr, T, H, N, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):  # fmt: skip
    """Per (sequence and head, chunk, block of BC key columns): dq, the part of dk through O and the state
    passed on, dW, and this key block's part of dG (summed over the blocks by _dwy_kernel)."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    ck = tl.program_id(2) * BC + tl.arange(0, BC)
    t, ok, D, e_in, e_out, e_c = _decays(g_ptr, seg_ptr, bh, bh // H, n, T, BT)
    q = _rows(q_ptr, bh, t, ok, ck, K, T)  # [BT, BC]
    k = _rows(k_ptr, bh, t, ok, ck, K, T)
    # sums over the value dim, a block of BC columns at a time (S: the state at the chunk's start, dS: the
    # gradient at its end)
    doS = tl.zeros([BT, BC], dtype=tl.float32)  # dO S^T
    dW = tl.zeros([BT, BC], dtype=tl.float32)  # -dV' S^T (V' = U - W S)
    dk_out = tl.zeros([BT, BC], dtype=tl.float32)  # V' dS^T
    dPD = tl.zeros([BT, BT], dtype=tl.float32)  # dO V'^T
    d_e_c = 0.0
    for c in range(0, V, BC):
        cv = c + tl.arange(0, BC)
        S = _state_tile(hs_ptr, bh, n, N, ck, cv, K, V)  # [BC, BC]
        dS = _state_tile(dhs_ptr, bh, n, N, ck, cv, K, V)
        dO = _rows(do_ptr, bh, t, ok, cv, V, T)  # [BT, BC]
        Vn = _rows(vn_ptr, bh, t, ok, cv, V, T)
        dVn = _rows(dvn_ptr, bh, t, ok, cv, V, T)
        doS += tl.dot(dO, tl.trans(S), input_precision="ieee")
        dW -= tl.dot(dVn, tl.trans(S), input_precision="ieee")
        dk_out += tl.dot(Vn, tl.trans(dS), input_precision="ieee")
        dPD += tl.dot(dO, tl.trans(Vn), input_precision="ieee")
        d_e_c += tl.sum(tl.sum(S * dS, axis=1), axis=0)
    # O = (q e_in) S + ((q k^T) * D) V',  S_next = e_c S + (k e_out)^T V'
    dP = dPD * D
    dq = doS * e_in[:, None] + tl.dot(dP, k, input_precision="ieee")
    dk = tl.dot(tl.trans(dP), q, input_precision="ieee") + dk_out * e_out[:, None]
    _put_rows(dq_ptr, dq, bh, t, ok, ck, K, T)
    _put_rows(dk_ptr, dk, bh, t, ok, ck, K, T)
    _put_rows(dw_ptr, dW, bh, t, ok, ck, K, T)
    # the decays as functions of G: D[i, j] = exp(G_i - G_j), e_in = exp(G), e_out = exp(G_C - G),
    # e_c = exp(G_C) (each where its mask keeps it); this key block's part of each
    dDD = dPD * tl.dot(q, tl.trans(k), input_precision="ieee") * D
    d_e_out = tl.sum(dk_out * k, axis=1)
    dG = tl.sum(dDD, axis=1) - tl.sum(dDD, axis=0) + tl.sum(q * doS, axis=1) * e_in - d_e_out * e_out
    dG_C = tl.sum(d_e_out * e_out, axis=0) + d_e_c * e_c
    dG += tl.where(t == tl.minimum(T, (n + 1) * BT) - 1, dG_C, 0.0)  # at the chunk's last (unpadded) position
    tl.store(dgp_ptr + (tl.program_id(2) * tl.num_programs(0) + bh) * T + t, dG, mask=ok)


@triton.jit
def _dwy_kernel(k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, tinv_ptr, w_ptr, u_ptr, dvn_ptr, dw_ptr, dgp_ptr, dk_ptr,
                dv_ptr, dg_ptr, db_ptr, T, H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):  # fmt: skip
    """Per (sequence and head, chunk): the chain rule through U = Tinv (beta v), W = Tinv (beta k e_in) and
    Tinv = (I + A)^-1: dv, dbeta, the rest of dk, and dg from dG by a reverse cumulative sum."""
    bh = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    t, ok, D, e_in, e_out, e_c = _decays(g_ptr, seg_ptr, bh, bh // H, n, T, BT)
    beta = tl.load(b_ptr + bh * T + t, mask=ok, other=0.0)  # [BT]
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    Tinv = _rows(tinv_ptr, bh, t, ok, tl.arange(0, BT), BT, T)  # [BT, BT]
    # U = Tinv bv (bv = beta v):  dbv = Tinv^T dV', dv = beta dbv;  with dX = Tinv^T dW (below),
    # dA = -Tinv^T (dV' U^T + dW W^T) ... = -(dbv U^T + dX W^T)
    dA = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for c in range(0, V, BC):
        cv = c + tl.arange(0, BC)
        dbv = tl.dot(tl.trans(Tinv), _rows(dvn_ptr, bh, t, ok, cv, V, T), input_precision="ieee")  # [BT, BC]
        _put_rows(dv_ptr, dbv * beta[:, None], bh, t, ok, cv, V, T)
        dbeta += tl.sum(_rows(v_ptr, bh, t, ok, cv, V, T) * dbv, axis=1)
        dA += tl.dot(dbv, tl.trans(_rows(u_ptr, bh, t, ok, cv, V, T)), input_precision="ieee")
    # W = Tinv X, X = kb e_in (kb = beta k):  dX = Tinv^T dW; dkb = dX e_in + (A's part, below),
    # dk += beta dkb, dbeta += sum(k dkb)
    d_e_in = tl.zeros([BT], dtype=tl.float32)
    for c in range(0, K, BC):
        ck = c + tl.arange(0, BC)
        k = _rows(k_ptr, bh, t, ok, ck, K, T)  # [BT, BC]
        dX = tl.dot(tl.trans(Tinv), _rows(dw_ptr, bh, t, ok, ck, K, T), input_precision="ieee")
        dA += tl.dot(dX, tl.trans(_rows(w_ptr, bh, t, ok, ck, K, T)), input_precision="ieee")
        d_e_in += tl.sum(dX * k, axis=1) * beta
        dbeta += tl.sum(k * dX, axis=1) * e_in
        _put_rows(
            dk_ptr, _rows(dk_ptr, bh, t, ok, ck, K, T) + dX * (beta * e_in)[:, None], bh, t, ok, ck, K, T
        )
    tl.debug_barrier()  # dk as written above, by every thread, before any reads it back below
    # A = strictly_lower(kb k^T * D):  dkb += (dA * D) k, dk += (dA * D)^T kb;  dD = dA * (kb k^T)
    dAD = tl.where(j < i, -dA, 0.0) * D
    dDD = tl.zeros([BT, BT], dtype=tl.float32)  # dD * D
    for c in range(0, K, BC):
        ck = c + tl.arange(0, BC)
        k = _rows(k_ptr, bh, t, ok, ck, K, T)
        dkb = tl.dot(dAD, k, input_precision="ieee")
        dk = tl.dot(tl.trans(dAD), k * beta[:, None], input_precision="ieee") + dkb * beta[:, None]
        _put_rows(dk_ptr, _rows(dk_ptr, bh, t, ok, ck, K, T) + dk, bh, t, ok, ck, K, T)
        dbeta += tl.sum(k * dkb, axis=1)
        dDD += dAD * tl.dot(k * beta[:, None], tl.trans(k), input_precision="ieee")
    # dG: the key blocks' parts (_dqk_kernel) and A's and e_in's here;  G = cumsum(g) within the chunk
    dG = tl.sum(dDD, axis=1) - tl.sum(dDD, axis=0) + d_e_in * e_in
    for p in range(0, tl.cdiv(K, BC)):
        dG += tl.load(dgp_ptr + (p * tl.num_programs(0) + bh) * T + t, mask=ok, other=0.0)
    dg = tl.sum(tl.where(j >= i, dG[None, :], 0.0), axis=1)  # reverse cumulative sum
    tl.store(dg_ptr + bh * T + t, dg, mask=ok)
    tl.store(db_ptr + bh * T + t, dbeta, mask=ok)


def _blocks(K: int, V: int, block_v: Optional[int]) -> tuple[int, int, int]:
    """BK (the whole key dim, padded), BV (value columns per program of the two passes over the chunks: at
    most 32 by default) and BC (the block of key or value columns a product is summed over, and of a
    chunk-parallel program's value or key columns: 16, so no product's operand holds a whole head)."""
    BK = max(16, triton.next_power_of_2(K))
    BV = block_v or min(max(16, triton.next_power_of_2(V)), 32)
    return BK, BV, 16


BR = 16  # the block of a chunk's positions the passes over the chunks sum their state updates over


def _launch(kernel, grid: tuple, *args) -> None:
    warps, stages = LAUNCH[kernel.__name__]
    kernel[grid](*args, num_warps=warps, num_stages=stages)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, seg, chunk, block_v):
        B, H, T, K = q.shape
        V = v.shape[-1]
        N, C = triton.cdiv(T, chunk), chunk
        BK, BV, BC = _blocks(K, V, block_v)
        new = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.float32)  # noqa: E731
        tinv, w, u, vn, o = (
            new(B, H, T, C),
            new(B, H, T, K),
            new(B, H, T, V),
            new(B, H, T, V),
            new(B, H, T, V),
        )
        e_in, e_out, e_c = new(B, H, T), new(B, H, T), new(B, H, N)
        states, final = new(B, H, N, K, V), new(B, H, K, V)
        s0 = final if initial_state is None else initial_state
        has_s0 = initial_state is not None
        _launch(
            _wy_kernel, (B * H, N), k, v, g, beta, seg, tinv, w, u, e_in, e_out, e_c, T, H, N, K, V, C, BC
        )
        _launch(_state_kernel, (B * H, triton.cdiv(V, BV)), k, w, u, e_out, e_c, s0, states, vn, final,
                T, N, K, V, C, BK, BV, BC, BR, has_s0)  # fmt: skip
        _launch(_output_kernel, (B * H, N), q, k, g, seg, states, vn, o, T, H, N, K, V, C, BC)
        ctx.save_for_backward(q, k, v, g, beta, seg, tinv, w, u, e_in, e_out, e_c, states, vn)
        ctx.chunk, ctx.block_v, ctx.has_s0 = chunk, block_v, has_s0
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, seg, tinv, w, u, e_in, e_out, e_c, states, vn = ctx.saved_tensors
        B, H, T, K = q.shape
        V = v.shape[-1]
        N, C = states.shape[2], ctx.chunk
        BK, BV, BC = _blocks(K, V, ctx.block_v)
        do = torch.zeros_like(v) if do is None else do.float().contiguous()
        dq, dk, dw, dv, dvn = (torch.empty_like(x) for x in (q, k, k, v, v))
        dg, db, dgp = torch.empty_like(g), torch.empty_like(beta), g.new_empty(triton.cdiv(K, BC), *g.shape)
        dstates, ds0 = torch.empty_like(states), torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
        dsf = ds0 if dfinal is None else dfinal.float().contiguous()
        _launch(_dvn_local_kernel, (B * H, N), q, k, g, seg, do, dvn, T, H, K, V, C, BC)
        _launch(_dstate_kernel, (B * H, triton.cdiv(V, BV)), q, k, w, e_in, e_out, e_c, do, dsf, dvn, dstates,
                ds0, T, N, K, V, C, BK, BV, BC, BR, dfinal is not None)  # fmt: skip
        _launch(_dqk_kernel, (B * H, N, triton.cdiv(K, BC)), q, k, g, seg, states, dstates, vn, dvn, do, dq,
                dk, dw, dgp, T, H, N, K, V, C, BC)  # fmt: skip
        _launch(_dwy_kernel, (B * H, N),
                k, v, g, beta, seg, tinv, w, u, dvn, dw, dgp, dk, dv, dg, db, T, H, K, V, C, BC)  # fmt: skip
        return dq, dk, dv, dg, db, (ds0 if ctx.has_s0 else None), None, None, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    seg: Optional[torch.Tensor] = None,
    block_v: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule chunk by chunk (the shapes: the module docstring); returns (o, final state).
    block_v: the value columns per program (a power of two >= 16; None: up to 32)."""
    reason = unsupported(chunk, q.shape[-1], v.shape[-1])
    if reason is not None:
        raise ValueError(f"chunk_gated_delta_rule cannot take {reason}")
    B, H, T, _ = q.shape
    if seg is None:
        seg = torch.zeros(B, T, dtype=torch.int32, device=q.device)
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    return _ChunkGatedDeltaRule.apply(
        q, k, v, g, beta, initial_state, seg.to(torch.int32).contiguous(), chunk, block_v
    )
