"""Generation with the KV cache: exact against recomputing the full sequence, and the sampling rules."""

import pytest
import torch
from conftest import greedy_gpt

from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions, TextStream, sample_next
from gptkit.model import GPT, KVCache

VARIANTS = {
    "learned-mha": dict(position="learned", n_kv_heads=None, mlp="gelu", norm="layernorm"),
    "learned-gqa": dict(position="learned", n_kv_heads=2, mlp="gelu", norm="layernorm"),
    "rope-mha": dict(position="rope", n_kv_heads=None, mlp="swiglu", norm="rmsnorm", bias=False),
    "rope-gqa": dict(position="rope", n_kv_heads=1, mlp="swiglu", norm="rmsnorm", bias=False),
}


def tiny_gpt(variant: str, max_seq_len: int = 32, attention: str = "sdpa", seed: int = 0) -> GPT:
    # STATIC_VARIANTS: VARIANTS and two more
    return greedy_gpt(max_seq_len, seed, attention=attention, **STATIC_VARIANTS[variant])


PROMPT = [3, 14, 15, 9, 2, 6]


@pytest.mark.parametrize("variant", [*VARIANTS, "rope-partial"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cached_logits_match_full_forward(variant, attention):
    model = tiny_gpt(variant, attention=attention)
    seq = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        full = model(seq).logits  # [B, T, V]
        cache = KVCache(model.cfg, batch_size=2)
        # prefill
        got = [model(seq[:, :7], cache=cache, logits_to_keep=1).logits[:, -1]]
        for t in range(7, 24):
            assert cache.length == t
            got.append(model(seq[:, t : t + 1], cache=cache, logits_to_keep=1).logits[:, -1])
    cached = torch.stack(got, dim=1)  # [B, 18, V]
    torch.testing.assert_close(cached, full[:, 6:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_with_cache_equals_recompute(variant):
    model = tiny_gpt(variant)
    opts = SampleOptions(max_new_tokens=20, temperature=0)
    cached = generate(model, PROMPT, opts)
    recomputed = generate(model, PROMPT, opts, use_cache=False)
    assert cached.tokens == recomputed.tokens
    assert len(cached.tokens[0]) == 20 and cached.decode_steps == 19
    # a real sequence, not one token repeated
    assert len(set(cached.tokens[0])) > 3


@pytest.mark.parametrize("variant", ["learned-gqa", "rope-gqa"])
@pytest.mark.parametrize("keep", [None, 16])
def test_sliding_window_beyond_context_equals_recompute(variant, keep):
    model = tiny_gpt(variant, max_seq_len=16)
    opts = SampleOptions(max_new_tokens=40, temperature=0, overflow="slide", slide_keep=keep)
    cached = generate(model, PROMPT, opts)
    recomputed = generate(model, PROMPT, opts, use_cache=False)
    assert len(cached.tokens[0]) == 40 and cached.slides > 0
    assert cached.tokens == recomputed.tokens
    # keep=max_seq_len slides one token at a time: each step sees the last 16 tokens at positions 0..15
    if keep == 16:
        seq = PROMPT + cached.tokens[0]
        with torch.no_grad():
            for n in (16, 30, len(seq) - 1):
                window = torch.tensor([seq[n - 16 : n]])  # [1, 16]
                assert model(window).logits[0, -1].argmax().item() == seq[n]


def test_overflow_stop_ends_at_the_context():
    model = tiny_gpt("rope-mha", max_seq_len=16)
    g = generate(model, PROMPT, SampleOptions(max_new_tokens=40, temperature=0, overflow="stop"))
    assert g.stop_reasons == ["context"]
    # the last token is predicted from 16, never fed back
    assert len(PROMPT) + len(g.tokens[0]) == 17
    assert "max_seq_len=16" in g.notes[0]


def test_decoding_projects_only_the_last_position():
    model = tiny_gpt("rope-gqa")
    rows, head = [], model.lm_head
    model.register_forward_hook(lambda m, inp, out: rows.append(tuple(out.logits.shape)))
    generate(model, PROMPT, SampleOptions(max_new_tokens=5, temperature=0, num_samples=3))
    # prefill and every decode step: logits [B, 1, vocab_size]
    assert rows == [(3, 1, 61)] * 5
    # the CPU decoding head is swapped back afterwards
    assert model.lm_head is head


def test_cache_is_sized_by_kv_heads():
    cfg = tiny_gpt("rope-gqa").cfg
    cache = KVCache(cfg, batch_size=2)
    assert tuple(cache.k[0].shape) == (2, 1, 32, 8)  # [B, n_kv_heads, max_len, head_dim]
    mha = KVCache(tiny_gpt("rope-mha").cfg, batch_size=2)
    assert mha.nbytes == 4 * cache.nbytes


def test_seed_reproducible_and_batch_of_samples():
    model = tiny_gpt("learned-mha")
    opts = dict(max_new_tokens=12, temperature=1.0, num_samples=4)
    a = generate(model, PROMPT, SampleOptions(seed=7, **opts))
    b = generate(model, PROMPT, SampleOptions(seed=7, **opts))
    c = generate(model, PROMPT, SampleOptions(seed=8, **opts))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    # samples differ within a batch
    assert len(a.tokens) == 4 and len({tuple(t) for t in a.tokens}) > 1
    greedy = generate(model, PROMPT, SampleOptions(max_new_tokens=12, temperature=0)).tokens[0]
    top1 = generate(model, PROMPT, SampleOptions(max_new_tokens=12, temperature=1.0, top_k=1, seed=3))
    assert top1.tokens[0] == greedy


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)  # [2000, 4]
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, 2, 1.0, g).tolist()) == {0, 1}
    # 0.5 alone reaches 0.45
    assert set(sample_next(logits, 1.0, None, 0.45, g).tolist()) == {0}
    assert set(sample_next(logits, 1.0, None, 0.7, g).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, None, 1.0, g).tolist()) == {0, 1, 2, 3}
    assert sample_next(logits[:1], 0, None, 1.0, None).tolist() == [0]
    # a low temperature sharpens: nearly always the top token
    assert (sample_next(logits, 0.05, None, 1.0, g) == 0).float().mean() > 0.99


