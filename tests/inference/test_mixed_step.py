"""The mixed serving step (gptkit/inference/scheduler.py, MixedView in block_pool.py): a step with running
decodes and prompt chunks runs them in ONE forward [1, n + N]. Checked against the two-forward step (a decode
forward, then a packed one: PagedSteps.mixed False) and `gptkit sample`'s one-sequence generate(): the same
greedy tokens, logits within 1e-5, with RoPE and GQA, learned positions, a sliding window, preemption and
the prefix cache; a step with only decodes or only prefill runs its one forward as before; a mixed forward
that fails runs the step as two forwards (a failing prompt still ends alone)."""

import pytest
import torch
from conftest import greedy_gpt

from gptkit.inference.batcher import Batcher, Job, SamplingParams
from gptkit.inference.block_pool import MixedView, Paging
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions

GQA = dict(position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False)
VARIANTS = {
    "rope-gqa": GQA,
    # GPT-2's: learned positions, LayerNorm, GELU, every head its own K/V
    "learned-mha": dict(position="learned", n_kv_heads=None, mlp="gelu", norm="layernorm"),
    # a local layer (a window of 5) beside a global one
    "rope-window": dict(GQA, sliding_window=5, layer_types=["local", "global"]),
    # the reference backend (the others run model.attention's default, sdpa)
    "rope-window-eager": dict(GQA, sliding_window=5, layer_types=["local", "global"], attention="eager"),
}


def prompts(k: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 61, (3 + (7 * i) % 23,), generator=g).tolist() for i in range(k)]


def released(b) -> bool:
    pool = b.paged.pool
    return b.active == 0 and not any(pool.refs) and pool.available == pool.blocks


class Run:
    """A paged Batcher, mixed or not, that records every forward's (input shape, mixed) and every logits row
    its sampler saw; jobs added at given steps (so that prompts arrive while others decode)."""

    def __init__(self, model, mixed: bool | None, paging: Paging, max_batch: int = 6) -> None:
        self.b = Batcher(model, max_batch=max_batch, paging=paging)
        if mixed is not None:
            self.b.paged.mixed = mixed
        self.forwards: list[tuple[int, tuple, bool]] = []
        self.logits: list[torch.Tensor] = []
        choose = self.b._choose

        def spy(logits, seqs):
            self.logits.append(logits.clone())
            return choose(logits, seqs)

        self.b._choose = spy

    def run(self, model, jobs) -> dict:
        """jobs: (step to add it at, prompt, params) -> {job: {choice: tokens}}."""
        got = {i: {} for i in range(len(jobs))}
        forward, patched = model.forward, "forward" in vars(model)

        def counted(ids, *args, cache=None, **kwargs):
            self.forwards.append((self.b.steps, tuple(ids.shape), isinstance(cache, MixedView)))
            return forward(ids, *args, cache=cache, **kwargs)

        model.forward = counted
        step = 0
        try:
            with torch.inference_mode():
                while step == 0 or self.b.busy or any(at >= step for at, _, _ in jobs):
                    for i, (at, p, params) in enumerate(jobs):
                        if at == step:
                            self.b.add(Job(p, params, self._collect(got[i])))
                    self.b.step()
                    step += 1
        finally:
            if patched:
                model.forward = forward
            else:
                del model.forward
        return got

    @staticmethod
    def _collect(into):
        return lambda events: [into.setdefault(e.choice, []).extend(e.tokens) for e in events]


def workload(seed: int):
    """Greedy prompts of 3-25 tokens arriving at steps 0, 0, 2, 3, 5, 9 and a seeded job of 2 choices."""
    ps = prompts(7, seed)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    seeded = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=3, n=2)
    at = [0, 0, 2, 3, 5, 9, 4]
    return ps, [(at[i], p, greedy if i < 6 else seeded) for i, p in enumerate(ps)]


