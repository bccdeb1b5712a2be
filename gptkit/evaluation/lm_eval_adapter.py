"""lm-eval's `LM` interface on a gptkit model and tokenizer, with no export: what `gptkit eval tasks=...` and
the in-training task evals score with.

Requests are tokenized exactly as lm-eval's `hf` backend tokenizes them (TemplateLM's context/continuation
split, the tokenizer's own special-token rules, a BOS first for an empty context and for rolling windows,
the EOS when there is no BOS), so the same model gives the same per-request log-likelihoods
(tests/evaluation/test_eval_tasks.py checks it against `hf` on the exported model). Scoring differs in
how it computes:

  loglikelihood   every request's input is (context + continuation)[-(max_len + 1):][:-1], as in `hf`
                  (a longer one loses tokens on the left: counted in `truncated`). The part before the
                  continuation is the request's *prefix*; requests with the same prefix (the choices of
                  one multiple-choice question) share one forward pass of it through a KV cache, then only
                  their continuations run, batched: [choices, continuation tokens] on top of the cache.
                  Prefixes of equal length are batched together, longest first; only the continuation
                  positions go through the output layer and the log-softmax.
  rolling         lm-eval's disjoint rolling windows (get_rolling_token_windows, context_len=1), scored as
                  loglikelihood requests and summed per document.
  generate_until  gptkit's KV-cache decoder (gptkit.inference.generate), one request at a time, greedy
                  unless the task samples, stopped at EOS and at the task's stop strings; the context is cut
                  on the left to max_len - max_gen_toks tokens, as in `hf`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from gptkit.errors import GptkitError
from gptkit.inference.generate import generate, special_token_ids
from gptkit.inference.sampling import SampleOptions
from gptkit.model.kv_cache import KVCache
from gptkit.tokenizer import describe_characters, unknown_characters

# as lm-eval's hf backend
DEFAULT_MAX_GEN_TOKS = 256


@dataclass
class AdapterStats:
    """What the adapter did, for the report under the results table."""

    # per request type
    requests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # requests whose input lost tokens on the left (longer than the model's context)
    truncated: int = 0
    # tokens that went through the model
    forward_tokens: int = 0
    seconds: float = 0.0


class GptkitLM(TemplateLM):
    """lm-eval's LM over a gptkit GPT (eval mode) and its `tokenizers.Tokenizer`.

    run_config is the run's config.yaml as a dict (its tokenizer.eos_token names the EOS); batch_size is the
    number of continuations scored per forward pass."""

    def __init__(
        self, model, tokenizer, run_config: dict | None = None, batch_size: int = 16, seed: int = 1234
    ):
        super().__init__()
        self.model, self.tokenizer_ = model, tokenizer
        self.cfg = model.cfg
        self.bos_id, self.eos_id = special_token_ids(tokenizer, run_config or {})
        self.batch_size = int(batch_size)
        self.seed = seed
        self.stats = AdapterStats()
        unk = getattr(tokenizer.model, "unk_token", None)
        # text mapped to it is text lost
        self._unk_id = tokenizer.token_to_id(unk) if unk else None
        self._device = model.tok_emb.weight.device

    # ---- what lm-eval asks of a model -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if self.eos_id is None:
            raise GptkitError(
                "this task needs an end-of-text token (generation stops there, an empty "
                "context starts there) and the run's tokenizer has none; train with "
                "tokenizer.eos_token set"
            )
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window start with: BOS, else EOS (as lm-eval)."""
        if self.bos_id is not None:
            return self.bos_id
        if self.eos_id is None:
            raise GptkitError(
                "this task scores text from its start, which needs a BOS or end-of-text token "
                "first, and the run's tokenizer has neither; train with "
                "tokenizer.eos_token set"
            )
        return self.eos_id

    @property
    def max_length(self) -> int:
        return self.cfg.max_seq_len

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs
    ) -> list[int]:
        """The tokenizer's ids for string; special tokens as its post-processor adds them (none for gptkit's
        own tokenizers), except for a string that already starts with the prefix token (as lm-eval)."""
        if add_special_tokens is None:
            add_special_tokens = not self._starts_with_prefix(string)
        ids = self._encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _encode(self, string: str, add_special_tokens: bool) -> list[int]:
        """The ids of string; text the tokenizer cannot represent (a char tokenizer meets a character its
        corpus never had) is a one-line GptkitError naming the characters."""
        try:
            ids = self.tokenizer_.encode(string, add_special_tokens=add_special_tokens).ids
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception for a missing [UNK]
            ids = None
        if ids is None or (self._unk_id is not None and self._unk_id in ids):
            unknown = unknown_characters(self.tokenizer_, string)
            raise GptkitError(
                f"the task's text has {len(unknown)} character(s) the run's tokenizer cannot "
                f"encode: {describe_characters(unknown)}; this run cannot be scored on this "
                f"task (a char tokenizer knows only its training corpus)"
            )
        return ids

    def _starts_with_prefix(self, string: str) -> bool:
        prefix = self.bos_id if self.bos_id is not None else self.eos_id
        if prefix is None:
            return False
        return string.startswith(self.tokenizer_.decode([prefix], skip_special_tokens=False))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer_.decode(ids, skip_special_tokens=True)

    # ---- log-likelihoods ------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) for each
        request ((context, continuation) strings, context ids, continuation ids)."""
        t0 = time.perf_counter()
        n = self.max_length
        groups: dict[tuple[int, ...], list[tuple[int, list[int], list[int]]]] = defaultdict(list)
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise GptkitError(
                    "a loglikelihood request has an empty continuation (the task's choices must not be empty)"
                )
            whole = list(ctx) + list(cont)
            if len(whole) > n + 1:
                self.stats.truncated += 1
            inp = whole[-(n + 1) :][:-1]  # [L]: the model's input, as lm-eval's hf backend cuts it
            c = min(len(cont), len(inp))
            groups[tuple(inp[: len(inp) - c])].append((i, inp[len(inp) - c :], list(cont)[-c:]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        alone = [(p, *groups.pop(p)[0]) for p in [p for p, g in groups.items() if len(g) == 1]]
        # a longrope model (Phi-4-mini) turns a sequence longer than its original context with other
        # frequencies: a continuation that takes its prefix past it is scored whole, and a batch of whole
        # inputs (right-padded to its longest) holds only inputs on one side of it
        for p in list(groups):
            crossing = [r for r in groups[p] if self.model.rope_restart(len(p), len(p) + len(r[1]))]
            alone += [(p, *r) for r in crossing]
            groups[p] = [r for r in groups[p] if r not in crossing]
            if not groups[p]:
                del groups[p]
        # longest first
        alone.sort(key=lambda item: -len(item[0]) - len(item[2]))
        past = [item for item in alone if self.model.rope_restart(1, len(item[0]) + len(item[2]))]
        for side in (past, alone[len(past) :]):
            for a in range(0, len(side), self.batch_size):
                self._score_whole(side[a : a + self.batch_size], out)
        # longest first; equal lengths side by side
        prefixes = sorted(groups, key=lambda p: (-len(p), p))
        b = 0
        while b < len(prefixes):
            batch = [prefixes[b]]
            rows = len(groups[prefixes[b]])
            while (
                b + len(batch) < len(prefixes)
                and len(prefixes[b + len(batch)]) == len(batch[0])
                and rows + len(groups[prefixes[b + len(batch)]]) <= self.batch_size
            ):
                rows += len(groups[prefixes[b + len(batch)]])
                batch.append(prefixes[b + len(batch)])
            b += len(batch)
            self._score_prefixes(batch, groups, out)
        self.stats.seconds += time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def _score_whole(self, items, out) -> None:
        """Requests that share their prefix with no other (each (prefix, index, tail, continuation)): whole
        inputs, right-padded, in one forward pass; only the continuation positions are log-softmaxed."""
        lengths = [len(p) + len(tail) for p, _, tail, _ in items]
        x = torch.zeros(len(items), max(lengths), dtype=torch.long)  # [R, L] right-padded: never read
        for r, (p, _, tail, _) in enumerate(items):
            x[r, : lengths[r]] = torch.tensor(list(p) + list(tail))
        logits = self.model(x.to(self._device)).logits  # [R, L, V]
        self.stats.forward_tokens += sum(lengths)
        for r, (_, i, tail, cont) in enumerate(items):
            out[i] = self._score(logits[r, lengths[r] - len(tail) : lengths[r]], cont)

    def _score(self, logits: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
        """(sum of log p(cont), greedy) from the logits [c, V] that predict cont."""
        lp = F.log_softmax(logits.float(), dim=-1)  # [c, V]
        target = torch.tensor(cont, device=lp.device)  # [c]
        return lp.gather(-1, target[:, None]).sum().item(), bool((lp.argmax(-1) == target).all())

    @torch.inference_mode()
    def _score_prefixes(self, prefixes, groups, out) -> None:
        """Run the prefixes (all of one length P) once, then every continuation of theirs on top, in chunks
        of batch_size rows; write (log-likelihood, greedy) into out."""
        P = len(prefixes[0])
        # (prefix index, request)
        rows = [(g, item) for g, p in enumerate(prefixes) for item in groups[p]]
        cache = None
        if P:
            cache = KVCache(self.cfg, len(prefixes), max_len=P, device=self._device, dtype=self._dtype())
            x = torch.tensor(prefixes, dtype=torch.long, device=self._device)  # [G, P]
            self.model(x, cache=cache, logits_to_keep=1)
            self.stats.forward_tokens += x.numel()
        for a in range(0, len(rows), self.batch_size):
            chunk = rows[a : a + self.batch_size]
            T = max(len(tail) for _, (_, tail, _) in chunk)
            x = torch.zeros(len(chunk), T, dtype=torch.long)  # [R, T] right-padded: padding is never read
            for r, (_, (_, tail, _)) in enumerate(chunk):
                x[r, : len(tail)] = torch.tensor(tail)
            tail_cache = self._expand(cache, [g for g, _ in chunk], P + T) if P else None
            logits = self.model(x.to(self._device), cache=tail_cache).logits  # [R, T, V]
            self.stats.forward_tokens += sum(len(tail) for _, (_, tail, _) in chunk)
            for r, (_, (i, tail, cont)) in enumerate(chunk):
                out[i] = self._score(logits[r, : len(tail)], cont)

    def _expand(self, cache: KVCache, rows: list[int], max_len: int) -> KVCache:
        """A cache of len(rows) rows, row r holding cache row rows[r]'s prefix, room for max_len tokens."""
        return cache.select(torch.tensor(rows, device=self._device), max_len)

    def _dtype(self) -> torch.dtype:
        return self.model.tok_emb.weight.dtype

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.stats.requests["loglikelihood"] += len(requests)
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text: lm-eval's disjoint rolling windows of max_length tokens, the
        first starting with the prefix token, summed per text."""
        self.stats.requests["loglikelihood_rolling"] += len(requests)
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += ll
        return totals

    # ---- generation -----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation from gptkit's KV-cache decoder, cut at the first stop string."""
        t0 = time.perf_counter()
        self.stats.requests["generate_until"] += len(requests)
        results = []
        for args in (req.args for req in requests):
            ids, until, max_gen, kwargs = self._generation_request(args)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            opts = SampleOptions(
                max_new_tokens=max_gen,
                temperature=temperature,
                seed=self.seed,
                eos_id=self.eos_id,
                stop=tuple(s for s in until if s),
                overflow="stop",
                decode="eager",
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            g = generate(self.model, ids, opts, decode=self.tok_decode)
            self.stats.forward_tokens += len(ids) + g.decode_steps
            results.append(postprocess_generated_text(g.texts[0], until, None))
        self.stats.seconds += time.perf_counter() - t0
        return results

    def sample_until(self, args: tuple, keys: list[int], temperature: float, top_p: float = 1.0) -> list[str]:
        """len(keys) completions of one generate_until request (its (context, gen_kwargs)), each drawn with
        its key by the rollout sampler (gptkit.inference.rollouts: a completion is a pure function of its
        key), at `temperature` and `top_p` whatever the task's own do_sample; stopped at the EOS and cut at
        the task's stop strings, as generate_until cuts them."""
        from gptkit.inference.rollouts import RolloutOptions, sample_groups

        t0 = time.perf_counter()
        ids, until, max_gen, _ = self._generation_request(args)
        stops = () if self.eos_id is None else (self.eos_id,)
        opts = RolloutOptions(max_gen, float(temperature), None, float(top_p), stops)
        (group,) = sample_groups(self.model, [ids], [list(keys)], opts, [max_gen])
        self.stats.requests["generate_until"] += len(keys)
        out = []
        for c in group:
            self.stats.forward_tokens += len(ids) + len(c.tokens)
            tokens = c.tokens[:-1] if c.tokens and c.tokens[-1] in stops else c.tokens
            out.append(postprocess_generated_text(self.tok_decode(tokens), until, None))
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _generation_request(self, args: tuple) -> tuple[list[int], list[str], int, dict]:
        """(prompt ids, stop strings, max_gen_toks, the other generation kwargs) of a generate_until request's
        (context, gen_kwargs): the prompt cut on the left to max_len - max_gen_toks tokens, as in `hf`."""
        context, gen_kwargs = args
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        max_gen = int(kwargs.pop("max_gen_toks"))
        room = self.max_length - max_gen
        if room <= 0:
            raise GptkitError(
                f"the task generates up to max_gen_toks={max_gen} tokens, which leaves "
                f"no room for its prompt in model.max_seq_len={self.max_length}; lower "
                f"the task's generation_kwargs.max_gen_toks"
            )
        ids = self._generation_prompt(context)
        if len(ids) > room:
            self.stats.truncated += 1
            ids = ids[-room:]
        return ids, until, max_gen, kwargs

    def _generation_prompt(self, context: str) -> list[int]:
        """The prompt's ids as the hf backend's batch encoding makes them (the tokenizer's special tokens,
        unless the text already starts with the BOS)."""
        bos = None
        if self.bos_id is not None:
            bos = self.tokenizer_.decode([self.bos_id], skip_special_tokens=False)
        ids = self._encode(context, add_special_tokens=not (bos and context.startswith(bos)))
        if not ids:
            ids = [self.prefix_token_id]
        return ids