def test_eos_and_stop_string_end_a_sample():
    model = tiny_gpt("rope-gqa")
    greedy = generate(model, PROMPT, SampleOptions(max_new_tokens=20, temperature=0)).tokens[0]
    eos = greedy[5]
    g = generate(model, PROMPT, SampleOptions(max_new_tokens=20, temperature=0, eos_id=eos))
    assert g.tokens[0] == greedy[: greedy.index(eos)] and g.stop_reasons == ["eos"]

    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731 - one char per token
    stop = decode(greedy[3:5])
    streamed = []
    g = generate(
        model,
        PROMPT,
        SampleOptions(max_new_tokens=20, temperature=0, stop=(stop,)),
        decode=decode,
        on_text=streamed.append,
    )
    full = decode(greedy)
    assert g.texts[0] == full[: full.index(stop)] and g.stop_reasons == ["stop"]
    assert "".join(streamed) == g.texts[0]


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    # "é" completes the character "\ufffd" stood for
    pieces = ["ab", "c", "\ufffd", "é", "X", "Y", "Z"]
    texts = {1: "ab", 2: "abc", 3: "abc\ufffd", 4: "abcé", 5: "abcéX", 6: "abcéXY", 7: "abcéXYQ"}
    s = TextStream(lambda ids: texts[len(ids)], stop=("XYZ",))
    out = [s.push(i) for i in range(len(pieces))]
    assert out == ["ab", "c", "", "é", "", "", "XYQ"]
    assert s.text == "abcéXYQ" and not s.stopped


def test_bad_sampling_values_are_rejected():
    from gptkit.errors import ConfigError

    model = tiny_gpt("learned-mha")
    for bad in (
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(temperature=-1.0),
        dict(top_k=-2),
        dict(max_new_tokens=0),
        dict(num_samples=0),
        dict(overflow="wrap"),
        dict(slide_keep=33),
    ):
        with pytest.raises(ConfigError):
            generate(model, PROMPT, SampleOptions(**bad))


