"""The fused kernels behind model.kernels against float64 references, gradients included.

norm / swiglu / rope are Triton kernels: in the interpreter here (conftest sets TRITON_INTERPRET=1),
compiled with one pinned configuration on a GPU. loss (chunked linear + cross-entropy) is pure torch.
Every buffer the Triton wrappers allocate is NaN-filled first (poisoned_allocations).
Budget: ~25 s on 2 cores.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import kernel_device, poisoned_allocations

from gptkit.bench.kernels import PeakMemory, logp_memory, loss_memory
from gptkit.model import GPT, ModelConfig
from gptkit_kernels.linear_ce import chunk_rows, linear_cross_entropy, linear_log_probs
from gptkit_kernels.norm import layer_norm, rms_norm
from gptkit_kernels.rope import rope
from gptkit_kernels.swiglu import swiglu

DEVICE = kernel_device()

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def check(fn, ref, inputs, dtype, tol=None):
    """fn(*inputs) and its gradients against ref run in float64 on the same values."""
    xs = [x.to(DEVICE, dtype).detach().requires_grad_() for x in inputs]
    with poisoned_allocations():
        out = fn(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        douts = [torch.randn_like(o) for o in outs]
        grads = torch.autograd.grad(outs, xs, douts)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    r = ref(*x64)
    refs = r if isinstance(r, tuple) else (r,)
    ref_grads = torch.autograd.grad(refs, x64, [d.double() for d in douts])
    tol = tol or TOL[dtype]
    for i, (got, want) in enumerate(zip((*outs, *grads), (*refs, *ref_grads))):
        torch.testing.assert_close(
            got.double(), want, rtol=tol, atol=tol, msg=lambda m: f"output/grad {i}: {m}"
        )


def rms_ref(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# a width padded on-chip, and an exact one
@pytest.mark.parametrize("dim", [40, 64])
def test_rms_norm(dim, dtype):
    # fp16: the reference rounds x * rstd to fp16 before the weight; so does ours: compare at fp16 precision
    check(
        lambda x, w: rms_norm(x, w, 1e-5),
        rms_ref,
        [torch.randn(3, 7, dim), torch.randn(dim)],
        dtype,
        tol=1e-5 if dtype == torch.float32 else 1e-2,
    )


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias):
    d = 48
    inputs = [torch.randn(5, 9, d) * 3 + 1, torch.randn(d)] + ([torch.randn(d)] if bias else [])
    check(
        lambda x, w, *b: layer_norm(x, w, b[0] if b else None, 1e-5),
        lambda x, w, *b: F.layer_norm(x, (d,), w, b[0] if b else None, 1e-5),
        inputs,
        torch.float32,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu(dtype):
    check(swiglu, lambda g, u: F.silu(g) * u, [torch.randn(3, 5, 700), torch.randn(3, 5, 700)], dtype)


def rope_ref(q, k, positions, theta=10000.0):
    """float64 RoPE, rotate-half layout, written independently of the model's tables."""
    D = q.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=q.device) / D)
    ang = positions.double()[..., None] * inv  # [B, T, D/2]
    cos, sin = ang.cos().repeat(1, 1, 2)[:, None], ang.sin().repeat(1, 1, 2)[:, None]  # [B, 1, T, D]

    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    return rot(q), rot(k)


@pytest.mark.parametrize("restart", [False, True])
def test_rope_on_strided_q_k_with_or_without_restarting_positions(restart):
    from gptkit.model.layers import RotaryEmbedding

    B, T, H, Hkv, D = 2, 9, 4, 2, 16
    tables = RotaryEmbedding(D, 64, 10000.0).to(DEVICE)
    # positions restart at every document (model.position_reset)
    if restart:
        positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1]], device=DEVICE)
        fn = lambda q, k: rope(q, k, tables.cos, tables.sin, positions)  # noqa: E731
    # a KV cache of 5 tokens: positions 5..13
    else:
        positions = torch.arange(5, 5 + T, device=DEVICE).expand(B, T)
        fn = lambda q, k: rope(q, k, tables.cos, tables.sin, None, 5)  # noqa: E731
    # the model's q and k are views of one projection
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D)
    q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
    k = qkv[..., H * D : (H + Hkv) * D].view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    check(fn, lambda q, k: rope_ref(q, k, positions), [q, k], torch.float32)


