"""The model: shapes for every variant, causality, eager == sdpa, init, tying."""

import math

import pytest
import torch

from gptkit.model import GPT, KVCache, ModelConfig

VARIANTS = {
    "gpt2": dict(position="learned", mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True),
    "llama-mha": dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False),
    "llama-gqa": dict(
        position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False, n_kv_heads=2
    ),
    "mqa-learned": dict(position="learned", mlp="gelu", norm="rmsnorm", bias=False, n_kv_heads=1),
    "rope-gelu-ln-bias-untied": dict(
        position="rope", mlp="gelu", norm="layernorm", bias=True, tie_embeddings=False
    ),
}


def tiny(variant: str, **kw) -> ModelConfig:
    base = dict(vocab_size=97, max_seq_len=32, n_layers=2, n_heads=4, d_model=32, **VARIANTS[variant])
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_shapes_and_loss(variant):
    torch.manual_seed(0)
    cfg = tiny(variant)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 20))  # [B, T]
    out = model(idx, idx)
    assert out.logits.shape == (3, 20, cfg.vocab_size)
    assert out.loss.dtype == torch.float32 and out.loss.ndim == 0
    # at init the loss is close to uniform over the vocabulary
    assert abs(out.loss.item() - math.log(cfg.vocab_size)) < 0.5
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(idx, logits_to_keep=1).logits.shape == (3, 1, cfg.vocab_size)


