"""Packed documents (data.pack=documents): attention never crosses a document boundary, in every backend,
and with model.position_reset a packed window computes what each document computes on its own.
The triton backend runs in the interpreter here. Budget: ~25 s on 2 cores.
"""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import kernel_device, reference

from gptkit.data import TokenDataModule, prepare
from gptkit.data.windows import doc_ids
from gptkit.errors import GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.model.attention import ATTENTION_BACKENDS
from gptkit.model.documents import Documents, document_bounds

DEVICE = kernel_device()

# two windows of T = 24: a one-token document, a window of one document
LENGTHS = [[5, 1, 12, 6], [24]]


def packed_ids(lengths_per_row):
    # [B, T]
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths_per_row])


def test_document_bounds_and_positions():
    start, end = document_bounds(torch.tensor([[0, 0, 1, 2, 2, 2], [3, 3, 3, 3, 3, 3]]))
    assert start.tolist() == [[0, 0, 2, 3, 3, 3], [0] * 6]
    assert end.tolist() == [[2, 2, 3, 6, 6, 6], [6] * 6]
    assert Documents(torch.tensor([[0, 0, 1, 2, 2, 2]])).positions.tolist() == [[0, 1, 0, 0, 1, 2]]


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
# values as wide as the keys, narrower (multi-head latent attention's) or wider: the Triton kernel takes one
# width, the narrower side is padded (attention.same_width)
@pytest.mark.parametrize("Dv", [16, 8, 24])
def test_every_backend_attends_only_inside_documents(backend, Dv):
    """Outputs and gradients equal attention run on each document alone (float64 reference)."""
    B, H, Hkv, T, D = 2, 4, 2, 24, 16
    docs = Documents(packed_ids(LENGTHS).to(DEVICE))
    q = torch.randn(B, H, T, D, device=DEVICE, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=DEVICE, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dv, device=DEVICE, requires_grad=True)
    dout = torch.randn(B, H, T, Dv, device=DEVICE)
    out, _ = ATTENTION_BACKENDS[backend](q, k, v, causal=True, docs=docs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b, row in enumerate(LENGTHS):
        s = 0
        for n in row:
            piece = [x[b : b + 1, :, s : s + n].detach().double().requires_grad_() for x in (q, k, v)]
            ref = reference(*piece, True, D**-0.5)
            ref_grads = torch.autograd.grad(ref, piece, dout[b : b + 1, :, s : s + n].double())
            for got, want in zip((out, *grads), (ref, *ref_grads)):
                torch.testing.assert_close(got[b : b + 1, :, s : s + n].double(), want, rtol=1e-5, atol=1e-5)
            s += n


def varlen_reference(
    q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch.nn.attention.varlen.varlen_attn's contract (tokens [N, heads, D], documents cut at cu_q), one
    document at a time with conftest.reference: stands in for the CUDA kernel on the CPU."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert enable_gqa == (k.shape[1] != q.shape[1])
    pieces = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        assert 0 < b - a <= max_q == max_k
        qd, kd, vd = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, n, D]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        pieces.append(reference(qd, kd, vd, True, scale)[0].transpose(0, 1))  # [n, H, D]
    return torch.cat(pieces).to(q.dtype)  # [N, H, D]


def test_documents_mask_forms_and_cu_seqlens():
    docs = Documents(packed_ids([[2, 1, 3], [6]]))
    allowed = docs.mask()  # [2, 1, 6, 6] bool
    additive = docs.mask(torch.float32)
    # built once
    assert additive.dtype == torch.float32 and docs.mask(torch.float32) is additive
    assert torch.equal(additive == 0, allowed) and bool((additive[~allowed] == float("-inf")).all())
    # the first token of the third document
    assert allowed[0, 0].int().tolist()[3] == [0, 0, 0, 1, 0, 0]
    assert docs.cu_seqlens().tolist() == [0, 2, 3, 6, 12] and docs.cu_seqlens().dtype == torch.int32


@pytest.mark.parametrize("Dv", [16, 8])
def test_sdpa_with_documents_takes_variable_length_flash_attention_where_it_runs(monkeypatch, Dv):
    """Where varlen_attn runs (CUDA, fp16/bf16), packed documents take it without any mask: the B*T tokens
    cut at Documents.cu_seqlens. On the CPU its contract is played by varlen_reference. Values narrower than
    the keys (multi-head latent attention's) are padded to their width (FlashAttention takes one)."""
    import gptkit.model.attention as attention

    monkeypatch.setattr(attention, "_varlen_attn", lambda: varlen_reference)
    monkeypatch.setattr(attention, "varlen_usable", lambda q: True)
    monkeypatch.setattr(Documents, "mask", lambda self, dtype=None: pytest.fail("a mask was built"))
    B, H, Hkv, T, D = 2, 4, 2, 24, 16
    docs = Documents(packed_ids(LENGTHS))
    q = torch.randn(B, H, T, D, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, requires_grad=True)
    v = torch.randn(B, Hkv, T, Dv, requires_grad=True)
    out, _ = attention.sdpa_attention(q, k, v, causal=True, docs=docs)
    assert out.shape == (B, H, T, Dv)
    for b, row in enumerate(LENGTHS):
        s = 0
        for n in row:
            ref = reference(*(x[b : b + 1, :, s : s + n] for x in (q, k, v)), True, D**-0.5)
            torch.testing.assert_close(out[b : b + 1, :, s : s + n], ref.float())
            s += n
    # the glue is differentiable
    out.sum().backward()
    assert all(x.grad is not None and bool(x.grad.abs().sum() > 0) for x in (q, k, v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sdpa_with_documents_on_a_gpu_in_bf16_runs_varlen_and_matches_each_document_alone():
    import gptkit.model.attention as attention

    B, H, Hkv, T, D = 2, 4, 2, 24, 16
    docs = Documents(packed_ids(LENGTHS).cuda())
    q, k, v = (
        torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (H, Hkv, Hkv)
    )
    if not attention.varlen_usable(q):
        pytest.skip("torch's varlen FlashAttention does not run on this GPU")
    out, _ = attention.sdpa_attention(q, k, v, causal=True, docs=docs)
    out.float().sum().backward()
    for b, row in enumerate(LENGTHS):
        s = 0
        for n in row:
            ref = reference(*(x[b : b + 1, :, s : s + n] for x in (q, k, v)), True, D**-0.5)
            torch.testing.assert_close(out[b : b + 1, :, s : s + n].double(), ref, rtol=2e-2, atol=2e-2)
            s += n
    assert all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v))


def test_sdpa_with_documents_on_the_cpu_takes_the_mask_without_a_warning():
    """On the CPU SDPA's FlashAttention kernel takes the dense mask (as fast as plain causal attention at
    these sizes, docs/chat.md), so packed chat runs print no warning."""
    import warnings

    docs = Documents(packed_ids(LENGTHS))
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ATTENTION_BACKENDS["sdpa"](q, k, v, causal=True, docs=docs)


@pytest.mark.parametrize(
    "backend, variant",
    [
        (
            "triton",
            dict(
                position="rope",
                mlp="swiglu",
                norm="rmsnorm",
                bias=False,
                n_heads=4,
                n_kv_heads=2,
                kernels=["rope", "norm"],
            ),
        ),
        ("eager", dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, n_heads=4, n_kv_heads=2)),
        ("sdpa", dict(position="learned", mlp="gelu", norm="layernorm", n_heads=2)),
    ],
)
def test_packed_window_with_position_reset_computes_each_document_alone(backend, variant):
    """model.position_reset: the logits of a packed window, and the gradients of any function of them, are
    those of each document run by itself (RoPE or learned positions restart at every document)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        max_seq_len=32,
        n_layers=1,
        d_model=64,
        attention=backend,
        position_reset=True,
        **variant,
    )
    model = GPT(cfg).to(DEVICE)
    lengths = LENGTHS[0]
    idx = torch.randint(0, 64, (1, sum(lengths)), device=DEVICE)
    # a random function of the logits
    weights = torch.randn(1, sum(lengths), 64, device=DEVICE)
    packed = model(idx, doc_ids=packed_ids([lengths]).to(DEVICE)).logits  # [1, T, V]
    packed_grads = torch.autograd.grad((packed * weights).sum(), list(model.parameters()))
    alone, s = [], 0
    for n in lengths:
        alone.append(model(idx[:, s : s + n]).logits)
        s += n
    alone = torch.cat(alone, dim=1)  # [1, T, V]
    alone_grads = torch.autograd.grad((alone * weights).sum(), list(model.parameters()))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for (name, _), gp, ga in zip(model.named_parameters(), packed_grads, alone_grads):
        torch.testing.assert_close(gp, ga, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_without_position_reset_later_documents_keep_absolute_positions():
    """Learned positions make the difference visible (RoPE scores depend only on position differences, so
    inside a document mask a shift changes nothing but rounding)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, max_seq_len=32, n_layers=1, n_heads=2, d_model=32, position="learned")
    model = GPT(cfg)
    idx = torch.randint(0, 64, (1, 12))
    ids = packed_ids([[4, 8]])
    packed = model(idx, doc_ids=ids).logits
    second_alone = model(idx[:, 4:]).logits
    # shifted positions
    assert not torch.allclose(packed[:, 4:], second_alone, atol=1e-4)
    reset = GPT(dataclasses.replace(cfg, position_reset=True))
    reset.load_state_dict(model.state_dict())
    torch.testing.assert_close(reset(idx, doc_ids=ids).logits[:, 4:], second_alone, rtol=1e-5, atol=1e-5)
    # the first doc
    torch.testing.assert_close(packed[:, :4], model(idx[:, :4]).logits, rtol=1e-5, atol=1e-5)


