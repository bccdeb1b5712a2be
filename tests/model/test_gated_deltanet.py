"""Gated DeltaNet (gptkit/model/gated_deltanet.py; `linear` layers of model.layer_types): the chunked and
step-by-step delta rules equal each other and transformers' Qwen3-Next functions, the layer equals
transformers' Qwen3NextGatedDeltaNet on perturbed weights, packed documents reset the state and the conv,
a hybrid trains (gradients reach every parameter), the counts and FLOPs, and one-line config errors. Decoding
through every cache is tests/model/test_attention_kinds.py's (the gdn rows)."""

import pytest
import torch
from conftest import kernel_device, run_cli
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from gptkit import accounting
from gptkit.errors import ConfigError
from gptkit.inference.slot_cache import SlotCache
from gptkit.model import GPT, KVCache, ModelConfig
from gptkit.model.gated_deltanet import (
    GatedDeltaNet,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
    triton_chunk_gated_delta_rule,
)

GDN = {"n_key_heads": 2, "n_value_heads": 4, "key_head_dim": 8, "value_head_dim": 6, "chunk_size": 16}


def inputs(B=2, T=150, seed=0):
    """q, k [B, T, 2, 8], v [B, T, 4, 6], g, beta [B, T, 4] and an initial state [B, 4, 8, 6]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, 2, 8, generator=gen), torch.randn(B, T, 2, 8, generator=gen)
    v = torch.randn(B, T, 4, 6, generator=gen)
    g = -torch.rand(B, T, 4, generator=gen) * 0.5
    beta = torch.rand(B, T, 4, generator=gen)
    return q, k, v, g, beta, torch.randn(B, 4, 8, 6, generator=gen)


@pytest.mark.parametrize("chunk", [64, 16])
def test_the_chunked_and_the_recurrent_rule_equal_transformers_and_each_other(chunk):
    """T = 150: two whole chunks of 64 and a padded one; grouped value heads; a carried-in state."""
    q, k, v, g, beta, S0 = inputs()
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, chunk, S0)
    o_ref, S_ref = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, chunk, S0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=0)
    o_step, S_step = recurrent_gated_delta_rule(q, k, v, g, beta, S0)
    o_hf, S_hf = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, S0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o_step, o_hf, atol=1e-5, rtol=0)
    torch.testing.assert_close(S_step, S_hf, atol=1e-5, rtol=0)
    torch.testing.assert_close(o, o_step, atol=1e-5, rtol=0)
    torch.testing.assert_close(S, S_step, atol=1e-5, rtol=0)


def test_the_chunked_rules_backward_does_not_grow_with_the_square_of_the_chunks():
    """The chunk loop reads each chunk through unbind and stacks the outputs once: no per-chunk slice or
    slice assignment, whose backward would materialize a whole [B, H, N, ...] tensor per chunk (a backward
    quadratic in T). The graph's per-chunk slicing nodes are as many at 8 chunks as at 2."""

    def slicing_nodes(T: int) -> int:
        q, k, v, g, beta, S0 = (t.requires_grad_() for t in inputs(B=1, T=T))
        o, S = chunk_gated_delta_rule(q, k, v, g, beta, 16, S0)
        seen, todo, count = set(), [o.grad_fn, S.grad_fn], 0
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            count += type(node).__name__ in ("CopySlices", "SelectBackward0", "SliceBackward0")
            todo += [n for n, _ in node.next_functions]
        return count

    assert slicing_nodes(8 * 16) == slicing_nodes(2 * 16)


