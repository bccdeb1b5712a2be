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

The model reads the pool through two views, each a cache as GPT.forward takes one (positions, update,
mask_for(layer), advance):

    PackedView    several sequences' next tokens packed in one row [1, N] (prefill chunks): each token at its
                  own position, attending to its own sequence's cached keys and to its chunk's keys up to its
                  own position, under a [1, 1, N, K] bool mask (documents.py's rule, start <= j <= i, with
                  a sequence's cached prefix as the start of its document; and a local layer's window)
    DecodeView    one token for each of n sequences [n, 1], each row reading its own blocks [n, span]
                  (gathered, padded, the padding masked)

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

    __slots__ = ("table", "computed", "keys")

    def __init__(self) -> None:
        self.table: list[Optional[int]] = []
        # tokens cached (= the position of the next token fed)
        self.computed = 0
        # the prefix-cache key of each full block registered so far
        self.keys: list[tuple] = []

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
    """Chunks of several sequences, packed in one row [1, N]: entries (pages, ids of the chunk)."""

    def __init__(self, pool: BlockPool, chunks: list[tuple[Pages, int]]) -> None:
        self.pool, self.chunks = pool, chunks
        q_pos, q_seq, write, read, k_pos, k_seq = [], [], [], [], [], []
        for i, (pages, T) in enumerate(chunks):
            start, first = pages.computed, pages.first * pool.block_size
            q_pos.append(torch.arange(start, start + T))
            q_seq.append(torch.full((T,), i))
            write.append(pool.rows(pages, start, start + T))
            read.append(pool.rows(pages, first, start + T))
            k_pos.append(torch.arange(first, start + T))
            k_seq.append(torch.full((start + T - first,), i))
        dev = pool.device
        qp, kp = torch.cat(q_pos).to(dev), torch.cat(k_pos).to(dev)
        self._positions = qp[None]  # [1, N]
        self.write, self.read = torch.cat(write).to(dev), torch.cat(read).to(dev)
        # [N, K]: a token sees its own sequence's keys up to its own position
        same = torch.cat(k_seq).to(dev)[None] == torch.cat(q_seq).to(dev)[:, None]
        base = same & (kp[None] <= qp[:, None])
        self.masks = {
            w: m[None, None] for w, m in _window_masks(base, qp[:, None], kp[None], pool.windows).items()
        }

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def mask_for(self, layer: int) -> torch.Tensor:
        """[1, 1, N, K] bool."""
        return self.masks[self.pool.windows[layer]]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [1, heads, N, width] into the tokens' rows; return every key and value the chunk's
        tokens may read, [1, heads, K, width] (read under mask_for)."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]
        pk.index_copy_(1, self.write, k[0].to(pk.dtype))
        pv.index_copy_(1, self.write, v[0].to(pv.dtype))
        return pk.index_select(1, self.read)[None], pv.index_select(1, self.read)[None]

    def advance(self, n: int) -> None:
        for pages, T in self.chunks:
            pages.computed += T


class DecodeView:
    """One new token for each of n sequences [n, 1], each at its own position."""

    def __init__(self, pool: BlockPool, seqs: list[Pages]) -> None:
        self.pool, self.seqs = pool, seqs
        bs = pool.block_size
        pos = [p.computed for p in seqs]
        firsts = [p.first * bs for p in seqs]
        span = max(e + 1 - f for e, f in zip(pos, firsts))
        idx = torch.zeros(len(seqs), span, dtype=torch.long)
        kp = torch.full((len(seqs), span), -1, dtype=torch.long)  # -1: padding
        for i, (pages, e, f) in enumerate(zip(seqs, pos, firsts)):
            idx[i, : e + 1 - f] = pool.rows(pages, f, e + 1)
            kp[i, : e + 1 - f] = torch.arange(f, e + 1)
        dev = pool.device
        self.write = idx[torch.arange(len(seqs)), torch.tensor(pos) - torch.tensor(firsts)].to(dev)  # [n]
        self.read = idx.to(dev)  # [n, span]
        self._positions = torch.tensor(pos, dtype=torch.long, device=dev)[:, None]  # [n, 1]
        kp = kp.to(dev)
        base = (kp >= 0) & (kp <= self._positions)  # [n, span]
        self.masks = {
            w: m[:, None, None] for w, m in _window_masks(base, self._positions, kp, pool.windows).items()
        }

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def mask_for(self, layer: int) -> torch.Tensor:
        """[n, 1, 1, span] bool."""
        return self.masks[self.pool.windows[layer]]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [n, heads, 1, width]; return each row's keys and values [n, heads, span, width]."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]
        pk.index_copy_(1, self.write, k[:, :, 0].transpose(0, 1).to(pk.dtype))
        pv.index_copy_(1, self.write, v[:, :, 0].transpose(0, 1).to(pv.dtype))
        n, span = self.read.shape
        flat = self.read.flatten()  # index_select: a fraction of advanced indexing's time on the CPU
        keys = pk.index_select(1, flat).unflatten(1, (n, span)).transpose(0, 1)  # [n, heads, span, width]
        return keys, pv.index_select(1, flat).unflatten(1, (n, span)).transpose(0, 1)

    def advance(self, n: int) -> None:
        for pages in self.seqs:
            pages.computed += n
