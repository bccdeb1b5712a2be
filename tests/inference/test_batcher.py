"""Continuous batching (gptkit/inference/): each request's greedy tokens are `gptkit sample`'s whatever
shares the batch, seeded choices draw as `sample seed=` does, the endings, cancelling, a full queue, a failed
step."""

import re
import threading

import pytest
import torch
from conftest import greedy_gpt

from gptkit.errors import GptkitError
from gptkit.inference.batcher import Batcher, Job, SamplingParams, generate_many
from gptkit.inference.block_pool import Paging
from gptkit.inference.decoding_layout import decoding_layout
from gptkit.inference.engine import Engine, QueueFull
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT

# RoPE, GQA, SwiGLU, RMSNorm, no biases
GQA = dict(position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False)
VARIANTS = {
    "rope-gqa": GQA,
    "learned-mha": dict(position="learned", n_kv_heads=None, mlp="gelu", norm="layernorm"),
    # a local layer (a window of 5) beside a global one: the decode mask narrows per layer (mask_for)
    "rope-window": dict(GQA, sliding_window=5, layer_types=["local", "global"]),
    # routing has no capacity: a token's experts do not depend on what shares its batch
    "rope-moe": dict(GQA, moe=dict(n_experts=4, top_k=2)),
}


def tiny(variant: str = "rope-gqa", max_seq_len: int = 48) -> GPT:
    return greedy_gpt(max_seq_len, **VARIANTS[variant])


def prompts(k: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (3 + (7 * i) % 23,), generator=g).tolist() for i in range(k)]


def released(batcher) -> bool:
    """No sequence holds memory: every slot empty, or every block of the pool back (free or cached)."""
    if batcher.paged is None:
        return batcher.cache.lengths == [0] * batcher.max_batch
    pool = batcher.paged.pool
    return batcher.active == 0 and not any(pool.refs) and pool.available == pool.blocks


def reference(model, prompt, n, decode=None, **opts):
    """`gptkit sample`'s tokens (gptkit.inference.generate.generate, overflow=stop as the server runs)."""
    opts = dict(max_new_tokens=n, temperature=0.0, overflow="stop") | opts
    return generate(model, prompt, SampleOptions(**opts), decode=decode)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_are_samples_whatever_shares_the_batch(variant):
    model = tiny(variant)
    ps = prompts(7)
    lengths = [20, 9, 14, 20, 5, 17, 11]
    batcher = Batcher(model, max_batch=4)
    got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    joined_with = []

    def collect(i):
        return lambda events: [got[i].extend(e.tokens) for e in events]

    with torch.inference_mode():
        # two start together, the others join mid-way, one every few steps, while the batch decodes
        for i in range(len(ps)):
            batcher.add(Job(ps[i], SamplingParams(max_new_tokens=lengths[i], temperature=0.0), collect(i)))
            for _ in range(0 if i == 0 else 3):
                batcher.step()
            joined_with.append(batcher.active)
        while batcher.busy:
            batcher.step()
    for i, p in enumerate(ps):
        assert got[i] == reference(model, p, lengths[i]).tokens[0], i
    # they did share: several rows per step, and requests joined a running batch
    assert batcher.rows / batcher.steps > 2 and max(joined_with) == 4
    # every slot is free again
    assert batcher.active == 0 and released(batcher)


def test_n_choices_share_the_prefill_and_seeded_choices_draw_as_sample_does():
    model = tiny()
    ps = prompts(3, seed=4)
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, seed=5, n=3),
        SamplingParams(max_new_tokens=9, temperature=0.0, n=2),
        SamplingParams(max_new_tokens=15, temperature=0.7, top_p=0.9, seed=11),
    ]
    out = generate_many(model, ps, params, max_batch=4)
    # choice i of a seeded request is `gptkit sample seed=<seed + i>`
    for c in range(3):
        ref = reference(model, ps[0], 12, temperature=0.9, top_k=20, seed=5 + c)
        assert out[0].choices[c].tokens == ref.tokens[0]
    assert len({tuple(ch.tokens) for ch in out[0].choices}) > 1
    greedy = reference(model, ps[1], 9).tokens[0]
    assert [ch.tokens for ch in out[1].choices] == [greedy, greedy]
    assert (
        out[2].choices[0].tokens == reference(model, ps[2], 15, temperature=0.7, top_p=0.9, seed=11).tokens[0]
    )
    # usage: the prompt once, every sampled token of every choice
    assert out[0].prompt_tokens == len(ps[0]) and out[0].sampled == 36


