"""Decoding with fixed shapes: a static KV cache, one compiled one-token step, captured as a CUDA graph.

    prefill (eager, any length)     window [B, W] at positions 0..W-1 -> logits [B, V] -> emit
    step    (fixed shapes)          tok [B, 1] at position pos [1]    -> logits [B, V] -> emit; pos += 1
    emit                            sample on the device -> ring[:, count % K]; tok <- the sample; count += 1

Everything the step reads or writes is a preallocated tensor (the StaticKVCache, tok, pos, ring, count),
so the step is traced once by torch.compile (no Python number in it changes between steps: no recompiles)
and, on CUDA, captured once as a CUDA graph; each later token is one `graph.replay()`. The host looks at
the tokens only every K = check_every tokens: it copies the ring to pinned memory without waiting, queues
the next K steps, and only then reads the copy (EOS, stop strings, streaming), so the device never waits
for the host. Up to 2K - 1 steps may run after every sample has finished; their tokens are dropped.

The window policy is the eager loop's (generate.py): the host knows at which step the window is full,
so a slide (a prefill over the last slide_keep tokens) needs no look at the device either.

Fallbacks, each with one note in Generation.notes: `graph` without CUDA, or when capture fails, runs the
same step without a graph; a step that torch.compile cannot compile runs uncompiled.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Optional

import torch

from gptkit.inference.sampling import (
    FinishChecks,
    Generation,
    SampleOptions,
    context_note,
    sample_next,
    window_plan,
)
from gptkit.model.kv_cache import StaticKVCache

# cache lengths are rounded up to this (capped at max_seq_len): fewer shapes to compile
CACHE_ROUNDING = 128
# eager runs of the step before capture (compiles it, initialises cuBLAS)
WARMUP_STEPS = 3


def _forward_one(model, tok: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """Logits [B, V] of the one token tok [B, 1] at cache.positions: the part that torch.compile traces."""
    return model(tok, cache=cache, logits_to_keep=1).logits[:, -1]


# compile backend -> the compiled _forward_one (one dynamo cache)
_compiled: dict[str, Callable] = {}


def compiled_forward(backend: str) -> Callable:
    if backend not in _compiled:
        _compiled[backend] = torch.compile(_forward_one, backend=backend, fullgraph=True, dynamic=False)
    return _compiled[backend]


def can_capture(device: torch.device) -> bool:
    return device.type == "cuda"


class StaticDecoder:
    """The buffers, the step and (on CUDA) the captured graph for one batch size, cache length, dtype and
    sampling rule. Reused by later generations with the same settings (see `decoder_for`)."""

    def __init__(
        self,
        model,
        batch: int,
        cache_len: int,
        temperature: float,
        top_k: Optional[int],
        top_p: float,
        check_every: int,
        *,
        graph: bool,
        compile_backend: Optional[str],
    ) -> None:
        device, dtype = model.tok_emb.weight.device, model.tok_emb.weight.dtype
        # the model keys the cache of decoders (decoder_for): no strong reference
        self._model = weakref.ref(model)
        self.device, self.K = device, check_every
        self.sampling = (temperature, top_k, top_p)
        self.cache = StaticKVCache(model.cfg, batch, cache_len, device=device, dtype=dtype)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1] the token fed next
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # [1] its position in the window
        self.ring = torch.zeros(batch, check_every, dtype=torch.long, device=device)  # [B, K] recent tokens
        # [1] tokens emitted (ring slot: count % K)
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.generator = torch.Generator(device=device) if temperature > 0 else None
        self.notes: list[str] = []
        self.forward = _forward_one
        self.graph = None
        self.mode = "static"
        if compile_backend is not None:
            self.forward = compiled_forward(compile_backend)
            try:
                # compiles here, not mid-generation
                self._warm_up()
            except Exception as exc:  # noqa: BLE001 - any compiler failure: decode uncompiled
                self.forward = _forward_one
                self.notes.append(
                    f"torch.compile could not compile the decode step ({_one_line(exc)}); decoding uncompiled"
                )
        if graph:
            if not can_capture(device):
                self.notes.append(
                    "decode=graph needs a CUDA device; decoding with the static cache, without a graph"
                )
            else:
                try:
                    self.graph = self._capture()
                    self.mode = "graph"
                # capture is an optimisation: run the same step eagerly
                except Exception as exc:  # noqa: BLE001
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    self.graph = None
                    self.notes.append(
                        f"CUDA graph capture failed ({_one_line(exc)}); decoding without a graph"
                    )

    @property
    def model(self):
        return self._model()

    # ---- the device program -------------------------------------------------------------------
    def _emit(self, logits: torch.Tensor) -> None:
        """Sample from logits [B, V], record the token in the ring and feed it back."""
        nxt = sample_next(logits, *self.sampling, self.generator)  # [B]
        self.ring.index_copy_(1, torch.remainder(self.count, self.K), nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.count.add_(1)

    def _step(self) -> None:
        self.cache.positions = self.pos
        self._emit(self.forward(self.model, self.tok, self.cache))
        self.pos.add_(1)

    def step(self) -> None:
        """One token per sample: a graph replay, or the step itself."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()

    def prefill(self, window: torch.Tensor) -> None:
        """Fill the cache from window [B, W] at positions 0..W-1 and emit the token that follows."""
        W = window.shape[1]
        # K/V need nothing (the mask hides what an earlier window left); a recurrent state starts from zero
        self.cache.reset()
        self.cache.positions = torch.arange(W, device=self.device)  # [W]
        self._emit(self.model(window, cache=self.cache, logits_to_keep=1).logits[:, -1])
        self.pos.fill_(W)

    def start(self, seed: Optional[int]) -> None:
        """Before a generation: the ring starts over, the generator is seeded (or drawn at random)."""
        self.count.zero_()
        if self.generator is not None:
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(seed))

    # ---- compile and capture --------------------------------------------------------------------
    def _warm_up(self) -> None:
        for _ in range(WARMUP_STEPS):
            # the slots written here are rewritten by the prefill before anything reads them
            self.pos.zero_()
            self._step()

    def _capture(self):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._warm_up()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            # the replays draw from it (seeded per generation)
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self._step()
        return graph

    # ---- reading tokens back ----------------------------------------------------------------------
    def snapshot(self):
        """Copy the ring to the host without waiting for it: -> (host tensor, event or None)."""
        if self.device.type != "cuda":
            return self.ring.clone(), None
        host = torch.empty(self.ring.shape, dtype=self.ring.dtype, pin_memory=True)
        host.copy_(self.ring, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


# model -> (key, the last decoder)
_decoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decoder_for(
    model, batch: int, cache_len: int, opts: SampleOptions, mode: str, compile_backend: Optional[str]
) -> tuple[StaticDecoder, float]:
    """The model's decoder for these settings (built, compiled and captured on first use) and the seconds
    it took to build now (0 when reused)."""
    w = model.tok_emb.weight
    key = (
        batch,
        cache_len,
        w.dtype,
        w.device,
        w.data_ptr(),
        float(opts.temperature),
        opts.top_k or None,
        float(opts.top_p),
        opts.check_every,
        mode,
        compile_backend,
    )
    held = _decoders.get(model)
    if held is not None and held[0] == key:
        return held[1], 0.0
    # free the old cache and graph first
    _decoders.pop(model, None)
    t0 = time.perf_counter()
    dec = StaticDecoder(
        model,
        batch,
        cache_len,
        float(opts.temperature),
        opts.top_k or None,
        float(opts.top_p),
        opts.check_every,
        graph=mode == "graph",
        compile_backend=compile_backend,
    )
    if w.device.type == "cuda":
        torch.cuda.synchronize(w.device)
    _decoders[model] = (key, dec)
    return dec, time.perf_counter() - t0


def static_cache_len(T0: int, start: int, N: int, max_len: int) -> int:
    need = T0 - start + N
    return min(max_len, -(-need // CACHE_ROUNDING) * CACHE_ROUNDING)


def generate_static(
    model,
    prompt_ids: list[int],
    opts: SampleOptions,
    decode,
    on_text,
    mode: str,
    compile_backend: Optional[str] = "default",
) -> Generation:
    """generate.generate for decode=static|graph (called from there, inside inference mode).

    compile_backend "default": opts.compile decides (None: inductor on CUDA, nothing elsewhere); a name:
    that torch.compile backend (tests use "aot_eager"); None: no compile."""
    cfg = model.cfg
    max_len = cfg.max_seq_len
    device = model.tok_emb.weight.device
    B, T0, N, K = opts.num_samples, len(prompt_ids), opts.max_new_tokens, opts.check_every
    keep = opts.keep(max_len)
    start, notes = window_plan(opts, T0, max_len)
    if compile_backend == "default":
        use = opts.compile if opts.compile is not None else device.type == "cuda"
        compile_backend = "inductor" if use else None
    # tokens to produce: overflow=stop ends when the next token would not fit (start is 0 then)
    limit = N if opts.overflow == "slide" else min(N, max_len - T0 + 1)
    if limit > 1:
        dec, setup_s = decoder_for(
            model, B, static_cache_len(T0, start, N, max_len), opts, mode, compile_backend
        )
    # one token is the prefill's: no step to compile or capture, and nothing worth keeping
    else:
        dec = StaticDecoder(
            model,
            B,
            min(max_len, T0 - start + 1),
            float(opts.temperature),
            opts.top_k or None,
            float(opts.top_p),
            K,
            graph=False,
            compile_backend=None,
        )
        setup_s = 0.0
    notes += dec.notes
    dec.start(opts.seed)
    checks = FinishChecks(B, N, opts.eos_id, decode, opts.stop, on_text)
    # per sample: the prompt and every token emitted so far
    seqs = [list(prompt_ids) for _ in range(B)]
    # tokens already copied back to seqs
    read = 0
    # (host copy, event, first token index, count) of the last snapshot, not yet read
    pending = None

    def take(snap) -> bool:
        """Read a snapshot into seqs and run the checks on its tokens; True when every sample is done."""
        host, event, first, count = snap
        if event is not None:
            event.synchronize()
        ring = host.tolist()
        done = False
        for i in range(first, first + count):
            ids = [ring[b][i % K] for b in range(B)]
            for b in range(B):
                seqs[b].append(ids[b])
            if checks.active and not done:
                done = checks.push(ids, i)
        return done

    def flip(emitted: int) -> bool:
        """Snapshot the unread tokens, then read the previous snapshot (already on the host by now)."""
        nonlocal read, pending
        host, event = dec.snapshot()
        snap, read = (host, event, read, emitted - read), emitted
        previous, pending = pending, snap
        return previous is not None and take(previous)

    def drain() -> bool:
        nonlocal pending
        done = False
        if pending is not None:
            done, pending = take(pending), None
        return done

    t0 = time.perf_counter()
    # [B, T0 - start]
    window = torch.tensor(prompt_ids[start:], dtype=torch.long, device=device).expand(B, -1)
    dec.prefill(window)
    # tokens emitted; length of the sequence so far
    emitted, n = 1, T0 + 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prefill_s = time.perf_counter() - t0
    steps = slides = 0
    t1 = time.perf_counter()
    done = False
    while emitted < limit and not done:
        # the newest token does not fit in the window: slide (overflow=stop never gets here); or the window
        # outgrew a longrope scaling's original context: every key again, with the long factors
        slide = n - start > max_len
        if slide or model.rope_restart(n - 1 - start, n - start):
            done = flip(emitted) or drain()
            if done:
                break
            if slide:
                start = n - keep
                slides += 1
            window = torch.tensor(
                [s[start:n] for s in seqs], dtype=torch.long, device=device
            )  # [B, n - start]
            dec.prefill(window)
        else:
            dec.step()
        emitted, n, steps = emitted + 1, n + 1, steps + 1
        if emitted - read == K:
            done = flip(emitted)
    if not done:
        done = flip(emitted) or drain()
    drain()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    decode_s = time.perf_counter() - t1
    if limit < N and not all(checks.finished):
        checks.stop_at_context(limit)
        notes.append(context_note(max_len))
    new, texts, reasons = checks.result([s[T0:] for s in seqs])
    return Generation(new, texts, reasons, T0, prefill_s, decode_s, steps, slides, notes, dec.mode, setup_s)
