"""`gptkit bench kernels`' cpu-linear rows: a decode step's Linear layers on the CPU, side by side.

For each of bench.cpu_linear.rows (rows a call: 1 is one client, 16 a full server batch, more a prefill
chunk), every Linear layer of bench.cpu_linear.model (fp32, random weights, no biases) runs once on its own
input, in the model's order; one pass is a step's matmuls, the weights streamed from memory. Five sides,
timed in interleaved rounds (A, B, C, ...: the sides see the same load), median (min-max) of the rounds:

  f_linear     F.linear on the layer's own weight (the model without a decoding layout)
  torch        torch's best layout for that many rows (decoding_layout without the kernel: oneDNN packed for
               2+ rows, MKL on W or W^T for one)
  kernel       gptkit_kernels.cpu_linear on the packed weight (the decoding layout uses it up to
               decoding_layout.KERNEL_MAX_ROWS rows a call; measured past it too, to show why the limit)
  int8_torch   quantize=int8's weights (gptkit/quant_int8.py) on torch's paths: its int8 kernel up to
               quant_int8.DIRECT_ROWS rows, the dequantized matmul past them
  int8_kernel  the same weights on the kernel's int8 path (cpu_linear.Packed.int8; quantize=int8 uses it up to
               quant_int8.KERNEL_ROWS rows of fp32)

speedup = torch / kernel, int8_speedup = int8_torch / int8_kernel. err_* = the largest |difference| from a
float64 F.linear on the side's own weight (the dequantized one for int8) over the LM head's outputs (the
widest layer): each side's rounding. Where the kernel cannot run (cpu_linear.available()), one row says why.
"""

from __future__ import annotations

import functools
import statistics
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from gptkit.errors import ConfigError


def rows(emit, cfg) -> None:
    """Emit one cpu-linear row per bench.cpu_linear.rows."""
    from gptkit import quant_int8
    from gptkit.bench.decode import build_model
    from gptkit.inference.decoding_layout import decoding_copy, plain_linear
    from gptkit_kernels import cpu_linear

    counts, threads, repeats, steps = check(cfg)
    why = cpu_linear.available()
    if why is not None:
        emit({"what": "cpu-linear", "note": f"not measured: gptkit's CPU kernel is not available: {why}"})
        return
    spec = cfg.get("model")
    model = build_model(OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else spec)
    linears = [m for m in model.modules() if plain_linear(m)]
    weights_mb = sum(m.weight.numel() * m.weight.element_size() for m in linears) / 1e6
    head = max(linears, key=lambda m: m.weight.numel())  # the widest layer
    for m in linears:  # (biases would differ in where they are added, not in the bytes streamed)
        m.bias = None
    packed = [cpu_linear.Packed(m.weight) for m in linears]
    # quantize=int8's weights (gptkit/quant_int8.py): torch's int8 path against the kernel's
    int8 = [quant_int8.Int8Weight.of(m.weight.detach()) for m in linears]
    packed_int8 = [cpu_linear.Packed.int8(w.qdata, w.scale.float()) for w in int8]
    g = torch.Generator().manual_seed(0)
    with _threads(threads), torch.inference_mode():
        for n in counts:
            xs = [torch.randn(n, m.in_features, generator=g) for m in linears]
            sides = {
                "f_linear": list(linears),
                "torch": [decoding_copy(m, n, kernel=False) for m in linears],
                "kernel": packed,
                "int8_torch": [functools.partial(quant_int8.torch_linear, weight=w) for w in int8],
                "int8_kernel": packed_int8,
            }
            ms = _interleaved(sides, xs, repeats, steps)
            i = linears.index(head)
            row = {"what": "cpu-linear", "rows": n, "layers": len(linears), "threads": threads}
            row["weights_mb"] = round(weights_mb, 1)
            for name, times in ms.items():
                row[f"{name}_ms"] = statistics.median(times)
                row[f"{name}_range"] = f"{min(times):.3g}-{max(times):.3g}"
            row["speedup"] = row["torch_ms"] / row["kernel_ms"]
            row["int8_speedup"] = row["int8_torch_ms"] / row["int8_kernel_ms"]
            # each side against float64 on its own weight (the int8 ones: the dequantized weight)
            for name, layers in sides.items():
                w = int8[i].dequantize() if name.startswith("int8") else head.weight
                want = F.linear(xs[i].double(), w.double())
                row[f"err_{name}"] = (layers[i](xs[i]).double() - want).abs().max().item()
            emit(row)


def check(cfg) -> tuple[list[int], int, int, int]:
    """bench.cpu_linear's rows, threads, repeats and steps; ConfigError (one line) for a bad one."""
    given = cfg.get("rows")
    counts = list(given) if OmegaConf.is_list(given) or isinstance(given, (list, tuple)) else []
    if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
        raise ConfigError(f"bench.cpu_linear.rows must be a list of integers >= 1, got {given!r}")
    got = {k: cfg.get(k) for k in ("threads", "repeats", "steps")}
    for key, value in got.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"bench.cpu_linear.{key} must be an integer >= 1, got {value!r}")
    return counts, got["threads"], got["repeats"], got["steps"]


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _interleaved(sides: dict, xs: list, repeats: int, steps: int) -> dict[str, list[float]]:
    """ms a step of each side: one warm-up step each, then `repeats` rounds timing `steps` steps of each in
    turn."""

    def step(layers) -> None:
        for layer, x in zip(layers, xs):
            layer(x)

    for layers in sides.values():
        step(layers)
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, layers in sides.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step(layers)
            out[name].append((time.perf_counter() - t0) / steps * 1e3)
    return out
