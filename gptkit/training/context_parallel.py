"""Context parallelism (trainer.context_parallel=k): each sequence split over k ranks, attention as a ring.

    split      a sequence of T tokens is cut into 2k chunks of c = T / 2k; rank r of a context-parallel group
               holds chunks r and 2k-1-r (load-balanced "zig-zag", OLMo-core's and torchtitan's): under the
               causal mask every rank then has the same work, 2k+1 chunk pairs of c x c scores
    positions  each token keeps its position in the whole sequence (RoPE, learned positions); with packed
               documents (model.position_reset) its position inside its own document, and the document's first
               position (global) rides along with each query: the mask is computed from global positions
    ring       attention of the local queries against the k ranks' keys and values, which travel around the
               ring (rank r sends to r+1, receives from r-1: k-1 shifts); each block's result (out_i, lse_i),
               its log-sum-exp per query row, is merged exactly:  lse = logaddexp_i lse_i,
               out = sum_i exp(lse_i - lse) out_i.  Chunk pairs wholly in the future (or wholly outside a
               sliding window) are skipped; the rest carry the exact mask (causal, the window, the documents)
    backward   FlashAttention's, block by block with the merged out and lse: P = exp(S - lse),
               dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ += dS K, dK += dS^T Q; the keys' gradients
               travel with their block and reach their owner after one more shift (k shifts of dK, dV)

Communication per layer and optimizer micro-step on each rank (B rows, T tokens, H_kv key/value heads of
width D, b bytes per element of K/V): forward (k-1) * 2 * B * (T/k) * H_kv * D * b; backward the same again
(the blocks travel a second time) plus k * 2 * B * (T/k) * H_kv * D * 4 (dK, dV accumulated in fp32).

The blocks run in one of the model's attention backends, each of which returns the log-sum-exp the merge
needs: eager (fp32 scores), sdpa (torch's CPU flash kernel, aten._scaled_dot_product_flash_attention_for_cpu,
or on CUDA the memory-efficient kernel, both with their log-sum-exp; the CUDA path is unchecked: no GPU here).
model.attention=triton is refused (config_checks): our kernel's forward returns the LSE
(gptkit_kernels.flash._forward) but its causal, window and document masks are in the coordinates of one
whole sequence, not of a chunk pair at global offsets.

`simulate` runs the same forward and backward code for k ranks in one process (the blocks are read from a
list instead of received): the fast tests compare it with one-process attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from gptkit.errors import ConfigError
from gptkit.training.config_checks import check_context_parallel_model


# ---- the split --------------------------------------------------------------------------------------------
def chunks_of(rank: int, k: int) -> tuple[int, int]:
    """The two chunks (of 2k) that rank `rank` of k holds: r and 2k-1-r."""
    return rank, 2 * k - 1 - rank


def zigzag_index(T: int, k: int, rank: int, device=None) -> torch.Tensor:
    """int64 [T / k]: the positions (of 0..T-1) that rank `rank` of k holds, in order."""
    if T % (2 * k):
        raise ConfigError(
            f"a sequence of {T} tokens cannot be split over 2 x {k} chunks (context_parallel={k})"
        )
    c = T // (2 * k)
    a, b = chunks_of(rank, k)
    return torch.cat(
        [torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)]
    )


def split(x: torch.Tensor, k: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's share of x along `dim` (the sequence): its two chunks."""
    return x.index_select(dim, zigzag_index(x.shape[dim], k, rank, x.device))


