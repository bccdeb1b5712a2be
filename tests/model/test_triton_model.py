"""model.attention=triton end to end: a training step matches sdpa; no GPU means a warned fallback.

On a CPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set by conftest).
Budget: ~30 s on 2 cores.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import HANG_S, REPO

from gptkit.model import GPT, ModelConfig
from gptkit_kernels import interpreting

DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


@pytest.mark.parametrize(
    "variant",
    [
        # llama-style GQA
        dict(position="rope", mlp="swiglu", norm="rmsnorm", bias=False, n_heads=4, n_kv_heads=2),
        # gpt2-style MHA
        dict(position="learned", mlp="gelu", norm="layernorm", n_heads=2),
    ],
)
def test_training_step_matches_sdpa(variant):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, max_seq_len=32, n_layers=2, d_model=64, attention="sdpa", **variant)
    sdpa_model = GPT(cfg).to(DEVICE)
    triton_model = GPT(dataclasses.replace(cfg, attention="triton")).to(DEVICE)
    # same weights, other attention backend
    triton_model.load_state_dict(sdpa_model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 27), device=DEVICE)  # [B, T]: T not a multiple of a tile
    targets = torch.randint(0, cfg.vocab_size, (2, 27), device=DEVICE)

    losses, grads = {}, {}
    for name, model in (("sdpa", sdpa_model), ("triton", triton_model)):
        # linear in the gradients: differences stay small
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        first = model(idx, targets).loss
        first.backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        # after one optimizer step
        second = model(idx, targets).loss
        losses[name] = (first.item(), second.item())

    assert losses["triton"] == pytest.approx(losses["sdpa"], rel=1e-5)
    # the step did something worth comparing
    assert losses["sdpa"][1] < losses["sdpa"][0]
    for name, g_sdpa in grads["sdpa"].items():
        torch.testing.assert_close(
            grads["triton"][name], g_sdpa, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}.grad: {m}"
        )


def test_model_built_with_attention_triton_runs_the_kernel(monkeypatch):
    """The config field reaches the kernel (not a silent sdpa fallback)."""
    import gptkit_kernels

    calls = []
    real = gptkit_kernels.flash_attention
    monkeypatch.setattr(gptkit_kernels, "flash_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layers=2, n_heads=2, d_model=32, attention="triton")
    GPT(cfg).to(DEVICE)(torch.randint(0, 64, (1, 16), device=DEVICE))
    assert len(calls) == cfg.n_layers


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_no_gpu_and_no_interpreter_falls_back_with_one_warning():
    script = textwrap.dedent("""
        import dataclasses
        import warnings
        import torch
        from gptkit.model import GPT, ModelConfig

        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=64, max_seq_len=16, n_layers=2, n_heads=2, d_model=32,
                          attention="triton")
        model = GPT(cfg)
        idx = torch.randint(0, 64, (2, 16))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(idx, idx).loss
            model(idx, idx).loss.backward()
        sdpa_model = GPT(dataclasses.replace(cfg, attention="sdpa"))
        sdpa_model.load_state_dict(model.state_dict())
        ref = sdpa_model(idx, idx).loss
        print("WARNINGS", [str(w.message) for w in caught])
        print("MATCH", torch.equal(out, ref))
        llama = dict(position="rope", mlp="swiglu", norm="rmsnorm")
        fused = GPT(dataclasses.replace(cfg, attention="sdpa", kernels=["norm", "swiglu", "rope", "loss"],
                                        **llama))
        eager = GPT(dataclasses.replace(cfg, attention="sdpa", **llama))
        eager.load_state_dict(fused.state_dict())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused_loss = fused(idx, idx).loss
            fused_loss.backward()
        print("KERNEL_WARNINGS", [str(w.message) for w in caught])
        print("KERNEL_MATCH", torch.allclose(fused_loss, eager(idx, idx).loss, rtol=1e-6))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=HANG_S
    )
    assert r.returncode == 0, r.stderr
    warnings_line = next(line for line in r.stdout.splitlines() if line.startswith("WARNINGS"))
    # once, for 4 attention calls
    assert warnings_line.count("falling back to sdpa") == 1, warnings_line
    assert "MATCH True" in r.stdout
    kernel_line = next(line for line in r.stdout.splitlines() if line.startswith("KERNEL_WARNINGS"))
    # once, for every fused layer
    assert kernel_line.count("using the eager torch versions") == 1, kernel_line
    # (the fused loss is pure torch: it runs here too)
    assert "KERNEL_MATCH True" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal is for machines without CUDA")