# ---- fused linear + cross-entropy ------------------------------------------------------------


# ragged chunks; one chunk
@pytest.mark.parametrize("chunk", [7, None])
def test_linear_cross_entropy_matches_f_cross_entropy_with_ignored_targets(chunk):
    N, d, V = 37, 16, 50
    x = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, d, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    # ignored positions
    t[::4] = -100
    loss = linear_cross_entropy(x, w, t, chunk_size=chunk)
    # an upstream gradient other than 1
    gx, gw = torch.autograd.grad(3.0 * loss, (x, w))
    want = F.cross_entropy(x @ w.T, t, ignore_index=-100)
    wx, ww = torch.autograd.grad(3.0 * want, (x, w))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, wx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=1e-12, atol=1e-12)
    # evaluation: the loss alone, the same value
    with torch.no_grad():
        assert linear_cross_entropy(x, w, t, chunk_size=chunk).item() == pytest.approx(want.item(), rel=1e-12)


def test_linear_cross_entropy_never_holds_the_full_logits():
    """Peak tensor memory of forward + backward: the largest allocation is one chunk of logits, never
    [tokens, vocab], and the peak is a fraction of eager F.linear + F.cross_entropy's."""
    N, d, V, rows = 2048, 32, 4096, 256
    x = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    t = torch.randint(0, V, (N,))
    peaks = {}
    for name in ("eager", "fused"):
        with PeakMemory() as pm:
            if name == "fused":
                loss = linear_cross_entropy(x, w, t, chunk_size=rows)
            else:
                loss = F.cross_entropy(F.linear(x, w).float(), t)
            loss.backward()
        peaks[name] = pm
        x.grad = w.grad = None
    full_logits = N * V * 4
    # the tracker sees the eager logits
    assert peaks["eager"].largest >= full_logits
    assert peaks["fused"].largest <= rows * V * 4 < full_logits
    assert peaks["fused"].peak * 4 <= peaks["eager"].peak


# ---- fused linear + per-token log-probs (DPO, KTO, GRPO) --------------------------------------------------


def eager_log_probs(x, w, t, softcap=None, temperature=1.0):
    """The unchunked path: whole logits, soft cap, / temperature, -F.cross_entropy per token."""
    logits = x @ w.T  # [N, T, V]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    v = logits.shape[-1]
    out = F.cross_entropy(
        logits.reshape(-1, v) / temperature, t.reshape(-1), ignore_index=-100, reduction="none"
    )
    return -out.view(t.shape)


# chunks that straddle the rows (T = 10); one chunk
@pytest.mark.parametrize("chunk", [7, 3, None])
@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (4.0, 0.7)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_linear_log_probs_and_gradients_match_the_unchunked_path(chunk, softcap, temperature, dtype, tol):
    """Per-token log-probs [N, T] and the gradients of any function of them (a random upstream gradient per
    token) w.r.t. the hidden states and the head weight; ignored targets give 0 and pass no gradient."""
    torch.manual_seed(0)
    N, T, d, V = 3, 10, 16, 50
    x = torch.randn(N, T, d, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(V, d, dtype=dtype)).requires_grad_()
    t = torch.randint(0, V, (N, T))
    t[0, :4] = -100
    t[2, 7:] = -100
    up = torch.randn(N, T, dtype=dtype)
    got = linear_log_probs(x, w, t, chunk_size=chunk, softcap=softcap, temperature=temperature)
    gx, gw = torch.autograd.grad((got * up).sum(), (x, w))
    want = eager_log_probs(x, w, t, softcap, temperature)
    wx, ww = torch.autograd.grad((want * up).sum(), (x, w))
    assert got.dtype == want.dtype and bool((got[t == -100] == 0).all())
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(gx, wx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw, ww, rtol=tol, atol=tol)
    with torch.no_grad():
        again = linear_log_probs(x, w, t, chunk_size=chunk, softcap=softcap, temperature=temperature)
    torch.testing.assert_close(again, want, rtol=tol, atol=tol)


