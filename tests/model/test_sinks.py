"""Attention sinks (model.attn_sinks, gpt-oss): every backend's output and the gradients of q, k, v and the
sinks against a float64 reference (GQA, a window, packed documents), with a soft-cap against eager, the Triton
kernel in fp16, a packed training step that trains every layer's sinks alike in every backend, count-params'
row, the one-line config error and export's refusal. The decode paths with sinks and the exact parameter
count are in test_attention_kinds.py."""

import pytest
import torch
from conftest import one_line, run_main

from gptkit.errors import ConfigError, GptkitError
from gptkit.hf.families import family_of
from gptkit.model import GPT, ModelConfig
from gptkit.model.attention import ATTENTION_BACKENDS
from gptkit.model.documents import Documents

B, H, HKV, T, D, W = 2, 4, 2, 40, 16, 9
DOC_IDS = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 3 + [1] * 37])


def reference(q, k, v, sinks, window=None, doc_ids=None):
    """float64, one query at a time: softmax over [its visible keys' scores, the head's sink], the sink's
    probability dropped (transformers' GptOss eager_attention_forward)."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)  # [B, H, T, D]
    rows = []
    for b in range(B):
        per_query = []
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)
            while doc_ids is not None and doc_ids[b, lo] != doc_ids[b, i]:
                lo += 1
            s = (q[b, :, i][:, None] * k[b, :, lo : i + 1]).sum(-1) * D**-0.5  # [H, n]
            p = torch.cat([s, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]  # [H, n]
            per_query.append((p[:, :, None] * v[b, :, lo : i + 1]).sum(1))  # [H, D]
        rows.append(torch.stack(per_query, dim=1))  # [H, T, D]
    return torch.stack(rows)  # [B, H, T, D]


@pytest.mark.parametrize("backend", list(ATTENTION_BACKENDS))
@pytest.mark.parametrize("window, documents", [(None, False), (W, False), (None, True), (W, True)])
def test_every_backend_with_sinks_gives_the_reference_output_and_gradients(backend, window, documents):
    """eager (a logit column), sdpa (a zero key/value under a float mask) and triton (the interpreter: the
    online softmax starts from the sink; the sinks' gradient from the saved lse) against float64 autograd."""
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, requires_grad=True) for _ in range(2))
    sinks = (2 * torch.randn(H)).requires_grad_()
    doc_ids = DOC_IDS if documents else None
    docs = Documents(doc_ids) if documents else None
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, window=window, docs=docs, sinks=sinks)
    want = reference(q, k, v, sinks, window, doc_ids)
    assert (out.double() - want).abs().max().item() <= 1e-5
    # the sinks change the output (a backend ignoring them cannot pass)
    plain, _ = ATTENTION_BACKENDS[backend](q, k, v, window=window, docs=docs)
    assert (plain - out).abs().max().item() > 1e-2
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    wants = torch.autograd.grad(want, (q, k, v, sinks), dout.double())
    for name, a, b in zip(("q", "k", "v", "sinks"), got, wants):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert (a.double() - b).abs().max().item() <= 1e-5, name
    assert wants[3].abs().min().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_with_sinks_is_the_same_kernel_whether_the_sinks_train_or_not(dtype):
    """A trained model and its frozen copy (DPO's reference) give the same output bit for bit: on the CPU,
    SDPA would take its flash kernel for a sink mask that needs no gradient and the math one for a mask that
    does (bf16: 4e-3 apart, a DPO reward 2e-4 at step 0)."""
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, dtype=dtype)
    k, v = (torch.randn(B, HKV, T, D, dtype=dtype) for _ in range(2))
    sinks = torch.randn(H)
    sdpa = ATTENTION_BACKENDS["sdpa"]
    frozen, _ = sdpa(q, k, v, sinks=sinks)
    trained, _ = sdpa(q, k, v, sinks=sinks.clone().requires_grad_())
    with torch.no_grad():
        reference, _ = sdpa(q, k, v, sinks=sinks.clone().requires_grad_())
    assert torch.equal(trained, frozen) and torch.equal(reference, frozen)


