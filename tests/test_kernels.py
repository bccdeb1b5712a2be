"""The Triton FlashAttention kernels against a float64 eager reference.

On a CPU they run in the Triton interpreter (conftest sets TRITON_INTERPRET=1 before any import);
with TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernels, and bf16 too.
Inputs are random on every run; every buffer the wrapper allocates is filled with NaN first, so an
element the kernels fail to write cannot pass. Budget: ~60 s on 2 cores (interpreter).
"""

from contextlib import contextmanager

import pytest
import torch

from gptkit_kernels import flash_attention, interpreting

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@contextmanager
def poisoned_allocations():
    """Every torch.empty / empty_like / Tensor.new_empty made inside is NaN-filled (floats)."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    mp.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    mp.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(real_new_empty(self, *a, **kw)))
    try:
        yield
    finally:
        mp.undo()


def reference(q, k, v, causal, scale):
    """Eager attention in float64: softmax(q k^T * scale) v, K/V repeated per query head."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, H, T, D]
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, H, T, T]
    if causal:
        T = q.shape[2]
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [B, H, T, D]


def check(T, head_dim, group, causal, dtype, *, B=2, n_kv_heads=1, scale=None):
    H = n_kv_heads * group
    q = torch.randn(B, H, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(B, n_kv_heads, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(B, n_kv_heads, T, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn(B, H, T, head_dim, device=DEVICE, dtype=dtype)  # [B, H, T, D]
    with poisoned_allocations():
        out = flash_attention(q, k, v, causal=causal, scale=scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference(q64, k64, v64, causal, head_dim**-0.5 if scale is None else scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())

    tol = TOL[dtype]
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *ref_grads)):
        assert got.shape == want.shape and got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


# every T with head dim 32; each GQA group in both causal modes
@pytest.mark.parametrize("T, group, causal", [
    (1, 1, True), (1, 2, False), (17, 1, False), (17, 4, True),
    (64, 2, True), (100, 1, True), (100, 4, False), (128, 2, False),
])
def test_fp32_sequence_lengths_and_groups(T, group, causal):
    check(T, 32, group, causal, torch.float32)


# every head dim with a ragged and a tile-aligned T (64 and 128 are the defaults of real models)
@pytest.mark.parametrize("head_dim, T, causal", [
    (64, 33, True), (64, 64, False), (128, 17, False), (128, 64, True), (48, 40, True), (16, 24, False),
])
def test_fp32_head_dims(head_dim, T, causal):
    check(T, head_dim, 2, causal, torch.float32, B=1)


@pytest.mark.parametrize("T, head_dim, group, causal", [
    (100, 32, 2, True), (64, 64, 4, False), (17, 128, 1, True),
])
def test_fp16(T, head_dim, group, causal):
    check(T, head_dim, group, causal, torch.float16)


def test_several_kv_heads_and_custom_scale():
    check(40, 32, 2, True, torch.float32, n_kv_heads=2, scale=0.3)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton interpreter does not compute bf16 correctly: GPU only")
@pytest.mark.parametrize("T, head_dim, group, causal", [(100, 64, 2, True), (256, 128, 4, False), (1000, 128, 1, True)])
def test_bf16_on_gpu(T, head_dim, group, causal):
    check(T, head_dim, group, causal, torch.bfloat16)


def test_strided_inputs_as_the_model_passes_them():
    """The model hands over q/k/v as transposed views of one fused projection."""
    B, T, H, Hkv, D = 2, 24, 4, 2, 32
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, device=DEVICE)  # [B, T, (H + 2 Hkv) * D]
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D], not contiguous
    k = k.view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    with poisoned_allocations():
        out = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, D**-0.5), rtol=1e-5, atol=1e-5)


def test_poisoning_reaches_the_allocations_the_wrapper_makes():
    with poisoned_allocations():
        x = torch.empty(3)
        y = torch.empty_like(x)
        z = x.new_empty(2, 2)
    assert x.isnan().all() and y.isnan().all() and z.isnan().all()


@pytest.mark.parametrize("shapes, message", [
    (((1, 4, 8, 32), (1, 3, 8, 32), (1, 3, 8, 32)), "divide"),
    (((1, 2, 8, 32), (1, 2, 9, 32), (1, 2, 9, 32)), "T_q must equal T_k"),
    (((1, 2, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), "between 16 and 256"),
    (((2, 8, 32), (2, 8, 32), (2, 8, 32)), "4-d"),
])
def test_bad_shapes_are_refused(shapes, message):
    q, k, v = (torch.randn(s, device=DEVICE) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v)


def test_mixed_dtypes_are_refused():
    q = torch.randn(1, 2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        flash_attention(q, q.half(), q.half())
