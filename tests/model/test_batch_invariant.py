"""gptkit/model/batch_invariant.py: under the mode a row's bits do not depend on the rest of the batch, so the
sampler's log-prob of each token (a decode through the KV cache, n rows a step) and the trainer's (one
teacher-forced forward over [B, T], chunked) are the same bits in fp32 on the CPU."""

import torch

from gptkit.inference.rollouts import RolloutOptions, sample_groups, sample_key
from gptkit.model import GPT, ModelConfig
from gptkit.model import batch_invariant as bi
from gptkit.training.objectives.base import target_logps
from gptkit.training.objectives.grpo_rows import completion_rows, sampled_rows


def grpo_tiny():
    """experiment=sft-tiny's model (the start of experiment=grpo-tiny): 3 layers, d_model 128, GQA 4:2,
    SwiGLU, RMSNorm, RoPE, a byte vocabulary."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=259,
        max_seq_len=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_model=128,
        d_ff=384,
        position="rope",
        mlp="swiglu",
        norm="rmsnorm",
    )
    return GPT(cfg).eval()


def test_sampler_and_trainer_log_probs_are_the_same_bits_at_any_batch():
    # (tests/training/test_grpo.py holds a run with sinks, the output gate and partial RoPE to it)
    temperature = 0.7
    model = grpo_tiny()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (20, 33, 12)]
    keys = [[sample_key(0, 0, p, r) for r in range(4)] for p in range(3)]
    opts = RolloutOptions(8, temperature, top_p=0.9)
    with bi.batch_invariant(model):
        groups = sample_groups(model, prompts, keys, opts, [8] * 3)
        x, y = completion_rows(prompts, [c.tokens for gr in groups for c in gr], 0)
        whole = target_logps(model, x, y, temperature)  # [12, T]
        # the rows in other batches: one alone, three
        alone = target_logps(model, x[5:6], y[5:6], temperature)
        three = target_logps(model, x[2:5], y[2:5], temperature)
    sampled = sampled_rows(prompts, groups, y.shape)
    mask = y != -100
    assert int(mask.sum()) > 24 and all(len(c.logprobs) == len(c.tokens) for gr in groups for c in gr)
    assert torch.equal(whole[mask], sampled[mask])
    assert torch.equal(alone, whole[5:6]) and torch.equal(three, whole[2:5])
    # the layers' own backends are back
    assert all(m.attend is not bi.attention for m in model.modules() if hasattr(m, "attend"))
    assert model.blocks[0].attn.attend.__name__ == "sdpa_attention"


def test_each_op_gives_a_row_the_same_bits_whatever_rows_or_keys_come_with_it():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 100, generator=g) * 3
    w = torch.randn(70, 100, generator=g)
    ops = {
        "linear": lambda t: torch.nn.functional.linear(t, w),
        "matmul": lambda t: t @ w.t(),
        "softmax": lambda t: t.softmax(-1),
        "log_softmax": lambda t: torch.log_softmax(t, dim=-1),
        "logsumexp": lambda t: torch.logsumexp(t, dim=-1),
        "mean": lambda t: t.mean(-1, keepdim=True),
        "silu": torch.nn.functional.silu,
        "sigmoid": torch.sigmoid,
        "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        "layer_norm": lambda t: torch.nn.functional.layer_norm(t, (100,)),
    }
    with bi.InvariantOps():
        for name, op in ops.items():
            whole = op(x)
            for a, b in ((7, 8), (0, 1), (3, 20), (30, 40)):
                assert torch.equal(op(x[a:b]), whole[a:b]), name
    # attention: query p with a cache of p + 1 keys equals row p of the causal pass over all 13 (GQA 4:2)
    q, k, v = (torch.randn(2, h, 13, 16, generator=g) for h in (4, 2, 2))
    causal, _ = bi.attention(q, k, v, keys=16)
    for p in (0, 5, 12):
        one, _ = bi.attention(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], keys=16)
        assert torch.equal(one, causal[:, :, p : p + 1]), p
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(causal, want, atol=1e-6)


def test_a_row_sum_is_computed_in_fp32_alike_at_any_row_count_under_autocast():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 259, generator=g)
    whole = bi.row_sum(x)
    assert torch.allclose(whole, x.sum(-1), atol=1e-4)
    assert all(torch.equal(bi.row_sum(x[a:b]), whole[a:b]) for a, b in ((0, 1), (5, 7), (9, 40)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert bi.row_sum(x.bfloat16()).dtype == torch.float32
