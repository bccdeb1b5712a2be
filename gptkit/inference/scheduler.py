"""The step of continuous batching over paged KV memory (gptkit/inference/block_pool.py): what each step
feeds the model, under a token budget.

    step():  drop what was cancelled -> admit waiting requests, first come first served, while a slot of
             max_batch is free and the pool has the blocks of their prompt (less its cached prefix) -> plan:
             every running sequence's next token (a decode), then prompt chunks in the tokens left of
             max_step_tokens, the prompt with the least prefill left first (several prompts, a long one in
             chunks over several steps) -> ONE forward: the n decode tokens and the N chunk tokens in one row
             [1, n + N] (the mixed step, below), or the decodes alone [n, 1], or the chunks alone [1, N] ->
             sample a token for every decode and every prompt whose last chunk ran -> finished sequences
             leave, their blocks back to the pool

The mixed step (block_pool.MixedView): on the CPU a forward streams every weight from memory, so a step with
decodes and prompt chunks paid for the weights twice in two forwards. In one row the linear layers run once
over all n + N tokens, and attention splits (gptkit.model.attention.Mixed): each decode token's query reads
its decode row exactly as a decode step does (one query, its mask), each chunk's queries its own sequence's
blocks as a packed prefill does; the logits kept are the decodes' rows and each finished prompt's last one,
sampled in the two forwards' order (the decodes, then the prompts), so the tokens are theirs (fp32 logits
within 1e-5: tests/inference/test_mixed_step.py). A model with a layer other than multi-head attention
(latent attention reads its values from its cached latents) keeps the two forwards (`mixed` False).

The order of prefill work (issue 53 item 1): a burst's prompts share the steps with the running decodes, so
a prompt's first token waits for every chunk planned before it. Least prefill left first finishes the short
prompts of a burst in the first steps instead of behind the long ones that came before them (the time to
first token of the median prompt), while the last prompt of a burst waits for the same work as in arrival
order. A prompt is aged by its wait, its key being tokens left + max_step_tokens x the step it first waited
at: a prompt admitted k steps later goes before it only if it has k budgets fewer tokens left, so a prompt
with r tokens left is overtaken by no prompt admitted more than r / max_step_tokens steps after it, and never
starves (tests/inference/test_scheduler.py). In one burst (the same step) the order is least-left-first.

A sequence is its tokens (the prompt, then what it sampled) and the blocks of those already cached
(`Pages.computed`): a step computes its next uncached tokens, a decode being the one-token case. A prompt
whose prefix is in the prefix cache starts past it. The n choices of a prompt wait for choice 0's prefill,
then share its blocks (the partial last block copied) and sample from the same logits.

When a sequence needs a block and none is left, the youngest sequence holding blocks is preempted: its
blocks go back (the full ones stay in the prefix cache while nobody needs them) and it is computed again
later, its prompt and its tokens so far, as a prefill (its sampler's state kept: a seeded choice draws on as
it would have). A request is never failed for memory: the pool holds at least one context (Paging.check).

The invariant of the batcher holds: a token's logits are the same function of the same tokens as
`gptkit sample`'s one-sequence pass; packing and chunking only change where the matmuls round (fp32 logits
agree to ~1e-6: tests/inference/test_batcher.py).

A mixed forward that fails is undone (its sequences' positions) and the step runs as two forwards; a packed
prefill that fails is run again one prompt at a time, so that only the prompt that fails ends (an "error"
event); a failure of the decode forward raises out of step(), as the slot path's does.
"""

from __future__ import annotations

import time

import torch

from gptkit.inference.block_pool import (
    BlockPool,
    DecodeRows,
    DecodeView,
    MixedView,
    PackedView,
    Pages,
    Paging,
)