@pytest.mark.parametrize("variant", ["learned-mha", "rope-gqa"])
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_matches_the_plain_model_and_restores_its_layers(variant, batch):
    """generate() decodes with its own copies of the Linear weights on CPU (W^T for one row, oneDNN-packed
    for several); the tokens must be those of the plain model's argmax, and the model's own modules must
    come back."""
    model = tiny_gpt(variant)
    before = {n: type(m) for n, m in model.named_modules()}
    out = generate(model, PROMPT, SampleOptions(max_new_tokens=12, temperature=0, num_samples=batch)).tokens
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == [ids[len(PROMPT) :]] * batch
    assert {n: type(m) for n, m in model.named_modules()} == before
    if model.cfg.tie_embeddings:
        assert model.lm_head.weight is model.tok_emb.weight


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("pack_min_bytes", [0, 5000, "kernel"])
def test_decoding_layout_computes_the_same_linear_maps(batch, bias, pack_min_bytes, monkeypatch):
    """Inside the decoding layout every Linear is swapped for a copy (gptkit's CPU kernel where it runs:
    "kernel"; without it, oneDNN-packed for batch > 1 where torch has oneDNN and the weight is large enough;
    else W^T, or the layer itself when it narrows at batch 1); each must compute the layer's own map for any
    number of rows (the prefill feeds B * T0 rows to weights packed for B; the kernel hands more than
    KERNEL_MAX_ROWS to F.linear) and leading shape; a packed layer runs a one-row input on the batch-1
    copy."""
    import gptkit.inference.decoding_layout as layout
    from gptkit_kernels import cpu_linear

    kernel = pack_min_bytes == "kernel"
    if kernel and cpu_linear.available() is not None:
        pytest.skip(f"the CPU linear kernel: {cpu_linear.available()}")
    if kernel:
        # every layer, however small, on the kernel
        monkeypatch.setattr(layout, "PACK_MIN_BYTES", 0)
    else:
        monkeypatch.setattr(layout, "_kernel_usable", lambda weight: False)
        # 5000: the 32x32 o_proj (4096 bytes) stays unpacked
        monkeypatch.setattr(layout, "PACK_MIN_BYTES", pack_min_bytes)
    model = tiny_gpt("learned-mha" if bias else "rope-gqa")
    layers = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in layers.values():
            # the init zeroes biases; make them count
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    inputs = {
        n: [
            torch.randn(*shape, m.in_features, generator=g)
            for shape in ((1,), (batch, 1), (batch, 7), (37,), (layout.KERNEL_MAX_ROWS + 1,))
        ]
        for n, m in layers.items()
    }
    kinds = set()
    with torch.no_grad():
        want = {n: [layers[n](x) for x in xs] for n, xs in inputs.items()}
        with layout.decoding_layout(model, batch):
            swapped = dict(model.named_modules())
            for n, xs in inputs.items():
                m = layers[n]
                if kernel:
                    assert type(swapped[n]).__name__ == "_KernelLinear"
                    for x, w in zip(xs, want[n]):
                        torch.testing.assert_close(swapped[n](x), w, rtol=1e-5, atol=1e-5)
                    continue
                packs = (
                    batch > 1 and m.weight.numel() * 4 >= pack_min_bytes and layout._onednn_usable(m.weight)
                )
                expect = (
                    "_PackedLinear"
                    if packs
                    else "Linear"
                    if batch == 1 and m.out_features < m.in_features
                    else "_TransposedLinear"
                )
                assert type(swapped[n]).__name__ == expect
                kinds.add(expect)
                if packs:
                    # a step of one row (a server laid out for max_batch rows, one client) takes the batch-1
                    # layout, not the weight packed for `batch` rows
                    one = "Linear" if m.out_features < m.in_features else "_TransposedLinear"
                    assert type(swapped[n].one).__name__ == one
                for x, w in zip(xs, want[n]):
                    torch.testing.assert_close(swapped[n](x), w, rtol=1e-5, atol=1e-5)
    if batch > 1 and not kernel:
        assert layout._onednn_usable(model.lm_head.weight) == torch.backends.mkldnn.is_available()
        # the small layers stay on W^T unless the threshold is 0
        if torch.backends.mkldnn.is_available():
            assert ("_TransposedLinear" in kinds) == (pack_min_bytes > 0)
            # the 32 x 61 head (7.8 kB) is packed either way
            assert "_PackedLinear" in kinds


def test_decoding_layout_falls_back_when_onednn_fails(monkeypatch):
    """A torch build whose oneDNN cannot run a packed layer: the layout falls back to W^T before
    generating, and the tokens are still the plain model's."""
    import gptkit.inference.decoding_layout as layout

    def broken(self, x):
        raise RuntimeError("oneDNN: unsupported")

    monkeypatch.setattr(layout, "_kernel_usable", lambda weight: False)
    monkeypatch.setattr(layout, "PACK_MIN_BYTES", 0)
    monkeypatch.setattr(layout._PackedLinear, "forward", broken)
    model = tiny_gpt("rope-gqa")
    with layout.decoding_layout(model, 4):
        kinds = {type(m).__name__ for m in model.modules()}
    assert "_PackedLinear" not in kinds and "_TransposedLinear" in kinds
    out = generate(model, PROMPT, SampleOptions(max_new_tokens=6, temperature=0, num_samples=2)).tokens
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == [ids[len(PROMPT) :]] * 2


