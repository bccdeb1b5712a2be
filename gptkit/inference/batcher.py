"""Continuous batching: every active sequence decodes in one batch; a request joins at any step and leaves
when it ends.

The KV memory is paged (gptkit/inference/block_pool.py: blocks of one pool, a prefix cache) and each step
is planned under a token budget, running decodes and prompt chunks together (gptkit/inference/scheduler.py).
A model whose cache cannot be paged (linear attention's recurrent state, a longrope scaling) and a draft
(speculative decoding) run on one slot per sequence instead (Batcher.paging_off says why):

    step():  drop what was cancelled -> admit waiting requests while slots are free (each one's prefill: its
             prompt [1, T0] alone into a free slot, and its first token) -> one decode step for every active
             sequence (tokens [n, 1], each at its own position: gptkit.inference.slot_cache) -> sample per row
             -> finished sequences leave, the last slot moving into each hole

A request (a Job) is prompt ids and SamplingParams; with n > 1 its n choices share the prefill (the slot is
copied). Each choice is sampled from its own generator: greedy is the argmax, exactly as
sampling.sample_next chooses it; a seeded choice i draws as `gptkit sample seed=<seed + i>` does,
whatever else shares the batch. What each step produced goes to the job's `deliver` in one call (Events):
the new token ids, the new text (when the job has a decode function: sampling.TextStream, which
also finds stop strings), and why a choice ended: eos (one of params.stop_ids, not emitted), stop (a stop
string, cut from the text), length (max_new_tokens), context (the next token would not fit in the
context), cancelled, error.

Log-probs (params.logprobs = k): each sampled token's log-prob and the k most likely tokens', from the
log-softmax of the model's own logits for that row (the temperature-1 distribution, before temperature,
top-k/top-p and any constraint; vLLM's default), in Event.logprobs. A constraint (params.constraint: a
factory of one Constraint per choice, e.g. a grammar's matcher, gptkit/serve/grammar.py) masks its own
row's logits before the token is chosen (on a copy: batch-mates and log-probs see the model's), is advanced
by the token, and ends the choice ("stop") when it is done.

What one request holds cannot fail the others: a failure while admitting a job (its generators, its
prefill) or while choosing or recording one sequence's token (its sampler, its constraint, its text) ends
that job or that choice alone with an "error" event, and the step goes on for the rest. Only a failure of
the batch's own decode pass (out of memory...) raises out of step() (the engine then fails that batch:
Engine.fail_all).

Greedy tokens are those of generate.generate (`gptkit sample`) and ChatSession (`gptkit chat`) for the
same prompt: the prefill is the same one-sequence pass; a decode step computes the same function of the
same tokens, but batched matmuls round in other places than one row's (fp32 logits agree to ~1e-6), so only
two top logits closer than that could be chosen apart (tests/inference/test_batcher.py checks tokens).

This class is single-threaded (gptkit.inference.engine runs it on a thread for a server); `generate_many`
runs it in the caller's thread for a list of prompts (rollouts, evaluation).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.block_pool import Paging, pageable
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.sampling import TextStream, argmax, sample_next
from gptkit.inference.scheduler import PagedSteps
from gptkit.inference.slot_cache import SlotCache
from gptkit.inference.speculative import Rule, Speculator, check_rewindable

FINISH_REASONS = ("eos", "stop", "length", "context", "cancelled", "error")

# what torch.Generator.manual_seed takes: a seed is a signed or an unsigned 64-bit integer
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def error_line(exc: BaseException) -> str:
    """An exception as the one line an "error" event carries."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"[:300]


