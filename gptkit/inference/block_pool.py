"""Paged KV memory for continuous batching: one pool of fixed-size blocks, a sequence holding only the blocks
its tokens fill, blocks of identical prefixes shared (the prefix cache).

    pool, per layer   k [k heads, blocks * block_size, k width], v [v heads, blocks * block_size, v width]
                      (the layer's cache layout, gptkit/model/attention_kinds.py: multi-head attention's
                      n_kv_heads x head_dim, multi-head latent attention's latent key and a value of width 0);
                      position p of a sequence: row table[p // size] * size + p % size (size: block_size)
    Pages             one sequence's block table and how many of its tokens are cached (`computed`)

A block is free (on the free list), held (a reference count per sequence holding it), or cached: a full
block nobody holds whose tokens are known (the prefix cache keeps it, least recently released first out,
until a new block is needed). A full block is keyed by its tokens and the key of the block before it, so two
sequences that start with the same block_size * k tokens read the same k blocks: a new request's prompt
skips the prefill of every full block already cached (a chat's earlier turns, a system prompt shared by
users), and the n choices of one prompt share its blocks (the last, partial one copied). A sequence always
computes at least its last token (its logits choose the next one).

Sliding windows: when every K/V layer is local (model.sliding_window W), a sequence releases the blocks that
lie wholly behind its window; a model with a global layer keeps them (that layer reads them).

The model reads the pool through three views, each a cache as GPT.forward takes one (positions, update,
mask_for(layer), advance):

    PackedView    several sequences' next tokens packed in one row [1, N] (prefill chunks): each token at its
                  own position; each chunk's queries attend to its own sequence's cached keys and its own
                  keys only, one attention call per chunk (mask_for gives gptkit.model.attention.Segments:
                  causal, bottom-right, the layer's window, as a lone prefill over its cache), so a step
                  costs the sum over chunks of queries x keys, not N x K scores masked across prompts; the
                  keys are read a whole block at a time
    DecodeView    one token for each of n sequences [n, 1], each at its own position, reading DecodeRows: a
                  contiguous copy of every decoding sequence's keys (copied from its blocks once, when it
                  starts decoding; each new key written there and in its block), so a step reads a slice as
                  the slot cache does instead of gathering n x span rows of the pool in every layer; when
                  every row sits at one column (one sequence decoding, or rows of one length) no mask and,
                  at one position, an int position: generate()'s contiguous cache's forward
    MixedView     a DecodeView's n tokens then a PackedView's chunks in one row [1, n + N] (one forward a
                  step: the linear layers once over both); mask_for gives gptkit.model.attention.Mixed, the
                  decode rows' keys of the layer and the decode mask beside the chunks' Segments, so each
                  part attends as in its own view

Linear attention's recurrent state (model.gdn) cannot be paged: a model with such a layer keeps one slot per
sequence (gptkit/inference/slot_cache.py), and so do speculative decoding and a longrope scaling.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

import torch

from gptkit.errors import ConfigError
from gptkit.model.attention import Mixed, Segments
from gptkit.model.attention_kinds import cache_layouts


@dataclass(frozen=True)
class Paging:
    """How the paged engine runs (serve's keys of the same names)."""

    # tokens per block; must divide the context (None: 16, or the largest power of 2 that divides it)
    block_size: Optional[int] = None
    # blocks in the pool; None: max_batch full contexts (the slot cache's memory)
    kv_blocks: Optional[int] = None
    # tokens one step feeds the model: every running decode's one, then prompt chunks up to this (None: 256,
    # or max_batch when larger; .ci/serve_sched.py: less shortens the gaps between tokens, more the TTFT)
    max_step_tokens: Optional[int] = None
    # share the blocks of identical prefixes across requests
    prefix_cache: bool = True

    def size(self, context: int) -> int:
        """Tokens per block for this context."""
        return math.gcd(16, context) if self.block_size is None else self.block_size

    def budget(self, max_batch: int) -> int:
        """Tokens one step feeds the model."""
        return max(256, max_batch) if self.max_step_tokens is None else self.max_step_tokens

    def check(self, context: int, max_batch: int) -> int:
        """The pool's size in blocks; a one-line ConfigError for a value that cannot run."""
        for key in ("block_size", "kv_blocks", "max_step_tokens"):
            v = getattr(self, key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{key}={v!r} must be an integer >= 1")
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"prefix_cache={self.prefix_cache!r} must be true or false")
        bs = self.size(context)
        if context % bs:
            raise ConfigError(f"block_size={bs} must divide the context of {context} tokens")
        if self.budget(max_batch) < max_batch:
            raise ConfigError(
                f"max_step_tokens={self.max_step_tokens} must be at least max_batch={max_batch} (a step "
                "feeds every running sequence's token)"
            )
        per_seq = context // bs
        blocks = per_seq * max_batch if self.kv_blocks is None else self.kv_blocks
        if blocks < per_seq:
            raise ConfigError(
                f"kv_blocks={blocks} cannot hold one sequence of the context ({context} tokens = {per_seq} "
                f"blocks of {bs})"
            )
        return blocks


def pageable(model) -> Optional[str]:
    """None when the model's cache can be paged; else why not (one line)."""
    if any(lay.state is not None for lay in cache_layouts(model.cfg)):
        return "a linear-attention layer keeps a recurrent state per sequence"
    rope = getattr(model, "rope", None)
    if rope is not None and getattr(rope, "switch_at", None) is not None:
        return "a longrope scaling refills a sequence's cache past its original context"
    return None


class Pages:
    """One sequence's blocks: table[i] holds its positions i * block_size.. (None: released, behind a
    window)."""

    __slots__ = ("table", "computed", "keys", "epoch")

    def __init__(self) -> None:
        self.table: list[Optional[int]] = []
        # tokens cached (= the position of the next token fed)
        self.computed = 0
        # the prefix-cache key of each full block registered so far
        self.keys: list[tuple] = []
        # released (its cache dropped) this many times: a decode row of an older epoch is stale
        self.epoch = 0

    @property
    def first(self) -> int:
        """The first position still held."""
        i = 0
        while i < len(self.table) and self.table[i] is None:
            i += 1
        return i


class BlockPool:
    def __init__(
        self, cfg, blocks: int, block_size: int, device, dtype: torch.dtype, prefix_cache: bool = True
    ) -> None:
        layouts = cache_layouts(cfg)
        self.blocks, self.block_size, self.device = blocks, block_size, device
        rows = blocks * block_size

        def zeros(shape):
            return torch.zeros((shape[0], rows, shape[1]), device=device, dtype=dtype)

        self.k = [zeros(lay.k) for lay in layouts]
        self.v = [zeros(lay.v) for lay in layouts]
        self.dtype = dtype
        self.windows = [lay.window for lay in layouts]
        # every K/V layer local: blocks behind the smallest window can go
        self.release_window = min(self.windows) if all(w is not None for w in self.windows) else None
        self.prefix_cache = prefix_cache
        self.refs = [0] * blocks
        self.free: deque[int] = deque(range(blocks))
        # key -> block, and block -> key, for full blocks whose tokens are known
        self.cached: dict[tuple, int] = {}
        self.key_of: list[Optional[tuple]] = [None] * blocks
        # cached blocks nobody holds, least recently released first
        self.idle: OrderedDict[int, None] = OrderedDict()
        # prompt tokens looked up, and found cached (their prefill skipped)
        self.lookups = 0
        self.hits = 0

    # ---- blocks ---------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks a sequence could take now (free, or cached and held by nobody)."""
        return len(self.free) + len(self.idle)

    def take(self) -> Optional[int]:
        """A block for new tokens (the free list first, then the least recently used cached one); None when
        every block is held."""
        if self.free:
            b = self.free.popleft()
        elif self.idle:
            b, _ = self.idle.popitem(last=False)
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
        else:
            return None
        self.refs[b] = 1
        return b

    def hold(self, b: int) -> None:
        if self.refs[b] == 0:
            self.idle.pop(b, None)
        self.refs[b] += 1

    def drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if self.key_of[b] is not None:
                self.idle[b] = None
            else:
                self.free.append(b)

    def release(self, pages: Pages) -> None:
        """Every block of a sequence back (cached ones stay cached)."""
        for b in pages.table:
            if b is not None:
                self.drop(b)
        pages.table, pages.computed, pages.keys = [], 0, []
        pages.epoch += 1

    def blocks_for(self, pages: Pages, end: int) -> int:
        """Blocks a sequence needs beyond its own to hold positions up to end - 1."""
        return max(0, -(-end // self.block_size) - len(pages.table))

    def grow(self, pages: Pages, end: int) -> bool:
        """Blocks for positions up to end - 1; False (and nothing taken) when the pool has too few."""
        need = self.blocks_for(pages, end)
        if need > self.available:
            return False
        pages.table.extend(self.take() for _ in range(need))
        return True

    def fork(self, pages: Pages) -> Optional[Pages]:
        """A copy of a sequence for another choice of its prompt: its full blocks shared, its partial last
        block copied; None when no block is free for that copy."""
        out = Pages()
        full = pages.computed // self.block_size
        partial = pages.computed % self.block_size
        if partial and not self.available:
            return None
        for b in pages.table[:full]:
            if b is not None:
                self.hold(b)
        out.table = list(pages.table[:full])
        if partial:
            b = self.take()
            src, dst = pages.table[full] * self.block_size, b * self.block_size
            for t in self.k + self.v:
                t[:, dst : dst + partial] = t[:, src : src + partial]
            out.table.append(b)
        out.computed, out.keys = pages.computed, list(pages.keys)
        return out

    # ---- the prefix cache -----------------------------------------------------------------------------
    def _key(self, parent: Optional[tuple], tokens: list[int]) -> tuple:
        return (hash(parent) if parent is not None else 0, tuple(tokens))

    def reuse(self, pages: Pages, ids: list[int]) -> int:
        """A new (or restarted) sequence of tokens `ids` takes the cached blocks of its longest cached
        prefix of full blocks (its last token always left to compute); returns the tokens skipped."""
        bs = self.block_size
        if not self.prefix_cache:
            return 0
        self.lookups += len(ids)
        parent = None
        for i in range((len(ids) - 1) // bs):
            key = self._key(parent, ids[i * bs : (i + 1) * bs])
            b = self.cached.get(key)
            if b is None:
                break
            self.hold(b)
            pages.table.append(b)
            pages.keys.append(key)
            parent = key
        pages.computed = len(pages.table) * bs
        self.hits += pages.computed
        return pages.computed

    def cached_blocks(self, ids: list[int]) -> int:
        """How many leading full blocks of `ids` are cached (its last token left out); nothing taken."""
        if not self.prefix_cache:
            return 0
        parent, n, bs = None, 0, self.block_size
        for i in range((len(ids) - 1) // bs):
            parent = self._key(parent, ids[i * bs : (i + 1) * bs])
            if parent not in self.cached:
                break
            n += 1
        return n

    def register(self, pages: Pages, ids: list[int]) -> None:
        """Key the sequence's newly full blocks (ids: its tokens, at least `computed` of them)."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        while len(pages.keys) < pages.computed // bs:
            i = len(pages.keys)
            key = self._key(pages.keys[-1] if pages.keys else None, ids[i * bs : (i + 1) * bs])
            pages.keys.append(key)
            b = pages.table[i]
            if b is not None and key not in self.cached and self.key_of[b] is None:
                self.cached[key] = b
                self.key_of[b] = key

    def behind_window(self, pages: Pages) -> None:
        """Release the blocks wholly behind the window of the sequence's next token (all layers local)."""
        W = self.release_window
        if W is None:
            return
        # the next token (position `computed`) sees positions > computed - W
        for i in range(min((pages.computed - W + 1) // self.block_size, len(pages.table))):
            if pages.table[i] is not None:
                self.drop(pages.table[i])
                pages.table[i] = None

    def stats(self) -> dict:
        return {
            "paged": True,
            "block_size": self.block_size,
            "blocks": self.blocks,
            "free": self.available,
            "prefix_cache": self.prefix_cache,
            "prefix_lookup_tokens": self.lookups,
            "prefix_hit_tokens": self.hits,
            "prefix_hit_rate": round(self.hits / self.lookups, 4) if self.lookups else 0.0,
        }

    # ---- rows of the pool ------------------------------------------------------------------------------
    def write_read(self, layer: int, write, k, v, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [heads, N, width] into the pool rows `write` [N] of `layer`; return the blocks `blocks`
        [b] of it, whole and in that order, [1, heads, b * block_size, width]."""
        out = []
        for t, x in ((self.k[layer], k), (self.v[layer], v)):
            t.index_copy_(1, write, x.to(t.dtype))
            heads, width = t.shape[0], t.shape[2]
            # a block's rows of one head are contiguous: one copy a block, not one a row
            got = t.view(heads, self.blocks, self.block_size * width).index_select(1, blocks)
            out.append(got.view(1, heads, len(blocks) * self.block_size, width))
        return out[0], out[1]

    def rows(self, pages: Pages, start: int, end: int) -> torch.Tensor:
        """[end - start] long: the pool rows of positions start..end-1 of a sequence."""
        pos = torch.arange(start, end)
        table = torch.tensor([-1 if b is None else b for b in pages.table], dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


def _window_masks(base, q_pos, k_pos, windows) -> dict:
    """window -> base & (key position > query position - W)."""
    out: dict = {None: base}
    for w in set(windows) - {None}:
        out[w] = base & (k_pos > q_pos - w)
    return out


class PackedView:
    """Chunks of several sequences, packed in one row [1, N]: entries (pages, tokens of the chunk)."""

    def __init__(self, pool: BlockPool, chunks: list[tuple[Pages, int]]) -> None:
        self.pool, self.chunks = pool, chunks
        bs = pool.block_size
        q_pos, write, blocks, bounds = [], [], [], []
        q_at = k_at = 0
        for pages, T in chunks:
            start = pages.computed
            lo, hi = pages.first, -(-(start + T) // bs)
            q_pos.append(torch.arange(start, start + T))
            write.append(pool.rows(pages, start, start + T))
            blocks.extend(pages.table[lo:hi])
            # its queries, and its keys: the whole blocks read, cut after its last query's own key
            bounds.append((q_at, q_at + T, k_at, k_at + start + T - lo * bs))
            q_at, k_at = q_at + T, k_at + (hi - lo) * bs
        dev = pool.device
        self._positions = torch.cat(q_pos).to(dev)[None]  # [1, N]
        self.write = torch.cat(write).to(dev)  # [N]
        self.blocks = torch.tensor(blocks, dtype=torch.long, device=dev)  # [blocks read]
        self.segments = Segments(tuple(bounds))

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def mask_for(self, layer: int) -> Segments:
        """Each chunk's queries against its own sequence's keys only (attention.per_segment: one call each,
        causal and the layer's window as a lone prefill's)."""
        return self.segments

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, heads, N, width] into the tokens' rows; return the blocks every chunk reads, each
        chunk's in a run, [1, heads, K, width] (cut per chunk by the Segments)."""
        return self.pool.write_read(layer, self.write, k[0], v[0], self.blocks)

    def advance(self, n: int) -> None:
        for pages, T in self.chunks:
            pages.computed += T


class DecodeRows:
    """The keys and values of the decoding sequences, each contiguous in a row of its own (what a decode
    step's attention reads, without gathering blocks every step):

        k, v per layer    [rows, k heads, cap, k width], [rows, v heads, cap, v width]; row i holds
                          seqs[i]'s positions base[i].. (its first held block's at the time it came)

    A sequence comes when it starts decoding (its blocks copied in once), gets its new token's key written
    both here and in its block, and goes when it leaves the decode set (the last row moved into its hole):
    rows 0..n-1 are the n sequences of a step, whose attention reads a slice. cap grows (doubling, up to the
    context) with the longest row; the pool stays the memory of record (the prefix cache, preemption and the
    n choices read it). Memory: rows x cap per layer, at most the slot cache's."""

    def __init__(self, pool: BlockPool, rows: int, context: int) -> None:
        self.pool, self.n_rows, self.context = pool, rows, context
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.cap = 0
        # row i: (the sequence's Pages, its epoch when it came), its base position, positions copied
        self.seqs: list[tuple[Pages, int]] = []
        self.base: list[int] = []
        self.filled: list[int] = []

    def place(self, seqs: list[Pages]) -> list[int]:
        """Rows 0..n-1 made to hold exactly these n sequences (every key they cached copied in); returns the
        order of seqs by row."""
        want = {id(p): p.epoch for p in seqs}
        i = 0
        while i < len(self.seqs):
            p, epoch = self.seqs[i]
            if want.get(id(p)) == epoch:
                i += 1
            else:
                self._drop(i)
        have = {id(p) for p, _ in self.seqs}
        for p in seqs:
            if id(p) not in have:
                self.seqs.append((p, p.epoch))
                self.base.append(p.first * self.pool.block_size)
                self.filled.append(0)
        self._grow(max(p.computed + 1 - b for (p, _), b in zip(self.seqs, self.base)))
        for i, (p, _) in enumerate(self.seqs):
            if self.filled[i] < p.computed - self.base[i]:
                self._fill(i, p)
        row = {id(p): i for i, (p, _) in enumerate(self.seqs)}
        return sorted(range(len(seqs)), key=lambda j: row[id(seqs[j])])

    def _drop(self, i: int) -> None:
        last = len(self.seqs) - 1
        if i != last:
            n = self.filled[last]
            for t in self.k + self.v:
                t[i, :, :n] = t[last, :, :n]
            self.seqs[i], self.base[i], self.filled[i] = self.seqs[last], self.base[last], n
        self.seqs.pop()
        self.base.pop()
        self.filled.pop()

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        bs = self.pool.block_size
        cap = min(max(need, 2 * self.cap, 4 * bs), self.context)
        cap = -(-cap // bs) * bs
        pool, old = self.pool, self.cap

        def grown(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(
                (self.n_rows, like.shape[0], cap, like.shape[2]), device=like.device, dtype=like.dtype
            )
            if old:
                out[:, :, :old] = t
            return out

        self.k = [grown(t, p) for t, p in zip(self.k or pool.k, pool.k)]
        self.v = [grown(t, p) for t, p in zip(self.v or pool.v, pool.v)]
        self.cap = cap

    def _fill(self, i: int, p: Pages) -> None:
        """Copy positions filled..computed-1 of row i's sequence from its blocks."""
        a, b = self.base[i] + self.filled[i], p.computed
        rows = self.pool.rows(p, a, b).to(self.pool.device)
        for layer in range(len(self.k)):
            self.k[layer][i, :, a - self.base[i] : b - self.base[i]] = self.pool.k[layer].index_select(
                1, rows
            )
            self.v[layer][i, :, a - self.base[i] : b - self.base[i]] = self.pool.v[layer].index_select(
                1, rows
            )
        self.filled[i] = b - self.base[i]


class DecodeView:
    """One new token for each of n sequences [n, 1], each at its own position: feed them in the order
    `order` (DecodeRows.place), row i of the batch being row i of the decode rows."""

    def __init__(self, pool: BlockPool, seqs: list[Pages], rows: DecodeRows) -> None:
        self.pool, self.rows = pool, rows
        self.order = rows.place(seqs)
        self.seqs = [seqs[j] for j in self.order]
        bs, n = pool.block_size, len(seqs)
        pos = [p.computed for p in self.seqs]
        cols = [e - b for e, b in zip(pos, rows.base)]
        self.span = max(cols) + 1
        dev = pool.device
        self.write = torch.tensor(
            [p.table[e // bs] * bs + e % bs for p, e in zip(self.seqs, pos)], dtype=torch.long, device=dev
        )  # [n]: the pool rows of the new tokens
        self.n = n
        # every row at the same column (one sequence, or rows of one length): each new token sees every key
        # of the span (its window: the span's last W, as a lone sequence's), so no mask, and a write to one
        # column of the decode rows; at one position too: an int position, as generate()'s cache gives
        self.col = cols[0] if all(c == cols[0] for c in cols) else None
        self._positions: int | torch.Tensor
        if self.col is not None:
            self.masks = {w: None for w in pool.windows}
            one = all(e == pos[0] for e in pos)
            self._positions = pos[0] if one else torch.tensor(pos, dtype=torch.long, device=dev)[:, None]
            return
        self.cols = torch.tensor(cols, dtype=torch.long, device=dev)  # [n]: their columns in the decode rows
        self.index = torch.arange(n, device=dev)
        self._positions = torch.tensor(pos, dtype=torch.long, device=dev)[:, None]  # [n, 1]
        j = torch.arange(self.span, device=dev)[None]  # [1, span]
        base = j <= self.cols[:, None]  # [n, span]
        kp = j + torch.tensor(rows.base, dtype=torch.long, device=dev)[:, None]  # [n, span] key positions
        self.masks = {
            w: m[:, None, None] for w, m in _window_masks(base, self._positions, kp, pool.windows).items()
        }

    @property
    def positions(self) -> int | torch.Tensor:
        """[n, 1] long, or an int when every token is at that position."""
        return self._positions

    def mask_for(self, layer: int) -> Optional[torch.Tensor]:
        """[n, 1, 1, span] bool; None when every row is at the same column (causal, the layer's window)."""
        return self.masks[self.pool.windows[layer]]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, heads, 1, width] in the pool and in the decode rows; return rows 0..n-1's keys and
        values [n, heads, span, width] (read under mask_for)."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]
        pk.index_copy_(1, self.write, k[:, :, 0].transpose(0, 1).to(pk.dtype))
        pv.index_copy_(1, self.write, v[:, :, 0].transpose(0, 1).to(pv.dtype))
        return self.to_rows(layer, k, v)

    def to_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, heads, 1, width] in the decode rows only; return rows 0..n-1's keys and values."""
        rk, rv = self.rows.k[layer], self.rows.v[layer]
        if self.col is not None:
            rk[: self.n, :, self.col] = k[:, :, 0]
            rv[: self.n, :, self.col] = v[:, :, 0]
        else:
            rk[self.index, :, self.cols] = k[:, :, 0].to(rk.dtype)
            rv[self.index, :, self.cols] = v[:, :, 0].to(rv.dtype)
        return rk[: self.n, :, : self.span], rv[: self.n, :, : self.span]

    def advance(self, n: int) -> None:
        for i, pages in enumerate(self.seqs):
            pages.computed += n
            self.rows.filled[i] = pages.computed - self.rows.base[i]


class MixedView:
    """A step's decodes and prefill chunks in one row [1, n + N] (scheduler.py's mixed step): the n decode
    tokens first, in the order of their decode rows (the DecodeView's), then the chunks (the PackedView's).
    Every linear layer runs once over the n + N rows; attention splits (gptkit.model.attention.Mixed): the
    decode tokens' queries read the decode rows as a DecodeView's step does (its mask, one query each), each
    chunk's its sequence's blocks as a PackedView's."""

    def __init__(self, decode: DecodeView, packed: PackedView) -> None:
        self.decode, self.packed, self.pool = decode, packed, decode.pool
        dev = self.pool.device
        pos = torch.tensor([p.computed for p in decode.seqs], dtype=torch.long, device=dev)  # [n]
        self._positions = torch.cat([pos, packed.positions[0]])[None]  # [1, n + N]
        # the pool rows of all n + N new tokens: one write a layer
        self.write = torch.cat([decode.write, packed.write])  # [n + N]
        self._rows: tuple = ()

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, heads, n + N, width] into the pool (and the decode tokens' into their decode rows);
        return the chunks' blocks as PackedView.update does. The decode rows' keys and values [n, heads,
        span, width] go to attention in mask_for's Mixed."""
        n = self.decode.n
        kd = k[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, width]
        vd = v[0, :, :n].transpose(0, 1).unsqueeze(2)
        self._rows = (layer, *self.decode.to_rows(layer, kd, vd))
        return self.pool.write_read(layer, self.write, k[0], v[0], self.packed.blocks)

    def mask_for(self, layer: int) -> Mixed:
        """The decode part (the decode rows of this layer, written by update, and the DecodeView's mask) and
        the chunks' Segments."""
        at, k, v = self._rows
        if at != layer:
            raise RuntimeError(f"MixedView.mask_for({layer}) before update({layer})")
        return Mixed(self.decode.n, k, v, self.decode.mask_for(layer), self.packed.segments)

    def advance(self, n: int) -> None:
        self.decode.advance(1)
        self.packed.advance(n)
