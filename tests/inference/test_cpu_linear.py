"""gptkit_kernels.cpu_linear (the CPU decode linear of gptkit/inference/decoding_layout.py): its results
against float64 within F.linear's own rounding, for 1-70 rows, widths that are not multiples of its blocks,
biases and threads; why it is not available, in one line; and the decoding layout's choice of it, whose
greedy tokens are the plain model's."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.nn.functional as F
from conftest import greedy_gpt

from gptkit_kernels import cpu_linear

# the reasons a machine may lack the kernel; a build that fails or computes wrong numbers is a failure
# (test_the_kernel_runs_where_it_can), never a skip
MACHINE_REASONS = ("turned off", "the kernel is written for", "this CPU runs", "no C compiler")
needs_kernel = pytest.mark.skipif(
    cpu_linear.available() is not None, reason=f"the CPU linear kernel: {cpu_linear.available()}"
)


def test_the_kernel_runs_where_it_can():
    why = cpu_linear.available()
    assert why is None or why.startswith(MACHINE_REASONS), why


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernel found (or not) again, built under tmp_path's cache, and forgotten after the test."""
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "cache"))
    cpu_linear._load.cache_clear()
    yield tmp_path
    cpu_linear._load.cache_clear()


def assert_as_close_as_f_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """got = x @ w^T + bias in fp32, within 4x F.linear's own distance from the float64 map."""
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == torch.float32
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    theirs = (F.linear(x, w, bias).double() - exact).abs().max().item()
    ours = (got.double() - exact).abs().max().item()
    assert ours <= 4 * theirs + 1e-6, (tuple(x.shape), tuple(w.shape), bias is None, ours, theirs)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_computes_the_linear_map(threads):
    """x @ W^T + b for every row count the decode feeds it (and more), widths with a partial last block of
    16 outputs, with and without a bias; each output within F.linear's own distance from the float64 map."""
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 7, 8, 9, 15, 16, 17, 33, 70):
            for n, k in ((37, 40), (16, 3), (1376, 512), (512, 1376), (95, 64)):
                x = torch.randn(rows, k, generator=g)
                w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
                for bias in (b, None):
                    got = cpu_linear.Packed(w, bias)(x)
                    assert_as_close_as_f_linear(got, x, w, bias)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_int8_kernel_computes_the_dequantized_map(threads):
    """Packed.int8(q, scale, bias)(x) = x @ (q * scale)^T + b for the same rows and widths, the int8 values
    widened in registers: within F.linear's own distance (on the dequantized weight) from the float64 map."""
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 9, 16, 17, 70):
            for n, k in ((37, 40), (16, 3), (1376, 512), (95, 64)):
                x = torch.randn(rows, k, generator=g)
                q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
                scale, b = torch.rand(n, generator=g) / 100, torch.randn(n, generator=g)
                w = q.float() * scale[:, None]  # exact: 8 x 24 bits
                for bias in (b, None):
                    got = cpu_linear.Packed.int8(q, scale, bias)(x)
                    assert_as_close_as_f_linear(got, x, w, bias)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(TypeError, match=r"int8 \[N, K\] values on the CPU and a scale \[N\]"):
        cpu_linear.Packed.int8(q.float(), scale)
    with pytest.raises(TypeError, match="and a scale"):
        cpu_linear.Packed.int8(q, scale[:-1])


@needs_kernel
def test_the_kernel_refuses_what_it_cannot_take():
    w = torch.randn(20, 8)
    packed = cpu_linear.pack(w)
    assert packed.shape == (2, 8, 16)
    # the padding of the last block is zeros
    assert packed[1, :, 4:].abs().sum() == 0
    layer = cpu_linear.Packed(w)
    for x in (torch.randn(3, 9), torch.randn(3, 8, dtype=torch.float64), torch.randn(8)):
        with pytest.raises(ValueError, match=r"x must be fp32 \[M, 8\]"):
            layer(x)
    with pytest.raises(TypeError, match="fp32 \\[N, K\\] weight"):
        cpu_linear.Packed(w.double())
    # a non-contiguous x is taken (copied)
    x = torch.randn(8, 3).t()
    torch.testing.assert_close(layer(x), F.linear(x, w))