# ---- the static path (static KV cache, fixed-shape step, device-side sampling): static_decode.py ----
STATIC_VARIANTS = {
    **VARIANTS,
    "learned-mqa": dict(position="learned", n_kv_heads=1, mlp="gelu", norm="layernorm"),
    "rope-gqa2": dict(position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False),
    # partial RoPE (Phi's): the first 4 of the 8 features of each head turn, before the cache
    "rope-partial": dict(
        position="rope", n_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False, rotary_dim=4
    ),
}


def static_gpt(variant: str, max_seq_len: int = 32, seed: int = 0) -> GPT:
    return tiny_gpt(variant, max_seq_len, "sdpa", seed)


def both(model, mode="static", **opts):
    """(eager, static) generations with the same options."""
    eager = generate(model, PROMPT, SampleOptions(decode="eager", **opts))
    static = generate(model, PROMPT, SampleOptions(decode=mode, **opts))
    return eager, static


def test_static_cache_writes_at_the_position_tensor_and_masks_the_rest():
    cfg = tiny_gpt("rope-gqa").cfg
    from gptkit.model import StaticKVCache

    cache = StaticKVCache(cfg, batch_size=2, max_len=8)
    cache.positions = torch.tensor([5])  # [T=1]
    k = torch.ones(2, 1, 1, 8)  # [B, n_kv_heads, T, head_dim]
    full_k, _ = cache.update(0, k, 2 * k)
    # the whole cache, every step the same shape
    assert tuple(full_k.shape) == (2, 1, 8, 8)
    assert full_k[:, :, 5].eq(1).all() and full_k[:, :, :5].eq(0).all() and full_k[:, :, 6:].eq(0).all()
    assert cache.mask.tolist() == [[True] * 6 + [False] * 2]  # [T, max_len]: slots up to the position
    cache.positions = torch.arange(3)
    assert cache.mask.tolist() == [[j <= i for j in range(8)] for i in range(3)]


@pytest.mark.parametrize("variant", ["learned-mha", "rope-gqa2", "rope-partial"])
def test_static_cache_logits_match_full_forward(variant):
    """Prefill and one-token steps through the static cache (positions as a tensor, attention over the whole
    cache under the mask) give the full forward's logits; stale slots from an earlier window stay hidden."""
    from gptkit.model import StaticKVCache

    model = static_gpt(variant)
    seq = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        full = model(seq).logits  # [B, T, V]
        cache = StaticKVCache(model.cfg, batch_size=2)
        cache.positions = torch.arange(12)
        # an earlier window: every slot 0..11 now holds stale K/V
        model(seq[:, :12] * 0 + 7, cache=cache)
        cache.positions = torch.arange(7)
        got = [model(seq[:, :7], cache=cache, logits_to_keep=1).logits[:, -1]]
        pos = torch.zeros(1, dtype=torch.long)
        cache.positions = pos
        for t in range(7, 20):
            pos.fill_(t)
            got.append(model(seq[:, t : t + 1], cache=cache, logits_to_keep=1).logits[:, -1])
    torch.testing.assert_close(torch.stack(got, dim=1), full[:, 6:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", STATIC_VARIANTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_static_greedy_equals_eager(variant, batch):
    """learned/RoPE x MHA/GQA/MQA, batch 1 and 3: the same greedy tokens as the eager loop, within the
    context and sliding beyond it (max_seq_len 16, 40 new tokens, the default and the one-token slide)."""
    for max_len, n, keep, every in ((32, 20, None, 16), (16, 40, None, 4), (16, 40, 16, 5)):
        model = static_gpt(variant, max_seq_len=max_len)
        eager, static = both(
            model, max_new_tokens=n, temperature=0, num_samples=batch, slide_keep=keep, check_every=every
        )
        assert static.tokens == eager.tokens and len(static.tokens[0]) == n
        assert (static.slides, static.decode_steps, static.stop_reasons) == (
            eager.slides,
            eager.decode_steps,
            eager.stop_reasons,
        )
        assert static.decode == "static" and static.notes == eager.notes
    assert eager.slides > 0 and len(set(eager.tokens[0])) > 3


def test_static_sampling_draws_what_eager_draws():
    """Device-side sampling (temperature, top-k, top-p) from a seeded generator: the eager loop's tokens."""
    model = static_gpt("rope-gqa2", max_seq_len=16)
    opts = dict(
        max_new_tokens=30, temperature=1.3, top_k=20, top_p=0.95, seed=11, num_samples=4, check_every=4
    )
    eager, static = both(model, **opts)
    assert static.tokens == eager.tokens
    # sampled, not greedy
    assert len({tuple(t) for t in static.tokens}) > 1
    again = generate(model, PROMPT, SampleOptions(decode="static", **opts))
    # the decoder is reused and reseeded
    assert again.tokens == static.tokens and again.setup_s == 0.0
    other = generate(model, PROMPT, SampleOptions(decode="static", **{**opts, "seed": 12}))
    assert other.tokens != static.tokens


def test_sample_next_draws_what_multinomial_draws():
    """The sync-free draw is torch.multinomial's own one-sample draw: the same tokens from the same
    generator."""
    from gptkit.inference.sampling import sample_next

    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0))  # [B, V]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(4):
        want = torch.multinomial((logits / 0.7).softmax(-1), 1, generator=g1).squeeze(-1)
        assert torch.equal(sample_next(logits, 0.7, None, 1.0, g2), want)