def test_linear_log_probs_never_hold_the_full_logits_forward_or_backward():
    """The largest allocation of forward + backward is one chunk of logits, never [tokens, vocab]: the
    backward recomputes them chunk by chunk. The eager path holds several whole copies."""
    N, d, V, rows = 2048, 32, 4096, 256
    x = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    t = torch.randint(0, V, (N,))
    peaks = {}
    for name in ("eager", "chunked"):
        with PeakMemory() as pm:
            if name == "chunked":
                logps = linear_log_probs(x, w, t, chunk_size=rows, temperature=0.9)
            else:
                logps = eager_log_probs(x, w, t, temperature=0.9)
            (logps * torch.linspace(-1, 1, N)).sum().backward()
        peaks[name] = pm
        x.grad = w.grad = None
    full_logits = N * V * 4
    assert peaks["eager"].largest >= full_logits
    assert peaks["chunked"].largest <= rows * V * 4 < full_logits
    assert peaks["chunked"].peak * 4 <= peaks["eager"].peak


def test_the_bench_row_measures_the_dpo_log_probs_chunked_against_eager():
    """gptkit bench kernels' logp-memory row (fake tensors: no memory used) with the default chunk of about
    2^26 logits: 2 x 2048 tokens at a 32k vocabulary are 2 chunks; the chunked peak is a fraction of the
    eager one, and its largest allocation one chunk."""
    pairs, T, vocab = 1, 2048, 32768
    eager = logp_memory(pairs, T, vocab, 16, torch.float32, chunked=False)
    chunked = logp_memory(pairs, T, vocab, 16, torch.float32, chunked=True)
    rows = chunk_rows(2 * pairs * T, vocab)
    assert rows < 2 * pairs * T and chunked.largest == rows * vocab * 4
    assert eager.largest >= 2 * pairs * T * vocab * 4 and chunked.peak * 2 <= eager.peak


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_linear_distill_and_gradients_match_the_unchunked_path(beta, dtype, tol):
    """linear_distill (chunks of 3 label rows) against distill_loss on the whole logits: loss, CE, D and the
    gradients w.r.t. the student's hidden states and head, at temperatures 1 and 2, soft-capped (each model
    its own cap) and not; masked rows get no gradient; without grad the same figures."""
    from gptkit.training.objectives.distill import distill_loss
    from gptkit_kernels.linear_distill import linear_distill

    torch.manual_seed(0)
    N, T, d, dt, V = 2, 9, 16, 24, 50
    x = (0.5 * torch.randn(N, T, d, dtype=dtype)).requires_grad_()
    w = (0.5 * torch.randn(V, d, dtype=dtype)).requires_grad_()
    tx, tw = torch.randn(N, T, dt, dtype=dtype), 0.5 * torch.randn(V, dt, dtype=dtype)
    t = torch.randint(0, V, (N, T))
    t[0, :4] = -100
    t[1, 7:] = -100
    for tau, cap, tcap in [(1.0, None, None), (2.0, 3.0, 5.0)]:
        got = linear_distill(
            x,
            w,
            tx,
            tw,
            t,
            beta=beta,
            temperature=tau,
            alpha=0.3,
            chunk_size=3,
            softcap=cap,
            teacher_softcap=tcap,
        )
        gx, gw = torch.autograd.grad(got[0], (x, w))
        zs, zt = F.linear(x, w), F.linear(tx, tw)
        if cap:
            zs, zt = torch.tanh(zs / cap) * cap, torch.tanh(zt / tcap) * tcap
        want = distill_loss(zs, zt, t, beta, tau, alpha=0.3)
        wx, ww = torch.autograd.grad(want[0], (x, w))
        for a, b in zip((*got, gx, gw), (*want, wx, ww)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert bool((gx[t == -100] == 0).all())
        with torch.no_grad():
            again = linear_distill(
                x,
                w,
                tx,
                tw,
                t,
                beta=beta,
                temperature=tau,
                alpha=0.3,
                chunk_size=3,
                softcap=cap,
                teacher_softcap=tcap,
            )
        for a, b in zip(again, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_bench_row_measures_the_distill_loss_chunked_against_eager():
    """gptkit bench kernels' distill-memory row (fake tensors: no memory used) at the shipped 150k vocabulary
    (1,024 of its 4,096 tokens, to stay fast): the chunked forward + backward never allocates a [tokens,
    vocab] tensor (its largest is one chunk), its peak is a small fraction of the eager one and within the
    memory estimate's count for objective=distill."""
    from omegaconf import OmegaConf

    from gptkit.bench.kernels import distill_memory
    from gptkit.conf_tree import conf_dir
    from gptkit_kernels.linear_distill import CHUNK_TENSORS

    shape = OmegaConf.load(conf_dir() / "bench" / "kernels.yaml").distill_shapes[0]
    assert (int(shape.rows) * int(shape.T), int(shape.vocab)) == (4096, 150000)
    shape.T = 1024
    tokens, V = 1024, 150000
    eager, chunked = distill_memory(shape, chunked=False), distill_memory(shape, chunked=True)
    assert eager.largest >= tokens * V * 4
    assert chunked.largest == chunk_rows(tokens, V) // CHUNK_TENSORS * V * 4
    assert chunked.peak * 20 <= eager.peak
    # the memory estimate of objective=distill (chunked_logps) bounds it
    from types import SimpleNamespace

    from gptkit.training.memory import chunked_logits_bytes

    assert chunked.peak <= chunked_logits_bytes(tokens, SimpleNamespace(vocab_size=V))


def test_the_model_gives_token_log_probs_without_logits():
    """GPT.forward(token_logps=True): [B, T] log-probs of the targets (at a temperature, under the soft cap),
    no logits; what the objectives read."""
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=96, max_seq_len=32, n_layers=1, d_model=32, n_heads=2, logit_softcap=3.0)
    )
    idx = torch.randint(0, 96, (2, 12))
    y = torch.randint(0, 96, (2, 12))
    y[1, :5] = -100
    out = model(idx, y, token_logps=True, temperature=0.8)
    assert out.logits is None and out.logps.shape == (2, 12)
    want = torch.log_softmax(model(idx).logits / 0.8, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(out.logps, torch.where(y == -100, 0.0, want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="token_logps needs targets"):
        model(idx, token_logps=True)


def test_fused_loss_cuts_peak_memory_4x_at_128k_vocab_8x2048_tokens():
    """The issue's case, measured with fake tensors (no memory is used): Llama 3 vocab, 1B width, bf16.
    The default chunk keeps each chunk of logits near 2^26 entries."""
    tokens, vocab, d = 8 * 2048, 128256, 2048
    assert chunk_rows(tokens, vocab) * vocab <= (1 << 26) + vocab
    eager = loss_memory(tokens, vocab, d, torch.bfloat16, fused=False)
    fused = loss_memory(tokens, vocab, d, torch.bfloat16, fused=True)
    assert eager.largest >= tokens * vocab * 2
    assert eager.peak >= 4 * fused.peak


def test_fake_and_real_tensors_measure_the_same_peak():
    """bench kernels measures the full-size case with fake tensors: they must agree with real ones."""
    for fused in (False, True):
        real = loss_memory(300, 500, 24, torch.float32, fused, fake=False)
        fake = loss_memory(300, 500, 24, torch.float32, fused, fake=True)
        assert (real.peak, real.largest) == (fake.peak, fake.largest) and real.peak > 0


# ---- model.kernels end to end ------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        dict(
            position="rope",
            mlp="swiglu",
            norm="rmsnorm",
            bias=False,
            n_heads=4,
            n_kv_heads=2,
            tie_embeddings=False,
        ),
        dict(
            position="learned",
            mlp="gelu",
            norm="layernorm",
            n_heads=2,
            tie_embeddings=True,
            # tied lm_head
        ),
    ],
)
def test_model_with_every_fused_kernel_matches_eager(variant, monkeypatch):
    import gptkit.model.fused as seam

    calls = []
    # no silent eager fallback
    for name in ("rms_norm", "layer_norm", "swiglu", "rope", "linear_cross_entropy"):
        real = getattr(seam, name)
        monkeypatch.setattr(seam, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, max_seq_len=32, n_layers=1, d_model=64, **variant)
    eager = GPT(cfg).to(DEVICE)
    fused = GPT(dataclasses.replace(cfg, kernels=["norm", "swiglu", "rope", "loss"])).to(DEVICE)
    fused.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 96, (2, 20), device=DEVICE)
    targets = torch.randint(0, 96, (2, 20), device=DEVICE)
    targets[0, :5] = -100
    out_e, out_f = eager(idx, targets), fused(idx, targets)
    # the fused loss never makes the logits
    assert out_f.logits is None
    norm = "rms_norm" if variant["norm"] == "rmsnorm" else "layer_norm"
    want = {
        norm: 2 + 1,
        "linear_cross_entropy": 1,
        **({"swiglu": 1, "rope": 1} if variant["mlp"] == "swiglu" else {}),
    }
    assert {n: calls.count(n) for n in set(calls)} == want
    torch.testing.assert_close(out_f.loss, out_e.loss, rtol=1e-5, atol=1e-6)
    out_e.loss.backward()
    out_f.loss.backward()
    for (name, p_e), p_f in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p_f.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # without targets the model still returns logits
    with torch.no_grad():
        assert fused(idx).logits.shape == (2, 20, 96)


