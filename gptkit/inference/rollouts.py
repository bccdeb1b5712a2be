"""Group sampling for reinforcement learning (objective=grpo): n completions of each prompt, decoded through
the KV cache, each drawn with noise of its own.

    sample_groups(model, prompts, keys, opts, budgets)   -> per prompt, its n Completions
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
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.errors import ConfigError
from gptkit.inference.sampling import sample_next
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


def key_noise(keys: torch.Tensor, index: int, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [n, vocab_size] (fp32) for the index-th new token of the rows whose keys (key_tensor) are
    `keys` [n, 2]: a pure function of (key, index, vocabulary id), 24 bits of a uniform per draw."""
    hi, lo = keys[:, 0], keys[:, 1]  # [n] each
    step = _mix32(torch.full_like(hi, index & _M32) ^ 0x85EBCA6B)  # [n]
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
