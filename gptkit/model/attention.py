"""Causal self-attention: the module, and the attention functions behind one dispatch seam.

Every backend has the same signature:

    fn(q, k, v, *, causal, mask, dropout_p, scale, return_probs, docs, window, softcap, sinks)
        -> (out, probs|None)

    q:    [B, n_heads,    T_q, head_dim]
    k, v: [B, n_kv_heads, T_k, head_dim]   (n_kv_heads divides n_heads: GQA/MQA; v may be of its own width
                                            Dv, out then [..., Dv]: multi-head latent attention's)
    mask: None, or a bool tensor broadcastable to [B, n_heads, T_q, T_k] (True = may attend);
          when given it replaces `causal` and `window` (a static KV cache builds it: gptkit/model/kv_cache.py)
          or Segments (sequences packed in one row, from a cache): every backend then runs once per
          segment (by_segment)
    docs: None, or the packed documents of the batch (gptkit.model.documents.Documents): causal
          attention inside each document only
    window: None, or W: query i also sees only the keys j with pos(i) - W < j (its last W positions, its own
          included: a sliding window, transformers' sliding_window); with documents both rules hold
    softcap: None, or c: the scores become c * tanh(scores / c) before the mask (Gemma 2)
    sinks: None, or [n_heads]: attention sinks (gpt-oss), one learned logit per head in every row's softmax
           denominator with no value: p_ij = exp(s_ij) / (exp(sinks_h) + sum_j exp(s_ij)),
           out_i = sum_j p_ij v_j
    out:  [B, n_heads, T_q, head_dim]

Queries are bottom-right aligned with the keys: query i sits at position T_k - T_q + i (a KV cache holds the
T_k - T_q positions before them). The mask is a description, never a dense [T, T] tensor where a kernel can
skip: `eager` is the readable reference (explicit fp32 softmax, a dense mask; can return the probabilities),
`sdpa` is torch's fused kernel (packed documents or a window: torch's variable-length FlashAttention on CUDA
in fp16/bf16, with its window; a window elsewhere runs query chunks against the keys their window reaches
(windowed_sdpa), so the cost grows with W, not T), `triton` is our own FlashAttention kernel in kernels/
(tiles wholly outside a window or a document skipped; soft-capping in both passes; one head width, so values
of another width than the keys, multi-head latent attention's, are padded to it: same_width). `sdpa` has no
soft-capping kernel: with model.attn_softcap it runs `eager`. Attention sinks (model.attn_sinks): `eager` adds
the sink as one more logit column; `sdpa` as one more zero key/value with the sink in a dense float mask
(sinks_sdpa); `triton` starts each row's online softmax from the sink and returns the sink's gradient.
A one-token query (a decode step) needs no causal mask, and under GQA `eager` and `sdpa` fold each group's
query heads into the query axis of their K/V head (q [B, n_kv_heads, group, head_dim]: no K/V copy per head).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gptkit.model.config import ATTENTIONS
from gptkit.model.fused import triton_available, warn_once

# gptkit_kernels is imported on use: it needs triton (optional); the model runs without it.


@functools.cache
def _varlen_attn():
    """torch's FlashAttention over variable-length sequences (CUDA, recent torch; None where missing), for
    packed documents. Imported on first use on a CUDA tensor: torch.nn.attention.varlen imports torch._dynamo,
    1.4 s of CPU (2.71 s vs 1.29 s for `import torch` alone, torch 2.13 CPU, 2026-12-04) that every process
    importing the model paid before its first line (sample, export, import, serve)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch: packed documents take a dense mask
        return None
    return varlen_attn


