"""Group sampling for reinforcement learning (objective=grpo): n completions of each prompt, decoded through
the KV cache, each drawn with noise of its own.

    sample_groups(model, prompts, keys, opts, budgets)   -> per prompt, its n Completions
    sample_groups_batched(... , max_rows)                -> the same, every group in one continuous batch
    sample_rows(model, prompts, keys, opts, budget)      -> one Completion per prompt, prompts of one length
                                                            in one batch (objective=gkd: corpus prefixes)

One prompt's n completions are one batch [n, T0 + new] (the prompt repeated, as generate.py does): no
padding, no position offsets, every row computes what a lone generation of that prompt computes. The noise
of row r at its i-th new token is a pure function of (keys[r], i) (counter-based, as JAX's PRNG: a 32-bit
integer hash of the key, the token index and the vocabulary id, `key_noise`), so a completion does not depend
on which other prompts are sampled, in which order or on which rank, nor on where a run was resumed: a key
(`sample_key(seed, step, prompt, sample)`) names its draws.

lockstep (FSDP2): every rank must run the same forward passes (each gathers the sharded weights).
`lockstep(active)` says whether any rank still decodes; a rank whose rows are done joins each remaining step
with a one-token forward whose output it drops.
"""

from __future__ import annotations

import functools
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.errors import ConfigError
from gptkit.inference.sampling import sample_next
from gptkit.inference.slot_cache import SlotCache
from gptkit.model.kv_cache import KVCache

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RolloutOptions:
    """How completions are drawn: at most max_new_tokens each (and no more than a row's room), temperature
    (0: greedy), top-k (None or 0: off), top-p (1: off), and the ids that end one (kept as its last token)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be a positive integer")
        if not float(self.temperature) >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ConfigError(f"top_k={self.top_k} must be a non-negative integer (0 or null: off)")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1: off)")


@dataclass
class Completion:
    # the new ids, the stop id included when one ended the completion
    tokens: list[int]
    # stop (a stop id) | length (max_new_tokens) | context (the prompt's row was full)
    stop_reason: str
    # each new token's fp32 log-prob under the raw model's logits / temperature (no top-k, top-p: the policy
    # GRPO's loss scores, token_logps), as the sampler saw them
    logprobs: list[float] = field(default_factory=list)


def sample_key(*parts: int) -> int:
    """A 64-bit key from integers (seed, step, prompt, sample, ...): the first 8 bytes of their BLAKE2b."""
    text = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32) and c < 2^32, without an int64 overflow (c split in halves)."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons) of int64 x in [0, 2^32), elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64: each vocabulary id hashed (the same for every row and token: made once)."""
    return _mix32(torch.arange(vocab_size, device=device) ^ 0x9E3779B9)


def key_tensor(keys: list[int], device) -> torch.Tensor:
    """[n, 2] int64: the high and low 32 bits of each 64-bit key."""
    return torch.tensor([[(k >> 32) & _M32, k & _M32] for k in keys], dtype=torch.long, device=device)


def key_noise(keys: torch.Tensor, index: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [n, vocab_size] (fp32) for the index-th new token of the rows whose keys (key_tensor) are
    `keys` [n, 2]: a pure function of (key, index, vocabulary id), 24 bits of a uniform per draw. index: one
    for every row, or [n] int64, each row's own (the engine's rows are at different tokens)."""
    hi, lo = keys[:, 0], keys[:, 1]  # [n] each
    if isinstance(index, torch.Tensor):
        index = index.to(hi.device, torch.long) & _M32  # [n]
    else:
        index = torch.full_like(hi, index & _M32)  # [n]
    step = _mix32(index ^ 0x85EBCA6B)  # [n]
    row = _mix32(_mix32(hi ^ step) ^ lo)  # [n]
    vocab = _vocab_hash(vocab_size, keys.device)  # [V]
    bits = _mix32(row[:, None] ^ vocab[None, :])  # [n, V] in [0, 2^32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # [n, V] in (0, 1)
    return -torch.log(uniform)


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n] fp32 log-probs of ids [n] under logits [n, V] divided by temperature (none at 0 or 1): the
    operations of the trainer's (gptkit_kernels.linear_ce: the picked logit minus the log-sum-exp), so that
    under gptkit.model.batch_invariant both are the same bits."""
    z = logits.float()
    if temperature not in (0.0, 1.0):
        z = z / temperature
    return z.gather(1, ids[:, None])[:, 0] - torch.logsumexp(z, dim=-1)


