"""Autoregressive generation with a KV cache: one prefill pass over the prompt, then one token per step.

    prompt ids [T0] -> repeat to [B, T0] -> prefill (cache filled, logits of the last position only)
      -> loop: sample next [B] -> append -> decode one step [B, 1] through the cache -> logits [B, V]

Two ways to run that loop (`decode`):
  eager   a growing KVCache; on CPU the Linear weights are laid out for the batch (gptkit.decoding_layout);
          EOS and stop strings are checked after every token.
  static  a preallocated StaticKVCache written at a position tensor, so the one-token step has fixed
  graph   shapes: it can be compiled (torch.compile) and, on CUDA, captured once as a CUDA graph and
          replayed (`graph`). Sampling stays on the device; EOS and stop strings are checked every
          `check_every` tokens without stalling the device (gptkit.static_decode).
  auto    graph on CUDA, eager elsewhere.
Greedy tokens are the same either way (tests/test_generate.py checks it, sliding windows included).

Beyond the context (model.max_seq_len), `overflow` says what happens:
  slide  the window slides: the cache is rebuilt by one prefill over the last `slide_keep` tokens,
         which the model sees at positions 0..slide_keep-1, and decoding continues through the cache.
         Every token is predicted from at most max_seq_len tokens at exact positions (learned or RoPE).
         slide_keep=max_seq_len re-prefills every step (always the full context, no cache benefit).
  stop   generation stops when the next token would not fit (stop_reason "context").
`use_cache=False` runs the same policy by recomputing the whole window every step: the reference
the cached path must match token for token, and the no-cache baseline of `gptkit bench sample`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.decoding_layout import decoding_layout
from gptkit.errors import ConfigError, GptkitError
from gptkit.model.kv_cache import KVCache

OVERFLOW_POLICIES = ("slide", "stop")
DECODE_MODES = ("auto", "eager", "static", "graph")


@dataclass
class SampleOptions:
    max_new_tokens: int = 200
    temperature: float = 1.0  # 0: greedy
    top_k: Optional[int] = None  # None or 0: off
    top_p: float = 1.0  # 1.0: off
    seed: Optional[int] = None
    num_samples: int = 1
    eos_id: Optional[int] = None
    stop: tuple[str, ...] = ()
    overflow: str = "slide"
    slide_keep: Optional[int] = None  # None: 3/4 of max_seq_len
    decode: str = "auto"  # auto | eager | static | graph (module docstring)
    compile: Optional[bool] = None  # torch.compile the static step; None: on CUDA only
    check_every: int = 16  # static/graph: tokens between two looks at EOS and stop strings

    def validate(self, max_seq_len: int) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be a positive integer")
        if not float(self.temperature) >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ConfigError(f"top_k={self.top_k} must be a non-negative integer (0 or null: off)")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1: off)")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ConfigError(f"num_samples={self.num_samples} must be a positive integer")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow={self.overflow!r} is not one of {', '.join(OVERFLOW_POLICIES)}")
        if self.slide_keep is not None and not 1 <= self.slide_keep <= max_seq_len:
            raise ConfigError(f"slide_keep={self.slide_keep} must be in [1, model.max_seq_len={max_seq_len}]")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"decode={self.decode!r} is not one of {', '.join(DECODE_MODES)}")
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ConfigError(f"check_every={self.check_every} must be a positive integer")

    def keep(self, max_seq_len: int) -> int:
        return self.slide_keep if self.slide_keep else max(1, max_seq_len * 3 // 4)

    def decode_mode(self, device: torch.device) -> str:
        """The loop `decode` resolves to on `device` (auto: graph on CUDA, eager elsewhere)."""
        if self.decode == "auto":
            return "graph" if device.type == "cuda" else "eager"
        return self.decode


@dataclass
class Generation:
    tokens: list[list[int]]  # per sample: the new token ids (cut at EOS / the stop string)
    texts: Optional[list[str]]  # per sample: the new text, when a decode function was given
    stop_reasons: list[str]  # per sample: eos | stop | length | context
    prompt_tokens: int
    prefill_s: float  # the first forward pass (the prompt) and the first token, seconds
    decode_s: float  # every later step, seconds
    decode_steps: int  # forward passes after the prefill (each emits one token per sample)
    slides: int = 0  # times the window slid (each one re-prefills slide_keep tokens)
    notes: list[str] = field(default_factory=list)
    decode: str = "eager"  # the loop that ran: eager | static | graph
    setup_s: float = 0.0  # static/graph: building the step (compile, CUDA graph capture), before the prefill


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for logits [B, V] -> [B]: the same index (the first maximum; NaN counts as one).

    On CPU torch's argmax is not vectorised but amax is, so for large vocabularies this finds the block of
    128 holding the maximum first, then the maximum within it (8 x 32000 fp32, one thread: 450 -> 95 us).
    """
    B, V = logits.shape
    block = 128
    n = V // block
    if logits.device.type != "cpu" or n < 8:
        return logits.argmax(-1)
    blocks = logits[:, : n * block].reshape(B, n, block)  # [B, n, block]
    best = blocks.amax(-1).argmax(-1)  # [B]: the first block holding the maximum
    rows = torch.arange(B, device=logits.device)
    idx = best * block + blocks[rows, best].argmax(-1)  # [B]
    if n * block < V:  # the last V % 128 entries
        tail = logits[:, n * block :].argmax(-1) + n * block  # [B]
        head_max, tail_max = logits[rows, idx], logits[rows, tail]
        later = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        idx = torch.where(later, tail, idx)
    return idx


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: float,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of logits [B, V]: greedy when temperature is 0, else sampled; -> [B].

    Never waits for the device, so it runs inside a CUDA graph."""
    if temperature == 0:
        return argmax(logits)
    logits = logits.float() / temperature  # [B, V]
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)  # [B, V]
    # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i: torch.multinomial(probs, 1) computes
    # exactly this (the same draws from the same generator), but first checks the probabilities on the host
    noise = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V]
    return argmax(probs / noise)


class TextStream:
    """Incremental decoding of a growing id list: only finished text is released.

    Decoding the whole list each time (not token by token) keeps multi-byte characters and BPE
    pieces intact; a trailing U+FFFD (an unfinished UTF-8 sequence) and anything that could be the
    start of a stop string are held back until the next token decides them.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        self.released = 0  # characters of the text already handed out
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the newly released text ("" when nothing is final yet)."""
        self.ids.append(token)
        self.text = self.decode(self.ids)
        for s in self.stop:
            i = self.text.find(s)
            if i >= 0:
                self.text, self.stopped = self.text[:i], True
                return self.finish()
        end = len(self.text)
        while end > self.released and self.text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for n in range(min(len(s) - 1, end - self.released), 0, -1):
                if self.text[end - n : end] == s[:n]:
                    end -= n
                    break
        return self._release(end)

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released : end]
        self.released = max(self.released, end)
        return piece


@torch.inference_mode()
def generate(model, prompt_ids: list[int], opts: SampleOptions, *,
             decode: Optional[Callable[[list[int]], str]] = None,
             on_text: Optional[Callable[[str], None]] = None,
             use_cache: bool = True) -> Generation:
    """Generate opts.num_samples continuations of prompt_ids in one batch.

    decode (ids -> text) enables stop strings and the texts of the result; on_text receives the
    streamed text of sample 0 as it becomes final (meant for num_samples == 1).
    """
    opts.validate(model.cfg.max_seq_len)
    if opts.stop and decode is None:
        raise ValueError("stop strings need a decode function")
    if not prompt_ids:
        raise GptkitError("the prompt has no tokens; give a prompt (or use a tokenizer with a BOS token)")
    mode = opts.decode_mode(model.tok_emb.weight.device)
    if mode != "eager" and use_cache:
        from gptkit.static_decode import generate_static

        return generate_static(model, prompt_ids, opts, decode, on_text, mode)
    with decoding_layout(model, opts.num_samples):
        return _generate(model, prompt_ids, opts, decode, on_text, use_cache)


def window_plan(opts: SampleOptions, T0: int, max_len: int) -> tuple[int, list[str]]:
    """(the first prompt token the model sees, notes) for a prompt of T0 tokens."""
    if T0 <= max_len:
        return 0, []
    if opts.overflow == "stop":
        raise GptkitError(f"the prompt has {T0} tokens, more than model.max_seq_len={max_len}; "
                          f"shorten it or use overflow=slide")
    keep = opts.keep(max_len)
    return T0 - keep, [f"the prompt has {T0} tokens > model.max_seq_len={max_len}: the model sees its last {keep}"]


def context_note(max_len: int) -> str:
    return f"stopped at model.max_seq_len={max_len} tokens (overflow=stop); overflow=slide continues with a sliding window"


def _generate(model, prompt_ids, opts, decode, on_text, use_cache) -> Generation:
    cfg = model.cfg
    max_len = cfg.max_seq_len
    device = model.tok_emb.weight.device
    B, T0, N = opts.num_samples, len(prompt_ids), opts.max_new_tokens
    keep = opts.keep(max_len)
    start, notes = window_plan(opts, T0, max_len)  # start: the first token of the window the model sees
    generator = None
    if opts.seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(opts.seed))

    tokens = torch.empty(B, T0 + N, dtype=torch.long, device=device)  # [B, T0 + N] prompt and output
    tokens[:, :T0] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    checks = FinishChecks(B, N, opts.eos_id, decode, opts.stop, on_text)
    cache = None
    if use_cache:  # [B, n_kv_heads, cache_len, head_dim] per layer: no longer than the window can get
        cache_len = min(max_len, T0 - start + N)
        cache = KVCache(cfg, B, max_len=cache_len, device=device, dtype=model.tok_emb.weight.dtype)

    def window_logits(n: int) -> torch.Tensor:
        """Logits [B, V] for the token after tokens[:, :n], over the window tokens[:, start:n]."""
        if cache is not None:
            cache.reset()
        return model(tokens[:, start:n], cache=cache, logits_to_keep=1).logits[:, -1]

    t0 = time.perf_counter()
    logits = window_logits(T0)  # [B, V]
    if device.type == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    steps = slides = 0
    n = T0
    t1 = time.perf_counter()
    for i in range(N):
        nxt = sample_next(logits, opts.temperature, opts.top_k, opts.top_p, generator)  # [B]
        tokens[:, n] = nxt
        n += 1
        if checks.active and checks.push(nxt.tolist(), i):
            break
        if i == N - 1:
            break
        if n - start > max_len:  # the newest token does not fit in the window
            if opts.overflow == "stop":
                checks.stop_at_context(i + 1)
                notes.append(context_note(max_len))
                break
            start = n - keep
            slides += 1
            logits = window_logits(n)
        elif cache is not None:
            logits = model(tokens[:, n - 1 : n], cache=cache, logits_to_keep=1).logits[:, -1]  # [B, V]
        else:
            logits = model(tokens[:, start:n], logits_to_keep=1).logits[:, -1]  # [B, V]
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t1
    new, texts, reasons = checks.result(tokens[:, T0:].tolist())
    return Generation(new, texts, reasons, T0, prefill_s, decode_s, steps, slides, notes)


class FinishChecks:
    """EOS and stop strings, sample by sample, and the text of sample 0 streamed to on_text."""

    def __init__(self, batch: int, max_new_tokens: int, eos_id: Optional[int],
                 decode: Optional[Callable[[list[int]], str]], stop: tuple[str, ...],
                 on_text: Optional[Callable[[str], None]]) -> None:
        self.eos_id, self.on_text = eos_id, on_text
        self.streams = [TextStream(decode, stop) for _ in range(batch)] if decode is not None else None
        self.finished = [False] * batch
        self.reasons = ["length"] * batch
        self.lengths = [max_new_tokens] * batch  # new tokens kept per sample
        self.active = eos_id is not None or self.streams is not None  # anything to check at all

    def push(self, ids: list[int], i: int) -> bool:
        """The i-th new token of every sample; True when every sample has finished."""
        for b, tok in enumerate(ids):
            if self.finished[b]:
                continue
            if self.eos_id is not None and tok == self.eos_id:
                self.finished[b], self.reasons[b], self.lengths[b] = True, "eos", i
                continue
            if self.streams is not None:
                piece = self.streams[b].push(tok)
                if b == 0 and self.on_text is not None and piece:
                    self.on_text(piece)
                if self.streams[b].stopped:
                    self.finished[b], self.reasons[b], self.lengths[b] = True, "stop", i + 1
        return all(self.finished)

    def stop_at_context(self, n_tokens: int) -> None:
        for b in range(len(self.finished)):
            if not self.finished[b]:
                self.reasons[b], self.lengths[b] = "context", n_tokens

    def result(self, out: list[list[int]]) -> tuple[list[list[int]], Optional[list[str]], list[str]]:
        """(new tokens cut per sample, texts, stop reasons) from every sample's generated ids."""
        new = [out[b][: self.lengths[b]] for b in range(len(out))]
        texts = None
        if self.streams is not None:
            piece = self.streams[0].finish()  # what was held back (a possible stop-string start)
            if self.on_text is not None and piece:
                self.on_text(piece)
            texts = [s.text for s in self.streams]
        return new, texts, self.reasons