AttentionFn = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass(frozen=True)
class Segments:
    """A mask description for several sequences packed in one row (batch 1) and read through a cache
    (gptkit/inference/block_pool.py's PackedView): segment (qs, qe, ks, ke) is the queries q[:, :, qs:qe]
    of one sequence against its keys k[:, :, ks:ke] (its cached prefix, then those queries' own keys), causal
    and bottom-right aligned as a lone sequence's forward over its cache is, with the layer's window. One
    attention call per segment: the cost is the sum over segments of queries x keys, not N x K with the
    scores across sequences masked."""

    bounds: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True, eq=False)
class Mixed:
    """A mask description for one row [1, n + N] of a serving step (gptkit/inference/block_pool.py's
    MixedView): its first n queries are n sequences' one new token each, attending as a decode step's
    [n, H, 1, D] queries do over k, v [n, n_kv_heads, span, D] (each sequence's keys, a row each) under
    `mask` (None, or [n, 1, 1, span] bool: the same call of the backend as that decode step's); its other N
    queries are packed chunks read through the cache's keys, `segments` (bounds counted from query n)."""

    n: int
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    segments: Segments


def by_segment(fn: AttentionFn) -> AttentionFn:
    """fn (a backend of the signature above), taking a Segments mask too: then one call of fn per segment
    (mask None: causal, bottom-right, the window), the outputs joined along the queries; and a Mixed mask:
    one call for its decode queries, then its segments'."""

    @functools.wraps(fn)
    def attend(q, k, v, *, mask=None, **args):
        if not isinstance(mask, (Segments, Mixed)):
            return fn(q, k, v, mask=mask, **args)
        if args.get("return_probs") or args.get("docs") is not None or q.shape[0] != 1:
            raise ValueError("a Segments mask takes one packed row, no documents, no attention maps")
        outs, n = [], 0
        if isinstance(mask, Mixed):
            n = mask.n
            qd = q[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, H, 1, D]
            out = fn(qd, mask.k, mask.v, mask=mask.mask, **args)[0]  # [n, H, 1, Dv]
            outs.append(out[:, :, 0].transpose(0, 1).unsqueeze(0))  # [1, H, n, Dv]
            mask = mask.segments
        outs += [
            fn(q[:, :, n + a : n + b], k[:, :, c:d], v[:, :, c:d], mask=None, **args)[0]  # [1, H, b - a, Dv]
            for a, b, c, d in mask.bounds
        ]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), None  # [1, H, N, Dv]

    return attend


@by_segment
def eager_attention(
    q,
    k,
    v,
    *,
    causal=True,
    mask=None,
    dropout_p=0.0,
    scale=None,
    return_probs=False,
    docs=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """The readable reference: q @ k^T, the mask, an fp32 softmax, @ v; can return the probabilities."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    window = effective_window(window, Tk)
    if docs is not None:
        mask = docs.mask()  # [B, 1, T, T]: causal, inside each document
        if window is not None:
            mask = mask & window_mask(Tq, Tk, window, q.device)  # [B, 1, T, T]
    # GQA: each group of H // Hkv query heads reads the same K/V head; one query (a decode step): the group's
    # heads are the rows of one query of its K/V head (no K/V copy per query head)
    fold = Hkv != H and Tq == 1 and docs is None and dropout_p == 0.0 and heads_broadcast(mask)
    if fold:
        q = q.reshape(B, Hkv, H // Hkv, D)  # [B, Hkv, G, D]
    elif Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # [B, H, Tk, D]
        v = v.repeat_interleave(H // Hkv, dim=1)
    scale = D**-0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, Tq, Tk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        # query i sits at absolute position (Tk - Tq + i): bottom-right aligned, so it also
        # holds when a KV cache makes Tk > Tq.
        mask = window_mask(Tq, Tk, window, q.device)  # [Tq, Tk]
    if mask is not None:
        # a bool mask has no dtype to get wrong
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        # fp32 softmax
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        # the sink is one more logit column of each row, dropped after the fp32 softmax (transformers' GptOss)
        heads = (Hkv, H // Hkv) if fold else (H, 1)
        sink_col = sinks.float().view(1, *heads, 1).expand(*scores.shape[:-1], 1)  # [B, H, Tq, 1] (folded)
        probs = torch.softmax(torch.cat([scores.float(), sink_col], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    if dropout_p > 0.0:
        probs_d = F.dropout(probs, p=dropout_p)
    else:
        probs_d = probs
    out = probs_d @ v  # [B, H, Tq, D] ([B, Hkv, G, D] folded)
    if fold:
        out, probs = out.reshape(B, H, 1, -1), probs.reshape(B, H, 1, Tk)
    return out, (probs if return_probs else None)


def heads_broadcast(mask) -> bool:
    """Whether a mask (None, a bool or float tensor) is the same for every head, so that a GQA group's query
    heads can be folded into the query axis under it (its head axis, the third from the right, is 1)."""
    return mask is None or (isinstance(mask, torch.Tensor) and (mask.dim() < 3 or mask.shape[-3] == 1))


def one_query_sdpa(q, k, v, mask=None, dropout_p=0.0, scale=None) -> torch.Tensor:
    """SDPA for one query per head, q [B, H, 1, D], against every key of k, v [B, Hkv, Tk, D] that `mask`
    (None: all; else broadcastable to [B, 1, 1, Tk]) lets through: no causal mask is needed. Under GQA the
    G = H // Hkv query heads that read one K/V head are the G rows of one query of that head, q [B, Hkv, G, D]
    (the same sums; torch's CPU kernel for enable_gqa copies K/V per query head). Returns [B, H, 1, Dv]."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    if Hkv == H or dropout_p > 0.0 or not heads_broadcast(mask):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=Hkv != H
        )
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, 1, -1)  # [B, Hkv, G, Dv] -> [B, H, 1, Dv]