def test_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("GPTKIT_CPU_LINEAR", "0")
    assert cpu_linear.available() == "turned off (GPTKIT_CPU_LINEAR=0)"
    with pytest.raises(RuntimeError, match="not available: turned off"):
        cpu_linear.Packed(torch.randn(16, 8))


@needs_kernel
def test_no_compiler_and_a_failing_compiler_say_why(fresh, monkeypatch):
    monkeypatch.setenv("PATH", str(fresh))
    monkeypatch.setenv("CC", "no-such-cc")
    assert cpu_linear.available() == "no C compiler (cc, gcc or $CC) to build it"
    cpu_linear._load.cache_clear()
    broken = fresh / "cc"
    broken.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo broken 1.0; exit 0; fi\n'
        "echo 'cc: error: unknown option' >&2\nexit 1\n"
    )
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(broken))
    why = cpu_linear.available()
    assert why.startswith(f"{broken} could not build it") and "unknown option" in why
    assert "\n" not in why
    # nothing half-written is left in the cache
    assert not [p for p in (fresh / "cache" / "kernels").iterdir()]


@needs_kernel
def test_built_once_then_loaded_from_the_cache(fresh):
    assert cpu_linear.available() is None
    built = list((fresh / "cache" / "kernels").glob("cpu_linear-*.so"))
    assert len(built) == 1
    stamp = os.stat(built[0]).st_mtime_ns
    cpu_linear._load.cache_clear()
    assert cpu_linear.available() is None
    assert list((fresh / "cache" / "kernels").glob("cpu_linear-*.so")) == built
    assert os.stat(built[0]).st_mtime_ns == stamp


@needs_kernel
def test_a_wrong_build_is_refused(fresh, monkeypatch):
    """A library that computes the wrong numbers (here: the kernels with their bias ignored) is found by the
    check at load, not in a model's answers."""
    assert cpu_linear.available() is None
    real = cpu_linear._run

    def wrong(fn, x, packed, bias, n, threads, scale=None):
        return real(fn, x, packed, None, n, threads, scale)

    cpu_linear._load.cache_clear()
    monkeypatch.setattr(cpu_linear, "_run", wrong)
    assert "computes wrong results" in cpu_linear.available()