def test_endings_are_samples():
    model = tiny(max_seq_len=24)
    p = prompts(1)[0][:10]
    greedy = reference(model, p, 12).tokens[0]
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731 - one char per token

    def one(params):
        return generate_many(model, [p], params, decode=decode)[0].choices[0]

    # an ending id: not emitted
    eos = greedy[4]
    ch = one(SamplingParams(max_new_tokens=12, temperature=0.0, stop_ids=(eos,)))
    assert ch.finish_reason == "eos" and ch.tokens == greedy[: greedy.index(eos)]
    # a stop string: the text ends before it
    stop = decode(greedy[3:5])
    ch = one(SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,)))
    ref = reference(model, p, 12, decode, stop=(stop,))
    assert ch.finish_reason == "stop" == ref.stop_reasons[0]
    assert ch.text == decode(greedy)[: decode(greedy).index(stop)]
    # the context: the last token is predicted from a full context, never fed back (sample's overflow=stop)
    ch = one(SamplingParams(max_new_tokens=40, temperature=0.0))
    ref = reference(model, p, 40)
    assert ch.finish_reason == "context" == ref.stop_reasons[0]
    assert ch.tokens == ref.tokens[0] and len(p) + len(ch.tokens) == 25
    with pytest.raises(GptkitError, match="more than the context of 24"):
        generate_many(model, [list(range(25))], SamplingParams(max_new_tokens=1))
    with pytest.raises(GptkitError, match="max_new_tokens=0 must be >= 1"):
        generate_many(model, [p], SamplingParams(max_new_tokens=0))


def test_engine_cancel_frees_the_slot_a_full_queue_refuses_and_a_failed_step_fails_only_its_requests():
    model = tiny()
    p = prompts(1)[0]
    with Engine(model, max_batch=1, max_queue=1) as engine:
        long = engine.submit(p, SamplingParams(max_new_tokens=40, temperature=0.0))
        first = next(iter(long))
        assert first.tokens and first.finish is None
        # the slot is busy: one may wait, the next is refused
        waiting = engine.submit(p, SamplingParams(max_new_tokens=3, temperature=0.0))
        with pytest.raises(QueueFull, match="max_queue=1"):
            engine.submit(p, SamplingParams(max_new_tokens=3, temperature=0.0))
        long.cancel()
        assert [e.finish for e in long if e.finish] == ["cancelled"]
        assert waiting.result().choices[0].tokens == reference(model, p, 3).tokens[0]
        assert engine.load()["active"] == 0

        # one failed step: its request ends with an error, the engine serves the next one
        calls = {"n": 0}
        forward = model.forward

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
            return forward(*args, **kwargs)

        model.forward = flaky
        try:
            with pytest.raises(GptkitError, match="generation failed: RuntimeError: injected"):
                engine.submit(p, SamplingParams(max_new_tokens=5, temperature=0.0)).result()
        finally:
            del model.forward
        assert engine.last_error and engine.running
        assert (
            engine.submit(p, SamplingParams(max_new_tokens=4, temperature=0.0)).result().choices[0].tokens
            == (reference(model, p, 4).tokens[0])
        )
    assert not engine.running


def test_engine_serves_concurrent_callers():
    model = tiny()
    ps = prompts(8, seed=2)
    results = {}
    with Engine(model, max_batch=4, max_queue=8) as engine:

        def client(i):
            results[i] = engine.submit(ps[i], SamplingParams(max_new_tokens=10, temperature=0.0)).result()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, p in enumerate(ps):
        assert results[i].choices[0].tokens == reference(model, p, 10).tokens[0]