class PagedSteps:
    """The step of a Batcher (passed in: its sequences, waiting jobs, sampling and endings) over a pool."""

    def __init__(self, batcher, paging: Paging) -> None:
        self.b = batcher
        model = batcher.model
        w = model.tok_emb.weight
        blocks = paging.check(batcher.max_len, batcher.max_batch)
        size = paging.size(batcher.max_len)
        self.pool = BlockPool(model.cfg, blocks, size, w.device, w.dtype, paging.prefix_cache)
        self.budget = paging.budget(batcher.max_batch)
        # the decoding sequences' keys, a contiguous row each (read by every decode step without a gather)
        self.rows = DecodeRows(self.pool, batcher.max_batch, batcher.max_len)
        # sequences preempted (recomputed later); prompt tokens computed by prefill forwards
        self.preempted = 0
        self.prefill_tokens = 0
        # sequences preempted in this step's plan
        self._out: set[int] = set()
        # steps planned so far, and the step at which each sequence first waited for a prefill (its age)
        self._clock = 0
        self._since: dict = {}
        # a step with decodes and prompt chunks runs them in one forward (module docstring) where every layer
        # is multi-head attention (MixedView); False: a decode forward, then a packed one
        cfg = model.cfg
        self.mixed = all(cfg.attention_kind_of(i) == "mha" for i in range(cfg.n_layers))
        # steps run as one mixed forward, and mixed forwards that failed (their step ran as two)
        self.mixed_steps = 0
        self.mixed_failed = 0

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self, out) -> None:
        b = self.b
        b._drop_cancelled(out)
        self._admit(out)
        decodes, chunks = self._plan()
        self._clock += 1
        ran = 0
        if decodes and chunks and self.mixed:
            ran += self._mixed_step(decodes, chunks, out)
        else:
            if decodes:
                self._decode(decodes, out)
                ran += len(decodes)
            if chunks:
                ran += self._prefill(chunks, out)
        if decodes or chunks:
            b.steps += 1
            b.rows += ran
        for s in b.seqs:
            if s.pages is not None and not s.finished:
                self._after(s)
        self._compact()

    def _ids(self, s) -> list[int]:
        return s.job.prompt + s.fed

    def _admit(self, out) -> None:
        b, pool = self.b, self.pool
        while b.waiting and len(b.seqs) + b.waiting[0].params.n <= b.max_batch:
            job = b.waiting[0]
            if job.cancelled:
                b.waiting.popleft()
                continue
            need = -(-(len(job.prompt) + 1) // pool.block_size) - pool.cached_blocks(job.prompt)
            if need > pool.available:
                break
            b.waiting.popleft()
            try:
                seqs = [b._new_seq(job, c) for c in range(job.params.n)]
            except Exception as exc:  # noqa: BLE001 - this job fails alone
                b._fail_job(job, b._error_line(exc), out)
                continue
            seqs[0].pages = Pages()
            b.seqs.extend(seqs)

    def _plan(self):
        """(decodes, chunks): the sequences that feed their one next token, and (sequence, tokens) of the
        prompts computed this step; blocks taken for both, the youngest preempted when they run out."""
        b, pool = self.b, self.pool
        decodes, chunks, planned, self._out = [], [], set(), set()
        live = [s for s in b.seqs if s.pages is not None and not s.finished]
        for s in live:
            if s.fed and s.pages.computed == len(s.job.prompt) + len(s.fed) - 1:
                if self._room(s, s.pages.computed + 1, planned):
                    decodes.append(s)
                    planned.add(id(s))
                else:
                    self._preempt(s)
        left = self.budget - len(decodes)
        waiting = [s for s in live if id(s) not in planned and id(s) not in self._out]
        for s in self.prefill_order(waiting):
            if left <= 0:
                break
            ids = self._ids(s)
            if not s.pages.table:
                pool.reuse(s.pages, ids)
            T = min(len(ids) - s.pages.computed, left)
            self._room(s, s.pages.computed + T, planned)
            T = min(T, (len(s.pages.table) + pool.available) * pool.block_size - s.pages.computed)
            if T <= 0 or not pool.grow(s.pages, s.pages.computed + T):
                continue
            chunks.append((s, T))
            planned.add(id(s))
            left -= T
        return decodes, chunks

    def prefill_order(self, seqs: list) -> list:
        """The sequences with tokens to prefill, in the order they take the step's prefill budget: least
        prefill left first (a prompt not started less its cached prefix), aged by their wait (module
        docstring: key = tokens left + budget x the step it first waited at); ties in admission order."""
        pool, clock = self.pool, self._clock
        for s in seqs:
            self._since.setdefault(s, clock)

        def key(s) -> int:
            ids = self._ids(s)
            done = s.pages.computed if s.pages.table else pool.cached_blocks(ids) * pool.block_size
            return len(ids) - done + self.budget * self._since[s]

        return sorted(seqs, key=key)

    def _room(self, s, end: int, planned: set) -> bool:
        """Blocks for s up to position end - 1, preempting the youngest unplanned sequences after it that
        hold blocks; False when there are still too few."""
        pool = self.pool
        while not pool.grow(s.pages, end):
            after = self.b.seqs[self.b.seqs.index(s) + 1 :]
            victims = [v for v in after if v.pages is not None and v.pages.table and id(v) not in planned]
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _preempt(self, s) -> None:
        self.pool.release(s.pages)
        self._out.add(id(s))
        self.preempted += 1

    def _decode(self, seqs, out) -> None:
        b = self.b
        view = DecodeView(self.pool, [s.pages for s in seqs], self.rows)
        # fed in the order of their decode rows
        seqs = [seqs[j] for j in view.order]
        tok = torch.tensor([[s.last] for s in seqs], dtype=torch.long, device=b.device)  # [n, 1]
        logits = b.model(tok, cache=view, logits_to_keep=1).logits[:, -1]  # [n, V]
        tokens = b._choose(logits, seqs)
        b._take(seqs, tokens, out, b._logprobs(logits, seqs, tokens))

    def _mixed_step(self, decodes, chunks, out) -> int:
        """The decodes and the chunks in one forward [1, n + N] (MixedView); sampled as the two forwards
        sample them: the decodes, then each prompt whose last chunk ran. If it fails, nothing it advanced is
        kept and the step runs as two forwards (a failing prompt then ends alone); returns the rows sampled.
        """
        b = self.b
        held = [s.pages for s in decodes] + [s.pages for s, _ in chunks]
        computed = [p.computed for p in held]
        try:
            seqs, logits = self._mixed(decodes, chunks)
        except Exception:  # noqa: BLE001 - the two forwards, then the per-prompt retry, find what fails
            self.mixed_failed += 1
            for p, c in zip(held, computed):
                p.computed = c
            rows = self.rows
            for i, (p, epoch) in enumerate(rows.seqs):
                if p.epoch == epoch:
                    rows.filled[i] = min(rows.filled[i], p.computed - rows.base[i])
            self._decode(decodes, out)
            return len(decodes) + self._prefill(chunks, out)
        self.mixed_steps += 1
        n = len(seqs)
        tokens = b._choose(logits[:n], seqs)
        b._take(seqs, tokens, out, b._logprobs(logits[:n], seqs, tokens))
        return n + self._sample(chunks, logits[n:], out)

    def _mixed(self, decodes, chunks) -> tuple[list, torch.Tensor]:
        """One forward of the decode tokens (in the order of their decode rows) then the chunks, [1, n + N];
        (the decodes in that order, logits [n + k, V]: each decode's, then the last token's of each chunk
        that ends its sequence's tokens)."""
        decode = DecodeView(self.pool, [s.pages for s in decodes], self.rows)
        seqs = [decodes[j] for j in decode.order]
        n = len(seqs)
        ids, rows = [s.last for s in seqs], list(range(n))
        self._lay(chunks, ids, rows)
        view = MixedView(decode, PackedView(self.pool, [(s.pages, T) for s, T in chunks]))
        logits = self._forward_rows(ids, view, rows)  # [n + k, V]
        self.prefill_tokens += len(ids) - n
        return seqs, logits

    def _prefill(self, chunks, out) -> int:
        """The chunks in one packed forward (again one by one if it fails: only a failing prompt ends);
        returns the sequences that sampled a token."""
        try:
            logits = self._packed(chunks)
        except Exception as exc:  # noqa: BLE001 - find the prompt that fails, the others go on
            if len(chunks) == 1:
                self._fail(chunks[0][0], exc, out)
                return 0
            done = 0
            for chunk in chunks:
                try:
                    logits = self._packed([chunk])
                except Exception as exc1:  # noqa: BLE001 - this job fails alone
                    self._fail(chunk[0], exc1, out)
                    continue
                done += self._sample([chunk], logits, out)
            return done
        return self._sample(chunks, logits, out)

    def _packed(self, chunks) -> torch.Tensor:
        """One forward of the chunks packed in a row [1, N]; the logits [k, V] of the last token of each
        chunk that ends its sequence's tokens."""
        ids, rows = [], []
        self._lay(chunks, ids, rows)
        view = PackedView(self.pool, [(s.pages, T) for s, T in chunks])
        # no chunk ends its tokens: one row anyway (a layer laid out for decoding takes no empty input)
        logits = self._forward_rows(ids, view, rows or [len(ids) - 1])[: len(rows)]  # [k, V]
        self.prefill_tokens += len(ids)
        return logits

    def _lay(self, chunks, ids: list, rows: list) -> None:
        """Append the chunks' tokens to ids, and to rows the index in ids of each chunk's last token when
        the chunk ends its sequence's tokens (a row that samples)."""
        for s, T in chunks:
            start = s.pages.computed
            seq_ids = self._ids(s)
            ids.extend(seq_ids[start : start + T])
            if start + T == len(seq_ids):
                rows.append(len(ids) - 1)

    def _forward_rows(self, ids: list, view, rows: list) -> torch.Tensor:
        """One forward of ids [1, len(ids)] through the cache view; the logits [len(rows), V] of those rows:
        only they go through the LM head (the final norm's output narrowed to them)."""
        b = self.b
        tokens = torch.tensor([ids], dtype=torch.long, device=b.device)  # [1, len(ids)]
        pick = torch.tensor(rows, dtype=torch.long, device=b.device)
        hook = b.model.final_norm.register_forward_hook(lambda m, i, o: o[:, pick])
        try:
            return b.model(tokens, cache=view).logits[0]
        finally:
            hook.remove()

    def _sample(self, chunks, logits, out) -> int:
        """Each sequence whose tokens are now all cached samples its next token (its waiting sibling choices
        from the same row, on a fork of its blocks)."""
        b, k = self.b, 0
        for s, _ in chunks:
            if s.pages.computed < len(s.job.prompt) + len(s.fed):
                continue
            row = logits[k : k + 1]
            k += 1
            seqs = [s]
            if s.job.first_token is None:
                s.job.first_token = time.perf_counter()
                for sib in b.seqs:
                    if sib.job is s.job and sib.pages is None:
                        sib.pages = self.pool.fork(s.pages)
                        if sib.pages is None:
                            # no block for the copy: it computes its prompt itself when one is free
                            sib.pages = Pages()
                        else:
                            seqs.append(sib)
            rows = row.expand(len(seqs), -1)
            tokens = b._choose(rows, seqs)
            b._take(seqs, tokens, out, b._logprobs(rows, seqs, tokens))
        return k

    def _fail(self, s, exc, out) -> None:
        line = self.b._error_line(exc)
        for other in self.b.seqs:
            if other.job is s.job and not other.finished:
                self.b._finish(other, "error", out, error=line)

    def _after(self, s) -> None:
        """Key its newly full blocks for the prefix cache; release those behind an all-local window."""
        pool = self.pool
        if pool.prefix_cache and s.pages.computed // pool.block_size > len(s.pages.keys):
            pool.register(s.pages, self._ids(s))
        pool.behind_window(s.pages)

    def _compact(self) -> None:
        keep = []
        for s in self.b.seqs:
            if s.finished:
                if s.pages is not None:
                    self.pool.release(s.pages)
            else:
                keep.append(s)
        self.b.seqs[:] = keep
        self._since = {s: self._since[s] for s in keep if s in self._since}

    def free_all(self) -> None:
        for s in self.b.seqs:
            if s.pages is not None:
                self.pool.release(s.pages)

    def stats(self) -> dict:
        rows = sum(t.numel() * t.element_size() for t in self.rows.k + self.rows.v)
        return {
            **self.pool.stats(),
            "preempted": self.preempted,
            "prefill_tokens": self.prefill_tokens,
            "decode_rows_bytes": rows,
        }