@torch.no_grad()
def sample_groups(
    model,
    prompts: list[list[int]],
    keys: list[list[int]],
    opts: RolloutOptions,
    budgets: list[int],
    lockstep: Optional[Callable[[bool], bool]] = None,
) -> list[list[Completion]]:
    """For each prompt (token ids), len(keys[p]) completions, row r drawn with key keys[p][r] and at most
    budgets[p] new tokens (the room its row leaves, at most opts.max_new_tokens). The model runs in eval mode
    (no dropout) and without autograd; its mode is restored afterwards."""
    opts.validate()
    was = model.training
    model.eval()
    try:
        return [_sample_group(model, p, k, opts, b, lockstep) for p, k, b in zip(prompts, keys, budgets)]
    finally:
        model.train(was)


def sample_rows(
    model,
    prompts: list[list[int]],
    keys: list[int],
    opts: RolloutOptions,
    budget: int,
    lockstep: Optional[Callable[[bool], bool]] = None,
) -> list[Completion]:
    """One completion of each prompt (all of one length: no padding, so each row computes what a lone
    generation of it computes), row r drawn with key keys[r], at most budget new tokens; one batch through one
    KV cache. Eval mode and no autograd, as sample_groups."""
    opts.validate()
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("sample_rows takes prompts of one length")
    was = model.training
    model.eval()
    try:
        return _sample_batch(model, prompts, keys, opts, budget, lockstep)
    finally:
        model.train(was)