# ---- prompts and special tokens ------------------------------------------------------------------
def special_token_ids(tokenizer, run_config: dict) -> tuple[Optional[int], Optional[int]]:
    """(bos_id, eos_id) of a run's tokenizer: the run's tokenizer.eos_token first, then the usual names."""
    from gptkit.hf import special_tokens

    found = {role: tid for role, (_, tid) in special_tokens(tokenizer).items()}
    eos_name = (run_config.get("tokenizer") or {}).get("eos_token")
    eos = tokenizer.token_to_id(eos_name) if eos_name else None
    return found.get("bos_token"), eos if eos is not None else found.get("eos_token")


def encode_prompt(tokenizer, prompt: str, bos_id: Optional[int]) -> list[int]:
    """The prompt's ids; an empty prompt is [BOS]. Characters the tokenizer cannot represent
    (it raises, drops them or maps them to an unknown token) are named in a one-line GptkitError."""
    if prompt == "":
        if bos_id is None:
            raise GptkitError("the prompt is empty and the tokenizer has no BOS token to start from; "
                              "give prompt=\"...\" (at least one character)")
        return [bos_id]

    def round_trips(text: str) -> bool:
        try:
            return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text
        except Exception:  # noqa: BLE001 - e.g. a WordLevel vocabulary without an unknown token
            return False

    if not round_trips(prompt):
        unknown = [c for c in dict.fromkeys(prompt) if not round_trips(c)]
        if unknown:
            names = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in unknown)
            raise GptkitError(f"the prompt has {len(unknown)} character(s) the tokenizer has never seen: {names}; "
                              f"remove or replace them (a char tokenizer knows only its training corpus)")
    return tokenizer.encode(prompt, add_special_tokens=False).ids