def test_kernel_names_are_checked():
    from gptkit.errors import ConfigError

    with pytest.raises(ConfigError, match="model.kernels"):
        ModelConfig(kernels=["norm", "flash"])
    with pytest.raises(ConfigError, match="model.kernels"):
        ModelConfig(kernels="norm")
    assert ModelConfig(kernels=["loss", "loss"]).kernels == ["loss"]


def test_bench_kernels_streams_rows_on_cpu(tmp_path, capsys):
    """`gptkit bench kernels` runs its CPU part (loss memory, document tiles) and says what needs a GPU."""
    import json

    from omegaconf import OmegaConf

    from gptkit.bench import kernels as bench
    from gptkit.conf_tree import conf_dir

    if torch.cuda.is_available():
        pytest.skip("the GPU part is long; .ci/gpu-check runs it")
    out = tmp_path / "k.json"
    cfg = OmegaConf.merge(
        # the shipped options
        OmegaConf.load(conf_dir() / "bench" / "kernels.yaml"),
        dict(
            loss_shapes=[dict(tokens=512, vocab=1000, d_model=16, dtype="fp32", fake=False, chunk_size=64)],
            # (the shipped real 150k-vocabulary row allocates gigabytes: a small real one; fake is free)
            logp_shapes=[
                dict(pairs=2, T=4096, vocab=150000, d_model=64, dtype="fp32", fake=True),
                dict(pairs=1, T=64, vocab=1000, d_model=16, dtype="fp32", fake=False),
            ],
            distill_shapes=[
                dict(rows=1, T=64, vocab=1000, d_model=16, d_teacher=24, dtype="fp32", beta=0.5)
                | dict(temperature=2.0, alpha=0.5, fake=False)
            ],
            doc_T=1024,
            doc_windows=2,
            out=str(out),
        ),
    )
    assert bench.run(cfg) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("what=loss-memory" in x for x in lines) and sum("what=doc-tiles" in x for x in lines) == 2
    assert any("what=distill-memory" in x and "chunked_s=" in x for x in lines)
    assert any("needs a CUDA GPU" in x for x in lines)
    rows = json.loads(out.read_text())["rows"]
    # 8 chunks of 64 tokens
    assert rows[0]["peak_ratio"] > 2
    doc = [x for x in rows if x["what"] == "doc-tiles"]
    # shorter documents: fewer tiles
    assert doc[0]["fraction"] < doc[1]["fraction"] < 1