# ---- data.pack ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    paths = []
    # 40 documents of 20..200 characters: the EOS token follows each
    for i in range(40):
        p = tmp / f"d{i:02d}.txt"
        p.write_text("".join(chr(c) for c in rng.integers(97, 123, size=int(rng.integers(20, 200)))))
        paths.append(str(p))
    return prepare(
        {"kind": "files", "paths": paths},
        {"kind": "char", "eos_token": "<eos>"},
        cache_dir=tmp / "cache",
        progress=False,
    )


def test_pack_documents_gives_doc_ids_from_eos_positions(docs_prepared):
    eos = docs_prepared.eos_id
    dm = TokenDataModule(docs_prepared, batch_size=4, seq_len=64, seed=1, pack="documents")
    x, y, ids = next(iter(dm.train_dataloader()))
    assert ids.shape == x.shape and ids.dtype == torch.int32
    # a new document starts right after each EOS
    for row_x, row_ids in zip(x, ids):
        for t in range(1, x.shape[1]):
            assert row_ids[t] - row_ids[t - 1] == int(row_x[t - 1] == eos)
    assert (ids[:, 0] == 0).all()
    stream = TokenDataModule(docs_prepared, batch_size=4, seq_len=64, seed=1)
    # the same windows either way
    sx, sy = next(iter(stream.train_dataloader()))
    assert torch.equal(sx, x) and torch.equal(sy, y)
    # the last: each window's index
    vx, vy, vids, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(vids, doc_ids(vx, eos))