def test_a_request_that_fails_ends_alone_and_its_neighbours_finish():
    """One job's sampler raises mid-way, another's prefill raises: each ends with an error event at once
    (the step it failed), while the greedy and seeded jobs beside them in the same batch get every token
    they get alone."""
    import gptkit.inference.batcher as batcher_module

    model = tiny()
    ps = prompts(4, seed=3)
    poison = 60  # a prefill whose prompt starts with this id raises
    ps[3] = [poison] + ps[3]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0.0),
        SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, seed=7),
        # top_k=13: the sampler below raises at this job's 4th token
        SamplingParams(max_new_tokens=20, temperature=0.8, top_k=13, seed=1, n=2),
        SamplingParams(max_new_tokens=20, temperature=0.0),
    ]
    alone = generate_many(model, ps[:2], params[:2])
    real_sample, calls = batcher_module.sample_next, {"n": 0}

    def sample(logits, temperature, top_k, top_p, generator):
        if top_k == 13:
            calls["n"] += 1
            if calls["n"] > 6:
                raise ValueError("injected sampler failure")
        return real_sample(logits, temperature, top_k, top_p, generator)

    forward = model.forward

    def prefill_fails(ids, *args, **kwargs):
        # a forward holding the poisoned prompt (alone, or packed with others) fails
        row, bad = ids[0].tolist(), ps[3]
        if ids.shape[1] > 1 and any(row[i : i + len(bad)] == bad for i in range(len(row))):
            raise RuntimeError("injected prefill failure")
        return forward(ids, *args, **kwargs)

    batcher = Batcher(model, max_batch=6)
    got = {i: {} for i in range(4)}
    errors_at: dict[int, int] = {}
    logged = []
    batcher.log = logged.append

    def collect(i):
        def deliver(events):
            for e in events:
                got[i].setdefault(e.choice, []).extend(e.tokens)
                if e.finish == "error":
                    assert "injected" in e.error
                    errors_at.setdefault(i, batcher.steps)
                elif e.finish:
                    assert e.finish == "length"

        return deliver

    batcher_module.sample_next = sample
    model.forward = prefill_fails
    try:
        with torch.inference_mode():
            for i in range(4):
                batcher.add(Job(ps[i], params[i], collect(i)))
            while batcher.busy:
                batcher.step()
    finally:
        batcher_module.sample_next = real_sample
        del model.forward
    # the failing jobs ended in the step they failed: the prefill's in the first (the packed prefill of the
    # four prompts failed, then each alone: only the poisoned one ends), the sampler's at its 4th token (the
    # prefill step sampled the 1st, the 3rd decode step after it fails)
    assert errors_at == {3: 1, 2: 4}
    assert got[3] == {0: []} and [len(got[2][c]) for c in (0, 1)] == [3, 3]
    # the neighbours ran to their end with the tokens they get alone
    assert got[0][0] == alone[0].choices[0].tokens and got[1][0] == alone[1].choices[0].tokens
    assert len(got[0][0]) == len(got[1][0]) == 20
    assert batcher.ended["error"] == 3 and batcher.active == 0 and released(batcher)
    assert len(logged) == 3 and all("injected" in line for line in logged)


def test_a_seed_out_of_range_is_refused_before_it_runs():
    model = tiny()
    p = prompts(1)[0]
    for seed, n in ((1 << 64, 1), ((1 << 64) - 1, 2), (-(1 << 63) - 1, 1), (1.5, 1), (True, 1)):
        with pytest.raises(GptkitError, match="seed="):
            SamplingParams(max_new_tokens=2, seed=seed, n=n).validate()
    with pytest.raises(GptkitError, match="temperature=nan must be a finite number"):
        SamplingParams(temperature=float("nan")).validate()
    # the ends of the range run
    for seed in ((1 << 64) - 1, -(1 << 63)):
        out = generate_many(model, [p], SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed))
        assert len(out[0].choices[0].tokens) == 3


