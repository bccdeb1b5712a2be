"""The paged scheduler's order of prefill work (gptkit/inference/scheduler.py, issue 53 item 1): running
decodes first, then the prompt with the least prefill left, aged by its wait so that a long prompt is never
starved; the order changes no greedy token and preemption still works."""

import math

import torch
from conftest import greedy_gpt

from gptkit.inference.batcher import Batcher, Job, SamplingParams
from gptkit.inference.block_pool import Paging
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions

GQA = dict(position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def spy(batcher) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each step's (decodes, [(prompt length, chunk tokens), ...] in the order planned)."""
    steps, plan = [], batcher.paged._plan

    def planned():
        decodes, chunks = plan()
        steps.append((len(decodes), [(len(s.job.prompt), T) for s, T in chunks]))
        return decodes, chunks

    batcher.paged._plan = planned
    return steps


def test_a_step_runs_decodes_then_the_least_prefill_left_several_prompts_a_step():
    """A synthetic queue of prompts of 30, 5, 20 and 3 tokens under a budget of 12 tokens a step: the 3- and
    5-token prompts whole and the 20-token one's first 4 in step 1 (first come first served would feed the
    30-token prompt's first 12); then the two decodes, and the 20-token prompt (16 left) before the 30."""
    model = greedy_gpt(64, **GQA)
    b = Batcher(model, max_batch=4, paging=Paging(block_size=4, max_step_tokens=12, prefix_cache=False))
    steps = spy(b)
    with torch.inference_mode():
        for i, n in enumerate([30, 5, 20, 3]):
            b.add(Job(prompt(n, i), SamplingParams(max_new_tokens=20, temperature=0.0), lambda e: None))
        for _ in range(5):
            b.step()
    assert steps == [
        (0, [(3, 3), (5, 5), (20, 4)]),
        (2, [(20, 10)]),
        (2, [(20, 6), (30, 4)]),
        (3, [(30, 9)]),
        (3, [(30, 9)]),
    ]


def test_a_prompt_whose_prefix_is_cached_counts_only_the_tokens_it_computes():
    """A 40-token prompt whose first 36 tokens are in the prefix cache has 4 tokens left: it goes before a
    fresh 20-token prompt queued ahead of it."""
    model = greedy_gpt(64, **GQA)
    b = Batcher(model, max_batch=4, paging=Paging(block_size=4, max_step_tokens=12))
    system = prompt(36, 7)
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    with torch.inference_mode():
        b.add(Job(system, SamplingParams(max_new_tokens=3, temperature=0.0), lambda e: None))
        while b.busy:
            b.step()
        steps = spy(b)
        b.add(Job(prompt(20, 8), greedy, lambda e: None))
        b.add(Job(system + prompt(4, 9), greedy, lambda e: None))
        b.step()
    assert steps == [(0, [(40, 4), (20, 8)])]


def test_a_long_prompt_is_not_starved_by_short_prompts_that_keep_coming():
    """A 40-token prompt, then three 3-token prompts (one token each) join at every step and fill a budget of
    9: least-left-first alone would never feed the long prompt (the control below); aged by its wait (key =
    tokens left + 9 x its admission step), no prompt admitted after step 4 goes before it, so its first
    token comes by step ceil(40 / 9) + ceil(40 / 9) + 1, while the short prompts were served first."""
    model = greedy_gpt(64, **GQA)

    def first_token_step(order=None) -> tuple[int | None, int]:
        b = Batcher(model, max_batch=4, paging=Paging(block_size=4, max_step_tokens=9, prefix_cache=False))
        if order is not None:
            b.paged.prefill_order = order
        got, shorts = [], []
        with torch.inference_mode():
            b.add(Job(prompt(40, 0), SamplingParams(max_new_tokens=2, temperature=0.0), got.append))
            for step in range(40):
                for i in range(3 - len(b.waiting)):
                    params = SamplingParams(max_new_tokens=1, temperature=0.0)
                    b.add(Job(prompt(3, 100 + 3 * step + i), params, shorts.append))
                b.step()
                if got:
                    return step, len(shorts)
        return None, len(shorts)

    step, served = first_token_step()
    assert step is not None and step <= 2 * math.ceil(40 / 9) + 1
    assert served >= 3 * 4
    # the control: least prefill left first without the age, the long prompt waits for ever
    assert first_token_step(order=lambda seqs: sorted(seqs, key=lambda s: len(s.job.prompt)))[0] is None


def test_the_order_changes_no_greedy_token_and_preemption_still_works():
    """A burst of prompts of 3-40 tokens under a budget of 9 tokens a step, with a pool too small for them
    all (preempted, recomputed): every greedy answer is `gptkit sample`'s, the same as under first come
    first served (the admission order), and every block comes back."""
    model = greedy_gpt(64, **GQA)
    ps = [prompt(n, i) for i, n in enumerate([40, 3, 25, 7, 33, 12, 5, 18])]
    refs = [
        generate(model, p, SampleOptions(max_new_tokens=12, temperature=0.0, overflow="stop")).tokens[0]
        for p in ps
    ]

    def answers(order=None):
        paging = Paging(block_size=4, kv_blocks=16, max_step_tokens=9, prefix_cache=False)
        b = Batcher(model, max_batch=6, paging=paging)
        if order is not None:
            b.paged.prefill_order = order
        steps = spy(b)
        got = {i: [] for i in range(len(ps))}
        with torch.inference_mode():
            for i, p in enumerate(ps):
                params = SamplingParams(max_new_tokens=12, temperature=0.0)
                b.add(Job(p, params, lambda events, i=i: [got[i].extend(e.tokens) for e in events]))
            while b.busy:
                b.step()
        pool = b.paged.pool
        assert b.paged.preempted > 0 and not any(pool.refs) and pool.available == pool.blocks
        return [got[i] for i in range(len(ps))], steps

    ours, steps = answers()
    fcfs, fcfs_steps = answers(order=list)
    assert ours == refs and fcfs == refs
    # the two orders did differ
    assert steps != fcfs_steps