def test_sinks_with_a_softcap_equal_eager_in_every_backend():
    """Gemma 2's soft-cap and the sinks together (documents and a window): triton caps in its kernel from the
    sink's start; sdpa runs eager (no soft-capping kernel), sinks passed along."""
    torch.manual_seed(3)
    q = 3 * torch.randn(B, H, T, D)
    q.requires_grad_()
    k, v = (torch.randn(B, HKV, T, D, requires_grad=True) for _ in range(2))
    sinks = torch.randn(H, requires_grad=True)
    args = dict(window=W, docs=Documents(DOC_IDS), softcap=2.0, sinks=sinks)
    want, _ = ATTENTION_BACKENDS["eager"](q, k, v, **args)
    dout = torch.randn_like(want)
    wants = torch.autograd.grad(want, (q, k, v, sinks), dout)
    uncapped, _ = ATTENTION_BACKENDS["eager"](q, k, v, **(args | dict(softcap=None)))
    assert (uncapped - want).abs().max().item() > 1e-2
    for backend in ("sdpa", "triton"):
        out, _ = ATTENTION_BACKENDS[backend](q, k, v, **args)
        got = torch.autograd.grad(out, (q, k, v, sinks), dout)
        for name, a, b in zip(("out", "q", "k", "v", "sinks"), (out, *got), (want, *wants)):
            assert (a - b).abs().max().item() <= 1e-5, (backend, name)


def test_flash_attention_sinks_in_fp16_and_refused_shapes():
    """The kernel in fp16 (fp32 sinks) within fp16's tolerance of the reference; a sinks tensor of the wrong
    shape is one ValueError."""
    from gptkit_kernels import flash_attention

    torch.manual_seed(1)
    q = torch.randn(B, H, T, D, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, dtype=torch.float16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(H, requires_grad=True)
    out = flash_attention(q, k, v, doc_bounds=(Documents(DOC_IDS).start, Documents(DOC_IDS).end), sinks=sinks)
    want = reference(q, k, v, sinks, None, DOC_IDS)
    assert out.dtype == torch.float16 and (out.double() - want).abs().max().item() <= 1e-2
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    wants = torch.autograd.grad(want, (q, k, v, sinks), dout.double())
    for name, a, b in zip(("q", "k", "v", "sinks"), got, wants):
        assert (a.double() - b).abs().max().item() <= 2e-2 * max(1.0, b.abs().max().item()), name
    with pytest.raises(ValueError, match=r"sinks must be a float \[H\] = \[4\] tensor"):
        flash_attention(q, k, v, sinks=torch.zeros(2))


def tiny(attention: str) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=48, max_seq_len=T, n_layers=2, n_heads=H, n_kv_heads=HKV, d_model=H * D)
    cfg |= dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, attention=attention)
    cfg |= dict(sliding_window=W, layer_types=["local", "global"], attn_sinks=True)
    return GPT(ModelConfig(**cfg))


def test_a_packed_training_step_trains_every_layers_sinks_alike_in_every_backend():
    """With packed documents (and a local layer), the loss's gradient reaches each layer's `sinks` [n_heads],
    the same in every backend (NeMo-RL's packed sinks went untrained)."""
    idx = torch.randint(0, 48, (B, T), generator=torch.Generator().manual_seed(2))  # [B, T]
    grads = {}
    for backend in ATTENTION_BACKENDS:
        model = tiny(backend)
        model(idx[:, :-1], idx[:, 1:], doc_ids=DOC_IDS[:, :-1]).loss.backward()
        grads[backend] = torch.stack([blk.attn.sinks.grad for blk in model.blocks])  # [n_layers, n_heads]
    assert grads["eager"].shape == (2, H) and grads["eager"].abs().min().item() > 0
    for backend, g in grads.items():
        torch.testing.assert_close(g, grads["eager"], atol=1e-6, rtol=1e-4, msg=backend)


def test_count_params_counts_the_sinks_a_bad_value_is_one_line_and_export_refuses(capsys):
    code, out, _ = run_main(capsys, "count-params", "model=llama-tiny", "model.attn_sinks=true")
    assert code == 0 and "attention sinks (4 layers)" in out
    code, _, err = run_main(capsys, "count-params", "model=llama-tiny", "model.attn_sinks=maybe")
    assert code == 2 and one_line(err) and "model.attn_sinks=maybe must be true or false" in err, err
    with pytest.raises(ConfigError, match="model.attn_sinks=1 must be true or false"):
        ModelConfig(attn_sinks=1)
    # no transformers family of today has sinks (gpt-oss is to come): export refuses rather than drop them
    llama = dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, n_heads=4, n_kv_heads=2)
    with pytest.raises(GptkitError, match=r"model.attn_sinks=True .* refusing"):
        family_of(ModelConfig(attn_sinks=True, **llama))