def unsplit(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The k ranks' shares (rank order) put back into sequence order along `dim`."""
    k = len(parts)
    T = parts[0].shape[dim] * k
    order = torch.cat([zigzag_index(T, k, r, parts[0].device) for r in range(k)])  # [T]
    whole = torch.cat(parts, dim)
    return whole.index_select(dim, torch.argsort(order))


@dataclass
class Shard:
    """One rank's share of a batch: the global positions of its tokens and, with packed documents, the first
    (global) position of each token's document."""

    pos: torch.Tensor  # int64 [T / k]
    start: Optional[torch.Tensor]  # int64 [B, T / k], or None (one document per row)
    chunk: int  # c = T / 2k tokens per chunk
    chunks: tuple[int, int]  # the two chunks held


def shard_of(T: int, k: int, rank: int, doc_start: Optional[torch.Tensor], device) -> Shard:
    """The Shard of rank `rank`; doc_start: int [B, T], the documents' first positions of the whole rows."""
    pos = zigzag_index(T, k, rank, device)
    start = None if doc_start is None else doc_start.long().index_select(1, pos)
    return Shard(pos, start, T // (2 * k), chunks_of(rank, k))


def rotary_positions(shard: Shard, position_reset: bool) -> torch.Tensor:
    """The positions the model's RoPE (or learned positions) reads: [T / k] global, or with packed documents
    and model.position_reset [B, T / k] inside each document."""
    if position_reset and shard.start is not None:
        return shard.pos[None, :] - shard.start
    return shard.pos


# ---- one block: (out, lse) of a query chunk against a key chunk ---------------------------------------
def _keep(q_pos, k_pos, q_start, window) -> torch.Tensor:
    """bool [B or 1, 1, Tq, Tk]: causal by global position, inside the window and the query's document."""
    keep = k_pos[None, :] <= q_pos[:, None]  # [Tq, Tk]
    if window is not None:
        keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
    keep = keep[None, None]
    if q_start is not None:
        keep = keep & (k_pos[None, None, None, :] >= q_start[:, None, :, None])  # [B, 1, Tq, Tk]
    return keep


def _expand(k: torch.Tensor, H: int) -> torch.Tensor:
    return k if k.shape[1] == H else k.repeat_interleave(H // k.shape[1], dim=1)


def eager_block(q, k, v, keep, scale):
    """(out fp32 [B, H, Tq, D], lse fp32 [B, H, Tq]; -inf on a row that sees no key)."""
    H = q.shape[1]
    s = (q.float() @ _expand(k, H).float().transpose(-2, -1)) * scale  # [B, H, Tq, Tk]
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Tq]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ _expand(v, H).float(), lse


def sdpa_block(q, k, v, keep, scale):
    """The same with torch's fused kernels (their log-sum-exp)."""
    H, Tq = q.shape[1], q.shape[2]
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    kx, vx = _expand(k, H), _expand(v, H)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, kx, vx, 0.0, False, attn_mask=bias, scale=scale
        )
    else:  # pragma: no cover - CUDA (memory-efficient kernel: an additive bias and its log-sum-exp)
        bias = bias.expand(q.shape[0], H, Tq, k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, kx, vx, bias, True, 0.0, False, scale=scale
        )[:2]
        lse = lse[..., :Tq]
    # a row that sees no key: the kernels give lse 0 and out 0; the merge needs -inf
    lse = lse.float().masked_fill(~keep.any(-1).expand(lse.shape), float("-inf"))
    return out.float(), lse


BLOCKS: dict[str, Callable] = {"eager": eager_block, "sdpa": sdpa_block}


def block_fn(backend: str) -> Callable:
    """The block function of model.attention=<backend> under context parallelism."""
    if backend not in BLOCKS:
        raise ConfigError(f"context parallelism runs its blocks with {', '.join(BLOCKS)}, not {backend}")
    return BLOCKS[backend]


# ---- the ring's pieces: which chunk pairs, the merge, the backward of a block ----------------------------
def _pairs(q_shard: Shard, k_chunks: tuple[int, int], window: Optional[int]):
    """(query rows slice, key cols slice, x, y) of the chunk pairs that can see anything: y <= x, and with a
    window not wholly behind it."""
    c = q_shard.chunk
    for i, x in enumerate(q_shard.chunks):
        for j, y in enumerate(k_chunks):
            if y > x:
                continue
            # the nearest key (end of chunk y) is behind the window of the first query of chunk x
            if window is not None and (y + 1) * c - 1 <= x * c - window:
                continue
            yield slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c)


