"""Speculative decoding: a draft proposes up to k tokens, the model checks them all in one forward pass.

    context (the tokens the model sees) -> drafter.propose -> d_1..d_n (n <= k), q_1..q_n (or point masses)
      -> one forward of [the tokens the cache lacks, d_1..d_n] -> the target's logits at n + 1 positions
      -> verify: the accepted drafts d_1..d_a and one token of the target's -> the cache rewound to hold
         the context and d_1..d_a (the rejected drafts' keys forgotten)

Every step emits 1..n+1 tokens for one target forward.
  greedy   a = the longest prefix of the drafts equal to the target's argmax; then the target's argmax at a.
           The tokens are the plain greedy decode's (tests/inference/test_speculative.py: every drafter).
  sampled  the standard rule (Leviathan et al. 2023; Chen et al. 2023): d_i is accepted with probability
           min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
           norm(max(0, p_i - q_i)), after n acceptances from p_{n+1}. Every token is then distributed
           exactly as the plain sampler's, p after the same temperature, top-k and top-p (sampling_probs,
           applied to p and q alike). A deterministic drafter (n-grams) proposes with certainty: q_i is a
           point mass on d_i.

The drafters (`Drafter`, the seam; gptkit/commands/sample.py's draft= picks one):
  ModelDrafter   another model with the same tokenizer (draft=<run>), or the model itself (acceptance 1 when
                 greedy: the upper bound); it keeps its own KV cache and rewinds it to the context it is given
  NgramDrafter   prompt lookup (draft=ngram): the last n tokens of the context (n = max_n down to 1) found
                 earlier in it, most recent first; the k tokens that followed them are proposed

The caches must be rewound after a rejection (KVCache.rewind): they are built without the rolling ring
(rolling=False, a sliding window's layer keeps every position; attention still applies the window, so the
tokens are the same). A recurrent state (Gated DeltaNet's linear attention) folds every token in and cannot
be taken back: such a model, as target or draft, is refused in one line; so is a longrope scaling, whose keys
are recomputed when a sequence crosses its switch.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.sampling import (
    FinishChecks,
    Generation,
    SampleOptions,
    argmax,
    context_note,
    sampling_probs,
    window_plan,
)
from gptkit.model.attention_kinds import cache_layouts
from gptkit.model.kv_cache import KVCache

# draft_k: proposals per step when not given
DEFAULT_K = 4
# NgramDrafter: the longest suffix of the context looked up
NGRAM_MAX_N = 3


def check_rewindable(model, role: str) -> None:
    """One line (GptkitError) when `model`'s cache cannot be rewound after a rejected draft."""
    if any(lay.state is not None for lay in cache_layouts(model.cfg)):
        raise GptkitError(
            f"speculative decoding rewinds the KV cache after a rejected draft, and {role} has Gated "
            "DeltaNet (linear attention) layers whose recurrent state cannot be rewound; drop draft="
        )
    rope = getattr(model, "rope", None)
    if rope is not None and getattr(rope, "switch_at", None) is not None:
        raise GptkitError(
            f"speculative decoding is not supported for {role}'s longrope scaling (its keys are recomputed "
            "when the sequence crosses the original context); drop draft="
        )


@dataclass
class Rule:
    """How tokens are chosen: the sampling settings (temperature 0: greedy) and the generator drawing."""

    temperature: float
    top_k: Optional[int]
    top_p: float
    generator: Optional[torch.Generator]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V] -> the filtered distribution [n, V] (fp32) the plain sampler draws from."""
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: torch.Tensor) -> int:
        """One index drawn from probs [V] (need not sum to 1): argmax(p / E), E ~ Exp(1), as sample_next."""
        noise = torch.empty_like(probs).exponential_(1, generator=self.generator)  # [V]
        return int(argmax((probs / noise)[None])[0])

    def uniform(self, like: torch.Tensor) -> float:
        return float(torch.rand((), generator=self.generator, device=like.device))


def verify_sampled(p: torch.Tensor, q: Optional[torch.Tensor], drafts: list[int], rule: Rule) -> list[int]:
    """The rejection rule: p [n + 1, V] the target's distributions, q [n, V] the draft's (None: point masses
    on the drafts), drafts n ids -> the accepted drafts and one more token (module docstring)."""
    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        p_d = float(p[i, d])
        if rule.uniform(p) * q_d < p_d:
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        # p <= q everywhere only when p == q up to rounding: p itself is then the residual's limit
        if not float(residual.sum()) > 0:
            residual = p[i]
        return drafts[:i] + [rule.draw(residual)]
    return drafts + [rule.draw(p[len(drafts)])]


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits [n + 1, V]: the drafts up to the first that is not the target's argmax, then its argmax."""
    best = argmax(logits).tolist()  # [n + 1]
    a = 0
    while a < len(drafts) and drafts[a] == best[a]:
        a += 1
    return drafts[:a] + [best[a]]