def test_the_python_example_of_docs_serve_runs():
    """docs/serve.md's "From Python, without HTTP" block, run as written on a tiny model."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "gptkit.inference" in b]
    assert blocks
    model = tiny()
    ps = prompts(3, seed=6)

    class Tok:
        @staticmethod
        def decode(ids):
            return "".join(chr(97 + i % 26) for i in ids)

    for block in blocks:
        scope = {"model": model, "ids_a": ps[0], "ids_b": ps[1], "ids": ps[2], "eos": 0, "tok": Tok}
        exec(compile(block, "docs/serve.md", "exec"), scope)
        outs = scope["outs"]
        assert [len(o.choices) for o in outs] == [4, 4]
        assert outs[0].choices[2].tokens == reference(model, ps[0], 64).tokens[0]
        assert scope["handle"].job.done


def run_all(batcher, jobs, record=None):
    """Add every (prompt, params) at once and step until done: {job index: tokens of choice 0 per choice}."""
    got = {i: {} for i in range(len(jobs))}

    def collect(i):
        return lambda events: [got[i].setdefault(e.choice, []).extend(e.tokens) for e in events]

    with torch.inference_mode():
        for i, (p, params) in enumerate(jobs):
            batcher.add(Job(p, params, collect(i)))
        while batcher.busy:
            batcher.step()
    return got


def test_packed_and_chunked_prefill_and_preemption_keep_samples_tokens():
    """Prompts prefilled together in one packed forward, long ones in chunks of max_step_tokens beside the
    running decodes, and sequences preempted (recomputed) when the pool runs out: every greedy token is
    `gptkit sample`'s, a seeded choice draws as it does in a roomy batch, every block comes back."""
    model = tiny("rope-window")
    ps = prompts(6, seed=8)
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0)
    seeded = SamplingParams(max_new_tokens=14, temperature=0.8, top_k=20, seed=3, n=2)
    jobs = [(p, greedy) for p in ps[:5]] + [(ps[5], seeded)]
    refs = [reference(model, p, 14).tokens[0] for p in ps[:5]]
    roomy = generate_many(model, [ps[5]], seeded)[0]
    shapes = []
    forward = model.forward

    def spy(ids, *args, **kwargs):
        shapes.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    model.forward = spy
    try:
        # everything fits: one packed forward holds every prompt
        packed = run_all(Batcher(model, max_batch=8, paging=Paging(block_size=4)), jobs)
        assert shapes[0] == (1, sum(len(p) for p in ps))
        # a budget of 9 tokens a step: the long prompts in chunks, decodes beside them; a pool of one
        # context (12 blocks of 4) for 7 sequences: preempted, recomputed, never failed
        shapes.clear()
        tight = Batcher(model, max_batch=7, paging=Paging(block_size=4, kv_blocks=12, max_step_tokens=9))
        # with serve's CPU decoding layout (a chunk that samples nothing still feeds the LM head a row)
        with decoding_layout(model, 7):
            chunked = run_all(tight, jobs)
    finally:
        del model.forward
    assert max(s[0] * s[1] for s in shapes) <= 9 and any(s[0] == 1 and s[1] > 1 for s in shapes[3:])
    assert tight.paged.preempted > 0 and released(tight)
    for got in (packed, chunked):
        assert [got[i][0] for i in range(5)] == refs
        assert [got[5][c] for c in (0, 1)] == [roomy.choices[c].tokens for c in (0, 1)]


def test_all_local_layers_release_the_blocks_behind_their_window():
    """Every layer local (a window of 5): a sequence holds the blocks of its window only, with the tokens
    `gptkit sample` gives."""
    model = greedy_gpt(48, **dict(GQA, sliding_window=5, layer_types=["local", "local"]))
    p = prompts(8, seed=5)[7]
    batcher = Batcher(model, max_batch=2, paging=Paging(block_size=4, prefix_cache=False))
    held = []
    got = []
    with torch.inference_mode():
        batcher.add(Job(p, SamplingParams(max_new_tokens=20, temperature=0.0), lambda ev: got.extend(ev)))
        while batcher.busy:
            batcher.step()
            held.append(sum(r > 0 for r in batcher.paged.pool.refs))
    assert [t for e in got for t in e.tokens] == reference(model, p, 20).tokens[0]
    # a window of 5 spans at most 3 blocks of 4 (and the block its next token goes to)
    assert len(p) + 20 > 16 and max(held) <= 3 and released(batcher)


def test_prefix_cache_skips_the_cached_prefill_with_the_same_tokens():
    """A chat's second turn (its first turn's prompt and answer, then more) computes only what is new; the
    blocks are counted, shared, released to the cache and evicted least recently used first."""
    from gptkit.inference.block_pool import BlockPool, Pages

    model = tiny()
    p = prompts(8, seed=9)[6]
    assert len(p) == 22
    batcher = Batcher(model, max_batch=2, paging=Paging(block_size=4))
    first = run_all(batcher, [(p, SamplingParams(max_new_tokens=6, temperature=0.0))])[0][0]
    stats = batcher.paged.stats()
    assert stats["prefill_tokens"] == 22 and stats["prefix_hit_tokens"] == 0
    second = p + first + [5, 6, 7]
    got = run_all(batcher, [(second, SamplingParams(max_new_tokens=5, temperature=0.0))])[0][0]
    assert got == reference(model, second, 5).tokens[0]
    stats = batcher.paged.stats()
    # the 22 + 5 tokens cached by the first turn hold 6 full blocks: 24 of 31 tokens skipped, 7 computed
    assert stats["prefix_hit_tokens"] == 24 and stats["prefill_tokens"] == 22 + 7
    assert stats["prefix_hit_rate"] == round(24 / (22 + 31), 4) and released(batcher)
    # off: everything computed again
    off = Batcher(model, max_batch=2, paging=Paging(block_size=4, prefix_cache=False))
    assert run_all(off, [(second, SamplingParams(max_new_tokens=5, temperature=0.0))])[0][0] == got
    assert off.paged.stats()["prefill_tokens"] == 31

    # reference counts and eviction, on a pool of 3 blocks of 2
    pool = BlockPool(model.cfg, 3, 2, "cpu", torch.float32)
    a, b = Pages(), Pages()
    assert pool.grow(a, 4) and pool.available == 1
    a.computed = 4
    pool.register(a, [1, 2, 3, 4])
    assert pool.reuse(b, [1, 2, 3, 4, 9]) == 4 and pool.refs[a.table[0]] == 2
    pool.release(a)
    assert pool.available == 1 and pool.refs[b.table[0]] == 1
    pool.release(b)
    # nobody holds them: both cached, still available; taking two evicts the first released first
    assert pool.available == 3 and len(pool.cached) == 2
    c = Pages()
    assert pool.grow(c, 4) and len(pool.cached) == 1 and pool.cached_blocks([1, 2, 3, 4, 9]) == 0