def _merge(out, lse, rows, o_i, lse_i) -> None:
    """out[rows], lse[rows] (fp32 accumulators) take one more block's (o_i, lse_i), in place."""
    a, b = lse[:, :, rows], lse_i
    new = torch.logaddexp(a, b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    wa = torch.where(torch.isinf(a), 0.0, torch.exp(a - safe))[..., None]
    wb = torch.where(torch.isinf(b), 0.0, torch.exp(b - safe))[..., None]
    out[:, :, rows] = out[:, :, rows] * wa + o_i * wb
    lse[:, :, rows] = new


def forward_block(q, k, v, q_shard, k_pos, k_chunks, window, scale, block, out, lse) -> None:
    """Merge the local queries' attention to one block of keys (global positions k_pos) into out, lse."""
    for rows, cols in _pairs(q_shard, k_chunks, window):
        start = None if q_shard.start is None else q_shard.start[:, rows]
        keep = _keep(q_shard.pos[rows], k_pos[cols], start, window)
        o_i, lse_i = block(q[:, :, rows], k[:, :, cols], v[:, :, cols], keep, scale)
        _merge(out, lse, rows, o_i, lse_i)


def backward_block(do, q, k, v, out, lse, delta, q_shard, k_pos, k_chunks, window, scale, dq, dk, dv) -> None:
    """Add one block's gradients: dq (local queries), dk, dv (the block's keys; fp32, [B, H_kv, Tk, D])."""
    H, Hkv = q.shape[1], k.shape[1]
    g = H // Hkv
    for rows, cols in _pairs(q_shard, k_chunks, window):
        start = None if q_shard.start is None else q_shard.start[:, rows]
        keep = _keep(q_shard.pos[rows], k_pos[cols], start, window)
        qr, kc, vc = (
            q[:, :, rows].float(),
            _expand(k[:, :, cols], H).float(),
            _expand(v[:, :, cols], H).float(),
        )
        s = (qr @ kc.transpose(-2, -1)) * scale  # [B, H, c, c]
        lr = lse[:, :, rows]
        p = torch.exp(s - torch.where(torch.isinf(lr), 0.0, lr)[..., None]).masked_fill(~keep, 0.0)
        dor = do[:, :, rows]
        dv_c = p.transpose(-2, -1) @ dor  # [B, H, c, D]
        ds = p * (dor @ vc.transpose(-2, -1) - delta[:, :, rows, None]) * scale
        dq[:, :, rows] += ds @ kc
        dk_c = ds.transpose(-2, -1) @ qr
        B, _, n, D = dk_c.shape
        dk[:, :, cols] += dk_c.view(B, Hkv, g, n, D).sum(2)
        dv[:, :, cols] += dv_c.view(B, Hkv, g, n, -1).sum(2)


# ---- the distributed ring ---------------------------------------------------------------------------------
class Ring:
    """A context-parallel group of k ranks as a ring: shift() sends to the next rank, receives from the
    previous one (gloo and nccl point-to-point)."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self.prev, self.group) for g in got]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return got

    def owner(self, step: int) -> int:
        """Whose block this rank holds at ring step `step`."""
        return (self.rank - step) % self.size


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard: Shard, ring: Ring, T: int, window, scale, block):
        B, H, n, _ = q.shape
        out = q.new_zeros(B, H, n, v.shape[-1], dtype=torch.float32)
        lse = torch.full((B, H, n), float("-inf"), device=q.device)
        kb, vb = k, v
        for step in range(ring.size):
            if step + 1 < ring.size:
                # (sequential on gloo; nccl overlaps nothing either here: kept simple and exact)
                nxt = ring.shift([kb, vb])
            o = ring.owner(step)
            forward_block(
                q,
                kb,
                vb,
                shard,
                zigzag_index(T, ring.size, o, q.device),
                chunks_of(o, ring.size),
                window,
                scale,
                block,
                out,
                lse,
            )
            if step + 1 < ring.size:
                kb, vb = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (shard, ring, T, window, scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        shard, ring, T, window, scale = ctx.args
        do = do.float()
        delta = (do * out).sum(-1)  # [B, H, n]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kb, vb = k, v
        dk = dv = None
        for step in range(ring.size):
            o = ring.owner(step)
            if step > 0:
                kb, vb, dk, dv = ring.shift([kb, vb, dk, dv])
            else:
                dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            backward_block(
                do,
                q,
                kb,
                vb,
                out,
                lse,
                delta,
                shard,
                zigzag_index(T, ring.size, o, q.device),
                chunks_of(o, ring.size),
                window,
                scale,
                dq,
                dk,
                dv,
            )
        # the last accumulators belong to the next rank's block: one more shift brings each home
        dk, dv = ring.shift([dk, dv]) if ring.size > 1 else (dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, shard: Shard, ring: Ring, T: int, window=None, scale=None, block=eager_block):
    """Exact causal attention of this rank's queries (q [B, H, T/k, D]) over the whole sequence of T tokens
    whose keys and values (k, v [B, H_kv, T/k, D]) the k ranks of `ring` hold, zig-zag split."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, shard, ring, T, window, scale, block)


# ---- one process, k simulated ranks (the fast tests) ---------------------------------------------------
class _Simulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, starts, k_ranks: int, window, scale, block):
        T = q.shape[2]
        outs, saved = [], []
        qs, ks, vs = ([split(x, k_ranks, r, 2) for r in range(k_ranks)] for x in (q, k, v))
        shards = [shard_of(T, k_ranks, r, starts, q.device) for r in range(k_ranks)]
        for r in range(k_ranks):
            B, H, n, _ = qs[r].shape
            out = q.new_zeros(B, H, n, v.shape[-1], dtype=torch.float32)
            lse = torch.full((B, H, n), float("-inf"), device=q.device)
            for step in range(k_ranks):
                o = (r - step) % k_ranks
                forward_block(
                    qs[r],
                    ks[o],
                    vs[o],
                    shards[r],
                    shards[o].pos,
                    chunks_of(o, k_ranks),
                    window,
                    scale,
                    block,
                    out,
                    lse,
                )
            outs.append(out)
            saved.append(lse)
        ctx.save_for_backward(q, k, v)
        ctx.args = (qs, ks, vs, shards, outs, saved, k_ranks, window, scale)
        return unsplit([o.to(q.dtype) for o in outs], 2), unsplit(saved, 2)

    @staticmethod
    def backward(ctx, do, _dlse):
        qs, ks, vs, shards, outs, lses, k_ranks, window, scale = ctx.args
        dos = [split(do.float(), k_ranks, r, 2) for r in range(k_ranks)]
        dqs = [torch.zeros(x.shape, dtype=torch.float32) for x in qs]
        dks = [torch.zeros(x.shape, dtype=torch.float32) for x in ks]
        dvs = [torch.zeros(x.shape, dtype=torch.float32) for x in vs]
        for r in range(k_ranks):
            delta = (dos[r] * outs[r]).sum(-1)
            for step in range(k_ranks):
                o = (r - step) % k_ranks
                backward_block(
                    dos[r],
                    qs[r],
                    ks[o],
                    vs[o],
                    outs[r],
                    lses[r],
                    delta,
                    shards[r],
                    shards[o].pos,
                    chunks_of(o, k_ranks),
                    window,
                    scale,
                    dqs[r],
                    dks[o],
                    dvs[o],
                )
        return unsplit(dqs, 2), unsplit(dks, 2), unsplit(dvs, 2), None, None, None, None, None


