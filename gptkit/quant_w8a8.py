"""quantize=w8a8 on the CPU: int8 weights AND int8 activations, quantized dynamically at every matmul, summed
int8 x int8 -> int32 by fbgemm (torch.ops.quantized.linear_dynamic, AVX-512 VNNI where the CPU has it), as
llama.cpp's Q8_0 does (it quantizes the activations too). quantize=int8 (gptkit/quant_int8.py) stays
weight-only.

    weights    quant_int8's layout (int8 per value, a bf16 scale per output row, symmetric), packed once more
               for fbgemm (torch.ops.quantized.linear_prepack on a per-channel qint8 tensor of the same
               values and scales: the same weight, held twice: int8's 8 bits a value plus fbgemm's copy).
    activation each row of x on its own: fbgemm quantizes the whole x [M, in] at once, asymmetric uint8 over
               [min(x, 0), max(x, 0)] (255 steps); so for M > 1 every row is first divided by its absmax
               (then multiplied back into the output row), which makes the step each row's own (up to the
               other rows' sign range). One row (a decode step) goes in as it is.
    matmul     every row count (decode, prefill, eval windows): y = dequant(round(x / step)) @ dequant(W).T,
               the sums exact in int32, to within step / 2 * sum|W[n]| (+ float rounding) of x @ dequant(W).T
               (tests/inference/test_w8a8.py checks the bound).
    what       as quantize=int8 on the CPU: the block projections and the LM head.

Fbgemm runs on x86 only (torch.backends.quantized.supported_engines has "fbgemm"); gptkit.quant.check_quantize
refuses w8a8 elsewhere, and off the CPU, in one line.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gptkit.quant_int8 import Int8Weight, int8_rows

ENGINE = "fbgemm"


def available() -> bool:
    """Whether this torch has fbgemm's quantized kernels (x86 builds)."""
    return ENGINE in torch.backends.quantized.supported_engines


def prepack(qdata: torch.Tensor, scale: torch.Tensor) -> Any:
    """fbgemm's packed weight of int8 values qdata [out, in] and row scales [out] (no bias)."""
    zeros = torch.zeros(qdata.shape[0], dtype=torch.long)
    saved = torch.backends.quantized.engine
    with warnings.catch_warnings():
        # torch 2.13 calls its quantized tensors deprecated (they still are what fbgemm's kernels take)
        warnings.simplefilter("ignore")
        q = torch._make_per_channel_quantized_tensor(qdata.cpu(), scale.double().cpu(), zeros, 0)
        try:
            torch.backends.quantized.engine = ENGINE
            return torch.ops.quantized.linear_prepack(q, None)
        finally:
            torch.backends.quantized.engine = saved


class W8A8Weight(Int8Weight):
    """Int8Weight whose F.linear quantizes x too and runs fbgemm's int8 x int8 matmul (module docstring)."""

    packed: Any

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, packed: Any = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, packed: Any = None):
        self.qdata, self.scale = qdata, scale
        self.packed = packed if packed is not None else prepack(qdata, scale)

    @classmethod
    def of(cls, weight: torch.Tensor) -> "W8A8Weight":
        q, scale = int8_rows(weight)
        return cls(q, scale, weight.dtype)

    def __repr__(self) -> str:
        return f"W8A8Weight(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype, outer_size, outer_stride):
        return W8A8Weight(inner["qdata"], inner["scale"], dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            return linear(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return W8A8Weight(w.qdata, w.scale, w.dtype, w.packed)
        cpu = torch.device(kwargs.get("device") or "cpu").type == "cpu"
        if func is aten._to_copy.default and set(kwargs) <= {"device", "dtype"} and cpu:
            return W8A8Weight(w.qdata, w.scale, kwargs.get("dtype") or w.dtype, w.packed)
        return super().__torch_dispatch__(func, types, args, kwargs)


def linear(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., in], weight [out, in], bias) -> [..., out] with x quantized per row (module
    docstring)."""
    x2 = x.reshape(-1, x.shape[-1]).float()  # [M, in]
    if x2.shape[0] == 1:
        y = torch.ops.quantized.linear_dynamic(x2, weight.packed)  # [1, out]
    else:
        s = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [M, 1]
        y = torch.ops.quantized.linear_dynamic(x2 / s, weight.packed) * s  # [M, out]
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