def test_paging_options_are_checked():
    model = tiny()
    for paging, line in (
        (Paging(block_size=5), "block_size=5 must divide the context of 48 tokens"),
        (Paging(kv_blocks=2), "kv_blocks=2 cannot hold one sequence of the context (48 tokens = 3 blocks"),
        (Paging(max_step_tokens=3), "max_step_tokens=3 must be at least max_batch=4"),
        (Paging(block_size=0), "block_size=0 must be an integer >= 1"),
    ):
        with pytest.raises(GptkitError, match=re.escape(line)):
            Batcher(model, max_batch=4, paging=paging)


PAGED_KINDS = {
    **{k: VARIANTS[k] for k in ("rope-gqa", "rope-window")},
    "mla": dict(
        GQA,
        n_kv_heads=None,
        attention_kind="mla",
        mla=dict(kv_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6),
    ),
}


@pytest.mark.parametrize("kind", PAGED_KINDS)
def test_packed_prefill_attends_per_prompt_and_decode_rows_give_the_lone_logits(kind):
    """Prompts packed in one row [1, N], each attending only to its own keys (one attention call per prompt:
    Segments), some past a cached prefix; then decode steps over the decode rows while a sequence leaves
    (its row refilled by the last one) and one comes: every position's logits are the lone forward's of
    that sequence's tokens (fp32 rounding)."""
    from gptkit.inference.block_pool import BlockPool, DecodeRows, DecodeView, PackedView, Pages
    from gptkit.model.attention import Segments

    model = greedy_gpt(48, **PAGED_KINDS[kind])
    pool = BlockPool(model.cfg, 40, 4, "cpu", torch.float32)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (13, 9, 21)]
    pages = [Pages() for _ in seqs]

    def lone(ids):
        return model(torch.tensor([ids])).logits[0]  # [T, V]

    def packed(chunks):
        ids = [t for p, T, s in chunks for t in s[p.computed : p.computed + T]]
        for p, T, _ in chunks:
            assert pool.grow(p, p.computed + T)
        view = PackedView(pool, [(p, T) for p, T, _ in chunks])
        assert isinstance(view.mask_for(0), Segments) and len(view.mask_for(0).bounds) == len(chunks)
        return model(torch.tensor([ids]), cache=view).logits[0]  # [N, V]

    with torch.inference_mode():
        # two prompts in part (5 and 4 tokens), then their rest beside a third whole prompt
        first = packed([(pages[0], 5, seqs[0]), (pages[1], 4, seqs[1])])
        torch.testing.assert_close(first[:5], lone(seqs[0])[:5], rtol=0, atol=1e-5)
        torch.testing.assert_close(first[5:], lone(seqs[1])[:4], rtol=0, atol=1e-5)
        rest = packed([(pages[0], 8, seqs[0]), (pages[1], 5, seqs[1]), (pages[2], 21, seqs[2])])
        want = torch.cat([lone(seqs[0])[5:], lone(seqs[1])[4:], lone(seqs[2])])
        torch.testing.assert_close(rest, want, rtol=0, atol=1e-5)
        rows = DecodeRows(pool, 3, 48)
        live = [0, 1, 2]
        for step in range(9):
            if step == 3:
                # the first sequence leaves (its row taken by the last one's), at step 6 it comes back
                live = [1, 2]
            if step == 6:
                live = [2, 0, 1]
            nxt = [(step * 7 + i) % 61 for i in live]
            for i in live:
                assert pool.grow(pages[i], pages[i].computed + 1)
            view = DecodeView(pool, [pages[i] for i in live], rows)
            order = [live[j] for j in view.order]
            tok = torch.tensor([[nxt[j]] for j in view.order])  # [n, 1]
            logits = model(tok, cache=view).logits[:, -1]  # [n, V]
            for r, i in enumerate(order):
                seqs[i] = seqs[i] + [int(tok[r, 0])]
                torch.testing.assert_close(logits[r], lone(seqs[i])[-1], rtol=0, atol=1e-5)
        assert rows.cap >= len(seqs[2]) and len(rows.seqs) == 3