def test_pack_is_not_part_of_the_cache_key_and_is_checked(docs_prepared, tmp_path):
    data = {"kind": "files", "paths": [str(tmp_path / "a.txt")]}
    (tmp_path / "a.txt").write_text("hello world, " * 50)
    a = prepare({**data, "pack": "documents"}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False)
    b = prepare(data, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False)
    assert a.dir == b.dir
    with pytest.raises(GptkitError, match="data.pack"):
        prepare({**data, "pack": "docs"}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False)
    # the byte tokenizer has none
    with pytest.raises(GptkitError, match="needs an EOS token"):
        TokenDataModule(b, batch_size=2, seq_len=16, seed=0, pack="documents")


@pytest.mark.long
def test_train_cli_with_packed_documents_and_fused_kernels(tmp_path):
    """The options reach the run (training and validation batches carry doc_ids): data.pack=documents,
    model.position_reset, model.kernels. (The Triton paths are checked in-process above: cheaper.)"""
    from conftest import run_cli, shakespeare

    paths = []
    for i in range(6):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(shakespeare(3000, start=3000 * i))
        paths.append(str(p))
    r = run_cli(
        "train",
        "model=llama-tiny",
        "model.n_layers=1",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=128",
        "model.max_seq_len=32",
        "model.attention=eager",
        "model.position_reset=true",
        "model.kernels=[loss]",
        "tokenizer=char",
        "tokenizer.eos_token='<eos>'",
        "data=files",
        f"data.paths=[{','.join(paths)}]",
        "data.pack=documents",
        "trainer.batch_size=2",
        "trainer.max_steps=2",
        "trainer.val_every=2",
        "trainer.val_windows=2",
        "trainer.checkpoint_every=2",
        "trainer.progress=false",
        f"runs_dir={tmp_path / 'runs'}",
        "name=packed",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = (tmp_path / "runs" / "packed" / "config.yaml").read_text()
    assert "pack: documents" in cfg and "position_reset: true" in cfg
    # eval follows the run's data.pack unless told otherwise
    import json

    runs = [
        run_cli(
            "eval", f"run={tmp_path / 'runs' / 'packed'}", "progress=false", "format=json", "split=all", *pack
        )
        for pack in ((), ("pack=stream",))
    ]
    assert all(e.returncode == 0 for e in runs), runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    packed, stream = (json.loads(e.stdout) for e in runs)
    assert packed["documents"] and not stream["documents"] and packed["loss"] != stream["loss"]
