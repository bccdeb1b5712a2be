"""The Triton FlashAttention kernels against a float64 eager reference.

On a CPU they run in the Triton interpreter (conftest sets TRITON_INTERPRET=1 before any import);
with TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernels, and bf16 too, each
with one pinned launch configuration (conftest sets GPTKIT_KERNELS_AUTOTUNE=0: no autotuning).
Both implementations are tested: "fa2" (the default) and "tma" (Hopper TMA descriptors; in the
interpreter here, on a GPU only where it is Hopper or newer, else the fa2 fallback runs again).
Inputs are random on every run; every buffer the wrapper allocates is filled with NaN first, so an
element the kernels fail to write cannot pass. Budget: ~80 s on 2 cores (interpreter).
"""

import pytest
import torch
from conftest import kernel_device, poisoned_allocations, reference

from gptkit_kernels import flash_attention
from gptkit_kernels.flash import forward_tiles

DEVICE = kernel_device()
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check(T, head_dim, group, causal, dtype, *, B=2, n_kv_heads=1, scale=None, impl="fa2"):
    H = n_kv_heads * group
    q = torch.randn(B, H, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, n_kv_heads, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(B, n_kv_heads, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, H, T, head_dim, device=DEVICE, dtype=dtype)  # [B, H, T, D]
    with poisoned_allocations():
        out = flash_attention(q, k, v, causal=causal, scale=scale, impl=impl)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    scale = head_dim**-0.5 if scale is None else scale
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(q64, k64, v64, causal, scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    # bf16 rounding (P and dS are rounded before their matmuls) grows with T:
    if dtype == torch.bfloat16:
        # allow twice the error of plain torch attention in bf16 (the FlashAttention repo's criterion)
        torch_out = reference(q, k, v, causal, scale, dtype)
        torch_grads = torch.autograd.grad(torch_out, (q, k, v), dout)
        torch_err = [
            (a.double() - b).abs().max().item() for a, b in zip((torch_out, *torch_grads), (ref, *ref_grads))
        ]
    else:
        torch_err = [0.0] * 4

    tol = TOL[dtype]
    for name, got, want, err in zip(
        ("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_grads), torch_err
    ):
        assert got.shape == want.shape and got.dtype == dtype, name
        torch.testing.assert_close(
            got.double(), want, rtol=tol, atol=max(tol, 2 * err), msg=lambda m: f"{name}: {m}"
        )


# every T with head dim 32; each GQA group in both causal modes
@pytest.mark.parametrize(
    "T, group, causal",
    [
        (1, 1, True),
        (1, 2, False),
        (17, 1, False),
        (17, 4, True),
        (64, 2, True),
        (100, 1, True),
        (100, 4, False),
        (128, 2, False),
    ],
)
def test_fp32_sequence_lengths_and_groups(T, group, causal):
    check(T, 32, group, causal, torch.float32)


# every head dim with a ragged and a tile-aligned T (64 and 128 are the defaults of real models)
@pytest.mark.parametrize(
    "head_dim, T, causal",
    [
        (64, 33, True),
        (64, 64, False),
        (128, 17, False),
        (128, 64, True),
        (48, 40, True),
        (16, 24, False),
    ],
)
def test_fp32_head_dims(head_dim, T, causal):
    check(T, head_dim, 2, causal, torch.float32, B=1)


@pytest.mark.parametrize(
    "T, head_dim, group, causal",
    [
        (100, 32, 2, True),
        (64, 64, 4, False),
        (17, 128, 1, True),
    ],
)
def test_fp16(T, head_dim, group, causal):
    check(T, head_dim, group, causal, torch.float16)


def test_several_kv_heads_and_custom_scale():
    check(40, 32, 2, True, torch.float32, n_kv_heads=2, scale=0.3)


@pytest.mark.skipif(
    DEVICE != "cuda", reason="the Triton interpreter does not compute bf16 correctly: GPU only"
)
@pytest.mark.parametrize(
    "T, head_dim, group, causal", [(100, 64, 2, True), (256, 128, 4, False), (1000, 128, 1, True)]
)
def test_bf16_on_gpu(T, head_dim, group, causal):
    check(T, head_dim, group, causal, torch.bfloat16)


@pytest.mark.parametrize("impl", ["fa2", "tma"])
def test_strided_inputs_as_the_model_passes_them(impl):
    """The model hands over q/k/v as transposed views of one fused projection."""
    B, T, H, Hkv, D = 2, 24, 4, 2, 32
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, device=DEVICE)  # [B, T, (H + 2 Hkv) * D]
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D], not contiguous
    k = k.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    with poisoned_allocations():
        out = flash_attention(q, k, v, causal=True, impl=impl)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, D**-0.5), rtol=1e-5, atol=1e-5)


