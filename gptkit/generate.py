"""Autoregressive generation with a KV cache: one prefill pass over the prompt, then one token per step.

    prompt ids [T0] -> repeat to [B, T0] -> prefill (cache filled, logits of the last position only)
      -> loop: sample next [B] -> append -> decode one step [B, 1] through the cache -> logits [B, V]

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gptkit.errors import ConfigError, GptkitError
from gptkit.model.kv_cache import KVCache
from gptkit.tokenizer import describe_characters, special_tokens, unknown_characters

OVERFLOW_POLICIES = ("slide", "stop")


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

    def keep(self, max_seq_len: int) -> int:
        return self.slide_keep if self.slide_keep else max(1, max_seq_len * 3 // 4)


@dataclass
class Generation:
    tokens: list[list[int]]  # per sample: the new token ids (cut at EOS / the stop string)
    texts: Optional[list[str]]  # per sample: the new text, when a decode function was given
    stop_reasons: list[str]  # per sample: eos | stop | length | context
    prompt_tokens: int
    prefill_s: float  # the first forward pass (the prompt), seconds
    decode_s: float  # every later step, seconds
    decode_steps: int  # forward passes after the prefill (each emits one token per sample)
    slides: int = 0  # times the window slid (each one re-prefills slide_keep tokens)
    notes: list[str] = field(default_factory=list)


def sample_next(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: float,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token per row of logits [B, V]: greedy when temperature is 0, else sampled; -> [B]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
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
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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


class _TransposedLinear(torch.nn.Module):
    """A Linear layer as x @ W^T with W^T stored contiguous [in_features, out_features] (MKL addmm).

    On CPU, for the one row per step that batch-1 decoding feeds a layer, this layout runs 2-3x faster
    than F.linear on the [out_features, in_features] weight (measured for the 32000x128 and 12000x384 LM
    heads in fp32); it is also the layout of GPT-2's Conv1D in transformers.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight_t = linear.weight.detach().t().contiguous()  # [in_features, out_features]
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t  # [..., out_features]
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight_t).view(*x.shape[:-1], -1)


class _PackedLinear(torch.nn.Module):
    """A Linear layer through oneDNN (torch's mkldnn backend) with its weight reordered once into the
    blocked layout oneDNN picks for `rows` input rows: the op torch.compile's CPU freezing pass emits.

    Measured on a decode step's worth of distinct fp32 weights (a 6-layer d=384 model with a 12000-token
    head, one thread): for the 2-16 rows per step of batched decoding this is ~2x faster than MKL on
    either weight layout (8 rows: 5.2 vs 10.0 ms). At one row MKL on W^T is as fast or faster (4.5 vs
    6.0 ms on one thread; on two threads the order depends on the model's sizes), hence
    _TransposedLinear there. Results are fp32 (max |diff| vs F.linear ~1e-6, MKL's own rounding size).
    """

    def __init__(self, linear: torch.nn.Linear, rows: int) -> None:
        super().__init__()
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")


