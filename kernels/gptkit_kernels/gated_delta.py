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
chunk (gptkit/model/gated_deltanet.py's chunk_gated_delta_rule is the readable PyTorch form it equals).
One program per (sequence, head, block of value columns) walks the chunks in order holding its columns of the
state S [K, V] in registers (each line below is column by column in V; A and Tinv are recomputed per block);
per chunk of C positions (G the cumulative log decay from the chunk's start, D[i, j] = exp(G_i - G_j) for
j <= i in one document, else 0):

    A  = strictly_lower((beta k) k^T * D);  Tinv = (I + A)^-1   the UT transform (forward substitution)
    U  = Tinv (beta v),  W = Tinv (beta k exp(G))                the WY representation of the C updates
    V' = U - W S                                                 the corrections against the carried state
    O  = (q exp(G)) S + ((q k^T) * D) V'                         the inter-chunk read + intra-chunk attention
    S <- exp(G_C) S + (k exp(G_C - G))^T V'                      the state passed to the next chunk

A document start at position i of a chunk cuts the carried state's reach (exp(G) zeroed from i on), the
writes before i to the chunk's end (exp(G_C - G) zeroed before i) and the pairs across it (D).

The forward saves the state at each chunk's start ([B, H, N, K, V] fp32, as flash-linear-attention keeps its
`h`). The backward walks the chunks in reverse, one program per (sequence, head), carrying dS; per chunk it
recomputes G, D, Tinv, U, W and V' from the saved state and applies the chain rule to the five lines above
(all matmuls; dA = -(Tinv^T dU U^T + Tinv^T dW W^T) for the triangular inverse), then turns dG into dg by a
reverse cumulative sum.

Limits: C a power of two in 16..64, K and V at most 128 (padded on-chip to a power of two >= 16). All
arithmetic in fp32 (IEEE dots, not TF32). Written after flash-linear-attention's chunk_gated_delta_rule
(fla/ops/gated_delta_rule), which splits the same steps over several kernels; this one keeps one program
per (sequence, head) so it reads top to bottom.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

CHUNKS = (16, 32, 64)
MAX_HEAD_DIM = 128


def unsupported(chunk: int, key_dim: int, value_dim: int) -> Optional[str]:
    """Why the kernel cannot take this chunk size or these head dims, or None when it can."""
    if chunk not in CHUNKS:
        return f"chunk size {chunk} (the kernel takes {', '.join(map(str, CHUNKS))})"
    for name, d in (("key", key_dim), ("value", value_dim)):
        if d > MAX_HEAD_DIM:
            return f"{name} head dim {d} (the kernel takes at most {MAX_HEAD_DIM})"
    return None


@triton.jit
def _chunk(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, bh, b, n, cv, T, K, V, BT: tl.constexpr,
           BK: tl.constexpr):  # fmt: skip
    """Chunk n of sequence b, head row bh (value columns cv): its inputs and the decay factors of the module
    docstring."""
    t = n * BT + tl.arange(0, BT)
    ok = t < T
    ck = tl.arange(0, BK)
    q = tl.load(
        q_ptr + (bh * T + t[:, None]) * K + ck[None, :], mask=ok[:, None] & (ck[None, :] < K), other=0.0
    )
    k = tl.load(
        k_ptr + (bh * T + t[:, None]) * K + ck[None, :], mask=ok[:, None] & (ck[None, :] < K), other=0.0
    )
    v = tl.load(
        v_ptr + (bh * T + t[:, None]) * V + cv[None, :], mask=ok[:, None] & (cv[None, :] < V), other=0.0
    )
    g = tl.load(g_ptr + bh * T + t, mask=ok, other=0.0)
    beta = tl.load(b_ptr + bh * T + t, mask=ok, other=0.0)
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
    return t, ok, q, k, v, beta, D, e_in, e_out, e_c