@dataclass(frozen=True)
class SamplingParams:
    """What one request generates."""

    max_new_tokens: int = 256
    # 0: greedy
    temperature: float = 1.0
    # None or 0: off
    top_k: Optional[int] = None
    # 1.0: off
    top_p: float = 1.0
    # choice i draws from a generator seeded with seed + i (None: a random seed)
    seed: Optional[int] = None
    # choices of the one prompt
    n: int = 1
    # ids that end a choice (end-of-text, end-of-turn); not emitted
    stop_ids: tuple[int, ...] = ()
    # strings that end a choice (needs the job's decode function); cut from the text
    stop: tuple[str, ...] = ()
    # None: no log-probs; k >= 0: each sampled token's log-prob and the k most likely tokens' (Event.logprobs)
    logprobs: Optional[int] = None
    # None, or a callable making one Constraint per choice: the tokens it may sample next (module docstring)
    constraint: Optional[Callable[[], "Constraint"]] = None

    def validate(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        for key in ("temperature", "top_p"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{key}={v!r} must be a finite number")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0
        ):
            raise ConfigError(f"top_k={self.top_k} must be a non-negative integer (0 or None: off)")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1: off)")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n={self.n!r} must be an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty strings")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 0
        ):
            raise ConfigError(f"logprobs={self.logprobs!r} must be None or an integer >= 0")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ConfigError(f"seed={self.seed!r} must be an integer or None")
            # choice i draws with seed + i: the last one must fit too
            if self.seed < SEED_MIN or self.seed + self.n - 1 > SEED_MAX:
                raise ConfigError(
                    f"seed={self.seed} with n={self.n} is out of range: seed must be in "
                    f"{SEED_MIN}..{SEED_MAX} and seed + n - 1 at most {SEED_MAX}"
                )


@dataclass
class Event:
    """What one step produced for one choice of a job."""

    choice: int
    # new token ids (an ending id is not among them)
    tokens: list[int] = field(default_factory=list)
    # new text released (a decode function given; "" otherwise)
    text: str = ""
    # set on the choice's last event: one of FINISH_REASONS
    finish: Optional[str] = None
    # finish == "error": what went wrong
    error: Optional[str] = None
    # params.logprobs set: one per token of `tokens`, (its log-prob, [(id, log-prob)] of the k most likely)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


class Constraint(Protocol):
    """What a sequence may sample next (structured output: a grammar's matcher). One per choice."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [V] of every token not allowed next to -inf, in place."""

    def advance(self, token: int) -> None:
        """The token sampled (raises when it was not allowed)."""

    @property
    def done(self) -> bool:
        """Nothing may follow: the sequence ends (reason "stop")."""


_ids = itertools.count(1)


