"""quantize=w8a8 on the CPU (gptkit/quant_w8a8.py): int8 weights and int8 activations quantized per row,
fbgemm's int8 x int8 matmul, against x @ dequantize(W).T within the activations' quantization step; sample
and eval through it; what it refuses in one line."""

import json

import pytest
import torch
from conftest import make_run, one_line, run_main

from gptkit import quant, quant_int8
from gptkit.errors import GptkitError
from gptkit.inference.generate import encode_prompt, generate
from gptkit.inference.sampling import SampleOptions
from gptkit.runs import load_model

quant_w8a8 = pytest.importorskip("gptkit.quant_w8a8")
if not quant_w8a8.available():
    pytest.skip("this torch has no fbgemm kernels (x86 builds only)", allow_module_level=True)


def test_w8a8_is_each_row_quantized_to_int8_within_its_step():
    """Every row count: y within one activation step (of that row's own scale: fbgemm's asymmetric uint8
    over [min, 0, max] / 255) times sum|W[n]| of x @ dequantize(W).T + bias, and not the fp32 product (the
    activations are quantized). A row 1e6 times smaller than its neighbour keeps its own step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    with torch.no_grad():
        layer.weight[3] *= 50  # one row of much larger values: its own scale
    bias = layer.bias.detach().clone()
    quant_int8.quantize(torch.nn.ModuleDict({"l": layer}), ["l.weight"], quant_w8a8.W8A8Weight)
    w = layer.weight
    assert type(w) is quant_w8a8.W8A8Weight and w.qdata.dtype == torch.int8
    deq = w.dequantize().double()  # int8's layout: q * bf16 scale, exact
    assert torch.equal(deq, w.qdata.double() * w.scale.double()[:, None])
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64)
        x[0] *= 1e3
        if rows > 1:
            x[1] *= 1e-3
        with torch.no_grad():
            y = layer(x).double()
        exact = x.double() @ deq.T + bias.double()
        s = x.double().abs().amax(1, keepdim=True)  # [rows, 1]
        xn = x.double() / s
        step = (xn.max().clamp_min(0) - xn.min().clamp_max(0)) / 255 * s  # [rows, 1]
        bound = step * deq.abs().sum(1)[None] + 1e-5 * (x.double().abs() @ deq.abs().T) + 1e-6
        assert ((y - exact).abs() <= bound).all(), rows
        assert not torch.allclose(y, exact, rtol=1e-6, atol=1e-6), rows
    with torch.no_grad():
        torch.testing.assert_close(layer(torch.zeros(1, 64)), bias.unsqueeze(0))


def test_w8a8_sums_do_not_saturate():
    """x at the top of its range (uint8 255) against weights at +-127: adjacent products sum past int16 (a
    u8 x s8 pair instruction without VNNI, vpmaddubsw, would saturate at 32767); the sums are exact int32."""
    w = torch.full((32, 64), 0.5)
    w[1::2] *= -1
    weight = quant_w8a8.W8A8Weight.of(w)
    x = torch.full((1, 64), 3.0)
    y = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(y, x @ weight.dequantize().T, rtol=1e-3, atol=0)


def test_sample_and_eval_on_w8a8(tmp_path, capsys):
    """sample quantize=w8a8 streams what generate() gives for the quantized model (the block projections
    and the LM head W8A8Weight); its logits stay near those of the model holding the dequantized weights
    (the activations' rounding alone); eval's loss within 2% of the full model's."""
    d, _, tok = make_run(tmp_path, max_seq_len=32)
    *_, model = load_model(d, quantize="w8a8")
    names = quant.inference_names(model.cfg, "w8a8")
    params = dict(model.named_parameters())
    assert quant.HEAD in names and all(type(params[n]) is quant_w8a8.W8A8Weight for n in names)
    prompt = "ROMEO: O, she"
    opts = SampleOptions(max_new_tokens=12, temperature=0)
    want = generate(model, encode_prompt(tok, prompt, None), opts, decode=tok.decode)
    args = (f"run={d}", f"prompt={prompt}", "greedy=true", "max_new_tokens=12", "quantize=w8a8")
    code, out, err = run_main(capsys, "sample", *args)
    assert code == 0 and out == prompt + want.texts[0] + "\n", err
    *_, plain = load_model(d)
    plain.lm_head.weight = torch.nn.Parameter(plain.lm_head.weight.detach().clone())
    plain.load_state_dict({n: params[n].dequantize() for n in names}, strict=False)
    x = torch.randint(0, model.cfg.vocab_size, (2, 32))
    with torch.no_grad():
        a, b = model(x).logits, plain(x).logits
    rel = ((a - b).norm() / b.norm()).item()
    print("rel", rel)
    assert rel < 0.05 and not torch.equal(a, b)
    code, out, err = run_main(capsys, "eval", f"run={d}", "quantize=w8a8", "progress=false", "--json")
    assert code == 0, err
    code, full, err = run_main(capsys, "eval", f"run={d}", "progress=false", "--json")
    assert abs(json.loads(out)["loss"] / json.loads(full)["loss"] - 1) < 0.02


def test_what_w8a8_refuses_is_one_line(tmp_path, capsys):
    """Off the CPU (fbgemm is x86 CPU code) and in count-params (it holds two copies of the int8 values)."""
    d, *_ = make_run(tmp_path, max_seq_len=16)
    *_, model = load_model(d)
    with pytest.raises(GptkitError, match="quantize=w8a8 runs on the CPU only") as e:
        quant.check_quantize("w8a8", model.cfg, "cuda:0")
    assert "\n" not in str(e.value)
    code, _, err = run_main(capsys, "count-params", "model=llama-tiny", "quantize=w8a8")
    assert code == 2 and one_line(err) and "count them with quantize=int8" in err, err
