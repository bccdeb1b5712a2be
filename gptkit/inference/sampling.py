"""Choosing tokens and deciding when to stop: what every decoding loop shares (generate.py's eager loop
and static_decode.py's fixed-shape one).

    SampleOptions   what to generate: length, temperature / top-k / top-p, seed, samples, EOS, stop strings,
                    the overflow policy beyond the context, the decoding mode
    sample_next     one token per row of logits, on the device (no host sync)
    TextStream      incremental text of a growing id list, holding back what a stop string may still claim
    FinishChecks    EOS and stop strings per sample, and the streamed text of sample 0
    Generation      what a generation returns
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.errors import ConfigError, GptkitError

OVERFLOW_POLICIES = ("slide", "stop")
DECODE_MODES = ("auto", "eager", "static", "graph")


@dataclass
class SampleOptions:
    max_new_tokens: int = 200
    # 0: greedy
    temperature: float = 1.0
    # None or 0: off
    top_k: Optional[int] = None
    # 1.0: off
    top_p: float = 1.0
    seed: Optional[int] = None
    num_samples: int = 1
    eos_id: Optional[int] = None
    stop: tuple[str, ...] = ()
    overflow: str = "slide"
    # None: 3/4 of max_seq_len
    slide_keep: Optional[int] = None
    # auto | eager | static | graph (module docstring)
    decode: str = "auto"
    # torch.compile the static step; None: on CUDA only
    compile: Optional[bool] = None
    # static/graph: tokens between two looks at EOS and stop strings
    check_every: int = 16

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
    # per sample: the new token ids (cut at EOS / the stop string)
    tokens: list[list[int]]
    # per sample: the new text, when a decode function was given
    texts: Optional[list[str]]
    # per sample: eos | stop | length | context
    stop_reasons: list[str]
    prompt_tokens: int
    # the first forward pass (the prompt) and the first token, seconds
    prefill_s: float
    # every later step, seconds
    decode_s: float
    # forward passes after the prefill (each emits one token per sample)
    decode_steps: int
    # times the window slid (each one re-prefills slide_keep tokens)
    slides: int = 0
    notes: list[str] = field(default_factory=list)
    # the loop that ran: eager | static | graph
    decode: str = "eager"
    # static/graph: building the step (compile, CUDA graph capture), before the prefill
    setup_s: float = 0.0
    # draft=: speculative decoding's figures (speculative.SpecStats.as_dict), else None
    speculative: Optional[dict] = None


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
    # the last V % 128 entries
    if n * block < V:
        tail = logits[:, n * block :].argmax(-1) + n * block  # [B]
        head_max, tail_max = logits[rows, idx], logits[rows, tail]
        later = (tail_max > head_max) | (tail_max.isnan() & ~head_max.isnan())
        idx = torch.where(later, tail, idx)
    return idx


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    generator: Optional[torch.Generator],
    noise: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per row of logits [B, V]: greedy when temperature is 0, else sampled; -> [B].

    noise: [B, V] Exp(1) draws to sample with (gptkit.inference.rollouts: each row's its own, a pure function
    of its key); None draws them from `generator`. Never waits for the device, so it runs inside a CUDA
    graph."""
    if temperature == 0:
        return argmax(logits)
    probs = sampling_probs(logits, temperature, top_k, top_p)  # [B, V]
    # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i: torch.multinomial(probs, 1) computes
    # exactly this (the same draws from the same generator), but first checks the probabilities on the host
    if noise is None:
        noise = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V]
    return argmax(probs / noise)


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: float
) -> torch.Tensor:
    """The distribution sample_next draws from, logits [B, V] -> fp32 probabilities [B, V]: divided by
    temperature (> 0), then top-k, then top-p (speculative.py filters the target's and the draft's alike)."""
    logits = logits.float() / temperature  # [B, V]
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
        # keep the smallest prefix reaching top_p
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)  # [B, V]


class TextStream:
    """Incremental decoding of a growing id list: only finished text is released.

    Decoding the whole list each time (not token by token) keeps multi-byte characters and BPE
    pieces intact; a trailing U+FFFD (an unfinished UTF-8 sequence) and anything that could be the
    start of a stop string are held back until the next token decides them.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode, self.stop = decode, stop
        self.ids: list[int] = []
        # characters of the text already handed out
        self.released = 0
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
        # hold back a suffix that may grow into a stop string
        for s in self.stop:
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


def window_plan(opts: SampleOptions, T0: int, max_len: int) -> tuple[int, list[str]]:
    """(the first prompt token the model sees, notes) for a prompt of T0 tokens."""
    if T0 <= max_len:
        return 0, []
    if opts.overflow == "stop":
        raise GptkitError(
            f"the prompt has {T0} tokens, more than model.max_seq_len={max_len}; "
            f"shorten it or use overflow=slide"
        )
    keep = opts.keep(max_len)
    return T0 - keep, [
        f"the prompt has {T0} tokens > model.max_seq_len={max_len}: the model sees its last {keep}"
    ]


def context_note(max_len: int) -> str:
    return (
        f"stopped at model.max_seq_len={max_len} tokens (overflow=stop); overflow=slide continues with a "
        f"sliding window"
    )


class FinishChecks:
    """EOS and stop strings, sample by sample, and the text of sample 0 streamed to on_text."""

    def __init__(
        self,
        batch: int,
        max_new_tokens: int,
        eos_id: Optional[int],
        decode: Optional[Callable[[list[int]], str]],
        stop: tuple[str, ...],
        on_text: Optional[Callable[[str], None]],
    ) -> None:
        self.eos_id, self.on_text = eos_id, on_text
        self.streams = [TextStream(decode, stop) for _ in range(batch)] if decode is not None else None
        self.finished = [False] * batch
        self.reasons = ["length"] * batch
        # new tokens kept per sample
        self.lengths = [max_new_tokens] * batch
        # anything to check at all
        self.active = eos_id is not None or self.streams is not None

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
            # what was held back (a possible stop-string start)
            piece = self.streams[0].finish()
            if self.on_text is not None and piece:
                self.on_text(piece)
            texts = [s.text for s in self.streams]
        return new, texts, self.reasons