def simulate(q, k, v, k_ranks: int, doc_start=None, window=None, scale=None, backend: str = "eager"):
    """Whole sequences (q [B, H, T, D], k, v [B, H_kv, T, D]) through the ring's code as k ranks would run it,
    in one process: (out [B, H, T, D], lse [B, H, T]) in sequence order; differentiable in q, k, v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _Simulated.apply(q, k, v, doc_start, k_ranks, window, scale, block_fn(backend))


# ---- the model under context parallelism ------------------------------------------------------------------
class ContextParallel:
    """Installs the ring into a GPT (its attention modules' `attend` and its `forward`, instance attributes):
    between enter(batch) and exit() each forward runs this rank's share of the batch's sequences at their
    global positions through the ring; otherwise the model runs as it is (validation: whole sequences)."""

    def __init__(self, model, group) -> None:
        cfg = model.cfg
        check_context_parallel_model(cfg, dist.get_world_size(group))
        self.ring = Ring(group)
        self.k = self.ring.size
        self.block = block_fn(cfg.attention)
        self.position_reset = bool(cfg.position_reset)
        self.T = 0
        self.shard_now: Optional[Shard] = None
        self.positions: Optional[torch.Tensor] = None
        self.active = False
        for block in model.blocks:
            block.attn.attend = self._attend(block.attn.attend)
        plain_forward = model.forward

        def forward(idx, targets=None, **kw):
            if self.active:
                kw["positions"] = self.positions
            return plain_forward(idx, targets, **kw)

        model.forward = forward

    def _attend(self, plain):
        def attend(q, k, v, **kw):
            if not self.active:
                return plain(q, k, v, **kw)
            if kw.get("mask") is not None or kw.get("return_probs") or kw.get("softcap") is not None:
                raise ValueError("context parallelism: no mask, probabilities or soft-capping")
            if kw.get("sinks") is not None or kw.get("dropout_p"):
                raise ValueError("context parallelism: no sinks or dropout")
            out = ring_attention(
                q, k, v, self.shard_now, self.ring, self.T, kw.get("window"), kw.get("scale"), self.block
            )
            return out, None

        return attend

    def shard(self, idx: torch.Tensor, targets=None, doc_ids=None) -> dict[str, Any]:
        """This rank's share of a batch of whole rows: idx, targets, the positions the model takes."""
        from gptkit.model.documents import document_bounds

        self.T = idx.shape[1]
        start = None if doc_ids is None else document_bounds(doc_ids)[0]
        self.shard_now = shard_of(self.T, self.k, self.ring.rank, start, idx.device)
        pos = self.shard_now.pos
        return {
            "idx": idx.index_select(1, pos),
            "targets": None if targets is None else targets.index_select(1, pos),
            "positions": rotary_positions(self.shard_now, self.position_reset),
        }

    def enter(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch (x, y[, doc_ids]) of whole rows -> this rank's (x, y); the model's forwards run
        the ring until exit()."""
        x, y, *docs = batch
        share = self.shard(x, y, docs[0] if docs else None)
        self.positions, self.active = share["positions"], True
        return share["idx"], share["targets"]

    def exit(self) -> None:
        self.active = False

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's share of a per-token tensor ([B, T/k, ...]) back in sequence order (no gradient)."""
        parts = [torch.empty_like(x) for _ in range(self.k)]
        dist.all_gather(parts, x.contiguous(), group=self.ring.group)
        return unsplit(parts, dim)
