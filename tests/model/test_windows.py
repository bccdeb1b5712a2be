"""Sliding-window attention (model.sliding_window, model.layer_types) through the model: every backend against
a query-by-query reference (documents and GQA included, gradients too), the rolling KV cache of the local
layers against the full cache and against no cache (eager, static, compiled), the window in the accounting,
Gemma's components, and the one-line errors of bad windows, patterns, RoPE types and soft-caps."""

import pytest
import torch
from conftest import one_line, run_main

from gptkit import accounting as acc
from gptkit.errors import ConfigError
from gptkit.inference import static_decode as sd
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, KVCache, ModelConfig, StaticKVCache
from gptkit.model.attention import ATTENTION_BACKENDS
from gptkit.model.documents import Documents

B, H, HKV, T, D, W = 2, 4, 2, 40, 16, 9


def reference(q, k, v, window, doc_ids=None):
    """float64 attention, one query at a time over the keys max(doc start, i - window + 1)..i."""
    q, k, v = (x.double() for x in (q, k, v))
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)  # [B, H, T, D]
    out = torch.zeros_like(q)  # [B, H, T, D]
    for b in range(B):
        for i in range(T):
            lo = max(0, i - window + 1)
            if doc_ids is not None:
                while doc_ids[b, lo] != doc_ids[b, i]:
                    lo += 1
            s = (q[b, :, i : i + 1] @ k[b, :, lo : i + 1].transpose(-1, -2)) * D**-0.5  # [H, 1, n]
            out[b, :, i] = (s.softmax(-1) @ v[b, :, lo : i + 1])[:, 0]
    return out


@pytest.mark.parametrize("backend", list(ATTENTION_BACKENDS))
@pytest.mark.parametrize("documents", [False, True])
def test_every_backend_attends_inside_the_window(backend, documents):
    """eager (dense mask), sdpa (query chunks on the CPU) and triton (the interpreter: tiles outside the
    window skipped) give the reference's outputs and the same gradients, with packed documents too."""
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, requires_grad=True) for _ in range(2))
    doc_ids = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 37]) if documents else None
    docs = Documents(doc_ids) if documents else None
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, window=W, docs=docs)
    want = reference(q, k, v, W, doc_ids)
    assert (out.double() - want).abs().max().item() <= 1e-5
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(reference(q, k, v, W, doc_ids), (q, k, v), dout.double())
    for name, a, b in zip("qkv", got, want_grads):
        assert (a.double() - b).abs().max().item() <= 1e-5, name