ONE_ROW_KINDS = {
    **PAGED_KINDS,
    "mqa-eager": dict(GQA, n_kv_heads=1, attention="eager"),
    "window-eager": dict(VARIANTS["rope-window"], attention="eager"),
    "learned-mha": VARIANTS["learned-mha"],
    # every layer local: blocks behind the window are released, a row's keys start past position 0
    "all-local": dict(GQA, sliding_window=5, layer_types=["local", "local"]),
}


@pytest.mark.parametrize("kind", ONE_ROW_KINDS)
def test_decode_rows_of_one_length_take_no_mask_and_give_the_lone_logits(kind):
    """Decode steps whose rows all sit at one column (one sequence; two of one length): no mask (each token
    sees its whole span, a window's last keys), an int position when they share it too, and every logit the
    lone forward's (fp32 rounding), past a window's released blocks; rows of two lengths keep the mask."""
    from gptkit.inference.block_pool import BlockPool, DecodeRows, DecodeView, PackedView, Pages

    model = greedy_gpt(48, **ONE_ROW_KINDS[kind])
    pool = BlockPool(model.cfg, 40, 4, "cpu", torch.float32)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (10, 10, 7)]
    pages = [Pages() for _ in seqs]

    def lone(ids):
        return model(torch.tensor([ids])).logits[0, -1]  # [V]

    with torch.inference_mode():
        for p, s in zip(pages, seqs):
            assert pool.grow(p, len(s))
            model(torch.tensor([s]), cache=PackedView(pool, [(p, len(s))]))
        rows = DecodeRows(pool, 3, 48)
        # two of one length, one alone, all three (two lengths), the third alone
        for step, live in enumerate([[0, 1]] * 3 + [[0]] * 6 + [[0, 1, 2]] * 2 + [[2]] * 3):
            for i in live:
                assert pool.grow(pages[i], pages[i].computed + 1)
            view = DecodeView(pool, [pages[i] for i in live], rows)
            order = [live[j] for j in view.order]
            same = len({pages[i].computed for i in live}) == 1
            assert (view.mask_for(0) is None) == same
            assert isinstance(view.positions, int) == same
            tok = torch.tensor([[(step * 5 + i) % 61] for i in order])  # [n, 1]
            logits = model(tok, cache=view, logits_to_keep=1).logits[:, -1]  # [n, V]
            for r, i in enumerate(order):
                seqs[i] = seqs[i] + [int(tok[r, 0])]
                torch.testing.assert_close(logits[r], lone(seqs[i]), rtol=0, atol=1e-5)
            for i in live:
                pool.behind_window(pages[i])
        assert kind != "all-local" or pages[0].table[0] is None


def test_shared_prefix_prompts_give_the_same_greedy_tokens_with_the_prefix_cache_on_and_off():
    """Requests that share a 13-token system prompt, more than the batch holds: with the cache on, the later
    ones skip its prefill (hits counted); every request's greedy tokens are the same on and off, and
    `gptkit sample`'s."""
    model = tiny()
    system = prompts(8, seed=11)[7][:13]
    ps = [system + p for p in prompts(6, seed=12)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    got = {}
    for cache in (True, False):
        batcher = Batcher(model, max_batch=3, paging=Paging(block_size=4, prefix_cache=cache))
        out = run_all(batcher, [(p, params) for p in ps])
        got[cache] = [out[i][0] for i in range(len(ps))]
        stats = batcher.paged.stats()
        # 12 of the 13 shared tokens fill 3 blocks: the requests admitted after the first one's prefill hit
        assert (stats["prefix_hit_tokens"] > 0) == cache and released(batcher)
    assert got[True] == got[False] == [reference(model, p, 8).tokens[0] for p in ps]