def test_bench_attention_refuses_without_cuda(cli):
    r = cli("bench", "attention")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "CUDA" in lines[0], r.stderr


def test_bench_attention_pipeline_dry_run(monkeypatch, tmp_path, capsys):
    """The GPU benchmark's check, timing, oom, streaming and JSON code with a stand-in timer: fp32 on the
    CPU (interpreter); fp16 on a GPU, where SDPA's flash backend refuses fp32."""
    import json
    import time

    import triton.testing
    from omegaconf import OmegaConf

    import gptkit.model.attention
    from gptkit.bench import attention as bench

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("simulated")

    def wall_ms(fn, warmup, rep, return_mode):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    dtype, tol = (torch.float16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-4)
    monkeypatch.setattr(bench, "DEVICE", DEVICE)
    monkeypatch.setattr(triton.testing, "do_bench", wall_ms)
    monkeypatch.setattr(gptkit.model.attention, "eager_attention", oom)
    cfg = OmegaConf.merge(
        # the shipped options
        OmegaConf.load(REPO / "conf" / "bench" / "attention.yaml"),
        dict(
            tokens=64,
            seq_lens=[32],
            head_dims=[32],
            d_model=64,
            gqa=[2],
            causal=[True],
            warmup_ms=1,
            rep_ms=1,
            check_tol=tol,
            backends=["sdpa-flash", "triton", "eager"],
            out=str(tmp_path / "attn.json"),
        ),
    )
    (case,) = bench._cases(cfg)
    assert (case.batch, case.n_heads, case.n_kv_heads) == (2, 2, 1)
    results = []
    for backend in cfg.backends:
        results.append(bench._measure(case, backend, dtype, cfg))
        print(bench.row(results[-1], results, cfg.check_tol))
        bench._write(cfg.out, bench.environment(), results)
    sdpa_r, triton_r, eager_r = results

    # the check ran against SDPA and agrees
    assert triton_r.max_rel_err < tol
    assert all(triton_r.tflops(m) > 0 and sdpa_r.tflops(m) > 0 for m in bench.MODES)
    assert eager_r.ms == {m: None for m in bench.MODES}
    assert case.flops("fwd+bwd") == 3.5 * 4 * 2 * 2 * 32**2 * 32 / 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "oom" in lines[2] and " ok " in lines[1] and lines[1].split()[-3].endswith("x")
    saved = json.loads((tmp_path / "attn.json").read_text())
    assert {"date", "gpu", "torch", "triton"} <= set(saved) and len(saved["results"]) == 3


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_compiled_blocks_run_the_kernels_without_a_graph_break(variant):
    """The kernels are torch custom ops: torch.compile (trainer.compile=true) keeps them in one graph per
    block and gets the same loss and gradients as the eager model, with every fused kernel on."""
    import torch._dynamo

    from gptkit.training.module import apply_compile

    shape = {"gpt2": {}, "llama": {"position": "rope", "mlp": "swiglu", "norm": "rmsnorm", "n_kv_heads": 1}}[
        variant
    ]
    cfg = ModelConfig(
        vocab_size=64,
        max_seq_len=16,
        n_layers=2,
        n_heads=2,
        d_model=32,
        attention="triton",
        kernels=["norm", "swiglu", "rope", "loss"],
        **shape,
    )
    torch.manual_seed(0)
    compiled, eager = GPT(cfg), GPT(cfg)
    eager.load_state_dict(compiled.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(compiled, "blocks", "aot_eager")
    x = torch.randint(0, 64, (2, 16))
    got, want = compiled(x, x).loss, eager(x, x).loss
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