def effective_window(window: int | None, Tk: int) -> int | None:
    """The window, or None when it cannot hide a key: every query of Tk keys sees at most Tk positions."""
    return None if window is None or window >= Tk else window


def window_mask(Tq: int, Tk: int, window: int | None, device) -> torch.Tensor:
    """[Tq, Tk] bool: query i (at position Tk - Tq + i) sees key j when j <= its position and, with a window,
    j > its position - window."""
    pos = torch.arange(Tk - Tq, Tk, device=device)[:, None]  # [Tq, 1]
    j = torch.arange(Tk, device=device)[None, :]  # [1, Tk]
    keep = j <= pos
    if window is not None:
        keep = keep & (j > pos - window)
    return keep  # [Tq, Tk]


@by_segment
def sdpa_attention(
    q,
    k,
    v,
    *,
    causal=True,
    mask=None,
    dropout_p=0.0,
    scale=None,
    return_probs=False,
    docs=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """torch's scaled_dot_product_attention (GQA without K/V copies). Packed documents: on CUDA in fp16/bf16
    torch's variable-length FlashAttention (no mask, no work across documents); elsewhere a dense mask. A
    window: variable-length FlashAttention's window where it runs, else windowed_sdpa (query chunks)."""
    if return_probs:
        raise ValueError("the sdpa backend cannot return attention probabilities; use attention=eager")
    if softcap is not None:
        return _softcap_in_eager(
            "sdpa", q, k, v, causal, mask, dropout_p, scale, docs, window, softcap, sinks
        )
    if sinks is not None:
        return sinks_sdpa(q, k, v, sinks, causal, mask, dropout_p, scale, docs, window), None
    Tq, Tk = q.shape[2], k.shape[2]
    window = effective_window(window, Tk) if mask is None else None
    if docs is not None:
        if mask is None and dropout_p == 0.0 and Tq == Tk and varlen_usable(q):
            q, k, v, scale, dv = same_width(q, k, v, scale)
            return varlen_attention(q, k, v, docs.cu_seqlens(), scale, window)[..., :dv], None
        if q.is_cuda:
            warn_once(
                "sdpa-docs",
                f"model.attention=sdpa with packed documents in {q.dtype} on CUDA takes a "
                "dense [B, 1, T, T] mask and computes every tile across documents (torch's "
                "variable-length FlashAttention needs fp16/bf16, no dropout, an sm80+ GPU); "
                "precision bf16-mixed or model.attention=triton skips them",
            )
        if window is not None:
            return windowed_sdpa(q, k, v, window, scale, dropout_p, docs.start), None
        # On the CPU the dense mask is the right form: SDPA's CPU FlashAttention kernel takes it (measured
        # as fast as the plain causal kernel at T=128, docs/chat.md); built once per forward, additive in
        # the dtype of q, and shared by every layer
        mask = docs.mask(q.dtype)  # [B, 1, T, T]
    elif window is not None and causal:
        if dropout_p == 0.0 and Tq == Tk and varlen_usable(q):
            B, T = q.shape[0], q.shape[2]
            # each row one sequence
            cu = torch.arange(0, (B + 1) * T, T, device=q.device, dtype=torch.int32)  # [B + 1]
            q, k, v, scale, dv = same_width(q, k, v, scale)
            return varlen_attention(q, k, v, cu, scale, window)[..., :dv], None
        if Tq == 1:
            # one new token: its window is the last `window` keys
            return one_query_sdpa(q, k[:, :, -window:], v[:, :, -window:], None, dropout_p, scale), None
        return windowed_sdpa(q, k, v, window, scale, dropout_p), None
    if mask is None and causal and Tq != Tk:
        # one new token attends to the whole cache
        if Tq == 1:
            causal = False
        # SDPA's is_causal is top-left aligned; a cached prefix needs bottom-right
        else:
            mask = window_mask(Tq, Tk, None, q.device)  # [Tq, Tk]
    if Tq == 1 and (mask is not None or not causal):
        # one query against every key the mask lets through (a decode step)
        return one_query_sdpa(q, k, v, mask, dropout_p, scale), None
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=scale,
        # no K/V copy per query head where torch allows
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out, None


def _softcap_in_eager(backend, q, k, v, causal, mask, dropout_p, scale, docs, window, softcap, sinks=None):
    """Soft-capped scores (model.attn_softcap) have no SDPA kernel: the eager reference computes them."""
    warn_once(
        "softcap",
        f"model.attn_softcap: model.attention={backend} has no soft-capping kernel; attention runs eager "
        f"(the [T, T] scores are materialized; model.attention=triton caps in its kernel)",
    )
    return eager_attention(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        docs=docs,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def sinks_sdpa(q, k, v, sinks, causal, mask, dropout_p, scale, docs, window) -> torch.Tensor:
    """Attention sinks (sinks [n_heads]) with torch's SDPA, exactly: one more key/value position, all zeros,
    that every query sees, and an additive float mask whose column there is the head's sink (score 0 + sink)
    while the other columns carry the rule (causal, window, documents, a cache's mask: 0 or -inf). SDPA
    differentiates its float mask, so the sinks learn (checked on the CPU kernels in tests/model). The mask is
    dense, [B or 1, n_heads, T_q, T_k + 1] in q's dtype (the sink rounded to it): no FlashAttention kernel
    takes a float mask, so on a GPU model.attention=triton is the fast path. Returns [B, n_heads, T_q, D]."""
    H, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    if mask is not None:
        keep = mask
    elif docs is not None:
        keep = docs.mask()  # [B, 1, T, T]
        window = effective_window(window, Tk)
        if window is not None:
            keep = keep & window_mask(Tq, Tk, window, q.device)
    elif causal:
        keep = window_mask(Tq, Tk, effective_window(window, Tk), q.device)  # [Tq, Tk]
    else:
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    while keep.dim() < 4:
        keep = keep[None]
    rows = keep.shape[0]
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    sink_col = sinks.to(q.dtype).view(1, H, 1, 1).expand(rows, H, Tq, 1)  # [rows, H, Tq, 1]
    bias = torch.cat([bias.expand(rows, H, Tq, Tk), sink_col], dim=-1)  # [rows, H, Tq, Tk + 1]
    # the sink's key and value: zeros (its score is the bias alone; it adds nothing to the output)
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))  # [B, n_kv_heads, Tk + 1, D]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale, enable_gqa=k.shape[1] != H
        )
    # on the CPU one kernel whether the sinks train or not: SDPA would take its flash kernel for a mask that
    # needs no gradient (frozen sinks, DPO's reference under no_grad) and its math one for a mask that does,
    # and a trained model and its frozen copy would differ (bf16: by 4e-3)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale, enable_gqa=k.shape[1] != H
        )