def test_the_rule_runs_in_fp32_under_autocast():
    """bf16 autocast (training's bf16-mixed) leaves the delta rule's matmuls and solves in fp32."""
    q, k, v, g, beta, S0 = inputs(T=40)
    for rule in (
        lambda: chunk_gated_delta_rule(q, k, v, g, beta, 16, S0),
        lambda: recurrent_gated_delta_rule(q, k, v, g, beta, S0),
    ):
        want = rule()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = rule()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resets_restart_the_state_in_both_forms_as_documents_run_apart():
    """Document starts mid-chunk, on a chunk's first position and on its last: each document's outputs are
    those of the document alone (from a zero state), and the final state is the last document's."""
    q, k, v, g, beta, _ = inputs(B=1, T=80)
    starts = [0, 13, 16, 31, 50]
    resets = torch.zeros(1, 80, dtype=torch.bool)
    resets[0, starts] = True
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, 16, resets=resets)
    o_step, S_step = recurrent_gated_delta_rule(q, k, v, g, beta, resets=resets)
    torch.testing.assert_close(o, o_step, atol=1e-5, rtol=0)
    torch.testing.assert_close(S, S_step, atol=1e-5, rtol=0)
    for a, b in zip(starts, starts[1:] + [80]):
        alone, S_alone = hf.torch_recurrent_gated_delta_rule(
            *(x[:, a:b] for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(o[:, a:b], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(S, S_alone, atol=1e-5, rtol=0)


def qwen3_next_layer(T_chunk=64):
    """transformers' Qwen3NextGatedDeltaNet and ours, every weight perturbed, loaded into ours."""
    hf_cfg = Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    ref = hf.Qwen3NextGatedDeltaNet(hf_cfg, 0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    cfg = ModelConfig(
        vocab_size=61,
        n_layers=1,
        n_heads=4,
        d_model=32,
        norm="rmsnorm",
        norm_eps=1e-6,
        attention_kind="gdn",
        gdn={**GDN, "chunk_size": T_chunk},
    )
    ours = GatedDeltaNet(cfg, 0).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_the_layer_equals_transformers_qwen3_next_gated_deltanet():
    """The same parameter names and shapes; fp32 outputs <= 1e-5 at T = 150 (past two chunks of 64), and
    with the decode state: a prefill then single tokens equal the whole pass."""
    ref, ours = qwen3_next_layer()
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in ref.named_parameters()}
    x = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x)
        got, probs = ours(x)
    assert probs is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    cfg = ModelConfig(vocab_size=61, n_layers=1, n_heads=4, d_model=32, attention_kind="gdn", gdn=GDN)
    cache = KVCache(cfg, batch_size=2, max_len=150)
    with torch.no_grad():
        steps = [ours(x[:, :70], cache=cache)[0]]
        for t in range(70, 150):
            steps.append(ours(x[:, t : t + 1], cache=cache)[0])
    # outputs up to ~15 through a gated RMSNorm of 6 features: the fp32 rounding of another grouping of the
    # same sums reaches 2.3e-5 there (this very pass in chunks of 16 instead of 64: 2.2e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=5e-5, rtol=0)


def hybrid(**over) -> GPT:
    """Three linear layers and a full one (Qwen3-Next's pattern), chunks of 8."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, max_seq_len=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32)
    cfg.update(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, init_std=0.1, tie_embeddings=False)
    cfg.update(layer_types=["linear", "linear", "linear", "global"], gdn={**GDN, "chunk_size": 8})
    return GPT(ModelConfig(**{**cfg, **over})).eval()


def test_the_split_layout_is_the_grouped_one_with_its_rows_held_apart():
    """model.gdn.layout=split (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) computes what grouped
    (Qwen3-Next's in_proj_qkvz, in_proj_ba: per key head its q, k, then its value heads' v, z) does with the
    same rows regrouped."""
    grouped = hybrid()
    split = hybrid(gdn={**GDN, "chunk_size": 8, "layout": "split"})
    h_k, h_v, d_k, d_v = GDN["n_key_heads"], GDN["n_value_heads"], GDN["key_head_dim"], GDN["value_head_dim"]
    r = h_v // h_k
    state = {}
    for k, v in grouped.state_dict().items():
        if k.endswith("in_proj_qkvz.weight"):
            q, k_, v_, z = v.view(h_k, 2 * d_k + 2 * r * d_v, -1).split([d_k, d_k, r * d_v, r * d_v], dim=1)
            qkv = torch.cat([x.reshape(-1, v.shape[-1]) for x in (q, k_, v_)])
            state[k.replace("qkvz", "qkv")], state[k.replace("qkvz", "z")] = qkv, z.reshape(-1, v.shape[-1])
        elif k.endswith("in_proj_ba.weight"):
            b, a = v.view(h_k, 2 * r, -1).split([r, r], dim=1)
            state[k.replace("ba", "b")], state[k.replace("ba", "a")] = b.reshape(h_v, -1), a.reshape(h_v, -1)
        else:
            state[k] = v
    split.load_state_dict(state)
    seq = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(split(seq).logits, grouped(seq).logits, atol=1e-6, rtol=0)


def test_a_packed_row_equals_its_documents_run_apart():
    """doc_ids with position_reset: the linear layers' state and conv restart at each document (one starting
    mid-chunk, one on a chunk boundary), the full layer attends inside it: each document's logits are its own
    run alone."""
    model = hybrid(position_reset=True)
    seq = torch.randint(0, 61, (1, 40), generator=torch.Generator().manual_seed(3))
    bounds = [0, 11, 24, 40]
    doc_ids = torch.zeros(1, 40, dtype=torch.long)
    for n, a in enumerate(bounds[1:-1], start=1):
        doc_ids[:, a:] = n
    with torch.no_grad():
        packed = model(seq, doc_ids=doc_ids).logits
        for a, b in zip(bounds, bounds[1:]):
            alone = model(seq[:, a:b]).logits
            torch.testing.assert_close(packed[:, a:b], alone, atol=1e-5, rtol=0)
        # without the reset the later documents read the earlier ones
        assert (model(seq).logits[:, 11:24] - packed[:, 11:24]).abs().max() > 1e-3


def test_a_hybrid_trains_every_parameter_through_packed_documents():
    model = hybrid().train()
    seq = torch.randint(0, 61, (2, 33), generator=torch.Generator().manual_seed(4))
    doc_ids = (torch.arange(32) >= 13).long().expand(2, 32)
    out = model(seq[:, :-1], seq[:, 1:], doc_ids=doc_ids)
    out.loss.backward()
    attn = model.blocks[0].attn
    assert isinstance(attn, GatedDeltaNet) and not isinstance(model.blocks[3].attn, GatedDeltaNet)
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    # transformers' initialization of the layer's own parameters (not GPT-2's normal)
    assert torch.all(attn.dt_bias == 1) and torch.all(attn.norm.weight == 1)
    assert torch.all((attn.A_log.exp() >= 0.0099) & (attn.A_log.exp() <= 16.01))


@pytest.mark.parametrize(
    "dtype, tol, d_k, d_v, chunk",
    [(torch.float32, 1e-5, 20, 40, 32), pytest.param(torch.float16, 2e-3, 8, 6, 16, marks=pytest.mark.long)],
)
def test_the_triton_kernel_equals_the_reference_forward_and_backward(dtype, tol, d_k, d_v, chunk):
    """The Triton chunked delta rule (the interpreter, or compiled on a GPU) against the PyTorch chunked form
    and the step-by-step one (on the CPU):
    T = 40 in chunks of 32 or 16 (a padded last chunk), grouped value heads, a carried-in state, documents
    starting mid-chunk, on a chunk's first position and at position 0 of row 1 (its carried-in state dropped
    there); the outputs, the final state and the gradients of q, k, v, g, beta and the initial state (through
    both outputs). fp16 inputs run the same fp32 arithmetic; only the rounding of inputs and outputs differs.
    In fp32 a value head of 40 spans two programs of 32 value columns of the passes over the chunks (the
    second one part-masked) and three blocks of 16 of the chunk-parallel kernels; a key head of 20 two blocks
    of 16 (the second part-masked)."""
    q, k, v, g, beta, S0 = (x.to(dtype) for x in inputs(T=40, seed=7))
    gen = torch.Generator().manual_seed(10)
    if d_v != 6:
        v, S0 = torch.randn(2, 40, 4, d_v, generator=gen), torch.randn(2, 4, 8, d_v, generator=gen)
    if d_k != 8:
        q, k = torch.randn(2, 40, 2, d_k, generator=gen), torch.randn(2, 40, 2, d_k, generator=gen)
        S0 = torch.randn(2, 4, d_k, d_v, generator=gen)
    resets = torch.zeros(2, 40, dtype=torch.bool)
    resets[0, [5, chunk, 29]] = True
    resets[1, [0, 21]] = True
    w_o = torch.randn(2, 40, 4, d_v, generator=torch.Generator().manual_seed(8))
    w_s = torch.randn(2, 4, d_k, d_v, generator=torch.Generator().manual_seed(9))

    def run(rule, device="cpu"):
        xs = [x.to(device).clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
        docs = resets.to(device)
        o, S = (
            rule(*xs[:5], chunk, xs[5], docs) if rule is not recurrent_gated_delta_rule else rule(*xs, docs)
        )
        ((o.float() * w_o.to(device)).sum() + (S * w_s.to(device)).sum()).backward()
        return o.cpu(), S.cpu(), [x.grad.cpu() for x in xs]

    o, S, grads = run(triton_chunk_gated_delta_rule, kernel_device())  # compiled on a GPU (.ci/gpu-check)
    assert o.dtype == dtype and S.dtype == torch.float32
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o_ref, S_ref, grads_ref = run(rule)
        torch.testing.assert_close(o, o_ref, atol=tol, rtol=0)
        torch.testing.assert_close(S, S_ref, atol=tol, rtol=0)
        for name, got, want in zip(("q", "k", "v", "g", "beta", "S0"), grads, grads_ref):
            torch.testing.assert_close(got, want, atol=tol * 10, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
    # row 1 restarts at position 0: its carried-in state reaches nothing
    assert grads[5][1].abs().max() == 0 and grads[5][0].abs().max() > 0


@pytest.mark.parametrize("attention", ["eager", pytest.param("triton", marks=pytest.mark.long)])
def test_model_attention_chooses_the_backend_of_both_kinds_of_layer(attention, monkeypatch):
    """model.attention=eager|triton: the full layer's backend (head_dim 16: the Triton kernel's least), and
    with triton the linear layers' chunked delta rule runs the Triton kernel (counted): the logits and the
    gradients equal sdpa's (the PyTorch delta rule), packed documents included."""
    from gptkit.model import gated_deltanet

    calls = []
    kernel = gated_deltanet.triton_chunk_gated_delta_rule
    monkeypatch.setattr(
        gated_deltanet, "triton_chunk_gated_delta_rule", lambda *a: calls.append(1) or kernel(*a)
    )
    seq = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(5))
    doc_ids = (torch.arange(24) >= 9).long().expand(2, 24)
    gdn = {**GDN, "chunk_size": 16}
    results = []
    for model in (hybrid(d_model=64, gdn=gdn), hybrid(d_model=64, gdn=gdn, attention=attention)):
        logits = model(seq, doc_ids=doc_ids).logits
        logits.square().mean().backward()
        results.append(
            (logits, model.blocks[0].attn.in_proj_qkvz.weight.grad, model.blocks[1].attn.A_log.grad)
        )
    assert len(calls) == (3 if attention == "triton" else 0)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_chunk_or_head_dim_the_kernel_cannot_take_is_one_line():
    """model.attention=triton builds the linear layers on the kernel: chunk 8 or a head of 160 is refused."""
    for gdn, message in (
        ({**GDN, "chunk_size": 8}, "chunk size 8"),
        ({**GDN, "key_head_dim": 160}, "key head dim 160"),
    ):
        with pytest.raises(ConfigError, match=message) as err:
            hybrid(gdn=gdn, attention="triton")
        assert "\n" not in str(err.value)
    hybrid(attention="sdpa")  # chunk 8 is the PyTorch form's to take