@triton.jit
def _ut(k, v, beta, D, e_in, S, BT: tl.constexpr):
    """The UT transform: Tinv = (I + strictly_lower((beta k) k^T * D))^-1 by forward substitution, a row at a
    time (row r = e_r - A[r, :] Tinv), then U, W and V' = U - W S."""
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    kb = k * beta[:, None]
    A = tl.where(j < i, tl.dot(kb, tl.trans(k), input_precision="ieee") * D, 0.0)
    Tinv = tl.where(i == j, 1.0, 0.0)
    for r in range(1, BT):
        a_r = tl.sum(tl.where(i == r, A, 0.0), axis=0)  # row r of A, indexed by column m
        row = tl.sum(a_r[:, None] * Tinv, axis=0)  # sum_m A[r, m] Tinv[m, :] (rows m < r are final)
        Tinv = tl.where(i == r, Tinv - row[None, :], Tinv)
    bv = v * beta[:, None]
    X = kb * e_in[:, None]
    U = tl.dot(Tinv, bv, input_precision="ieee")
    W = tl.dot(Tinv, X, input_precision="ieee")
    Vn = U - tl.dot(W, S, input_precision="ieee")
    return kb, bv, X, Tinv, U, W, Vn


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, s0_ptr, o_ptr, hs_ptr, sf_ptr, T, H, N,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                HAS_S0: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B * H * T * K can pass 2^31
    b = bh // H
    ck, cv = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)  # this program's value columns
    kv = ck[:, None] * V + cv[None, :]
    kv_ok = (ck[:, None] < K) & (cv[None, :] < V)
    if HAS_S0:
        S = tl.load(s0_ptr + bh * K * V + kv, mask=kv_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(0, N):
        t, ok, q, k, v, beta, D, e_in, e_out, e_c = _chunk(
            q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, bh, b, n, cv, T, K, V, BT, BK
        )
        tl.store(hs_ptr + (bh * N + n) * K * V + kv, S, mask=kv_ok)  # the state at the chunk's start
        kb, bv, X, Tinv, U, W, Vn = _ut(k, v, beta, D, e_in, S, BT)
        intra = tl.dot(q, tl.trans(k), input_precision="ieee") * D
        o = tl.dot(q * e_in[:, None], S, input_precision="ieee") + tl.dot(intra, Vn, input_precision="ieee")
        tl.store(o_ptr + (bh * T + t[:, None]) * V + cv[None, :], o, mask=ok[:, None] & (cv[None, :] < V))
        S = S * e_c + tl.dot(tl.trans(k * e_out[:, None]), Vn, input_precision="ieee")
    tl.store(sf_ptr + bh * K * V + kv, S, mask=kv_ok)


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, hs_ptr, do_ptr, dsf_ptr, dq_ptr, dk_ptr, dv_ptr,
                dg_ptr, db_ptr, ds0_ptr, T, H, N, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, HAS_DSF: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)  # int64 offsets: B * H * T * K can pass 2^31
    b = bh // H
    ck, cv = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)  # this program's value columns
    kv = ck[:, None] * V + cv[None, :]
    kv_ok = (ck[:, None] < K) & (cv[None, :] < V)
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    if HAS_DSF:
        dS = tl.load(
            dsf_ptr + bh * K * V + kv, mask=kv_ok, other=0.0
        )  # the gradient reaching the final state
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
    # dq, dk, dg, dbeta sum over the value blocks: this block writes its own part (summed by the caller)
    part = tl.program_id(1).to(tl.int64) * tl.num_programs(0)
    for m in range(0, N):
        n = N - 1 - m
        t, ok, q, k, v, beta, D, e_in, e_out, e_c = _chunk(
            q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, seg_ptr, bh, b, n, cv, T, K, V, BT, BK
        )
        S = tl.load(hs_ptr + (bh * N + n) * K * V + kv, mask=kv_ok, other=0.0)
        kb, bv, X, Tinv, U, W, Vn = _ut(k, v, beta, D, e_in, S, BT)
        rows_v = ok[:, None] & (cv[None, :] < V)
        do = tl.load(do_ptr + (bh * T + t[:, None]) * V + cv[None, :], mask=rows_v, other=0.0)
        P = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BT, BT]
        k_out = k * e_out[:, None]
        # O = (q e_in) S + (P * D) V',  S_next = e_c S + k_out^T V'
        dVn = tl.dot(tl.trans(P * D), do, input_precision="ieee") + tl.dot(k_out, dS, input_precision="ieee")
        dS_prev = (
            tl.dot(tl.trans(q * e_in[:, None]), do, input_precision="ieee")
            + dS * e_c
            - tl.dot(tl.trans(W), dVn, input_precision="ieee")
        )
        dW = -tl.dot(dVn, tl.trans(S), input_precision="ieee")  # V' = U - W S
        dPD = tl.dot(do, tl.trans(Vn), input_precision="ieee")
        dP = dPD * D
        dD = dPD * P
        doS = tl.dot(do, tl.trans(S), input_precision="ieee")  # [BT, BK]
        dq = doS * e_in[:, None] + tl.dot(dP, k, input_precision="ieee")
        dk = tl.dot(tl.trans(dP), q, input_precision="ieee")
        dk_out = tl.dot(Vn, tl.trans(dS), input_precision="ieee")  # [BT, BK]
        dk += dk_out * e_out[:, None]
        d_e_out = tl.sum(dk_out * k, axis=1)
        d_e_c = tl.sum(tl.sum(S * dS, axis=1), axis=0)
        d_e_in = tl.sum(q * doS, axis=1)
        # U = Tinv bv, W = Tinv X, Tinv = (I + A)^-1
        dbv = tl.dot(tl.trans(Tinv), dVn, input_precision="ieee")
        dX = tl.dot(tl.trans(Tinv), dW, input_precision="ieee")
        dA = -(
            tl.dot(dbv, tl.trans(U), input_precision="ieee") + tl.dot(dX, tl.trans(W), input_precision="ieee")
        )
        dA = tl.where(j < i, dA, 0.0)
        # A = strictly_lower(kb k^T * D)
        dAD = dA * D
        dkb = tl.dot(dAD, k, input_precision="ieee") + dX * e_in[:, None]
        dk += tl.dot(tl.trans(dAD), kb, input_precision="ieee")
        dD += dA * tl.dot(kb, tl.trans(k), input_precision="ieee")
        d_e_in += tl.sum(dX * kb, axis=1)
        # bv = beta v, kb = beta k
        dv = dbv * beta[:, None]
        dbeta = tl.sum(v * dbv, axis=1) + tl.sum(k * dkb, axis=1)
        dk += dkb * beta[:, None]
        # the decays as functions of G, then g: D[i, j] = exp(G_i - G_j), e_in = exp(G), e_out = exp(G_C - G),
        # e_c = exp(G_C) (each where its mask keeps it); G = cumsum(g)
        dDD = dD * D
        dG = tl.sum(dDD, axis=1) - tl.sum(dDD, axis=0) + d_e_in * e_in - d_e_out * e_out
        dG_C = tl.sum(d_e_out * e_out, axis=0) + d_e_c * e_c
        dG += tl.where(tl.arange(0, BT) == BT - 1, dG_C, 0.0)
        dg = tl.sum(tl.where(j >= i, dG[None, :], 0.0), axis=1)  # reverse cumulative sum
        rows_k = ok[:, None] & (ck[None, :] < K)
        tl.store(dq_ptr + ((part + bh) * T + t[:, None]) * K + ck[None, :], dq, mask=rows_k)
        tl.store(dk_ptr + ((part + bh) * T + t[:, None]) * K + ck[None, :], dk, mask=rows_k)
        tl.store(dv_ptr + (bh * T + t[:, None]) * V + cv[None, :], dv, mask=rows_v)
        tl.store(dg_ptr + (part + bh) * T + t, dg, mask=ok)
        tl.store(db_ptr + (part + bh) * T + t, dbeta, mask=ok)
        dS = dS_prev
    tl.store(ds0_ptr + bh * K * V + kv, dS, mask=kv_ok)