@pytest.mark.parametrize("variant", VARIANTS)
def test_causality(variant):
    torch.manual_seed(0)
    cfg = tiny(variant)
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    changed = idx.clone()
    changed[:, 12:] = torch.randint(0, cfg.vocab_size, (2, 12))
    a, b = model(idx).logits, model(changed).logits
    # positions <= 11 never see the future
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("variant", ["gpt2", "llama-mha", "llama-gqa", "mqa-learned"])
def test_eager_matches_sdpa(variant):
    torch.manual_seed(0)
    cfg = tiny(variant, attention="eager")
    eager = GPT(cfg).eval()
    sdpa = GPT(tiny(variant, attention="sdpa")).eval()
    sdpa.load_state_dict(eager.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    torch.testing.assert_close(eager(idx).logits, sdpa(idx).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gpt2", "llama-gqa"])
def test_kv_cache_prefill_then_decode_matches_full_forward(variant):
    torch.manual_seed(0)
    cfg = tiny(variant)
    model = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 20))
    full = model(idx).logits
    cache = KVCache(cfg, batch_size=2)
    parts = [model(idx[:, :13], cache=cache).logits]
    parts += [model(idx[:, t : t + 1], cache=cache).logits for t in range(13, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.k[0].shape == (2, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)


def test_eager_returns_attention_probabilities():
    cfg = tiny("llama-gqa")
    model = GPT(cfg).eval()
    out = model(torch.randint(0, 97, (1, 10)), return_attention=True)
    assert len(out.attentions) == cfg.n_layers
    p = out.attentions[0]  # [B, n_heads, T, T]
    assert p.shape == (1, cfg.n_heads, 10, 10)
    torch.testing.assert_close(p.sum(-1), torch.ones(1, cfg.n_heads, 10))
    assert torch.all(p.triu(1) == 0)


def test_init_and_tying():
    torch.manual_seed(0)
    cfg = tiny("gpt2", n_layers=8, d_model=256, n_heads=4)
    model = GPT(cfg)
    assert model.lm_head.weight is model.tok_emb.weight
    resid = model.blocks[0].attn.o_proj.weight.std().item()
    other = model.blocks[0].attn.qkv_proj.weight.std().item()
    assert abs(other - 0.02) < 0.002
    assert abs(resid - 0.02 / math.sqrt(2 * 8)) < 0.001
    assert torch.all(model.blocks[0].attn.qkv_proj.bias == 0)
    assert torch.all(model.blocks[0].attn_norm.weight == 1)
    untied = GPT(tiny("llama-mha"))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_gqa_projection_sizes():
    # 4 heads, 2 kv heads, head_dim 8
    cfg = tiny("llama-gqa")
    attn = GPT(cfg).blocks[0].attn
    assert attn.qkv_proj.weight.shape == (cfg.d_model + 2 * 2 * 8, cfg.d_model)


def test_half_precision_forward_keeps_fp32_reductions():
    torch.manual_seed(0)
    cfg = tiny("llama-gqa")
    model = GPT(cfg).eval()
    idx = torch.randint(0, 97, (2, 16))
    ref = model(idx).logits
    half = model.to(torch.bfloat16)(idx).logits
    assert half.dtype == torch.bfloat16
    assert (half.float() - ref).abs().max() < 0.1


def test_sequence_longer_than_context_is_refused():
    cfg = tiny("gpt2")
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(cfg)(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_rope_tables_stay_fp32_when_the_model_is_cast():
    cfg = tiny("llama-gqa")
    model = GPT(cfg)
    ref = model.rope.cos.clone()
    model.to(torch.bfloat16)
    assert model.rope.cos.dtype == torch.float32 and torch.equal(model.rope.cos, ref)
    with torch.device("meta"):
        lazy = GPT(cfg)
    # as load_run does: the tables are rebuilt, not left uninitialised
    lazy = lazy.to_empty(device="cpu")
    assert torch.equal(lazy.rope.cos, ref)


@pytest.mark.parametrize(
    "scaling",
    [None, {"type": "longrope", "original_max_seq_len": 8, "factor": 2.0}],
    ids=["plain", "longrope"],
)
@pytest.mark.parametrize("rotary", [8, 4], ids=["full", "partial"])
def test_rope_rotates_queries_and_keys_side_by_side_as_apart(scaling, rotary):
    """RotaryEmbedding.rotate on q and k concatenated over the heads (multi-head attention's one pass) gives
    bit for bit what forward(q, k) gives, at an int position, [T] and [B, T] positions, partial RoPE and a
    longrope scaling's switch included."""
    from gptkit.model.layers import RotaryEmbedding

    if scaling is not None:
        half = [1.0] * (rotary // 2)
        scaling = {
            **scaling,
            "short_factor": half,
            "long_factor": [2.0] * (rotary // 2),
            "attention_factor": None,
        }
    rope = RotaryEmbedding(rotary, max_seq_len=16, theta=10000.0, scaling=scaling)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
    for positions in (5, 9, torch.tensor([2, 3, 11]), torch.tensor([[0, 1, 2], [7, 8, 9]])):
        want_q, want_k = rope(q, k, positions)
        both = rope.rotate(torch.cat([q, k], dim=1), positions)
        assert torch.equal(both[:, :4], want_q) and torch.equal(both[:, 4:], want_k)


def test_rope_angles_remembered_within_a_forward_follow_positions_changed_in_place():
    """The angles rotate() remembers for the layers of one forward are dropped at the next forward: a
    positions tensor a caller advances in place (a static decode loop's) rotates at its new positions, the
    logits those of a fresh tensor; within a forward, another positions object is looked up anew."""
    from gptkit.model.layers import RotaryEmbedding

    torch.manual_seed(0)
    model = GPT(tiny("llama-gqa")).eval()
    idx = torch.randint(0, 97, (2, 3))
    with torch.inference_mode():
        pos = torch.tensor([[3, 4, 5], [7, 8, 9]])
        model(idx, positions=pos)
        # in place (an inference tensor: no version counter to tell), the gaps changed (RoPE is relative)
        pos[1] = torch.tensor([0, 4, 9])
        got = model(idx, positions=pos).logits
        want = model(idx, positions=torch.tensor([[3, 4, 5], [0, 4, 9]])).logits
    assert torch.equal(got, want)
    rope = RotaryEmbedding(8, max_seq_len=16, theta=10000.0)
    x = torch.randn(1, 2, 2, 8)
    a, b = torch.tensor([[1, 2]]), torch.tensor([[4, 5]])
    assert torch.equal(rope.rotate(x, a), rope(x, x, a)[0])
    assert torch.equal(rope.rotate(x, b), rope(x, x, b)[0])


def test_rmsnorm_in_inference_computes_the_training_formula_bit_for_bit():
    """RMSNorm under no_grad in fp32 on the CPU takes torch's rms_norm (one op): the same numbers as the
    Llama formula it runs with gradients, for several widths, scales and weights."""
    from gptkit.model.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dim, scale in ((64, 1e-3), (512, 1.0), (1376, 30.0)):
        norm = RMSNorm(dim, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g))
        x = torch.randn(3, 5, dim, generator=g) * scale
        with torch.no_grad():
            fast = norm(x)
        slow = norm(x.requires_grad_())
        h = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(fast, slow.detach()) and torch.equal(fast, norm.weight.detach() * h)


def _one_query_reference(q, k, v, window, mask, sinks, softcap):
    """float64 attention of one query per head [B, H, 1, D] over k, v [B, Hkv, Tk, D], K/V repeated per query
    head (the unfolded form): the keys of the window (the last W), the mask's, sinks in the denominator."""
    H, Hkv, Tk = q.shape[1], k.shape[1], k.shape[2]
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, 1, Tk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keep = torch.ones(Tk, dtype=torch.bool)
    if window is not None:
        keep = torch.arange(Tk) > Tk - 1 - window
    scores = scores.masked_fill(~(keep if mask is None else mask), float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    return torch.softmax(scores, -1) @ v  # [B, H, 1, D]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_one_query_attention_folds_a_gqa_group_into_one_query_as_the_unfolded_form(backend, kv_heads):
    """A decode step's one query per head: a GQA (MQA) group's query heads folded into the query axis of their
    K/V head (no K/V copy per head) give the unfolded attention (float64 reference, K/V repeated per head),
    with a window, a per-row mask [B, 1, 1, Tk] (the decode rows'), sinks, a soft-cap (eager)."""
    from gptkit.model.attention import ATTENTION_BACKENDS

    fn = ATTENTION_BACKENDS[backend]
    g = torch.Generator().manual_seed(0)
    B, H, Tk, D = 3, 4, 11, 8
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(2, B, kv_heads, Tk, D, generator=g)
    lengths = torch.tensor([11, 6, 1])
    row_mask = (torch.arange(Tk)[None] < lengths[:, None])[:, None, None]  # [B, 1, 1, Tk]
    sinks = torch.randn(H, generator=g)
    cases = [(None, None, None, None), (5, None, None, None), (None, row_mask, None, None)]
    cases += [(None, None, sinks, None), (4, None, sinks, None), (None, row_mask, sinks, None)]
    if backend == "eager":
        cases += [(None, None, None, 2.0), (5, row_mask, None, 2.0)]
    for window, mask, s, cap in cases:
        want = _one_query_reference(q, k, v, window if mask is None else None, mask, s, cap)
        got, _ = fn(q, k, v, causal=True, mask=mask, window=window, sinks=s, softcap=cap)
        assert got.shape == (B, H, 1, D)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    if backend == "eager":
        # the probabilities come back per query head
        _, probs = fn(q, k, v, causal=True, return_probs=True)
        assert probs.shape == (B, H, 1, Tk)
        torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, 1))