@needs_kernel
def test_the_decoding_layout_takes_the_kernel_and_keeps_the_tokens(monkeypatch):
    """With the kernel available every plain Linear of PACK_MIN_BYTES or more decodes through it (batch 1
    and 4), the prefill's larger calls through F.linear on the layer's own weight; greedy tokens equal the
    plain model's."""
    import gptkit.inference.decoding_layout as layout
    from gptkit.inference.generate import generate
    from gptkit.inference.sampling import SampleOptions

    model = greedy_gpt(128, position="rope", mlp="swiglu", norm="rmsnorm", n_kv_heads=2, bias=False)
    prompt = [[(3 + 7 * i) % 61 for i in range(70)]]
    # the tiny model's layers (32 x 32 .. 61 x 32) are below the threshold: none takes the kernel
    with layout.decoding_layout(model, 4):
        assert not any(type(m).__name__ == "_KernelLinear" for m in model.modules())
    monkeypatch.setattr(layout, "PACK_MIN_BYTES", 0)
    for batch in (1, 4):
        with layout.decoding_layout(model, batch):
            kinds = {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
        assert kinds == {"_KernelLinear"}
    out = generate(model, prompt[0], SampleOptions(max_new_tokens=8, temperature=0, num_samples=2)).tokens
    ids = list(prompt[0])
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == [ids[len(prompt[0]) :]] * 2


@needs_kernel
def test_a_cache_that_cannot_be_written_builds_in_a_private_folder(fresh, monkeypatch):
    """GPTKIT_CACHE under a file: the kernel is built in a new private temporary folder and runs."""
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPTKIT_CACHE", str(blocker / "cache"))
    assert cpu_linear.available() is None
    w = torch.randn(40, 24)
    x = torch.randn(3, 24)
    torch.testing.assert_close(cpu_linear.Packed(w)(x), F.linear(x, w))


def test_the_layout_says_whose_matmuls_decode(fresh, monkeypatch):
    """serve's banner line: how many layers take the kernel, or why none does."""
    from gptkit.inference.decoding_layout import PACK_MIN_BYTES, describe

    model = greedy_gpt(32)
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    if cpu_linear.available() is None:
        monkeypatch.setattr("gptkit.inference.decoding_layout.PACK_MIN_BYTES", 0)
        assert describe(model).startswith(f"gptkit's CPU kernel for {n} of {n} Linear layers")
        monkeypatch.setattr("gptkit.inference.decoding_layout.PACK_MIN_BYTES", PACK_MIN_BYTES)
        # the tiny model's layers are all below the threshold
        assert describe(model) == "torch's (oneDNN, MKL)"
    cpu_linear._load.cache_clear()
    monkeypatch.setenv("GPTKIT_CPU_LINEAR", "0")
    assert (
        describe(model)
        == "torch's (oneDNN, MKL); gptkit's CPU kernel is not used: turned off (GPTKIT_CPU_LINEAR=0)"
    )


@needs_kernel
def test_packed_weights_are_kept_while_the_weights_stay_the_same(monkeypatch):
    """A layout entered again reuses its packed weights; a weight written in place (an optimizer step,
    load_state_dict), a new bias, or a weight created in inference mode (no version counter) is packed anew,
    and every layout computes the layer's current map."""
    import gptkit.inference.decoding_layout as layout

    monkeypatch.setattr(layout, "PACK_MIN_BYTES", 0)
    packs = []
    real = cpu_linear.pack
    # the layer's packs (the kernel's check at load packs weights of other shapes)
    monkeypatch.setattr(cpu_linear, "pack", lambda w: (w.shape == (40, 24) and packs.append(1)) or real(w))
    lin = torch.nn.Linear(24, 40)
    model = torch.nn.Sequential(lin)
    model.lm_head = lin  # decoding_layout reads the head's device
    x = torch.randn(3, 24)

    def run() -> torch.Tensor:
        with torch.no_grad(), layout.decoding_layout(model, 4):
            assert type(model[0]).__name__ == "_KernelLinear"
            return model[0](x)

    torch.testing.assert_close(run(), lin(x).detach())
    torch.testing.assert_close(run(), lin(x).detach())
    assert len(packs) == 1
    with torch.no_grad():
        lin.weight.mul_(2.0)
    torch.testing.assert_close(run(), lin(x).detach())
    assert len(packs) == 2
    with torch.no_grad():
        lin.bias.add_(1.0)
    torch.testing.assert_close(run(), lin(x).detach())
    assert len(packs) == 3
    with torch.inference_mode():
        frozen = torch.nn.Linear(24, 40)
    model[0] = frozen
    model.lm_head = frozen
    with torch.no_grad():
        want = frozen(x)
    torch.testing.assert_close(run(), want)
    torch.testing.assert_close(run(), want)
    assert len(packs) == 5


def test_bench_kernels_times_a_decode_steps_linears_three_ways(fresh, monkeypatch, capsys):
    """`gptkit bench kernels`' cpu-linear rows: per rows value, F.linear, torch's layout and the kernel on
    every Linear layer of the model, and quantize=int8's weights on torch's paths and on the kernel; each
    side's rounding on the LM head against float64; one note where the kernel cannot run; a bad option is
    one line. (Times are printed, never checked.)"""
    import json

    from omegaconf import OmegaConf

    from gptkit.bench import kernels as bench
    from gptkit.conf_tree import conf_dir
    from gptkit.errors import ConfigError

    out = fresh / "k.json"
    model = dict(preset="llama-tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model["vocab_size"] = 300
    cfg = OmegaConf.merge(
        OmegaConf.load(conf_dir() / "bench" / "kernels.yaml"),
        dict(loss_shapes=[], logp_shapes=[], distill_shapes=[], out=str(out)),
    )
    cfg.cpu_linear = dict(model=model, rows=[1, 3, 70], threads=1, repeats=2, steps=1)
    monkeypatch.setattr("gptkit.bench.attention.triton_version", lambda: None)  # the CPU rows only
    assert bench.run(cfg) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["what"] == "cpu-linear"]
    if cpu_linear.available() is None:
        # per layer: q/k/v in one, o, gate, up, down; and the head
        want = [(n, 2 * 5 + 1, 1) for n in (1, 3, 70)]
        assert [(r["rows"], r["layers"], r["threads"]) for r in rows] == want
        for r in rows:
            assert r["speedup"] == pytest.approx(r["torch_ms"] / r["kernel_ms"])
            assert r["int8_speedup"] == pytest.approx(r["int8_torch_ms"] / r["int8_kernel_ms"])
            assert all(r[f"err_{side}"] < 1e-5 for side in ("f_linear", "torch", "kernel", "int8_kernel")), r
            # torch's int8 kernel rounds x to bf16 (up to quant_int8.DIRECT_ROWS rows)
            assert r["err_int8_torch"] < (1e-2 if r["rows"] <= 32 else 1e-5), r
            low, high = (float(v) for v in r["kernel_range"].split("-"))  # 3 significant digits
            assert low <= float(f"{r['kernel_ms']:.3g}") <= high
    cpu_linear._load.cache_clear()
    monkeypatch.setenv("GPTKIT_CPU_LINEAR", "0")
    assert bench.run(cfg) == 0
    assert "what=cpu-linear  note=not measured: gptkit's CPU kernel is not available: turned off" in (
        capsys.readouterr().out
    )
    bad_options = (({"rows": [0]}, "bench.cpu_linear.rows must be"), ({"repeats": None}, "repeats must be"))
    for bad, says in bad_options:
        cfg.cpu_linear = {**dict(model=model, rows=[1], threads=1, repeats=1, steps=1), **bad}
        with pytest.raises(ConfigError, match=says):
            bench.run(cfg)


@needs_kernel
def test_an_int8_layer_packs_once_and_again_after_its_values_change(monkeypatch):
    """quantize=int8's weight (gptkit/quant_int8.py) packs its int8 values for the kernel at the first fp32
    call of up to KERNEL_ROWS rows, reuses them, packs anew after an in-place write, and computes the current
    dequantized map; other inputs take torch's paths, and so does a weight past the cap on packed copies."""
    from gptkit import quant_int8

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40)
    quant_int8.quantize(torch.nn.ModuleDict({"l": layer}), ["l.weight"])
    weight, bias = layer.weight, layer.bias.detach()
    x = torch.randn(2, 64)
    first = weight.packed(x)
    assert first is not None and weight.packed(x) is first
    with torch.no_grad():
        weight.qdata[0] = 7
        y = layer(x)
    assert weight.packed(x) is not first
    torch.testing.assert_close(y, x @ weight.dequantize().T + bias, rtol=1e-5, atol=1e-5)
    rows = quant_int8.KERNEL_ROWS + 1
    assert weight.packed(x.double()) is None and weight.packed(torch.randn(rows, 64)) is None
    # an input that needs its gradient: torch's paths, as without the kernel (which has no backward: its
    # output would cut the graph silently)
    x.requires_grad_(True)
    assert weight.packed(x) is None and layer(x).grad_fn is not None
    x = x.detach()
    # a second layer while the first holds its copy: over a cap of 1.5 copies, torch's int8 kernel (bf16 x)
    monkeypatch.setattr(quant_int8._PACKED, "max_bytes", 40 * 64 * 3 // 2)
    other = torch.nn.Linear(64, 40)
    quant_int8.quantize(torch.nn.ModuleDict({"l": other}), ["l.weight"])
    assert other.weight.packed(x) is None and weight.packed(x) is not None
    with torch.no_grad():
        deq = other.weight.dequantize().double()
        want = (x.bfloat16().double() @ deq.T).bfloat16().float() + other.bias
        torch.testing.assert_close(other(x), want)