def _blocks(K: int, V: int, block_v: Optional[int]) -> tuple[int, int, int]:
    """BK (the whole key dim), BV (value columns per program: the state S[:, block] and every value-side tile
    split across programs, at most 32 wide, so a 128 x 128 state does not sit in one program's registers)
    and the number of value blocks."""
    BV = block_v or min(max(16, triton.next_power_of_2(V)), 32)
    return max(16, triton.next_power_of_2(K)), BV, triton.cdiv(V, BV)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, seg, chunk, block_v):
        B, H, T, K = q.shape
        V = v.shape[-1]
        N = triton.cdiv(T, chunk)
        BK, BV, NV = _blocks(K, V, block_v)
        o = torch.empty(B, H, T, V, device=q.device, dtype=torch.float32)
        states = torch.empty(B, H, N, K, V, device=q.device, dtype=torch.float32)
        final = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
        s0 = final if initial_state is None else initial_state
        _fwd_kernel[(B * H, NV)](
            q,
            k,
            v,
            g,
            beta,
            seg,
            s0,
            o,
            states,
            final,
            T,
            H,
            N,
            K,
            V,
            chunk,
            BK,
            BV,
            initial_state is not None,
        )
        ctx.save_for_backward(q, k, v, g, beta, seg, states)
        ctx.chunk, ctx.block_v, ctx.has_s0 = chunk, block_v, initial_state is not None
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, seg, states = ctx.saved_tensors
        B, H, T, K = q.shape
        V = v.shape[-1]
        N = states.shape[2]
        BK, BV, NV = _blocks(K, V, ctx.block_v)
        dq, dk = q.new_empty(NV, *q.shape), k.new_empty(NV, *k.shape)
        dg, db = g.new_empty(NV, *g.shape), beta.new_empty(NV, *beta.shape)
        dv = torch.empty_like(v)
        ds0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
        do = torch.zeros_like(v) if do is None else do.float().contiguous()
        dsf = ds0 if dfinal is None else dfinal.float().contiguous()
        _bwd_kernel[(B * H, NV)](
            q, k, v, g, beta, seg, states, do, dsf, dq, dk, dv, dg, db, ds0, T, H, N, K, V, ctx.chunk, BK, BV,
            dfinal is not None,
        )  # fmt: skip
        dq, dk, dg, db = (x.sum(0) for x in (dq, dk, dg, db))
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