# queries per chunk of windowed_sdpa: half the window (each chunk reads W - 1 + C keys), at least this many
MIN_WINDOW_CHUNK = 16


def windowed_sdpa(
    q, k, v, window: int, scale=None, dropout_p=0.0, doc_start=None, chunk: int | None = None
) -> torch.Tensor:
    """Causal attention in a sliding window with torch's SDPA, chunk by chunk: the queries at positions
    [s, e) see only the keys [s - window + 1, e), so each chunk of C = max(window // 2, MIN_WINDOW_CHUNK)
    queries multiplies a [C, W - 1 + C] block, never [T, T] (forward and backward cost ~1.5 T W, not T^2 / 2).
    Queries are bottom-right aligned (query i at position T_k - T_q + i); doc_start: None, or int [B, T_q] the
    first position of each query's packed document (T_q = T_k); chunk: C (default above). Returns
    [B, n_heads, T_q, head_dim]."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    off = Tk - Tq
    C = chunk or max(window // 2, MIN_WINDOW_CHUNK)
    gqa = k.shape[1] != H
    # (rows, cols, first key's distance back from the first query) -> the additive band mask of a chunk
    bands: dict[tuple[int, int, int], torch.Tensor] = {}
    outs = []
    for s in range(0, Tq, C):
        e = min(s + C, Tq)
        a, b = max(0, off + s - window + 1), off + e
        key = (e - s, b - a, off + s - a)
        mask = None
        if doc_start is not None or e - s > 1:
            if key not in bands:
                pos = torch.arange(off + s, off + e, device=q.device)[:, None]  # [rows, 1] query positions
                j = torch.arange(a, b, device=q.device)[None, :]  # [1, cols] key positions
                band = (j <= pos) & (j > pos - window)  # [rows, cols]
                bands[key] = torch.zeros(band.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~band, float("-inf")
                )
            mask = bands[key]  # [rows, cols] additive
            if doc_start is not None:
                j = torch.arange(a, b, device=q.device)  # [cols]
                inside = j[None, None, :] >= doc_start[:, s:e, None]  # [B, rows, cols]
                mask = mask.masked_fill(~inside, float("-inf"))[:, None]  # [B, 1, rows, cols]
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, s:e],
                k[:, :, a:b],
                v[:, :, a:b],
                attn_mask=mask,
                dropout_p=dropout_p,
                scale=scale,
                enable_gqa=gqa,
            )  # [B, H, rows, D]
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, H, Tq, D]


def same_width(q, k, v, scale=None):
    """(q, k, v, scale, v width): for kernels that take one head width, queries and keys of width D and
    values of width Dv != D (multi-head latent attention: 192 and 128 at DeepSeek-V3's shape) padded with
    zero features to max(D, Dv), exactly: zero features add nothing to a score, and a zero value feature gives
    a zero output feature (cut off by the caller, [..., :Dv]). The scale is made explicit (D^-0.5 unless
    given), so the padding does not change it. Equal widths come back as they are."""
    D, Dv = q.shape[-1], v.shape[-1]
    if D == Dv:
        return q, k, v, scale, Dv
    scale = D**-0.5 if scale is None else scale
    if Dv < D:
        return q, k, F.pad(v, (0, D - Dv)), scale, Dv
    return F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D)), v, scale, Dv


def varlen_usable(q: torch.Tensor) -> bool:
    """Whether torch's variable-length FlashAttention (torch.nn.attention.varlen) runs q: fp16/bf16 on a CUDA
    GPU of compute capability >= 8.0 (FlashAttention 2's), head_dim a multiple of 8 up to 256."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or _varlen_attn() is None:
        return False
    D = q.shape[-1]
    return D % 8 == 0 and D <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0)


def varlen_attention(q, k, v, cu: torch.Tensor, scale=None, window: int | None = None) -> torch.Tensor:
    """Causal attention inside each sequence of the B rows of T tokens taken as one run of B*T tokens cut at
    cu (int32 [n + 1]: packed documents' cu_seqlens, or each row whole), with torch's varlen_attn; a window
    keeps the last `window` keys of each query (FlashAttention's window_size (window - 1, 0)). q [B, n_heads,
    T, D], k, v [B, n_kv_heads, T, D] -> [B, n_heads, T, D]. No mask is built and no tile across two
    sequences (or wholly outside a window) is computed."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    q_flat = q.transpose(1, 2).reshape(B * T, H, D)  # [B*T, n_heads, D]
    k_flat = k.transpose(1, 2).reshape(B * T, Hkv, D)  # [B*T, n_kv_heads, D]
    v_flat = v.transpose(1, 2).reshape(B * T, Hkv, D)
    # T bounds every sequence's length (no host sync for the longest); window (-1, 0) is causal
    left = -1 if window is None else window - 1
    out = _varlen_attn()(
        q_flat, k_flat, v_flat, cu, cu, T, T, scale=scale, window_size=(left, 0), enable_gqa=Hkv != H
    )  # [B*T, n_heads, D]
    return out.view(B, T, H, D).transpose(1, 2)  # [B, n_heads, T, D]


@by_segment
def triton_attention(
    q,
    k,
    v,
    *,
    causal=True,
    mask=None,
    dropout_p=0.0,
    scale=None,
    return_probs=False,
    docs=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """Our FlashAttention kernels (documents, windows and soft-capping included); cases they do not cover go
    to sdpa.

    Falls back to sdpa (with one warning per process) when triton is missing or no CUDA device is
    present and TRITON_INTERPRET=1 is not set, and per call for masks, dropout, or a KV cache (T_q != T_k).
    """
    args = dict(
        causal=causal,
        mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        return_probs=return_probs,
        docs=docs,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    if not triton_available(q.device):
        warn_once(
            "triton",
            "model.attention=triton needs triton and CUDA tensors (or TRITON_INTERPRET=1); "
            "falling back to sdpa",
        )
        return sdpa_attention(q, k, v, **args)
    if mask is not None or dropout_p > 0.0 or return_probs or q.shape[2] != k.shape[2]:
        return sdpa_attention(q, k, v, **args)
    from gptkit_kernels import flash_attention

    bounds = None if docs is None else (docs.start, docs.end)
    window = effective_window(window, k.shape[2])
    # one head width in the kernel: values narrower (or wider) than queries and keys are padded (same_width)
    q, k, v, scale, dv = same_width(q, k, v, scale)
    out = flash_attention(
        q, k, v, causal=causal, scale=scale, doc_bounds=bounds, window=window, softcap=softcap, sinks=sinks
    )
    return out[..., :dv], None


# model.attention=<name> runs <name>_attention: the names are model/config.py's ATTENTIONS (one list)
ATTENTION_BACKENDS: dict[str, AttentionFn] = {name: globals()[f"{name}_attention"] for name in ATTENTIONS}


def get_attention(name: str) -> AttentionFn:
    """The attention function of model.attention=<name>."""
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        known = ", ".join(ATTENTION_BACKENDS)
        raise ValueError(f"unknown attention backend {name!r}; known: {known}") from None
