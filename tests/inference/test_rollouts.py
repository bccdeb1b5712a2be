"""gptkit/inference/rollouts.py: a group's completions through the KV cache, each a pure function of its key
(not of the other prompts, their order or the resume point), greedy as gptkit.inference.generate, stopped and
kept at a stop id, and the same when a rank joins the forward passes of others (FSDP2's lockstep); the engine
(sample_groups_batched: every group in one continuous batch) draws the per-group path's tokens.
"""

import torch

from gptkit.inference.generate import generate
from gptkit.inference.rollouts import (
    RolloutOptions,
    key_noise,
    key_tensor,
    sample_groups,
    sample_groups_batched,
    sample_key,
)
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.model.batch_invariant import batch_invariant


def tiny_model(**extra):
    torch.manual_seed(0)
    cfg = ModelConfig(
        **extra,
        vocab_size=40,
        max_seq_len=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_model=32,
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
    )
    return GPT(cfg).eval()


def tokens(groups):
    return [[c.tokens for c in g] for g in groups]


def ends(groups):
    return [[(c.tokens, c.stop_reason) for c in g] for g in groups]


def test_a_completion_depends_on_its_key_only_not_on_the_other_prompts_or_their_order():
    model = tiny_model()
    opts = RolloutOptions(max_new_tokens=10, temperature=1.0, stop_ids=(5,))
    keys = [sample_key(1337, 4, 0, r) for r in range(4)]
    alone = tokens(sample_groups(model, [[1, 2, 3]], [keys], opts, [10]))
    other = [sample_key(1337, 4, 1, r) for r in range(3)]
    among = tokens(sample_groups(model, [[7, 8], [1, 2, 3]], [other, keys], opts, [10, 10]))
    assert among[1] == alone[0]
    # the same draws again (a resumed step), and other draws for other keys
    assert tokens(sample_groups(model, [[1, 2, 3]], [keys], opts, [10])) == alone
    assert tokens(sample_groups(model, [[1, 2, 3]], [[k + 1 for k in keys]], opts, [10])) != alone
    # each completion ends at the stop id, which it keeps, or at the limit
    for c in sample_groups(model, [[1, 2, 3]], [keys], opts, [10])[0]:
        assert (c.stop_reason == "stop" and c.tokens[-1] == 5 and 5 not in c.tokens[:-1]) or (
            c.stop_reason == "length" and len(c.tokens) == 10 and 5 not in c.tokens
        )
    # a row with less room than max_new_tokens: cut by the context
    short = sample_groups(model, [[1, 2, 3]], [[sample_key(9)]], RolloutOptions(10, 1.0), [4])[0][0]
    assert (len(short.tokens), short.stop_reason) == (4, "context")
    assert model.training is False


def test_greedy_is_gptkits_greedy_and_sampling_draws_from_the_softmax():
    model = tiny_model()
    greedy = sample_groups(model, [[1, 2, 3]], [[0, 1]], RolloutOptions(12, temperature=0.0), [12])
    want = generate(model, [1, 2, 3], SampleOptions(max_new_tokens=12, temperature=0.0, decode="eager"))
    assert [c.tokens for c in greedy[0]] == [want.tokens[0]] * 2
    # sliding-window layers (their rolling cache) too: 15 tokens through a window of 4
    local = tiny_model(sliding_window=4)
    greedy = sample_groups(local, [[1, 2, 3]], [[0]], RolloutOptions(12, temperature=0.0), [12])
    want = generate(local, [1, 2, 3], SampleOptions(max_new_tokens=12, temperature=0.0, decode="eager"))
    assert greedy[0][0].tokens == want.tokens[0]
    # the first token of 3000 keys against the model's distribution
    keys = [sample_key(5, r) for r in range(3000)]
    first = sample_groups(model, [[1, 2, 3]], [keys], RolloutOptions(1, temperature=1.0), [1])[0]
    freq = torch.bincount(torch.tensor([c.tokens[0] for c in first]), minlength=40).double() / 3000
    p = model(torch.tensor([[1, 2, 3]])).logits[0, -1].double().softmax(-1)
    # each frequency within ~4 standard errors
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / 3000).sqrt() + 1e-3).all(), (freq, p)
    # the noise is Exp(1), a pure function of (key, token index, vocabulary id)
    k = key_tensor(keys, "cpu")
    noise = key_noise(k, 3, 40)
    assert torch.equal(noise, key_noise(k, 3, 40)) and not torch.equal(noise, key_noise(k, 4, 40))
    assert abs(float(noise.mean()) - 1.0) < 0.02 and abs(float(noise.var()) - 1.0) < 0.05


