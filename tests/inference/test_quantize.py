"""quantize=int8|int4|nf4 (gptkit/quant.py through gptkit.runs.load_for_inference): torchao's NF4 against the
QLoRA paper's code book, the bytes count-params counts against the tensors allocated, the CPU's int8 (torch's
kernel, gptkit/quant_int8.py) against its formula, sample and eval on quantized weights (the very model the
weights dequantize to), and what torchao cannot run in one line."""

import json

import pytest
import torch
from conftest import make_run, one_line, run_main

from gptkit import accounting, quant
from gptkit.inference.generate import encode_prompt, generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.runs import load_model, write_run_folder

pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")

LLAMA = dict(mlp="swiglu", norm="rmsnorm", bias=False, n_kv_heads=2)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("quantize"), max_seq_len=32)


def test_nf4_round_trip_is_the_paper_codebooks_and_count_params_counts_torchaos_bytes():
    """torchao's NF4 (a 4-decimal code book, double-quantized scales) loses what the QLoRA paper's exact code
    book loses (RMS error within 0.1%, with its scales or the unquantized ones); count-params' bytes of the
    quantized weights are those of the tensors torchao holds, for nf4 and int8."""
    torch.manual_seed(0)
    w = torch.randn(512, 256) * 0.02
    q = quant.to_nf4(w)
    rms = lambda x: (x.double() - w.double()).pow(2).mean().sqrt().item()  # noqa: E731
    ours = rms(q.get_original_weight())
    for reference in (quant.reference_nf4(w), quant.reference_nf4(w, scales=quant.nf4_scales(q))):
        assert abs(ours / rms(reference) - 1) < 1e-3
    assert torch.allclose(q.nf4.double(), torch.tensor(quant.NF4_CODEBOOK, dtype=torch.float64), atol=5e-5)

    for tied in (False, True):
        cfg = ModelConfig(
            vocab_size=64, max_seq_len=16, n_layers=2, n_heads=4, d_model=64, tie_embeddings=tied, **LLAMA
        )
        for kind in ("nf4", "int8"):
            # int8 on the CPU: the LM head too (a tied one as its own copy, the embedding kept)
            names = quant.inference_names(cfg, kind)
            assert (quant.HEAD in names) == (kind == "int8")
            torch.manual_seed(0)
            model = quant.quantize_model(GPT(cfg).eval(), kind)
            params = dict(model.named_parameters())
            held = sum(quant.weight_bytes(params[n]) for n in names)
            rest = sum(p.numel() * p.element_size() for n, p in params.items() if n not in names)
            want = accounting.quantized_weights(cfg, kind, "fp32")
            assert held == want["quantized"] and rest == want["rest"], (kind, tied)
            assert want["total"] < want["full"]


def test_sample_and_eval_run_the_model_the_quantized_weights_dequantize_to(run_dir, capsys):
    """sample quantize=nf4|int8 streams what generate() gives for the quantized model; eval's loss is the one
    of the plain model holding the dequantized weights; count-params reports the quantized bytes."""
    d, _, tok = run_dir
    prompt = "ROMEO: O, she"
    for kind in ("nf4", "int8"):
        *_, model = load_model(d, quantize=kind)
        names = quant.inference_names(model.cfg, kind)
        params = dict(model.named_parameters())
        assert all(type(params[n]) is not torch.nn.Parameter for n in names), kind
        want = generate(
            model,
            encode_prompt(tok, prompt, None),
            SampleOptions(max_new_tokens=12, temperature=0),
            decode=tok.decode,
        )
        code, out, err = run_main(
            capsys,
            "sample",
            f"run={d}",
            f"prompt={prompt}",
            "greedy=true",
            "max_new_tokens=12",
            f"quantize={kind}",
        )
        assert code == 0 and out == prompt + want.texts[0] + "\n", err
        # the same model with the dequantized weights in plain tensors
        *_, plain = load_model(d)
        if quant.HEAD in names:
            # a tied head quantized as its own copy: the embedding keeps the full weights
            plain.lm_head.weight = torch.nn.Parameter(plain.lm_head.weight.detach().clone())
        dequantized = {
            n: params[n].get_original_weight() if kind == "nf4" else params[n].dequantize() for n in names
        }
        plain.load_state_dict(dequantized, strict=False)
        # 64 rows a matmul: int8 runs the dequantized weight in fp32 (test_int8_... below: one row)
        x = torch.randint(0, model.cfg.vocab_size, (2, 32))
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, plain(x).logits, atol=1e-4, rtol=1e-4)
        code, out, err = run_main(capsys, "eval", f"run={d}", f"quantize={kind}", "progress=false", "--json")
        assert code == 0, err
        code, full, err = run_main(capsys, "eval", f"run={d}", "progress=false", "--json")
        assert abs(json.loads(out)["loss"] / json.loads(full)["loss"] - 1) < 0.2
    code, out, err = run_main(capsys, "count-params", "model=llama2-7b", "quantize=nf4", "format=json")
    q = json.loads(out)["quantized_weights"]
    assert code == 0 and 4.12 < q["bits"] < 4.13 and q["total"] / q["full"] < 0.3, err