def test_the_counts_the_state_and_the_flops_of_a_hybrid():
    """count_params equals the module's parameters, kv_cache_bytes counts the linear layers' state (not
    growing with the context) beside the full layer's K/V, and the FLOPs of a linear layer do not grow with
    the context."""
    model = hybrid()
    cfg = model.cfg
    counts = accounting.count_params(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    # the delta rule's state 4 x 8 x 6 and the conv's last 3 inputs of 2*16 + 24 channels, per linear layer
    state = 4 * 8 * 6 + (2 * 16 + 24) * 3
    kv = 2 * 2 * 8  # the full layer: K and V of 2 heads x 8 per position
    for context in (1, 64):
        assert accounting.kv_cache_bytes(cfg, context, "fp32") == 4 * (3 * state + context * kv)
    cache = KVCache(cfg, batch_size=1, max_len=64)
    assert cache.nbytes == accounting.kv_cache_bytes(cfg, 64, "fp32")
    # a bf16 cache keeps the states in fp32 (each token adds to them), the K/V in bf16: serve's slots too
    half = KVCache(cfg, batch_size=1, max_len=64, dtype=torch.bfloat16)
    slots = SlotCache(cfg, slots=2, max_len=64, dtype=torch.bfloat16)
    assert half.states[0].dtype == slots.states[0].dtype == torch.float32
    assert half.k[3].dtype == torch.bfloat16
    assert half.nbytes == slots.nbytes // 2 == accounting.kv_cache_bytes(cfg, 64, "bf16")
    assert accounting.kv_cache_bytes(cfg, 64, "bf16") == 4 * 3 * state + 2 * 64 * kv
    per_layer = accounting.delta_rule_flops(cfg)
    # per value head: C (2 d_k + d_v) + C (d_k + d_v) / 2 + 3 d_k d_v multiply-adds, C = 8
    assert per_layer == 2 * 4 * (8 * 22 + 8 * 14 / 2 + 3 * 48)
    short, long = accounting.flops_per_token(cfg, 16), accounting.flops_per_token(cfg, 64)
    # only the full layer's attention grows: 4 * (64 - 16) * d_attn more FLOPs per token
    assert long.forward_dense - short.forward_dense == 4 * 48 * 32


@pytest.mark.parametrize(
    "over, message",
    [
        ({"layer_types": ["full", "linear"]}, r"holds full: each must be one of local, global, linear"),
        ({"layer_types": ["linear", "global"], "gdn": None}, r"linear layers \(Gated DeltaNet\) need"),
        ({"gdn": GDN}, r"model.gdn is set but no layer is linear"),
        ({"attention_kind": "gdn", "layer_types": ["linear", "global"]}, r"makes every layer linear.*global"),
        ({"attention_kind": "gdn", "attn_sinks": True}, r"model.attn_sinks applies to softmax attention"),
        ({"layer_types": ["linear", "global"], "gdn": {**GDN, "n_value_heads": 3}}, r"not a multiple of"),
        ({"layer_types": ["linear", "global"], "gdn": {**GDN, "chunk_size": 0}}, r"chunk_size=0 must be"),
        ({"layer_types": ["linear", "global"], "gdn": {**GDN, "heads": 2}}, r"unknown model.gdn field"),
        (
            {"layer_types": ["linear", "global"], "gdn": {**GDN, "layout": "qwen3_5"}},
            r"model.gdn.layout='qwen3_5' must be one of grouped, split",
        ),
    ],
)
def test_bad_mixes_are_one_line_errors(over, message):
    gdn = GDN if "attention_kind" in over else None
    cfg = dict(vocab_size=61, n_layers=2, n_heads=4, d_model=32, gdn=gdn)
    with pytest.raises(ConfigError, match=message) as err:
        ModelConfig(**{**cfg, **over})
    assert "\n" not in str(err.value)


@pytest.mark.long
def test_gdn_tiny_trains_and_samples_past_its_context(tmp_path):
    """model=gdn-tiny (3 linear : 1 full; shrunk) trains on the built-in corpus, and `sample` decodes through
    the states and the full layer's cache past the context (the window slides: the states restart)."""
    shrink = [
        "model.d_model=32",
        "model.max_seq_len=32",
        "model.gdn.key_head_dim=8",
        "model.gdn.value_head_dim=8",
    ]
    r = run_cli(
        "train",
        "model=gdn-tiny",
        *shrink,
        "model.gdn.chunk_size=8",
        "trainer.max_steps=4",
        "trainer.val_every=4",
        "trainer.accelerator=cpu",
        "name=gdn",
        f"runs_dir={tmp_path}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("sample", f"run={tmp_path / 'gdn'}", "prompt=def ", "max_new_tokens=40", "greedy=true")
    assert r.returncode == 0 and "40 new" in r.stderr, r.stderr[-3000:]