def test_a_rank_that_is_done_joins_the_others_forward_passes_and_draws_the_same():
    model = tiny_model()
    opts = RolloutOptions(max_new_tokens=8, temperature=1.0, stop_ids=(5,))
    keys = [sample_key(3, r) for r in range(3)]
    plain = tokens(sample_groups(model, [[1, 2]], [keys], opts, [8]))
    calls, seen = [], []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return forward(*args, **kwargs)

    model.forward = counted

    # another rank decodes 20 steps whatever this one does
    def lockstep(active):
        seen.append(active)
        return len(seen) < 20

    joined = tokens(sample_groups(model, [[1, 2]], [keys], opts, [8], lockstep=lockstep))
    assert joined == plain
    # one prefill, then a forward after each of the 19 "go on"s: decoding steps, then one-token joins
    assert len(calls) == 20 and calls[-1] == (1, 1)


def test_the_engine_draws_the_per_group_paths_tokens_whatever_shares_its_batch():
    """Several prompts' groups in one continuous batch (rows at their own positions, joining when slots free
    up, leaving when they end): each completion the per-group path's, greedy and sampled, through a sliding
    window and across a longrope switch (a row's restart); the same in another order, with fewer slots,
    alone, and again (a resumed step)."""
    pairs = 32 // 2 // 2
    longrope = {"type": "longrope", "factor": 4.0, "original_max_seq_len": 8}
    longrope |= {"short_factor": [1.0] * pairs, "long_factor": [3.0] * pairs}
    prompts = [[1, 2, 3], [7, 8], [4, 5, 6, 7, 9], [3]]
    keys = [[sample_key(1337, 4, p, r) for r in range(3)] for p in range(4)]
    budgets = [10, 10, 6, 10]
    for model in (tiny_model(), tiny_model(sliding_window=4), tiny_model(rope_scaling=longrope)):
        for temperature in (0.0, 1.0):
            opts = RolloutOptions(10, temperature, stop_ids=(5,))
            # torch's forwards: the same tokens and ends (log-probs may differ in the last bits)
            want = ends(sample_groups(model, prompts, keys, opts, budgets))
            assert ends(sample_groups_batched(model, prompts, keys, opts, budgets)) == want
            # 5 slots: groups of 3 join as rows leave; the order reversed
            back = sample_groups_batched(model, prompts[::-1], keys[::-1], opts, budgets[::-1], max_rows=5)
            assert ends(back[::-1]) == want
            alone = sample_groups_batched(model, prompts[2:3], keys[2:3], opts, budgets[2:3])
            assert ends(alone) == want[2:3]
        assert {end for g in want for _, end in g} >= {"context", "length"}
    assert model.training is False
    # batch-invariant forwards (grpo.batch_invariant, the default): every log-prob the same bits too
    model = tiny_model()
    opts = RolloutOptions(10, 1.0, stop_ids=(5,))
    with batch_invariant(model):
        want = sample_groups(model, prompts, keys, opts, budgets)
        assert sample_groups_batched(model, prompts, keys, opts, budgets) == want
        back = sample_groups_batched(model, prompts[::-1], keys[::-1], opts, budgets[::-1], max_rows=5)
        assert back[::-1] == want
    assert all(len(c.logprobs) == len(c.tokens) for g in want for c in g)
    # each row's own token index: the rows of one index drawn together
    k = key_tensor([sample_key(2, r) for r in range(3)], "cpu")
    index = torch.tensor([0, 7, 2])
    rows = torch.cat([key_noise(k[r : r + 1], int(index[r]), 40) for r in range(3)])
    assert torch.equal(key_noise(k, index, 40), rows)


def test_a_rank_that_is_done_joins_the_engines_forward_passes_and_draws_the_same():
    """lockstep (FSDP2): every forward of the engine, prefills and decode steps, is one step asked of the
    ranks; a rank without work joins with a one-token forward, so each rank runs as many."""
    model = tiny_model()
    opts = RolloutOptions(max_new_tokens=6, temperature=1.0, stop_ids=(5,))
    keys = [[sample_key(3, p, r) for r in range(2)] for p in range(2)]
    plain = sample_groups_batched(model, [[1, 2], [3]], keys, opts, [6, 6])
    calls, seen = [], []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return forward(*args, **kwargs)

    model.forward = counted

    def lockstep(active):
        seen.append(active)
        return len(seen) < 20

    assert sample_groups_batched(model, [[1, 2], [3]], keys, opts, [6, 6], lockstep=lockstep) == plain
    # the dtype probe, then one forward per "go on": 2 prefills, decode steps, then one-token joins
    assert len(calls) == 20 and calls[:3] == [(1, 1), (1, 2), (1, 1)] and calls[-1] == (1, 1)
    work = seen.index(False)
    assert 3 <= work < 19 and not any(seen[work:]) and all(seen[:work])