def varlen_window_reference(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch.nn.attention.varlen.varlen_attn's contract with a window (tokens [N, heads, D], sequences cut at
    cu_q, query i sees the keys i - window_size[0]..i of its sequence): stands in for the CUDA kernel."""
    left, right = window_size
    assert right == 0 and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and enable_gqa
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert 0 < b - a <= max_q == max_k
        kk, vv = (x[a:b].repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))  # [n, H, D]
        for i in range(b - a):
            lo = 0 if left < 0 else max(0, i - left)
            s = torch.einsum("hd,nhd->hn", q[a + i], kk[lo : i + 1]) * scale  # [H, n]
            out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv[lo : i + 1]))  # [H, D]
    return torch.stack(out)  # [N, H, D]


def test_sdpa_window_takes_variable_length_flash_attention_where_it_runs(monkeypatch):
    """Where varlen_attn runs (CUDA, fp16/bf16), a window is its window_size (W - 1, 0): each row one
    sequence, or the packed documents; no mask is built, no chunk run. On the CPU a stand-in plays it."""
    import gptkit.model.attention as attention

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen_window_reference)
    monkeypatch.setattr(attention, "varlen_usable", lambda q: True)
    monkeypatch.setattr(attention, "windowed_sdpa", lambda *a, **kw: pytest.fail("chunks ran"))
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, requires_grad=True) for _ in range(2))
    doc_ids = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 37])
    for ids in (None, doc_ids):
        docs = None if ids is None else Documents(ids)
        out, _ = attention.sdpa_attention(q, k, v, window=W, docs=docs, scale=D**-0.5)
        assert (out.double() - reference(q, k, v, W, ids)).abs().max().item() <= 1e-5
    out.sum().backward()
    assert all(bool(x.grad.abs().sum() > 0) for x in (q, k, v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_and_triton_windows_on_a_gpu_in_bf16():
    import gptkit.model.attention as attention

    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if not attention.varlen_usable(q):
        pytest.skip("torch's varlen FlashAttention does not run on this GPU")
    want = reference(q.cpu(), k.cpu(), v.cpu(), W)
    for backend in ("sdpa", "triton"):
        out, _ = ATTENTION_BACKENDS[backend](q, k, v, window=W)
        assert (out.cpu().double() - want).abs().max().item() <= 3e-2, backend


def tiny(**kw) -> GPT:
    """Three layers, local - global - local with a window of 5, every weight random."""
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=48, max_seq_len=64, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32, position="rope"
    )
    cfg |= dict(
        mlp="swiglu", norm="rmsnorm", bias=False, sliding_window=5, layer_types=["local", "global", "local"]
    )
    model = GPT(ModelConfig(**(cfg | kw)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def greedy(model, prompt, n, cache):
    out, x = list(prompt), torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(x, cache=cache, logits_to_keep=1).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out[len(prompt) :]


@pytest.mark.long
def test_rolling_cache_keeps_the_window_and_decodes_as_the_full_cache():
    """A local layer caches only its last W positions (memory), and greedy decoding through it equals the
    full cache, no cache, and the static decoder with and without torch.compile (the step traced whole)."""
    model = tiny()
    prompt = torch.randint(0, 48, (11,)).tolist()
    rolling, full = KVCache(model.cfg, 1), KVCache(model.cfg, 1, rolling=False)
    want = greedy(model, prompt, 30, full)
    assert greedy(model, prompt, 30, rolling) == want
    assert [k.shape[2] for k in rolling.k] == [5, 64, 5] and rolling.nbytes < full.nbytes
    opts = SampleOptions(max_new_tokens=30, temperature=0.0, decode="eager")
    assert generate(model, prompt, opts).tokens[0] == want
    assert generate(model, prompt, opts, use_cache=False).tokens[0] == want
    static = SampleOptions(max_new_tokens=30, temperature=0.0, decode="static")
    for backend in (None, "aot_eager"):
        gen = sd.generate_static(model, prompt, static, None, None, "static", compile_backend=backend)
        assert gen.tokens[0] == want and not gen.notes, backend
    dec = sd.decoder_for(model, 1, sd.static_cache_len(11, 0, 30, 64), static, "static", "aot_eager")[0]
    assert isinstance(dec.cache, StaticKVCache) and [k.shape[2] for k in dec.cache.k] == [5, 64, 5]


def test_rolling_cache_prefills_in_chunks_rewinds_and_selects_rows():
    """Chunks longer than the window through the ring give the logits of one full forward; rewinding works
    while the ring still holds what the next position needs (else it empties); select copies rows."""
    model = tiny()
    idx = torch.randint(0, 48, (2, 30))  # [B, T]
    with torch.no_grad():
        want = model(idx).logits  # [B, T, V]
        cache = KVCache(model.cfg, 2)
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in ((0, 3), (3, 12), (12, 13), (13, 30))]
        assert (torch.cat(parts, 1) - want).abs().max().item() <= 1e-5
        # the ring of 5 has wrapped: only the last token can be taken back
        assert cache.rewind(29) == 29 and cache.rewind(27) == 0
        cache.reset()
        model(idx[:, :4], cache=cache)
        assert cache.rewind(2) == 2
        tail = model(idx[:, 2:30], cache=cache).logits
        assert (tail - want[:, 2:]).abs().max().item() <= 1e-5
        rows = cache.select(torch.tensor([1, 1, 0]), 40)
        assert rows.length == 30 and [k.shape[2] for k in rows.k] == [5, 40, 5]
        step = model(idx[[1, 1, 0], -1:], cache=rows).logits[:, -1]
        ref = model(torch.cat([idx, idx[:, -1:]], 1)).logits[[1, 1, 0], -1]
        assert (step - ref).abs().max().item() <= 1e-5


def test_local_layers_attention_flops_and_kv_cache_from_the_window():
    """A local layer counts min(W, T) keys per query (dense), W - W^2/2T (causal); its cache holds at most W
    tokens."""
    cfg = ModelConfig(
        n_layers=6,
        n_heads=4,
        d_model=64,
        max_seq_len=1024,
        sliding_window=128,
        layer_types=["local"] * 5 + ["global"],
    )
    glob = ModelConfig(n_layers=6, n_heads=4, d_model=64, max_seq_len=1024)
    f, g = acc.flops_per_token(cfg), acc.flops_per_token(glob)
    assert f.attention_forward_dense == 4 * 64 * (5 * 128 + 1024)
    assert f.attention_forward_causal == 4 * 64 * (5 * (128 - 128**2 / 2048) + 512)
    assert g.attention_forward_causal == g.attention_forward_dense / 2
    assert f.forward_dense - f.attention_forward_dense == g.forward_dense - g.attention_forward_dense
    assert acc.kv_cache_bytes(cfg, 1024, "fp32") == 2 * (5 * 128 + 1024) * 64 * 4
    assert acc.kv_cache_bytes(glob, 1024, "fp32") == 1024 * acc.kv_cache_bytes_per_token(glob, "fp32")


def test_gemma_components_init_as_the_identity_and_train():
    """(1 + w) norms start at w = 0 (the identity), sandwich norms exist around both branches, and one
    backward reaches every new weight (post norms, QK-norms, the local layers' RoPE is not a weight)."""
    model = tiny(
        mlp="geglu",
        norm="rmsnorm_unit_offset",
        norm_placement="sandwich",
        qk_norm="head",
        head_dim=16,
        scale_embeddings=True,
        rope_local_theta=100.0,
        query_pre_attn_scalar=24,
        attn_softcap=20.0,
        logit_softcap=10.0,
    ).train()
    fresh = GPT(model.cfg)
    assert all(p.abs().sum() == 0 for n, p in fresh.named_parameters() if "_norm." in n)
    idx = torch.randint(0, 48, (2, 16))
    out = model(idx, idx)
    assert out.logits.abs().max() < 10.0
    out.loss.backward()
    for name in (
        "blocks.0.attn_post_norm.weight",
        "blocks.1.mlp_post_norm.weight",
        "blocks.2.attn.q_norm.weight",
    ):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name
    assert model.rope_local is not None and "rope_local.cos" not in model.state_dict()
    # the soft-capped window in our kernel (the interpreter) equals the eager reference
    triton = GPT.from_state(
        ModelConfig.from_dict({**model.cfg.to_dict(), "attention": "triton"}), model.state_dict()
    )
    eager = GPT.from_state(
        ModelConfig.from_dict({**model.cfg.to_dict(), "attention": "eager"}), model.state_dict()
    )
    with torch.no_grad():
        assert (triton(idx).logits - eager(idx).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.sliding_window=0", "model.sliding_window=0 must be a positive integer"),
        ("model.sliding_window=4096", "exceeds model.max_seq_len=256"),
        ("model.layer_types=[local,global]", "model.layer_types has 2 entries but model.n_layers=6"),
        ("model.sliding_window=null", "model.sliding_window is null"),
        ("model.rope_scaling={type: ntk, factor: 2.0}", "known types: llama3, linear, dynamic, yarn"),
        ("model.attn_softcap=0", "model.attn_softcap=0 must be a number > 0"),
        ("model.logit_softcap=-30.0", "model.logit_softcap=-30.0 must be a number > 0"),
    ],
)
def test_bad_windows_patterns_rope_types_and_softcaps_are_one_line_errors(capsys, override, named):
    code, _, err = run_main(capsys, "count-params", "model=gemma3-tiny", override)
    assert code == 2 and one_line(err) and named in err, err


def test_rope_scaling_keys_are_checked():
    with pytest.raises(ConfigError, match="missing: original_max_seq_len"):
        ModelConfig(position="rope", rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="unknown: beta"):
        ModelConfig(position="rope", rope_scaling={"type": "linear", "factor": 4.0, "beta": 1})


def test_bench_attention_cpu_rows_of_a_window(capsys):
    """`gptkit bench attention bench.device=cpu`: sdpa timed with and without a window, triton checked in the
    interpreter, and the summary line of each windowed row."""
    code, out, err = run_main(
        capsys,
        "bench",
        "attention",
        "bench.device=cpu",
        "bench.dtype=fp32",
        "bench.backends=[sdpa,triton]",
        "bench.windows=[null,8]",
        "bench.causal=[true]",
        "bench.seq_lens=[48]",
        "bench.tokens=48",
        "bench.d_model=32",
        "bench.head_dims=[16]",
        "bench.gqa=[2]",
        "bench.warmup_ms=1",
        "bench.rep_ms=1",
    )
    assert code == 0, err
    assert out.count(" ok ") == 2 and "window 8 at T=48 (sdpa): fwd+bwd" in out
    assert "window 8 at T=48 (triton); forward tiles" in out