class Job:
    """One request: prompt ids, SamplingParams, and where its events go.

    deliver(events) is called from the thread that runs the batcher, once per step that produced events for
    this job. decode (ids -> text) turns on text and stop strings. Set `cancelled` (any thread) to stop it:
    its slots are freed at the next step."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        deliver: Callable[[list[Event]], None],
        decode: Optional[Callable[[list[int]], str]] = None,
    ) -> None:
        self.id = next(_ids)
        self.prompt = list(prompt)
        self.params = params
        self.deliver = deliver
        self.decode = decode
        self.cancelled = False
        # tokens sampled per choice (an ending id included): the usage figure
        self.sampled = [0] * params.n
        self.submitted = time.perf_counter()
        # perf_counter of the first token (the prefill's), None before
        self.first_token: Optional[float] = None
        self.finished = 0

    @property
    def done(self) -> bool:
        return self.finished == self.params.n


class _Seq:
    """One choice of a job, in a slot."""

    __slots__ = (
        "job",
        "choice",
        "last",
        "fed",
        "n_out",
        "generator",
        "stream",
        "finished",
        "constraint",
        "pages",
    )

    def __init__(self, job: Job, choice: int, device: torch.device) -> None:
        self.job, self.choice = job, choice
        # the token fed at the next step
        self.last = -1
        # the tokens sampled and fed (a longrope model's restart runs the prompt and these again)
        self.fed: list[int] = []
        # tokens sampled so far
        self.n_out = 0
        p = job.params
        self.generator = None
        if p.temperature > 0:
            self.generator = torch.Generator(device=device)
            if p.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(p.seed) + choice)
        self.stream = TextStream(job.decode, p.stop) if job.decode is not None else None
        self.finished = False
        self.constraint = p.constraint() if p.constraint is not None else None
        # paged: its blocks (gptkit.inference.block_pool.Pages); None while it waits for choice 0's prefill
        self.pages = None


class Batcher:
    """The continuous-batching loop over one model (module docstring). Not thread-safe: one thread calls
    add() and step()."""

    def __init__(
        self,
        model,
        max_batch: int = 8,
        max_len: Optional[int] = None,
        speculate: Optional[Speculator] = None,
        paging: Optional[Paging] = Paging(),
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch={max_batch!r} must be an integer >= 1")
        if speculate is not None:
            check_rewindable(model, "the model")
        # a draft (speculative.py): each sequence decodes alone, its draft's tokens checked in one forward
        self.speculate = speculate
        self.model = model
        w = model.tok_emb.weight
        self.device = w.device
        self.max_batch = max_batch
        self.max_len = min(max_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        # why this model runs on one slot per sequence (None: paged)
        self.paging_off = (
            "paging=None" if paging is None else "a draft" if speculate is not None else pageable(model)
        )
        # seqs[i] lives in cache slot i (paged: in the order they were admitted)
        self.seqs: list[_Seq] = []
        self.waiting: deque[Job] = deque()
        self.cache, self.paged = None, None
        if self.paging_off is None:
            self.paged = PagedSteps(self, paging)
        else:
            if paging is not None:
                # the one Paging value that needs the pool refused here too
                paging.check(self.max_len, max_batch)
            self.cache = SlotCache(model.cfg, max_batch, self.max_len, device=w.device, dtype=w.dtype)
        # decode steps run, and the rows they ran (their mean is the mean batch)
        self.steps = 0
        self.rows = 0
        # choices ended, by reason (FINISH_REASONS)
        self.ended = {reason: 0 for reason in FINISH_REASONS}
        # told one line per request or choice that failed alone (the engine prints it on stderr)
        self.log: Callable[[str], None] = lambda line: None

    # ---- requests -----------------------------------------------------------------------------------
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """A one-line GptkitError when the job cannot run here."""
        params.validate()
        if params.n > self.max_batch:
            raise ConfigError(f"n={params.n} is more than the batch holds (max_batch={self.max_batch})")
        if not prompt:
            raise GptkitError("the prompt has no tokens")
        if len(prompt) > self.max_len:
            raise GptkitError(
                f"the prompt has {len(prompt)} tokens, more than the context of {self.max_len} tokens"
            )
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise GptkitError(f"the prompt holds the token id {bad!r}, not one of the model's 0..{vocab - 1}")

    def add(self, job: Job) -> None:
        """Queue a job (checked first: a bad one raises and is not queued)."""
        self.check(job.prompt, job.params)
        if job.params.stop and job.decode is None:
            raise ConfigError("stop strings need the job's decode function")
        self.waiting.append(job)

    @property
    def busy(self) -> bool:
        return bool(self.seqs or self.waiting)

    @property
    def active(self) -> int:
        """Slots in use."""
        return len(self.seqs)

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits, decode one token for every active sequence, deliver the events."""
        out: dict[Job, list[Event]] = {}
        if self.paged is not None:
            self.paged.step(out)
            for job, events in out.items():
                job.deliver(events)
            return
        self._drop_cancelled(out)
        while self.waiting and len(self.seqs) + self.waiting[0].params.n <= self.max_batch:
            job = self.waiting.popleft()
            if not job.cancelled:
                self._prefill(job, out)
        self._compact()
        if self.seqs:
            self._decode(out) if self.speculate is None else self._speculate(out)
            self._compact()
        for job, events in out.items():
            job.deliver(events)

    def fail_all(self, message: str) -> None:
        """Every job, active or waiting, ends with an error event; every slot is freed."""
        jobs = list(dict.fromkeys([s.job for s in self.seqs] + list(self.waiting)))
        ended = {(s.job, s.choice) for s in self.seqs if s.finished}
        if self.paged is not None:
            self.paged.free_all()
        self.seqs.clear()
        self.waiting.clear()
        for i in range(self.max_batch if self.cache is not None else 0):
            self.cache.free(i)
        for job in jobs:
            events = [
                Event(c, finish="error", error=message)
                for c in range(job.params.n)
                if (job, c) not in ended and job.finished < job.params.n
            ]
            job.finished = job.params.n
            self.ended["error"] += len(events)
            if events:
                try:
                    job.deliver(events)
                except Exception:  # noqa: BLE001 - a receiver that is gone must not stop the others
                    pass

    def _drop_cancelled(self, out: dict[Job, list[Event]]) -> None:
        for s in self.seqs:
            if s.job.cancelled and not s.finished:
                self._finish(s, "cancelled", out)
        if any(j.cancelled for j in self.waiting):
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(job)
                job.finished = job.params.n
                self.ended["cancelled"] += job.params.n
                out.setdefault(job, []).extend(Event(c, finish="cancelled") for c in range(job.params.n))

    def _new_seq(self, job: Job, choice: int) -> _Seq:
        return _Seq(job, choice, self.device)

    @staticmethod
    def _error_line(exc: BaseException) -> str:
        return error_line(exc)

    def _prefill(self, job: Job, out: dict[Job, list[Event]]) -> None:
        slot = len(self.seqs)
        try:
            seqs = [_Seq(job, c, self.device) for c in range(job.params.n)]
            ids = torch.tensor([job.prompt], dtype=torch.long, device=self.device)  # [1, T0]
            logits = self.model(ids, cache=self.cache.prefill(slot), logits_to_keep=1).logits[:, -1]  # [1, V]
            for c in range(1, job.params.n):
                self.cache.copy(slot, slot + c)
        except Exception as exc:  # noqa: BLE001 - this job fails alone; the batch goes on
            for c in range(job.params.n):
                self.cache.free(slot + c)
            self._fail_job(job, error_line(exc), out)
            return
        self.seqs.extend(seqs)
        job.first_token = time.perf_counter()
        rows = logits.expand(len(seqs), -1)  # [n, V]: every choice samples from the prompt's logits
        tokens = self._choose(rows, seqs)
        self._take(seqs, tokens, out, self._logprobs(rows, seqs, tokens))

    def _decode(self, out: dict[Job, list[Event]]) -> None:
        n = len(self.seqs)
        tok = torch.tensor([[s.last] for s in self.seqs], dtype=torch.long, device=self.device)  # [n, 1]
        logits = self.model(tok, cache=self.cache.decode(n), logits_to_keep=1).logits[:, -1]  # [n, V]
        self.steps += 1
        self.rows += n
        for i, s in enumerate(self.seqs):
            if self.model.rope_restart(self.cache.lengths[i] - 1, self.cache.lengths[i]):
                # this sequence outgrew a longrope scaling's original context: its slot again, every key with
                # the long factors (the row just decoded is dropped), as this request alone would be
                self.cache.free(i)
                ids = torch.tensor([s.job.prompt + s.fed], dtype=torch.long, device=self.device)  # [1, T]
                view = self.cache.prefill(i)
                logits[i] = self.model(ids, cache=view, logits_to_keep=1).logits[0, -1]
        tokens = self._choose(logits, self.seqs)
        self._take(self.seqs, tokens, out, self._logprobs(logits, self.seqs, tokens))

    def _speculate(self, out: dict[Job, list[Event]]) -> None:
        """One forward per sequence, alone in its slot: [its last token, its draft's tokens] -> the accepted
        drafts and one token of the model's (speculative.py's rule, with its own generator), each recorded as
        a decode step's token is; the slot's length then rewound past the rejected drafts. A choice with a
        constraint or log-probs gets no draft (its one token chosen as _decode chooses it)."""
        sp, vocab = self.speculate, self.model.cfg.vocab_size
        for i, s in enumerate(self.seqs):
            p = s.job.params
            start = self.cache.lengths[i]
            plain = s.constraint is not None or p.logprobs is not None
            rule = Rule(p.temperature, p.top_k, p.top_p, s.generator)
            k = 0 if plain else min(sp.k, p.max_new_tokens - s.n_out - 1, self.max_len - start - 1)
            try:
                drafts, q = sp.propose(s.job.prompt + s.fed, k, rule, vocab)
            except Exception as exc:  # noqa: BLE001 - this choice fails alone
                self._finish(s, "error", out, error=error_line(exc))
                continue
            ids = torch.tensor([[s.last] + drafts], dtype=torch.long, device=self.device)  # [1, 1 + n]
            view = self.cache.prefill(i)
            logits = self.model(ids, cache=view, logits_to_keep=len(drafts) + 1).logits[0]  # [1 + n, V]
            self.steps += 1
            self.rows += 1
            if plain:
                row = logits[-1:]  # [1, V]
                tokens = self._choose(row, [s])
                self._take([s], tokens, out, self._logprobs(row, [s], tokens))
                continue
            try:
                new = sp.verify(logits, drafts, q, rule)
            except Exception as exc:  # noqa: BLE001 - this choice fails alone
                self._finish(s, "error", out, error=error_line(exc))
                continue
            # the slot holds the last token and the accepted drafts; the model's own token is fed next
            self.cache.lengths[i] = start + len(new)
            for tok in new:
                self._take([s], [tok], out)
                if s.finished:
                    break

    def _choose(self, logits: torch.Tensor, seqs: list[_Seq]) -> list[int | str]:
        """One token per row of logits [n, V], each by its sequence's sampling rule (within its constraint's
        tokens, if it has one); a row whose sampling failed gets the error's line instead (that choice
        alone ends with an error)."""
        failed: dict[int, str] = {}
        if any(s.constraint is not None for s in seqs):
            # a copy: the log-probs are the model's, and a batch-mate's row is never touched
            logits = logits.clone()
            for i, s in enumerate(seqs):
                if s.constraint is not None:
                    try:
                        s.constraint.mask(logits[i])
                    except Exception as exc:  # noqa: BLE001 - this choice fails alone
                        failed[i] = error_line(exc)
        greedy = [i for i, s in enumerate(seqs) if s.generator is None]
        if len(greedy) == len(seqs) and not failed:
            return argmax(logits).tolist()
        chosen = torch.empty(len(seqs), dtype=torch.long, device=logits.device)  # [n]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            chosen[rows] = argmax(logits[rows])
        for i, s in enumerate(seqs):
            if s.generator is not None and i not in failed:
                p = s.job.params
                try:
                    row = sample_next(logits[i : i + 1], p.temperature, p.top_k, p.top_p, s.generator)  # [1]
                    chosen[i] = row[0]
                except Exception as exc:  # noqa: BLE001 - this choice fails alone
                    failed[i] = error_line(exc)
        tokens: list[int | str] = chosen.tolist()
        for i, line in failed.items():
            tokens[i] = line
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, seqs: list[_Seq], tokens: list[int | str]
    ) -> list[Optional[tuple[float, list[tuple[int, float]]]]]:
        """For each sequence that asks (params.logprobs), its token's log-prob and the k most likely tokens',
        from the log-softmax of the model's own logits [n, V] (before temperature, top-k/top-p and any
        constraint: the temperature-1 distribution); None for the others."""
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.job.params.logprobs is not None and not isinstance(tokens[i], str)
        ]
        got: list[Optional[tuple[float, list[tuple[int, float]]]]] = [None] * len(seqs)
        if not rows:
            return got
        index = torch.tensor(rows, device=logits.device)
        lp = torch.log_softmax(logits[index].float(), dim=-1)  # [r, V]
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))[:, 0].tolist()
        k = min(max(seqs[i].job.params.logprobs for i in rows), lp.shape[-1])
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [r, k]
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            kk = seqs[i].job.params.logprobs
            got[i] = (chosen[j], list(zip(top_i[j][:kk], top_v[j][:kk])))
        return got

    def _take(
        self,
        seqs: list[_Seq],
        tokens: list[int | str],
        out: dict[Job, list[Event]],
        logprobs: Optional[list] = None,
    ) -> None:
        """Record each sequence's new token (and its log-probs); end the ones it ends (a str: the error that
        ends that one)."""
        for j, (s, tok) in enumerate(zip(seqs, tokens)):
            if isinstance(tok, str):
                self._finish(s, "error", out, error=tok)
                continue
            try:
                self._take_one(s, tok, out, logprobs[j] if logprobs else None)
            except Exception as exc:  # noqa: BLE001 - this choice fails alone (its text, its stop strings)
                if not s.finished:
                    self._finish(s, "error", out, error=error_line(exc))

    def _take_one(self, s: _Seq, tok: int, out: dict[Job, list[Event]], logprobs=None) -> None:
        job, p = s.job, s.job.params
        s.n_out += 1
        job.sampled[s.choice] += 1
        if tok in p.stop_ids:
            self._finish(s, "eos", out)
            return
        if s.constraint is not None:
            s.constraint.advance(tok)
        s.last = tok
        s.fed.append(tok)
        ev = Event(s.choice, [tok], logprobs=[logprobs] if logprobs is not None else [])
        out.setdefault(job, []).append(ev)
        if s.stream is not None:
            ev.text = s.stream.push(tok)
            if s.stream.stopped:
                self._finish(s, "stop", out, ev)
                return
        if s.constraint is not None and s.constraint.done:
            self._finish(s, "stop", out, ev)
        elif s.n_out >= p.max_new_tokens:
            self._finish(s, "length", out, ev)
        # the token cannot be fed: the context is full
        elif len(job.prompt) + s.n_out > self.max_len:
            self._finish(s, "context", out, ev)

    def _finish(
        self,
        s: _Seq,
        reason: str,
        out: dict[Job, list[Event]],
        ev: Optional[Event] = None,
        error: Optional[str] = None,
    ) -> None:
        """End a sequence; ev: the event of its last token, which then carries the ending; error: what
        went wrong (reason "error")."""
        s.finished = True
        s.job.finished += 1
        self.ended[reason] += 1
        if error is not None:
            self.log(f"request {s.job.id} choice {s.choice} failed ({error})")
        text = s.stream.finish() if s.stream is not None and reason not in ("cancelled", "error") else ""
        if ev is None:
            out.setdefault(s.job, []).append(Event(s.choice, text=text, finish=reason, error=error))
        else:
            ev.text += text
            ev.finish, ev.error = reason, error

    def _fail_job(self, job: Job, error: str, out: dict[Job, list[Event]]) -> None:
        """End every choice of a job that holds no slot (its admission failed) with an error."""
        job.finished = job.params.n
        self.ended["error"] += job.params.n
        self.log(f"request {job.id} failed ({error})")
        out.setdefault(job, []).extend(Event(c, finish="error", error=error) for c in range(job.params.n))

    def _compact(self) -> None:
        """Finished sequences leave; the last active slot moves into each hole."""
        i = 0
        while i < len(self.seqs):
            if not self.seqs[i].finished:
                i += 1
                continue
            last = len(self.seqs) - 1
            if i != last:
                self.cache.move(last, i)
                self.seqs[i] = self.seqs[last]
            else:
                self.cache.free(i)
            self.seqs.pop()