class Drafter:
    """The seam: what proposes the next tokens of a context."""

    # how the report names it
    name = ""

    def propose(self, context: list[int], k: int, rule: Rule) -> tuple[list[int], Optional[torch.Tensor]]:
        """At most k tokens to follow `context` (the tokens the target sees) and the draft's distributions
        they were drawn from, q [n, V] (None: each is proposed with certainty, a point mass)."""
        raise NotImplementedError

    def layout(self, target):
        """A context manager the decoding of `target` runs in (a draft model's CPU decoding layout, unless the
        draft is the target, already laid out); none by default."""
        return nullcontext()


class NgramDrafter(Drafter):
    """Prompt lookup: the k tokens that followed the most recent earlier occurrence of the context's last n
    tokens (n = max_n down to 1); nothing when none occurs. Deterministic: q is a point mass."""

    name = "ngram"

    def __init__(self, max_n: int = NGRAM_MAX_N) -> None:
        self.max_n = max_n

    def propose(self, context, k, rule):
        L = len(context)
        for n in range(min(self.max_n, L - 1), 0, -1):
            tail = context[L - n :]
            for s in range(L - n - 1, -1, -1):
                if context[s : s + n] == tail:
                    return context[s + n : s + n + k], None
        return [], None


class ModelDrafter(Drafter):
    """A draft model (another run with the same tokenizer, or the model itself) decoding k tokens with its
    own KV cache; each call rewinds that cache to the longest prefix it shares with the new context."""

    def __init__(self, model, name: str) -> None:
        check_rewindable(model, f"the draft ({name})")
        self.model, self.name = model, name
        w = model.tok_emb.weight
        cfg = model.cfg
        self.cache = KVCache(cfg, 1, max_len=cfg.max_seq_len, device=w.device, dtype=w.dtype, rolling=False)
        # the tokens whose keys the cache holds, in order
        self.fed: list[int] = []

    def layout(self, target):
        return nullcontext() if self.model is target else decoding_layout(self.model, 1)

    def propose(self, context, k, rule):
        room = self.model.cfg.max_seq_len
        k = min(k, room)
        # the last draft is not fed: len(context) + k - 1 positions
        if len(context) + k - 1 > room:
            context = context[len(context) - (room - k + 1) :]
        keep = 0
        limit = min(len(self.fed), len(context) - 1)
        while keep < limit and self.fed[keep] == context[keep]:
            keep += 1
        keep = self.cache.rewind(min(keep, self.cache.length))
        device = self.model.tok_emb.weight.device
        feed = torch.tensor([context[keep:]], dtype=torch.long, device=device)  # [1, T]
        logits = self.model(feed, cache=self.cache, logits_to_keep=1).logits[:, -1]  # [1, V]
        self.fed = list(context)
        out: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            if rule.greedy:
                tok = int(argmax(logits)[0])
            else:
                q = rule.probs(logits)[0]  # [V]
                tok = rule.draw(q)
                qs.append(q)
            out.append(tok)
            if i == k - 1:
                break
            step = torch.tensor([[tok]], dtype=torch.long, device=device)  # [1, 1]
            logits = self.model(step, cache=self.cache, logits_to_keep=1).logits[:, -1]  # [1, V]
            self.fed.append(tok)
        return out, (torch.stack(qs) if qs else None)