def test_fast_argmax_is_torch_argmax():
    from gptkit.inference.sampling import argmax

    g = torch.Generator().manual_seed(0)
    for V in (61, 1024, 12000, 32000, 50257):
        x = torch.randn(5, V, generator=g)
        # a tie between an early and a late (tail) column: the first wins
        x[1, V // 3] = x[1, V - 1] = 100.0
        # all equal
        x[2, :] = 0.0
        # NaN counts as the maximum, as in torch.argmax
        x[3, V - 1] = float("nan")
        x[4, 7] = float("nan")
        x[4, V - 1] = float("nan")
        assert torch.equal(argmax(x), x.argmax(-1)), V


def test_static_eos_and_stop_strings_are_checked_every_k_tokens():
    """EOS and stop strings are read back every check_every tokens: the same tokens, texts, stop reasons and
    streamed text as the eager loop; at most 2 * check_every - 1 steps run after the last sample finished."""
    model = static_gpt("rope-gqa")
    K = 4
    greedy = generate(model, PROMPT, SampleOptions(max_new_tokens=30, temperature=0, decode="eager")).tokens[
        0
    ]
    eos = greedy[9]
    eager, static = both(model, max_new_tokens=30, temperature=0, eos_id=eos, check_every=K)
    assert static.tokens == eager.tokens == [greedy[: greedy.index(eos)]] and static.stop_reasons == ["eos"]
    assert eager.decode_steps < static.decode_steps <= eager.decode_steps + 2 * K - 1

    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731 - one char per token
    stop = decode(greedy[12:14])
    streamed = {"eager": [], "static": []}
    for mode in streamed:
        g = generate(
            model,
            PROMPT,
            SampleOptions(max_new_tokens=30, temperature=0, stop=(stop,), decode=mode, check_every=K),
            decode=decode,
            on_text=streamed[mode].append,
        )
        full = decode(greedy)
        assert g.texts[0] == full[: full.index(stop)] and g.stop_reasons == ["stop"]
        assert "".join(streamed[mode]) == g.texts[0]

    # a batch whose samples end at different steps (sampling), one of them possibly never
    opts = dict(max_new_tokens=25, temperature=1.0, seed=4, num_samples=4, eos_id=eos, check_every=K)
    eager, static = both(model, **opts)
    assert static.tokens == eager.tokens and static.stop_reasons == eager.stop_reasons


def test_static_overflow_stop_equals_eager():
    model = static_gpt("learned-gqa", max_seq_len=16)
    eager, static = both(model, max_new_tokens=40, temperature=0, overflow="stop", check_every=3)
    assert static.tokens == eager.tokens and static.stop_reasons == ["context"]
    assert static.notes == eager.notes and "max_seq_len=16" in static.notes[0]


def test_graph_without_cuda_falls_back_with_one_note():
    model = static_gpt("rope-mha")
    eager, graph = both(model, mode="graph", max_new_tokens=12, temperature=0)
    assert graph.tokens == eager.tokens and graph.decode == "static"
    assert graph.notes == [
        "decode=graph needs a CUDA device; decoding with the static cache, without a graph"
    ]
    assert SampleOptions().decode_mode(torch.device("cpu")) == "eager"
    assert SampleOptions().decode_mode(torch.device("cuda")) == "graph"


def test_failed_capture_and_failed_compile_fall_back(monkeypatch):
    """Where capture is possible but fails (here: torch has no CUDA), or torch.compile fails, generation goes
    on without it, with one note each, and the tokens are the same."""
    import gptkit.inference.static_decode as sd

    def broken_compiler(backend):
        def fail(*args, **kwargs):
            raise RuntimeError("no compiler\nsecond line")

        return fail

    monkeypatch.setattr(sd, "can_capture", lambda device: True)
    monkeypatch.setattr(sd, "compiled_forward", broken_compiler)
    model = static_gpt("learned-mha")
    eager, graph = both(model, mode="graph", compile=True, max_new_tokens=12, temperature=0, num_samples=2)
    assert graph.tokens == eager.tokens and graph.decode == "static"
    assert len(graph.notes) == 2
    assert graph.notes[0] == (
        "torch.compile could not compile the decode step (RuntimeError: no compiler); decoding uncompiled"
    )
    assert graph.notes[1].startswith("CUDA graph capture failed (")
    assert graph.notes[1].endswith("without a graph")


def test_compiled_step_is_traced_once(monkeypatch):
    """The one-token step compiles as one graph (fullgraph) and is never recompiled: positions are tensors,
    shapes fixed; generations with slides, other prompts and seeds reuse it. aot_eager traces exactly what
    inductor would compile, without the C++ build."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import gptkit.inference.static_decode as sd

    torch._dynamo.reset()
    monkeypatch.setattr(sd, "_compiled", {})
    counters.clear()
    model = static_gpt("rope-gqa2", max_seq_len=16)
    eager = generate(
        model, PROMPT, SampleOptions(max_new_tokens=40, temperature=0, num_samples=2, decode="eager")
    )
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        opts = SampleOptions(max_new_tokens=40, temperature=0, num_samples=2, check_every=4)
        first = sd.generate_static(model, PROMPT, opts, None, None, "static", compile_backend="aot_eager")
        second = sd.generate_static(
            model, PROMPT[:4], opts, None, None, "static", compile_backend="aot_eager"
        )
    assert first.tokens == eager.tokens and first.slides > 0 and first.notes == []
    assert len(second.tokens[0]) == 40
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", ["learned-mha", "learned-gqa", "rope-mha", "rope-gqa2", "rope-gqa"])
def test_cuda_graph_greedy_equals_eager_fp32(variant, compile):
    """On a GPU, in fp32: the captured (and compiled) step decodes the eager loop's greedy tokens, batch 1
    and 3, sliding beyond the context; seeded sampling is reproducible through the graph."""
    model = static_gpt(variant, max_seq_len=16).cuda()
    for batch in (1, 3):
        eager, graph = both(
            model,
            mode="graph",
            compile=compile,
            max_new_tokens=40,
            temperature=0,
            num_samples=batch,
            check_every=4,
        )
        assert graph.notes == [] and graph.decode == "graph"
        assert graph.tokens == eager.tokens and graph.slides == eager.slides > 0
    opts = dict(
        max_new_tokens=20, temperature=1.0, top_k=10, seed=3, num_samples=2, decode="graph", compile=compile
    )
    a, b = (generate(model, PROMPT, SampleOptions(**opts)) for _ in range(2))
    assert a.tokens == b.tokens and a.notes == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_bf16_runs():
    model = static_gpt("rope-gqa2", max_seq_len=64).cuda().to(torch.bfloat16)
    g = generate(
        model, PROMPT, SampleOptions(max_new_tokens=50, temperature=0, num_samples=8, decode="graph")
    )
    assert g.notes == [] and g.decode == "graph" and len(g.tokens[0]) == 50


def test_a_dropped_model_frees_its_decoder():
    import gc
    import weakref

    import gptkit.inference.static_decode as sd

    model = static_gpt("learned-mha")
    generate(model, PROMPT, SampleOptions(max_new_tokens=5, temperature=0, decode="static"))
    assert model in sd._decoders
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