DECODING_LAYOUT_MAX_BYTES = 1 << 30  # above this, a second copy of the weights is not worth the memory


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@contextmanager
def decoding_layout(model, batch: int = 1):
    """On CPU, swap every Linear layer for a copy laid out for decoding `batch` rows per step, for the
    duration of a generation (the model's own modules come back afterwards): oneDNN with prepacked
    weights for fp32 batches of 2 or more rows; for one row (and other dtypes) MKL on W^T, except for
    narrowing layers (out < in features), where MKL's matrix-vector product is faster on W itself
    (cold weights, one row: 1536 -> 384 in 200-250 us on W vs 270-325 us on W^T; the other way round
    for widening layers, 384 -> 1536 in 165-180 vs 310-340 us; gpt2-15M decode step 5.5 -> 4.9 ms).
    The copies cost one more set of matmul weights, so this is done only while those weights take
    less than DECODING_LAYOUT_MAX_BYTES."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if model.lm_head.weight.device.type != "cpu" or linear_bytes > DECODING_LAYOUT_MAX_BYTES:
        yield
        return

    def decoding_copy(linear: torch.nn.Linear) -> torch.nn.Module:
        if batch > 1 and _onednn_usable(linear.weight):
            try:
                packed = _PackedLinear(linear, batch)
                packed(linear.weight.new_zeros(batch, linear.in_features))  # fails here, not mid-generation
                return packed
            except RuntimeError:  # a torch build whose oneDNN cannot pack or run this layer
                pass
        if batch == 1 and linear.out_features < linear.in_features:
            return linear  # a narrowing layer (MLP down-projection): MKL is faster on W itself
        return _TransposedLinear(linear)

    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                swapped.append((parent, name, child))
                setattr(parent, name, decoding_copy(child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


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
    with decoding_layout(model, opts.num_samples):
        return _generate(model, prompt_ids, opts, decode, on_text, use_cache)


def _generate(model, prompt_ids, opts, decode, on_text, use_cache) -> Generation:
    cfg = model.cfg
    max_len = cfg.max_seq_len
    if opts.stop and decode is None:
        raise ValueError("stop strings need a decode function")
    if not prompt_ids:
        raise GptkitError("the prompt has no tokens; give a prompt (or use a tokenizer with a BOS token)")
    device = model.tok_emb.weight.device
    B, T0, N = opts.num_samples, len(prompt_ids), opts.max_new_tokens
    keep = opts.keep(max_len)
    notes: list[str] = []
    if T0 > max_len:
        if opts.overflow == "stop":
            raise GptkitError(f"the prompt has {T0} tokens, more than model.max_seq_len={max_len}; "
                              f"shorten it or use overflow=slide")
        notes.append(f"the prompt has {T0} tokens > model.max_seq_len={max_len}: the model sees its last {keep}")
    generator = None
    if opts.seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(opts.seed))

    tokens = torch.empty(B, T0 + N, dtype=torch.long, device=device)  # [B, T0 + N] prompt and output
    tokens[:, :T0] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    streams = [TextStream(decode, opts.stop) for _ in range(B)] if decode is not None else None
    finished = [False] * B
    reasons = ["length"] * B
    lengths = [N] * B  # new tokens kept per sample
    start = 0 if T0 <= max_len else T0 - keep  # first token of the window the model sees
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
        if opts.eos_id is not None or streams is not None:
            done_now = _finish_checks(nxt, i, opts.eos_id, finished, streams, reasons, lengths, on_text)
            if done_now:
                break
        if i == N - 1:
            break
        if n - start > max_len:  # the newest token does not fit in the window
            if opts.overflow == "stop":
                for b in range(B):
                    if not finished[b]:
                        reasons[b], lengths[b] = "context", i + 1
                notes.append(f"stopped at model.max_seq_len={max_len} tokens (overflow=stop); "
                             f"overflow=slide continues with a sliding window")
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

    out = tokens[:, T0:].tolist()
    new = [out[b][: lengths[b]] for b in range(B)]
    texts = None
    if streams is not None:
        piece = streams[0].finish()  # what was held back (a possible stop-string start)
        if on_text is not None and piece:
            on_text(piece)
        texts = [s.text for s in streams]
    return Generation(new, texts, reasons, T0, prefill_s, decode_s, steps, slides, notes)


def _finish_checks(nxt, i, eos_id, finished, streams, reasons, lengths, on_text) -> bool:
    """Mark samples that hit EOS or a stop string at step i; stream sample 0. True when all are done."""
    ids = nxt.tolist()
    for b, tok in enumerate(ids):
        if finished[b]:
            continue
        if eos_id is not None and tok == eos_id:
            finished[b], reasons[b], lengths[b] = True, "eos", i
            continue
        if streams is not None:
            piece = streams[b].push(tok)
            if b == 0 and on_text is not None and piece:
                on_text(piece)
            if streams[b].stopped:
                finished[b], reasons[b], lengths[b] = True, "stop", i + 1
    return all(finished)


# ---- prompts and special tokens ------------------------------------------------------------------
def special_token_ids(tokenizer, run_config: dict) -> tuple[Optional[int], Optional[int]]:
    """(bos_id, eos_id) of a run's tokenizer: the run's tokenizer.eos_token first, then the usual names."""
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

    unknown = unknown_characters(tokenizer, prompt)
    if unknown:
        raise GptkitError(f"the prompt has {len(unknown)} character(s) the tokenizer has never seen: "
                          f"{describe_characters(unknown)}; remove or replace them (a char tokenizer knows only "
                          f"its training corpus)")
    return tokenizer.encode(prompt, add_special_tokens=False).ids