@dataclass
class SpecStats:
    """What a speculative generation reports."""

    # draft tokens proposed and accepted
    proposed: int = 0
    accepted: int = 0
    # forward passes of the target (the first one holds the prompt)
    forwards: int = 0
    # tokens emitted
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def as_dict(self, draft: str, k: int) -> dict:
        return {
            "draft": draft,
            "draft_k": k,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "target_forwards": self.forwards,
            "tokens_per_forward": self.tokens_per_forward,
        }

    def line(self, draft: str, k: int) -> str:
        return (
            f"draft={draft} draft_k={k}: acceptance {self.acceptance:.2f} ({self.accepted}/{self.proposed} "
            f"drafts), {self.tokens_per_forward:.2f} tokens per target forward ({self.tokens} in "
            f"{self.forwards})"
        )


@dataclass
class Speculator:
    """A drafter and k: one verified step at a time (step), its counts in stats."""

    drafter: Drafter
    k: int = DEFAULT_K
    stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"draft_k={self.k} must be a positive integer")

    def describe(self) -> str:
        return self.stats.line(self.drafter.name, self.k)

    def propose(self, context: list[int], k: int, rule: Rule, vocab: int):
        """The drafter's proposal for `context`, at most k tokens (k <= 0: none), cut before an id the model
        does not have (a padded draft vocabulary); q [n, vocab] fp32 or None (point masses)."""
        drafts, q = self.drafter.propose(context, k, rule) if k > 0 else ([], None)
        drafts = drafts[: max(k, 0)]
        for i, d in enumerate(drafts):
            if not 0 <= d < vocab:
                drafts = drafts[:i]
                break
        if q is not None:
            q = q[: len(drafts)].float()
            q = q[:, :vocab] if q.shape[1] >= vocab else torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
        return drafts, q

    def verify(
        self, logits: torch.Tensor, drafts: list[int], q: Optional[torch.Tensor], rule: Rule
    ) -> list[int]:
        """The model's logits [n + 1, V] after the context and each draft -> the accepted drafts and one token
        of the model's (counted in stats)."""
        if rule.greedy:
            new = verify_greedy(logits, drafts)
        else:
            new = verify_sampled(rule.probs(logits), q, drafts, rule)
        self.stats.proposed += len(drafts)
        self.stats.accepted += len(new) - 1
        self.stats.forwards += 1
        self.stats.tokens += len(new)
        return new

    def step(self, model, cache: KVCache, window: list[int], limit: int, rule: Rule) -> list[int]:
        """window: the tokens the model sees, the cache holding a shorter prefix of them (position 0 is
        window[0], room for cache.max_len); -> 1..min(k + 1, limit) new tokens, the cache then holding
        window and every new token but the last."""
        k = min(self.k, limit - 1, cache.max_len - len(window))
        drafts, q = self.propose(window, k, rule, model.cfg.vocab_size)
        device = model.tok_emb.weight.device
        feed = torch.tensor([window[cache.length :] + drafts], dtype=torch.long, device=device)  # [1, T]
        logits = model(feed, cache=cache, logits_to_keep=len(drafts) + 1).logits[0]  # [n + 1, V]
        new = self.verify(logits, drafts, q, rule)
        a = len(new) - 1
        if cache.rewind(len(window) + a) != len(window) + a:
            raise RuntimeError("speculative decoding: the KV cache could not be rewound")
        return new