@dataclass
class Choice:
    tokens: list[int]
    text: Optional[str]
    finish_reason: str


@dataclass
class Completion:
    """What generate_many returns per prompt."""

    prompt_tokens: int
    choices: list[Choice]
    # tokens sampled over the choices (an ending id included)
    sampled: int


def generate_many(
    model,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    decode: Optional[Callable[[list[int]], str]] = None,
    max_batch: int = 16,
) -> list[Completion]:
    """Generate for every prompt through one Batcher in this thread (no server, no thread): at most max_batch
    sequences decode together, the next prompt joining as soon as a slot is free (on the CPU with the
    decoding layout for max_batch rows). params: one for all, or one per prompt. Returns one Completion per
    prompt, in order."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    batcher = Batcher(model, max_batch=max([max_batch] + [p.n for p in params]))
    results: list[dict[int, Choice]] = [dict() for _ in prompts]

    def collector(i: int, n: int):
        got: dict[int, Choice] = results[i]

        def deliver(events: list[Event]) -> None:
            for e in events:
                ch = got.setdefault(e.choice, Choice([], "" if decode is not None else None, ""))
                ch.tokens += e.tokens
                if decode is not None:
                    ch.text += e.text
                if e.finish:
                    if e.finish == "error":
                        raise GptkitError(e.error or "generation failed")
                    ch.finish_reason = e.finish

        return deliver

    jobs = []
    rows = batcher.max_batch if model.lm_head.weight.device.type == "cpu" else None
    layout = decoding_layout(model, rows) if rows else contextlib.nullcontext()
    with torch.inference_mode(), layout:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            job = Job(prompt, p, collector(i, p.n), decode)
            batcher.add(job)
            jobs.append(job)
        while batcher.busy:
            batcher.step()
    return [
        Completion(len(j.prompt), [results[i][c] for c in range(j.params.n)], sum(j.sampled))
        for i, j in enumerate(jobs)
    ]