# the Hopper (TMA descriptor) implementation: ragged T, GQA, causal or not, a head dim padded on-chip
@pytest.mark.parametrize(
    "T, head_dim, group, causal, dtype",
    [
        (45, 32, 2, True, torch.float32),
        (33, 48, 1, False, torch.float32),
        (40, 64, 4, True, torch.float16),
    ],
)
def test_tma_implementation(T, head_dim, group, causal, dtype):
    check(T, head_dim, group, causal, dtype, impl="tma")


@pytest.mark.skipif(
    DEVICE != "cuda", reason="the Triton interpreter does not compute bf16 correctly: GPU only"
)
def test_tma_bf16_on_gpu():
    check(1000, 128, 4, True, torch.bfloat16, impl="tma")


# ---- packed documents -------------------------------------------------------------------------


def bounds_of(lengths_per_row):
    """(start, end) int32 [B, T] for rows of documents of the given lengths (each row sums to T)."""
    starts, ends = [], []
    for lengths in lengths_per_row:
        s = [a for a, n in zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths) for _ in range(n)]
        e = [a + n for a, n in zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths) for _ in range(n)]
        starts.append(s)
        ends.append(e)
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32)


@pytest.mark.parametrize(
    "impl, causal, lengths, group, dtype",
    [
        # a 1-token document; a row of one document
        ("fa2", True, [[7, 20, 1, 17], [45]], 2, torch.float32),
        ("fa2", False, [[16, 16, 13], [1, 44]], 1, torch.float32),
        ("fa2", True, [[30, 15], [3, 3, 39]], 4, torch.float16),
        ("tma", True, [[7, 20, 1, 17], [2, 40, 3]], 2, torch.float32),
        ("tma", False, [[12, 33], [45]], 2, torch.float32),
    ],
)
def test_documents_equal_attention_run_on_each_document_alone(impl, causal, lengths, group, dtype):
    """Packed rows with doc_bounds give, row for row, the outputs and gradients of attention run on each
    document by itself (float64 reference per document)."""
    B, T, D, Hkv = len(lengths), sum(lengths[0]), 32, 2
    H = Hkv * group
    start, end = bounds_of(lengths)
    q = torch.randn(B, H, T, D, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, H, T, D, device=DEVICE, dtype=dtype)
    with poisoned_allocations():
        out = flash_attention(
            q, k, v, causal=causal, doc_bounds=(start.to(DEVICE), end.to(DEVICE)), impl=impl
        )
        grads = torch.autograd.grad(out, (q, k, v), dout)

    want = [torch.zeros(x.shape, dtype=torch.float64, device=DEVICE) for x in (out, q, k, v)]
    for b, row in enumerate(lengths):
        s = 0
        # each document alone, in float64
        for n in row:
            piece = [x[b : b + 1, :, s : s + n].detach().double().requires_grad_() for x in (q, k, v)]
            ref = reference(*piece, causal, D**-0.5)
            ref_grads = torch.autograd.grad(ref, piece, dout[b : b + 1, :, s : s + n].double())
            for w, r in zip(want, (ref, *ref_grads)):
                w[b : b + 1, :, s : s + n] = r
            s += n
    tol = TOL[dtype]
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        torch.testing.assert_close(got.double(), w, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "window, lengths, group, dtype, softcap",
    [
        (5, None, 2, torch.float32, None),
        (16, [[7, 20, 1, 17], [45]], 2, torch.float32, 2.0),
        (33, [[30, 15], [3, 3, 39]], 1, torch.float16, None),
        (None, None, 2, torch.float32, 2.0),
    ],
)
def test_sliding_window_and_softcap_equal_the_masked_reference(window, lengths, group, dtype, softcap):
    """window=W (and packed documents), softcap=c: outputs and gradients of the float64 reference under the
    mask start <= j <= i, j > i - W, of c * tanh(scores / c); the tiles wholly outside the window are
    skipped (forward_tiles, below)."""
    B, T, D, Hkv = 2, 45, 16, 2
    H = Hkv * group
    bounds = None if lengths is None else bounds_of(lengths)
    # scores of a few units: the cap of 2 bends them
    q = (2 * torch.randn(B, H, T, D, device=DEVICE)).to(dtype).requires_grad_()
    k = (2 * torch.randn(B, Hkv, T, D, device=DEVICE)).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, T, D, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, H, T, D, device=DEVICE, dtype=dtype)
    doc = None if bounds is None else tuple(x.to(DEVICE) for x in bounds)
    with poisoned_allocations():
        out = flash_attention(q, k, v, causal=True, doc_bounds=doc, window=window, softcap=softcap)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    i = torch.arange(T, device=DEVICE)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - (window or T))  # [T, T]
    if bounds is not None:
        keep = keep & (i[None, None, :] >= bounds[0].to(DEVICE)[:, :, None])  # [B, T, T]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kk, vv = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)  # [B, H, T, D]
    scores = q64 @ kk.transpose(-2, -1) * D**-0.5  # [B, H, T, T]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    ref = scores.masked_fill(~keep.reshape(-1, 1, T, T), float("-inf")).softmax(-1) @ vv  # [B, H, T, D]
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = TOL[dtype]
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), w, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(DEVICE != "cpu", reason="counts the interpreter's dot products")
@pytest.mark.parametrize(
    "causal, lengths, window",
    [
        (True, [[64, 30, 3, 31], [128]], None),
        (False, [[50, 78], [20, 100, 8]], None),
        (True, [[64, 30, 3, 31], [128]], 20),
    ],
)
def test_forward_tiles_is_the_kernels_schedule(monkeypatch, causal, lengths, window):
    """forward_tiles (the cost model `gptkit bench kernels` reports) counts exactly the tiles the forward
    kernel multiplies (two dots each); documents cut the count, and a window cuts it further."""
    from triton.runtime.interpreter import InterpreterBuilder

    from gptkit_kernels.flash import _INTERPRET_BLOCKS

    dots = []
    real = InterpreterBuilder.create_dot
    monkeypatch.setattr(InterpreterBuilder, "create_dot", lambda self, *a: dots.append(1) or real(self, *a))
    B, T = len(lengths), sum(lengths[0])
    bounds = bounds_of(lengths)
    q = torch.randn(B, 1, T, 16)
    with torch.no_grad():
        flash_attention(q, q, q, causal=causal, doc_bounds=bounds, window=window)
    bm, bn = _INTERPRET_BLOCKS["fwd"]
    assert len(dots) == 2 * forward_tiles(T, bm, bn, causal, bounds, window)
    assert forward_tiles(T, bm, bn, causal, bounds) < B * forward_tiles(T, bm, bn, causal)
    if window is not None:
        assert forward_tiles(T, bm, bn, causal, bounds, window) < forward_tiles(T, bm, bn, causal, bounds)
        # a window alone: ~T/BLOCK_M tiles of ~(W + BLOCK_M) / BLOCK_N keys each, not T^2 / 2
        assert forward_tiles(T, bm, bn, causal, None, window) <= (T // bm) * ((window + bm) // bn + 2)


def test_poisoning_reaches_the_allocations_the_wrapper_makes():
    with poisoned_allocations():
        x = torch.empty(3)
        y = torch.empty_like(x)
        z = x.new_empty(2, 2)
    assert x.isnan().all() and y.isnan().all() and z.isnan().all()


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((1, 4, 8, 32), (1, 3, 8, 32), (1, 3, 8, 32)), "divide"),
        (((1, 2, 8, 32), (1, 2, 9, 32), (1, 2, 9, 32)), "T_q must equal T_k"),
        (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), "between 16 and 256"),
        (((2, 8, 32), (2, 8, 32), (2, 8, 32)), "4-d"),
    ],
)
def test_bad_shapes_are_refused(shapes, message):
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v)


def test_mixed_dtypes_are_refused():
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention(q, q.half(), q.half())


def test_bad_windows_are_refused():
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="causal=True"):
        flash_attention(q, q, q, causal=False, window=4)
    with pytest.raises(ValueError, match="positive integer"):
        flash_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        flash_attention(q, q, q, softcap=0.0)