@pytest.mark.parametrize("kernel", ["gptkit", "torch"])
def test_int8_on_the_cpu_is_a_kernel_on_the_exact_dequantized_weight(kernel, monkeypatch):
    """quantize=int8 on the CPU (gptkit/quant_int8.py): per-row symmetric int8 with a bf16 scale rounded up,
    q * scale exact in fp32 and within half a step of the weight. fp32 inputs of up to KERNEL_ROWS rows where
    gptkit's CPU kernel runs: x @ dequantize().T in fp32. Without it (GPTKIT_CPU_LINEAR=0), up to DIRECT_ROWS
    rows torch's int8 kernel, which is bf16(bf16(x) @ dequantize().T) summed in fp32 (within bf16 rounding of
    x @ dequantize().T). More rows, or an input width torch's kernel cannot step (not a multiple of 16)
    without gptkit's, x @ dequantize().T in fp32."""
    from gptkit import quant_int8
    from gptkit_kernels import cpu_linear

    cpu_linear._load.cache_clear()
    monkeypatch.setenv("GPTKIT_CPU_LINEAR", "1" if kernel == "gptkit" else "0")
    ours = cpu_linear.available() is None
    if kernel == "gptkit" and not ours:
        pytest.skip(f"gptkit's CPU kernel: {cpu_linear.available()}")
    torch.manual_seed(0)
    try:
        for out, n_in in ((48, 64), (40, 36)):
            layer = torch.nn.Linear(n_in, out)
            with torch.no_grad():
                layer.weight[3] *= 50  # one row of much larger values: its own scale
            w = layer.weight.detach().clone()
            q = quant_int8.Int8Weight.of(w)
            deq = q.dequantize()
            assert q.qdata.dtype == torch.int8 and q.qdata.abs().max() <= 127
            assert q.scale.dtype == torch.bfloat16
            # bf16 scales times int8 values: exact in fp32 and in fp64 alike
            assert torch.equal(deq.double(), q.qdata.double() * q.scale.double()[:, None])
            assert ((w - deq).abs() <= q.scale.float()[:, None] / 2 * (1 + 1e-6)).all()
            assert (q.scale.float() >= w.abs().amax(1) / 127).all()
            bias = layer.bias.detach().clone()
            quant_int8.quantize(torch.nn.ModuleDict({"l": layer}), ["l.weight"])
            assert type(layer.weight) is quant_int8.Int8Weight
            rows_tried = (1, 5, quant_int8.DIRECT_ROWS, quant_int8.DIRECT_ROWS + 1, quant_int8.KERNEL_ROWS)
            for rows in (*rows_tried, quant_int8.KERNEL_ROWS + 1):
                x = torch.randn(rows, n_in)
                with torch.no_grad():
                    y = layer(x)
                exact = x.double() @ deq.double().T + bias.double()
                if ours and rows <= quant_int8.KERNEL_ROWS:
                    assert layer.weight.packed(x) is not None
                    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
                elif rows <= quant_int8.DIRECT_ROWS and n_in % quant_int8.KERNEL_STEP == 0:
                    # torch's: bf16 in, fp32 sums, bf16 out (then the bias in fp32)
                    kernel = (x.bfloat16().double() @ deq.double().T).bfloat16().double() + bias.double()
                    torch.testing.assert_close(y.double(), kernel, rtol=2**-7, atol=1e-5)
                    bound = 2**-8 * (x.double().abs() @ deq.double().abs().T) + 1e-6
                    assert ((y.double() - exact).abs() <= bound).all(), (out, n_in, rows)
                else:
                    assert layer.weight.packed(x) is None
                    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    finally:
        cpu_linear._load.cache_clear()


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["quantize=int4"],
            "quantize=int4 needs a CUDA GPU (torchao 0.18.0's int4 weight-only kernel is tinygemm's",
        ),
        (["quantize=int3"], "quantize=int3 is not one of int8, w8a8, int4, nf4"),
        (["quantize=nf4", "moe"], "a mixture of experts (model.moe) keeps its experts stacked"),
        (
            ["quantize=nf4", "narrow"],
            "quantize=nf4 quantizes blocks of 64 values, which do not divide blocks.0",
        ),
    ],
    ids=["int4-cpu", "unknown", "moe", "nf4-blocks"],
)
def test_what_torchao_cannot_run_is_one_line(run_dir, tmp_path, capsys, args, needle):
    d = run_dir[0]
    if "moe" in args or "narrow" in args:
        extra = dict(moe=dict(n_experts=4, top_k=2, d_expert=24)) if "moe" in args else {}
        width = 36 if "narrow" in args else 32
        cfg = ModelConfig(
            vocab_size=64, max_seq_len=16, n_layers=1, n_heads=4, d_model=width, **LLAMA, **extra
        )
        d = write_run_folder(tmp_path / "run", {}, GPT(cfg), run_dir[2])
    code, _, err = run_main(capsys, "sample", f"run={d}", "prompt=ROMEO:", "max_new_tokens=2", args[0])
    assert code == 2 and one_line(err) and needle in err, err