class _Cache(KVCache):
    """A KVCache whose tensors are allocated at the first keys written to them, in their dtype and on their
    device: the compute dtype (autocast's, FSDP2's param_dtype, the weights'), which the caller need not
    know. Built on the meta device (no memory) until then."""

    def __init__(self, cfg, batch_size: int, max_len: int) -> None:
        super().__init__(cfg, batch_size, max_len, device="meta")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer].is_meta:
            # [B, k heads, slots, k width] and [B, v heads, slots, v width]: the layer's cache layout
            self.k[layer] = k.new_zeros(self.k[layer].shape)
            self.v[layer] = v.new_zeros(self.v[layer].shape)
        return super().update(layer, k, v)

    def state(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        if self.states[layer].is_meta:
            # [B, *state]: the compute dtype, or fp32 where the layout says so
            fp32 = self.layouts[layer].state_fp32
            self.states[layer] = like.new_zeros(
                self.states[layer].shape, dtype=torch.float32 if fp32 else None
            )
        return self.states[layer]


def _sample_group(model, prompt, keys, opts: RolloutOptions, budget: int, lockstep) -> list[Completion]:
    """One prompt's completions, one batch of len(keys) rows through one KV cache (module docstring)."""
    return _sample_batch(model, [prompt] * len(keys), keys, opts, budget, lockstep)


@torch.no_grad()
def _sample_batch(model, prompts, keys, opts: RolloutOptions, budget: int, lockstep) -> list[Completion]:
    """Row r: prompts[r] (all of one length) and its completion drawn with keys[r], one batch through one KV
    cache."""
    if budget < 1 or not prompts[0]:
        raise ValueError(f"a prompt of {len(prompts[0])} tokens with room for {budget} new tokens")
    device = model.tok_emb.weight.device
    n, t0 = len(keys), len(prompts[0])
    key_t = key_tensor(keys, device)  # [n, 2]
    stop = torch.tensor(list(opts.stop_ids) or [-1], dtype=torch.long, device=device)  # [n_stop]
    # per layer its cache layout's K and V for T0 + budget positions (or its state), allocated on first use
    cache = _Cache(model.cfg, n, t0 + budget)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [n, T0]
    logits = model(ids, cache=cache, logits_to_keep=1).logits[:, -1]  # [n, V]
    out = torch.zeros(n, budget, dtype=torch.long, device=device)  # [n, budget]
    logps = torch.zeros(n, budget, dtype=torch.float32, device=device)  # [n, budget]
    done = torch.zeros(n, dtype=torch.bool, device=device)  # [n]
    lengths = [budget] * n
    stopped = [False] * n
    i, active = 0, True
    while True:
        if active:
            noise = key_noise(key_t, i, logits.shape[-1]) if opts.temperature > 0 else None  # [n, V]
            nxt = sample_next(logits, opts.temperature, opts.top_k, opts.top_p, None, noise)  # [n]
            out[:, i] = nxt
            logps[:, i] = token_logps(logits, nxt, opts.temperature)
            hit = torch.isin(nxt, stop) & ~done  # [n]
            if bool(hit.any()):
                for r in hit.nonzero().flatten().tolist():
                    lengths[r], stopped[r] = i + 1, True
                done |= hit
            active = i + 1 < budget and not bool(done.all())
        if lockstep is not None:
            if not lockstep(active):
                break
            if not active:
                # every rank runs each forward of FSDP2's gathers: join with one token, output dropped
                model(torch.zeros(1, 1, dtype=torch.long, device=device), logits_to_keep=1)
                continue
        elif not active:
            break
        if model.rope_restart(t0 + i, t0 + i + 1):
            # past a longrope scaling's original context: every key again, with the long factors
            cache = _Cache(model.cfg, n, t0 + budget)
            every = torch.cat((ids, out[:, : i + 1]), dim=1)  # [n, T0 + i + 1]
            logits = model(every, cache=cache, logits_to_keep=1).logits[:, -1]  # [n, V]
        else:
            logits = model(out[:, i : i + 1], cache=cache, logits_to_keep=1).logits[:, -1]  # [n, V]
        i += 1
    rows, lps = out.tolist(), logps.tolist()
    full = "length" if budget == opts.max_new_tokens else "context"
    return [
        Completion(rows[r][: lengths[r]], "stop" if stopped[r] else full, lps[r][: lengths[r]])
        for r in range(n)
    ]


# ---- several prompts' groups in one batch ---------------------------------------------------------------


@torch.no_grad()
def sample_groups_batched(
    model,
    prompts: list[list[int]],
    keys: list[list[int]],
    opts: RolloutOptions,
    budgets: list[int],
    lockstep: Optional[Callable[[bool], bool]] = None,
    max_rows: Optional[int] = None,
) -> list[list[Completion]]:
    """sample_groups' completions (the same keys, budgets and stop reasons), decoded by continuous batching:
    every group's rows in one batch through a SlotCache (gptkit.inference.slot_cache: one slot per row, each
    at its own position), at most max_rows rows at once (None: every group's), a group joining when its rows
    fit (its prompt's prefill [1, T0] copied into its rows' slots) and each row leaving when it ends. Row r
    of group p draws its i-th token with key_noise(keys[p][r], i) whichever step and slot it is in, so a
    completion is the function of its key that sample_groups computes, up to the rounding of a batched
    decode (a decode step reads each row at its own length under a mask; a batch-invariant decode makes it
    exact).

    lockstep (FSDP2): every forward (a prefill, a decode step, a row's longrope restart) is one step of the
    loop, and each step first asks lockstep(this rank has work); a rank without work joins with a one-token
    forward whose output it drops, so every rank runs as many forwards."""
    opts.validate()
    for p, b in zip(prompts, budgets):
        if b < 1 or not p:
            raise ValueError(f"a prompt of {len(p)} tokens with room for {b} new tokens")
    most = max((len(k) for k in keys), default=1)
    rows = max(most, int(max_rows) if max_rows else sum(len(k) for k in keys))
    was = model.training
    model.eval()
    try:
        return _Engine(model, prompts, keys, opts, budgets, rows, lockstep).run()
    finally:
        model.train(was)


class _Row:
    """One completion in a slot of the engine."""

    __slots__ = ("group", "r", "key", "budget", "tokens", "logprobs", "restart")

    def __init__(self, group: int, r: int, key: int, budget: int) -> None:
        self.group, self.r, self.key, self.budget = group, r, key, budget
        # the tokens drawn so far (the last one not yet fed)
        self.tokens: list[int] = []
        # each drawn token's log-prob (token_logps: the trainer's operations)
        self.logprobs: list[float] = []
        # its next token must be fed by a prefill of the whole row (a longrope scaling's switch)
        self.restart = False


class _Engine:
    """sample_groups_batched's loop: one forward per step (module docstring of sample_groups_batched)."""

    def __init__(self, model, prompts, keys, opts: RolloutOptions, budgets, rows: int, lockstep) -> None:
        self.model, self.prompts, self.keys, self.opts = model, prompts, keys, opts
        self.budgets, self.capacity, self.lockstep = budgets, rows, lockstep
        self.device = model.tok_emb.weight.device
        self.stops = set(opts.stop_ids)
        self.done: list[list[Optional[Completion]]] = [[None] * len(k) for k in keys]
        # rows[i] lives in slot i
        self.rows: list[_Row] = []
        self.forwards = 0

    def run(self) -> list[list[Completion]]:
        dtype = self._compute_dtype()
        longest = max((len(p) + b for p, b in zip(self.prompts, self.budgets)), default=1)
        self.cache = SlotCache(self.model.cfg, self.capacity, longest, device=self.device, dtype=dtype)
        waiting = deque(g for g in range(len(self.prompts)) if self.keys[g])
        while True:
            admit = bool(waiting) and len(self.rows) + len(self.keys[waiting[0]]) <= self.capacity
            restart = next((i for i, row in enumerate(self.rows) if row.restart), None)
            work = admit or bool(self.rows)
            if self.lockstep is not None:
                if not self.lockstep(work):
                    break
                if not work:
                    # every rank runs each forward of FSDP2's gathers: join with one token, output dropped
                    self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), logits_to_keep=1)
                    continue
            elif not work:
                break
            if admit:
                self._admit(waiting.popleft())
            elif restart is not None:
                self._restart(restart)
            else:
                self._decode()
            self._compact()
        return self.done  # type: ignore[return-value]

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the model's keys come out in (autocast's, FSDP2's param_dtype, the weights'): one
        one-token forward into a cache allocated at its first keys (every rank runs it)."""
        probe = _Cache(self.model.cfg, 1, 1)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), cache=probe, logits_to_keep=1)
        for layer, lay in enumerate(probe.layouts):
            if probe.k[layer] is not None and not probe.k[layer].is_meta:
                return probe.k[layer].dtype
            state = probe.states[layer]
            if state is not None and not state.is_meta and not lay.state_fp32:
                return state.dtype
        return self.model.tok_emb.weight.dtype

    def _forward(self, ids: torch.Tensor, view) -> torch.Tensor:
        self.forwards += 1
        return self.model(ids, cache=view, logits_to_keep=1).logits[:, -1]  # [n, V]

    def _admit(self, g: int) -> None:
        """Group g's prompt [1, T0] into the next free slot, copied into one slot per row; each row's first
        token drawn from the prompt's logits."""
        slot, n = len(self.rows), len(self.keys[g])
        ids = torch.tensor([self.prompts[g]], dtype=torch.long, device=self.device)  # [1, T0]
        logits = self._forward(ids, self.cache.prefill(slot))  # [1, V]
        for c in range(1, n):
            self.cache.copy(slot, slot + c)
        new = [_Row(g, r, k, self.budgets[g]) for r, k in enumerate(self.keys[g])]
        self.rows.extend(new)
        self._draw(new, logits.expand(n, -1))

    def _restart(self, i: int) -> None:
        """Row i past a longrope scaling's original context: its slot again, every key with the long factors
        (its prompt and its tokens, the last one included), as sample_groups does."""
        row = self.rows[i]
        self.cache.free(i)
        ids = torch.tensor([self.prompts[row.group] + row.tokens], dtype=torch.long, device=self.device)
        logits = self._forward(ids, self.cache.prefill(i))  # [1, V]
        self._draw([row], logits)

    def _decode(self) -> None:
        """One token for every row [n, 1], each at its own position."""
        n = len(self.rows)
        last = torch.tensor([[row.tokens[-1]] for row in self.rows], dtype=torch.long, device=self.device)
        logits = self._forward(last, self.cache.decode(n))  # [n, V]
        self._draw(self.rows, logits)

    def _draw(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Each row's next token from its logits [n, V] with its key's noise at its own token index."""
        o = self.opts
        noise = None
        if o.temperature > 0:
            keys = key_tensor([row.key for row in rows], logits.device)  # [n, 2]
            index = torch.tensor([len(row.tokens) for row in rows], dtype=torch.long, device=logits.device)
            noise = key_noise(keys, index, logits.shape[-1])  # [n, V]
        picked = sample_next(logits, o.temperature, o.top_k, o.top_p, None, noise)  # [n]
        lps = token_logps(logits, picked.view(-1), o.temperature).tolist()  # [n]
        for row, tok, lp in zip(rows, picked.view(-1).tolist(), lps):
            row.tokens.append(int(tok))
            row.logprobs.append(lp)
            row.restart = False
            end = None
            if tok in self.stops:
                end = "stop"
            elif len(row.tokens) >= row.budget:
                end = "length" if row.budget == o.max_new_tokens else "context"
            if end is not None:
                self.done[row.group][row.r] = Completion(row.tokens, end, row.logprobs)
                continue
            # the cache holds the prompt and every token but this one, which is fed next at that position
            cached = len(self.prompts[row.group]) + len(row.tokens) - 1
            row.restart = self.model.rope_restart(cached, cached + 1)

    def _compact(self) -> None:
        """Ended rows leave; the last row moves into each hole (the active rows stay in slots 0..n-1)."""
        i = 0
        while i < len(self.rows):
            row = self.rows[i]
            if self.done[row.group][row.r] is None:
                i += 1
                continue
            last = len(self.rows) - 1
            if i != last:
                self.cache.move(last, i)
                self.rows[i] = self.rows[last]
            else:
                self.cache.free(i)
            self.rows.pop()


# grpo.rollouts: how a step's groups are decoded (both draw each completion from its key)
SAMPLERS: dict[str, Callable[..., list[list[Completion]]]] = {
    "engine": sample_groups_batched,
    "groups": sample_groups,
}