def generate_speculative(
    model,
    prompt_ids: list[int],
    opts: SampleOptions,
    speculator: Speculator,
    decode: Optional[Callable[[list[int]], str]],
    on_text: Optional[Callable[[str], None]],
) -> Generation:
    """generate() with a draft (one sample): the same window, overflow and stop rules as the eager loop."""
    if opts.num_samples != 1:
        raise ConfigError(f"draft= decodes one sample at a time: num_samples={opts.num_samples} must be 1")
    check_rewindable(model, "the model")
    cfg = model.cfg
    max_len = cfg.max_seq_len
    w = model.tok_emb.weight
    T0, N = len(prompt_ids), opts.max_new_tokens
    keep = opts.keep(max_len)
    start, notes = window_plan(opts, T0, max_len)
    generator = None
    if opts.seed is not None:
        generator = torch.Generator(device=w.device).manual_seed(int(opts.seed))
    rule = Rule(opts.temperature, opts.top_k, opts.top_p, generator)
    checks = FinishChecks(1, N, opts.eos_id, decode, opts.stop, on_text)
    # rolling=False: a rejected draft's positions can be forgotten in every layer
    cache = KVCache(cfg, 1, max_len=max_len, device=w.device, dtype=w.dtype, rolling=False)
    speculator.stats = SpecStats()
    tokens = list(prompt_ids)
    produced = slides = 0
    prefill_s = 0.0
    first = 0
    done = False
    t0 = t1 = time.perf_counter()
    while not done:
        # the newest token does not fit in the window
        if len(tokens) - start > max_len:
            if opts.overflow == "stop":
                checks.stop_at_context(produced)
                notes.append(context_note(max_len))
                break
            start = len(tokens) - keep
            slides += 1
            cache.reset()
        new = speculator.step(model, cache, tokens[start:], N - produced, rule)
        if speculator.stats.forwards == 1:
            if w.device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            prefill_s = t1 - t0
            # the tokens of the first step, timed as the prefill
            first = len(new)
        for tok in new:
            tokens.append(tok)
            produced += 1
            if checks.active and checks.push([tok], produced - 1):
                done = True
                break
            if produced == N:
                done = True
                break
    if w.device.type == "cuda":
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t1
    # the tokens the generation kept (a step's tokens after its end are not counted)
    speculator.stats.tokens = produced
    out, texts, reasons = checks.result([tokens[T0:] + [0] * (N - produced)])
    g = Generation(out, texts, reasons, T0, prefill_s, decode_s, speculator.stats.forwards - 1, slides, notes)
    g.speculative = {
        **speculator.stats.as_dict(speculator.drafter.name, speculator.k),
        "decode_tokens": max(0, produced - first),
    }
    return g


def load_speculator(draft, draft_k, run, device: str, dtype: str) -> Optional[Speculator]:
    """draft= of sample, chat and serve -> a Speculator for the loaded run `run` (gptkit.runs.Run), or None
    (draft=null). draft=ngram: prompt lookup; draft=mtp: the run's MTP heads (refused in one line: not a
    draft yet); else a run folder or checkpoint whose tokenizer.json is byte for byte the run's (else one
    line)."""
    if draft in (None, "", "null", "none"):
        return None
    k = draft_k if draft_k is not None else DEFAULT_K
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"draft_k={draft_k} must be a positive integer")
    check_rewindable(run.model, "the model")
    draft = str(draft)
    if draft == "ngram":
        return Speculator(NgramDrafter(), k)
    if draft == "mtp":
        if getattr(run.model, "mtp", None) is None:
            raise GptkitError(
                f"draft=mtp: the run {run.dir} has no MTP heads (model.mtp); use draft=ngram or a run"
            )
        raise GptkitError(
            "draft=mtp: drafting with the MTP heads is not built yet (docs/speculative.md); use "
            "draft=ngram or draft=<run>"
        )
    import hashlib

    from gptkit.runs import TOKENIZER_FILE, find_run_checkpoint, load_for_inference

    Speculator(Drafter(), k)  # draft_k checked before a model loads
    d = load_for_inference(find_run_checkpoint(draft), device, dtype)

    def digest(folder) -> str:
        return hashlib.sha256((folder / TOKENIZER_FILE).read_bytes()).hexdigest()

    if digest(d.dir) != digest(run.dir):
        raise GptkitError(
            f"draft={draft}: its tokenizer ({d.dir / TOKENIZER_FILE}) is not the run's "
            f"({run.dir / TOKENIZER_FILE}); a draft must share the tokenizer, byte for byte"
        )
    return Speculator(ModelDrafter(d.model, draft), k)
