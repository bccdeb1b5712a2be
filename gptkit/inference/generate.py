"""Autoregressive generation with a KV cache: one prefill pass over the prompt, then one token per step.

    prompt ids [T0] -> repeat to [B, T0] -> prefill (cache filled, logits of the last position only)
      -> loop: sample next [B] -> append -> decode one step [B, 1] through the cache -> logits [B, V]

Two ways to run that loop (`decode`):
  eager   a growing KVCache; on CPU the Linear weights are laid out for the batch (decoding_layout.py);
          EOS and stop strings are checked after every token.
  static  a preallocated StaticKVCache written at a position tensor, so the one-token step has fixed
  graph   shapes: it can be compiled (torch.compile) and, on CUDA, captured once as a CUDA graph and
          replayed (`graph`). Sampling stays on the device; EOS and stop strings are checked every
          `check_every` tokens without stalling the device (static_decode.py).
  auto    graph on CUDA, eager elsewhere.
Greedy tokens are the same either way (tests/inference/test_generate.py checks it, sliding windows included).

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

from gptkit.chat_formats.tools import Conversation
from gptkit.chat_templates import encode_conversation, encode_text
from gptkit.errors import GptkitError
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.sampling import (
    FinishChecks,
    Generation,
    SampleOptions,
    TextStream,
    context_note,
    sample_next,
    window_plan,
)
from gptkit.inference.speculative import Rule, SpecStats, Speculator, check_rewindable, generate_speculative
from gptkit.inference.static_decode import generate_static
from gptkit.model.kv_cache import KVCache
from gptkit.tokenizer import describe_characters, special_tokens, unknown_characters


@torch.inference_mode()
def generate(
    model,
    prompt_ids: list[int],
    opts: SampleOptions,
    *,
    decode: Optional[Callable[[list[int]], str]] = None,
    on_text: Optional[Callable[[str], None]] = None,
    use_cache: bool = True,
    speculate: Optional[Speculator] = None,
) -> Generation:
    """Generate opts.num_samples continuations of prompt_ids in one batch.

    decode (ids -> text) enables stop strings and the texts of the result; on_text receives the
    streamed text of sample 0 as it becomes final (meant for num_samples == 1). speculate: a draft and k
    (speculative.py: one sample, the eager loop with the draft's proposals checked k at a time;
    Generation.speculative holds its figures).
    """
    opts.validate(model.cfg.max_seq_len)
    if opts.stop and decode is None:
        raise ValueError("stop strings need a decode function")
    if not prompt_ids:
        raise GptkitError("the prompt has no tokens; give a prompt (or use a tokenizer with a BOS token)")
    if speculate is not None:
        with decoding_layout(model, 1), speculate.drafter.layout(model):
            return generate_speculative(model, prompt_ids, opts, speculate, decode, on_text)
    mode = opts.decode_mode(model.tok_emb.weight.device)
    if mode != "eager" and use_cache:
        return generate_static(model, prompt_ids, opts, decode, on_text, mode)
    with decoding_layout(model, opts.num_samples):
        return _generate(model, prompt_ids, opts, decode, on_text, use_cache)


def _generate(model, prompt_ids, opts, decode, on_text, use_cache) -> Generation:
    cfg = model.cfg
    max_len = cfg.max_seq_len
    device = model.tok_emb.weight.device
    B, T0, N = opts.num_samples, len(prompt_ids), opts.max_new_tokens
    keep = opts.keep(max_len)
    # start: the first token of the window the model sees
    start, notes = window_plan(opts, T0, max_len)
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
        # the newest token does not fit in the window
        if n - start > max_len:
            if opts.overflow == "stop":
                checks.stop_at_context(i + 1)
                notes.append(context_note(max_len))
                break
            start = n - keep
            slides += 1
            logits = window_logits(n)
        elif cache is not None and model.rope_restart(n - 1 - start, n - start):
            # past a longrope scaling's original context: every key again, with the long factors
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


# ---- prompts and special tokens ------------------------------------------------------------------
def special_token_ids(tokenizer, run_config: dict) -> tuple[Optional[int], Optional[int]]:
    """(bos_id, eos_id) of a run's tokenizer: the run's tokenizer.eos_token first, then the usual names."""
    found = {role: tid for role, (_, tid) in special_tokens(tokenizer).items()}
    eos_name = (run_config.get("tokenizer") or {}).get("eos_token")
    eos = tokenizer.token_to_id(eos_name) if eos_name else None
    return found.get("bos_token"), eos if eos is not None else found.get("eos_token")


# what an empty prompt continues when the tokenizer has no BOS and no end-of-text token
EMPTY_START = "\n"


def empty_prompt_start(bos_id: Optional[int], eos_id: Optional[int]) -> str:
    """What an empty prompt starts from, in words: BOS, else the end-of-text token (a new document begins
    after it, as in GPT-2), else a newline (a line's start: byte or char tokenizers without specials)."""
    if bos_id is not None:
        return "the BOS token"
    return "the end-of-text token" if eos_id is not None else 'a newline ("\\n")'


def encode_prompt(
    tokenizer,
    prompt: str,
    bos_id: Optional[int],
    eos_id: Optional[int] = None,
    allow_special_text: bool = False,
) -> list[int]:
    """The prompt's ids; an empty prompt is [BOS], else [end-of-text], else a newline's ids (see
    empty_prompt_start). Characters the tokenizer cannot represent (it raises, drops them or maps them to an
    unknown token) are named in a one-line GptkitError. Text is data: a special token the prompt spells is
    its characters (allow_special_text: the control id, as before: special_tokens_in_content=allow)."""
    if prompt == "":
        for start in (bos_id, eos_id):
            if start is not None:
                return [start]
        if unknown_characters(tokenizer, EMPTY_START):
            raise GptkitError(
                "the prompt is empty and the tokenizer has no BOS token, no end-of-text token "
                'and no newline to start from; give prompt="..." (at least one character)'
            )
        return tokenizer.encode(EMPTY_START, add_special_tokens=False).ids

    unknown = unknown_characters(tokenizer, prompt)
    if unknown:
        raise GptkitError(
            f"the prompt has {len(unknown)} character(s) the tokenizer has never seen: "
            f"{describe_characters(unknown)}; remove or replace them (a char tokenizer knows "
            f"only its training corpus)"
        )
    if allow_special_text:
        return tokenizer.encode(prompt, add_special_tokens=False).ids
    return encode_text(tokenizer, prompt)


# ---- a conversation: one KV cache across turns -----------------------------------------------------------
@dataclass
class Turn:
    # the assistant's reply
    text: str
    # its token ids (the end-of-turn token excluded)
    tokens: list[int]
    # eos (the end-of-turn / end-of-text token) | length | context
    stop_reason: str
    # the conversation so far, rendered with the generation prompt
    prompt_tokens: int
    # of those, run through the model in this turn's prefill (the rest came from the cache)
    fed_tokens: int
    prefill_s: float
    decode_s: float
    notes: list[str] = field(default_factory=list)
    # the tools the reply calls ({id, name, arguments}; empty: its text is all of it)
    calls: list[dict] = field(default_factory=list)
    # speculate=: the turn's speculative figures (speculative.SpecStats.as_dict), else None
    speculative: Optional[dict] = None


class ChatSession:
    """A conversation with a model, rendered with a chat template, through one KV cache kept across turns.

    Every turn renders the whole conversation (the template decides the text) and tokenizes it
    (encode_conversation: a special token that a message spells is its text, unless allow_special_text); the
    tokens the cache already holds (the longest common prefix with what it was fed, the previous replies
    included) are not run again: a second turn feeds only its new tokens. reuse_cache=False re-runs the whole
    conversation every turn (the baseline). When the conversation no longer fits in max_context tokens
    (with room for max_new_tokens), its oldest turns are left out (the system prompt stays).

    fit_answer=True (max_new_tokens is a default, not the user's): an answer gets at most what the context
    leaves after the conversation, and older turns are left out to keep only min(max_new_tokens, half the
    context) for it, so a default larger than a small model's context still chats (fit_note says so).
    """

    def __init__(
        self,
        model,
        tokenizer,
        template,
        opts: SampleOptions,
        system: str | None = None,
        stop_ids: tuple[int, ...] = (),
        max_context: int | None = None,
        reuse_cache: bool = True,
        fit_answer: bool = False,
        allow_special_text: bool = False,
        tools: list[dict] | None = None,
        speculate: Optional[Speculator] = None,
    ) -> None:
        cfg = model.cfg
        # the tools the template renders (gptkit.chat_formats.tools' specs), and how a reply calls them
        self.tools = tools or None
        self.call_syntax = template.call_syntax() if self.tools else None
        if self.tools and self.call_syntax is None:
            raise GptkitError(
                f"the chat template {template.name} writes no tool call that gptkit can read back (no JSON "
                'call object such as {"name": ..., "arguments": ...}); chat with tools= needs a template '
                "with tool syntax"
            )
        self.model, self.tokenizer, self.template, self.opts = model, tokenizer, template, opts
        self.system, self.stop_ids, self.reuse_cache = system, set(stop_ids), reuse_cache
        self.allow_special_text = allow_special_text
        # a draft (speculative.py): its proposals checked draft_k at a time; the cache keeps every position
        self.speculate = speculate
        if speculate is not None:
            check_rewindable(model, "the model")
        self.max_context = min(max_context or cfg.max_seq_len, cfg.max_seq_len)
        self.fit_answer = fit_answer
        # what a turn keeps free for its answer when older turns are left out
        self.room = (
            min(opts.max_new_tokens, max(1, self.max_context // 2)) if fit_answer else opts.max_new_tokens
        )
        if self.room >= self.max_context:
            raise GptkitError(
                f"max_new_tokens={opts.max_new_tokens} leaves no room for the conversation in "
                f"{self.max_context} tokens of context; lower it"
            )
        device = model.tok_emb.weight.device
        dtype = model.tok_emb.weight.dtype
        # across turns
        self.cache = KVCache(
            cfg, 1, max_len=self.max_context, device=device, dtype=dtype, rolling=speculate is None
        )
        self.generator = None
        if opts.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(int(opts.seed))
        self.reset()

    def fit_note(self) -> str | None:
        """One line when fit_answer may cap answers below max_new_tokens (a small context), else None."""
        if self.room >= self.opts.max_new_tokens:
            return None
        return (
            f"an answer gets at most what the {self.max_context}-token context leaves after the "
            f"conversation (the default max_new_tokens={self.opts.max_new_tokens} does not fit; older turns "
            f"are left out to keep {self.room} free); give max_new_tokens= to choose"
        )

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages: list[dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        # the tokens whose keys and values the cache holds, in order
        self.cached: list[int] = []
        self.cache.reset()

    def _prompt(self) -> tuple[list[int], list[str]]:
        """The conversation's ids with the generation prompt, its oldest turns left out until it fits."""
        notes = []
        while True:
            try:
                ids, _ = encode_conversation(
                    self.tokenizer,
                    self.template,
                    Conversation(self.messages, self.tools),
                    "the message",
                    add_generation_prompt=True,
                    allow_special_text=self.allow_special_text,
                )
            # the conversation as it was
            except GptkitError:
                self.messages.pop()
                raise
            if len(ids) + self.room <= self.max_context:
                return ids, notes
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            # the oldest exchange: a user message and what answers it (the reply, its calls, their results)
            later = [i for i, m in enumerate(self.messages) if i > first and m["role"] == "user"]
            # only the new exchange is left
            if not later:
                # a long message, a shorter answer
                if self.fit_answer and len(ids) < self.max_context:
                    return ids, notes
                self.messages.pop()
                with_answer = "" if self.fit_answer else f"with max_new_tokens={self.opts.max_new_tokens} "
                raise GptkitError(
                    f"the message takes {len(ids)} tokens with the template; {with_answer}that exceeds the "
                    f"context of {self.max_context}: shorten it"
                )
            del self.messages[first : later[0]]
            notes.append("the conversation outgrew the context: its oldest turn was left out")

    def reply(self, user: str, on_text: Optional[Callable[[str], None]] = None) -> Turn:
        """Add the user's message, generate the assistant's reply (streamed to on_text), add it too."""
        self.messages.append({"role": "user", "content": user})
        return self._answer(on_text)

    def answer_calls(self, results: list[str], on_text: Optional[Callable[[str], None]] = None) -> Turn:
        """Add the results of the last reply's calls (one each, in order) as tool messages, and generate
        the assistant's next reply."""
        calls = self.messages[-1].get("tool_calls") or []
        if len(results) != len(calls):
            raise GptkitError(f"{len(results)} tool results for {len(calls)} calls")
        for c, r in zip(calls, results):
            self.messages.append(
                {"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": r}
            )
        return self._answer(on_text)

    @torch.inference_mode()
    def _answer(self, on_text: Optional[Callable[[str], None]]) -> Turn:
        ids, notes = self._prompt()
        keep = 0
        if self.reuse_cache:
            # at least one token is fed, for the next logits
            limit = min(len(self.cached), len(ids) - 1)
            while keep < limit and self.cached[keep] == ids[keep]:
                keep += 1
        # keys cached on the other side of a longrope scaling's switch are stale: all fed again
        if self.model.rope_restart(self.cache.length, len(ids)):
            keep = 0
        # a local layer's rolling cache may no longer hold what position `keep` needs: then 0, all fed again
        keep = self.cache.rewind(keep)
        self.cached = ids[:keep]
        stream = TextStream(self.tokenizer.decode)
        reader = self.template.reply_reader(self.tokenizer)
        out: list[int] = []
        # fit_answer: at most what the context leaves (otherwise _prompt left max_new_tokens free)
        budget = min(self.opts.max_new_tokens, self.max_context - len(ids))

        def show(tok: int) -> None:
            # the text a reply shows (harmony: its final channel's)
            if reader.shows(tok):
                piece = stream.push(tok)
                if on_text is not None and piece:
                    on_text(piece)

        if self.speculate is not None:
            with decoding_layout(self.model, 1), self.speculate.drafter.layout(self.model):
                reason, prefill_s, decode_s = self._speculate(ids, out, budget, show)
        else:
            reason, prefill_s, decode_s = self._decode(ids, keep, out, budget, show)
        piece = stream.finish()
        if on_text is not None and piece:
            on_text(piece)
        message = reader.message(out, stream.text)
        # a reply the reader showed none of (harmony's, without a message header): shown whole at its end
        if on_text is not None and message["content"] and not stream.text:
            on_text(message["content"])
        calls = []
        parsed = (
            self.call_syntax.parse(message["content"], self.tools)
            if self.call_syntax is not None and reason == "eos"
            else None
        )
        if parsed is not None:
            # the calls, as the template renders them (arguments objects), each an id
            n = sum(len(m.get("tool_calls") or []) for m in self.messages)
            calls = [{"id": f"call_{n + k}", **c} for k, c in enumerate(parsed[1])]
            message = {
                "role": "assistant",
                "content": parsed[0] or "",
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ],
            }
        self.messages.append(message)
        spec = None if self.speculate is None else self.speculate.stats.as_dict(self.speculate.drafter.name,
                                                                                self.speculate.k)  # fmt: skip
        return Turn(
            message["content"],
            out,
            reason,
            len(ids),
            len(ids) - keep,
            prefill_s,
            decode_s,
            notes,
            calls,
            spec,
        )

    def _speculate(self, ids: list[int], out: list[int], budget: int, show) -> tuple[str, float, float]:
        """The reply's tokens into `out` through the draft (the cache holds self.cached, a prefix of ids):
        (stop reason, prefill s, decode s); the first verified step (it holds the prompt) is the prefill."""
        o = self.opts
        rule = Rule(o.temperature, o.top_k, o.top_p, self.generator)
        self.speculate.stats = SpecStats()
        # the tokens run so far: the cache holds a prefix of them
        seq = list(ids)
        reason = "length" if budget == o.max_new_tokens else "context"
        t0 = t1 = time.perf_counter()
        prefill_s = 0.0
        done = False
        while not done:
            new = self.speculate.step(self.model, self.cache, seq, budget - len(out), rule)
            seq += new
            if self.speculate.stats.forwards == 1:
                t1 = time.perf_counter()
                prefill_s = t1 - t0
            for tok in new:
                if tok in self.stop_ids:
                    reason, done = "eos", True
                    break
                out.append(tok)
                show(tok)
                if len(out) == budget:
                    done = True
                    break
        self.cached = seq[: self.cache.length]
        # the tokens the reply kept, its end-of-turn token included
        self.speculate.stats.tokens = len(out) + (reason == "eos")
        return reason, prefill_s, time.perf_counter() - t1

    def _decode(
        self, ids: list[int], keep: int, out: list[int], budget: int, show
    ) -> tuple[str, float, float]:
        """The reply's tokens into `out`, one forward a token (the cache holds self.cached = ids[:keep]):
        (stop reason, prefill s, decode s)."""
        device = self.model.tok_emb.weight.device
        t0 = time.perf_counter()
        new = torch.tensor([ids[keep:]], dtype=torch.long, device=device)  # [1, T_new]
        logits = self.model(new, cache=self.cache, logits_to_keep=1).logits[:, -1]  # [1, V]
        self.cached += ids[keep:]
        if device.type == "cuda":
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        reason = "length"
        t1 = time.perf_counter()
        for i in range(budget):
            nxt = sample_next(logits, self.opts.temperature, self.opts.top_k, self.opts.top_p, self.generator)
            tok = int(nxt[0])
            if tok in self.stop_ids:
                reason = "eos"
                break
            out.append(tok)
            show(tok)
            if i == budget - 1:
                reason = "length" if budget == self.opts.max_new_tokens else "context"
                break
            if self.cache.length >= self.max_context:
                reason = "context"
                break
            self.cached.append(tok)
            if self.model.rope_restart(self.cache.length, len(self.cached)):
                # past a longrope scaling's original context: every key again, with the long factors
                self.cache.reset()
                every = torch.tensor([self.cached], dtype=torch.long, device=device)  # [1, T]
                logits = self.model(every, cache=self.cache, logits_to_keep=1).logits[:, -1]  # [1, V]
            else:
                logits = self.model(nxt[:, None], cache=self.cache, logits_to_keep=1).logits[:, -1]  # [1, V]
        if device.type == "cuda":
            torch.cuda.synchronize()
        return reason, prefill_s, time.perf_counter() - t1