CASES = {
    "roomy": Paging(block_size=4, max_step_tokens=16, prefix_cache=False),
    # a pool of one context (12 blocks of 4) for up to 6 sequences: preempted, recomputed
    "preempted": Paging(block_size=4, kv_blocks=12, max_step_tokens=9, prefix_cache=False),
    "prefix cache": Paging(block_size=4, max_step_tokens=12),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_forward_a_step_gives_the_tokens_and_logits_of_two(variant, case):
    """Mixed on and off on the same arrivals: every step that has decodes and chunks runs one forward of
    n + N tokens (off: two), the greedy tokens are generate()'s, every logits row the samplers saw agrees
    within 1e-5 (so the seeded choices draw the same), every block comes back."""
    model = greedy_gpt(48, **VARIANTS[variant])
    ps, jobs = workload(seed=11)
    if case == "prefix cache":
        # prompts that share a prefix of 2 blocks with an earlier one
        jobs = jobs + [(6, ps[3][:8] + [1, 2, 3], jobs[0][2]), (7, ps[3][:9], jobs[0][2])]
    refs = [
        generate(model, p, SampleOptions(max_new_tokens=10, temperature=0.0, overflow="stop")).tokens[0]
        for _, p, params in jobs
        if params.temperature == 0.0
    ]
    mixed, two = Run(model, True, CASES[case]), Run(model, False, CASES[case])
    got_mixed, got_two = mixed.run(model, jobs), two.run(model, jobs)
    greedy = [i for i, (_, _, params) in enumerate(jobs) if params.temperature == 0.0]
    assert [got_mixed[i][0] for i in greedy] == refs == [got_two[i][0] for i in greedy]
    assert got_mixed[6] == got_two[6] and [len(got_mixed[6][c]) for c in (0, 1)] == [10, 10]
    assert len(mixed.logits) == len(two.logits)
    for a, b in zip(mixed.logits, two.logits):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the same plan, step by step: one forward a step mixed, two where the step had both
    assert mixed.b.steps == two.b.steps
    per_step = {}
    for step, shape, is_mixed in mixed.forwards:
        per_step.setdefault(step, []).append((shape, is_mixed))
    assert all(len(f) == 1 for f in per_step.values())
    both = [s for s, f in per_step.items() if f[0][1]]
    assert len(both) == mixed.b.paged.mixed_steps >= 3 and mixed.b.paged.mixed_failed == 0
    two_steps = {}
    for step, shape, _ in two.forwards:
        two_steps.setdefault(step, []).append(shape)
    for s in both:
        (shape, _), (dec, packed) = per_step[s][0], two_steps[s]
        # n decodes [n, 1] and N chunk tokens [1, N] in one row [1, n + N]
        assert dec[1] == 1 and packed[0] == 1 and shape == (1, dec[0] + packed[1])
    # a step with only decodes or only prefill: the same forward as before
    for s, f in per_step.items():
        if s not in both:
            assert f[0][0] == two_steps[s][0] and len(two_steps[s]) == 1
    if case == "preempted":
        assert mixed.b.paged.preempted > 0
    if case == "prefix cache":
        assert mixed.b.paged.pool.hits > 0 and mixed.b.paged.pool.hits == two.b.paged.pool.hits
    assert released(mixed.b) and released(two.b)


def test_a_failing_mixed_forward_runs_the_step_as_two_and_a_failing_prompt_ends_alone():
    """The mixed forward raises (any step holding the poisoned prompt; once at the end of a healthy step): the
    step runs its decode forward and its packed prefill as two forwards; the poisoned prompt ends with an
    error in the step it arrived, its neighbours get generate()'s tokens."""
    model = greedy_gpt(48, **GQA)
    ps, jobs = workload(seed=5)
    jobs = jobs[:6]
    poison = [60, 60, 60] + ps[1]
    jobs.append((3, poison, jobs[0][2]))
    refs = [
        generate(model, p, SampleOptions(max_new_tokens=10, temperature=0.0, overflow="stop")).tokens[0]
        for _, p, _ in jobs[:6]
    ]
    run = Run(model, True, Paging(block_size=4, max_step_tokens=16, prefix_cache=False))
    forward, healthy_fail = model.forward, {"left": 1}

    def fails(ids, *args, cache=None, **kwargs):
        row = ids[0].tolist()
        has_poison = ids.shape[0] == 1 and any(row[i : i + 3] == [60, 60, 60] for i in range(len(row)))
        if has_poison:
            raise RuntimeError("injected failure")
        out = forward(ids, *args, cache=cache, **kwargs)
        if isinstance(cache, MixedView) and healthy_fail["left"]:
            # after the whole forward: its keys written, its sequences advanced (undone by the step)
            healthy_fail["left"] -= 1
            raise RuntimeError("injected failure after the forward")
        return out

    model.forward = fails
    try:
        got = run.run(model, jobs)
    finally:
        del model.forward
    assert [got[i][0] for i in range(6)] == refs
    assert got[6] == {0: []} and run.b.ended["error"] == 1
    assert run.b.paged.mixed_failed >= 2 and run.b.paged.mixed_steps > 0 and released(run.b)


def test_a_model_with_a_latent_attention_layer_keeps_two_forwards():
    """Multi-head latent attention reads its values from its cached latents (no MixedView part for them):
    its steps stay two forwards, with generate()'s tokens."""
    mla = dict(kv_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
    model = greedy_gpt(48, **dict(GQA, n_kv_heads=None, attention_kind="mla", mla=mla))
    ps, jobs = workload(seed=2)
    jobs = jobs[:6]
    run = Run(model, None, Paging(block_size=4, max_step_tokens=16, prefix_cache=False))
    assert run.b.paged.mixed is False
    got = run.run(model, jobs)
    refs = [
        generate(model, p, SampleOptions(max_new_tokens=10, temperature=0.0, overflow="stop")).tokens[0]
        for _, p, _ in jobs
    ]
    assert [got[i][0] for i in range(6)] == refs and run.b.paged.mixed_steps == 0
    assert not any(m for _, _, m in run.forwards)
