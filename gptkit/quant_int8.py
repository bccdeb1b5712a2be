"""quantize=int8 on the CPU: weight-only int8 through gptkit's CPU kernel (gptkit_kernels.cpu_linear) where
it runs, else torch's own CPU kernel, torch._weight_int8pack_mm (no torchao). gptkit/quant.py chooses this
module by device (quant.int8_layout); on CUDA quantize=int8 stays torchao's.

    layout     each [out, in] weight as int8 values q [out, in] and one bf16 scale per output row, symmetric:
               scale = max|row| / 127 rounded UP to a bf16 value (so |w / scale| <= 127), q = round(w / scale)
               clamped to [-127, 127]. q * scale is exact in fp32 (8 x 8 significant bits): dequantize() is
               the weight the layer applies. 8 bits a value and 16 a row.
    matmul     fp32 inputs of one to KERNEL_ROWS rows (decode steps, a server's batch of them), where
               gptkit's CPU kernel runs (gptkit_kernels.cpu_linear: x86-64 with AVX-512, a C compiler):
               Packed.int8, the int8 values streamed in blocks of 16 outputs and widened to fp32 in
               registers, x @ q^T summed in fp32, times the scale, plus the bias: x @ dequantize().T in
               fp32 (2.0x faster than torch's int8 kernel below at one row, 2.6x at 16: docs/kernels.md).
               The packed copy (one more int8 copy of the weight) is made at the first call and kept
               while the values stay the same, up to PACKED_MAX_BYTES of copies in all (about a
               1B-parameter model; the weights first called past it keep torch's kernel).
               Otherwise, one to DIRECT_ROWS rows: torch._weight_int8pack_mm. On x86 its vectorized
               (AVX-512 / AVX2) loop is the bf16 one only (torch 2.13: fp32 and fp16 inputs take a scalar
               loop, 7-10x slower than fp32 F.linear at one row), so x goes in as bf16, each product
               bf16(x) * (q * scale) is summed in fp32, and the output comes back rounded to bf16, then
               cast to the model's dtype: the layer computes bf16(bf16(x) @ dequantize().T). More rows (a
               prefill, eval's windows): x @ dequantize().T in the model's dtype (the dequantized copy is
               paid once for many rows; torch's kernel's 4 x 4 tiles are not blocked for many). Torch's
               kernel reads 16 values of a row at a time with no tail: without gptkit's, a layer whose
               input width is not a multiple of 16 always takes the dequantized matmul.
    what       the block projections (quant.quantized_names) and the LM head. A tied head (tie_embeddings)
               gets its own int8 copy; the embedding keeps the model's dtype for its lookups.

Int8Weight is a tensor subclass held as the layer's weight (the layer keeps its class: the CPU decoding layout
leaves it in place, multi-head latent attention's kv_b_proj is read through dequantize()); F.linear runs the
kernel above, any other op gets the dequantized weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from gptkit_kernels import cpu_linear

# rows of x up to which a matmul runs torch's int8 kernel; past it, the dequantized weight and the model
# dtype's matmul (one thread, a [1376, 512] weight: the kernel 0.83 ms at 32 rows against 1.23, 1.69 at 64
# against 1.44; a [32000, 512] head 27 ms against 92 at 32 rows)
DIRECT_ROWS = 32
# torch's int8 kernel's step along a row (AVX-512: 16 values; it has no tail loop)
KERNEL_STEP = 16
# rows of an fp32 x up to which gptkit's CPU kernel runs: past the fp32 kernel's 64 (decoding_layout's
# KERNEL_MAX_ROWS), as it streams a quarter of the bytes. `gptkit bench kernels`, a 56M Llama's 41 layers, one
# thread: 31 against torch's 99 ms at 64 rows, 148-152 against 186-211 at 256 (the dequantized matmul)
KERNEL_ROWS = 256
# the most bytes of packed copies alive at once (the decoding layout's cap on a second copy of the weights,
# decoding_layout.DECODING_LAYOUT_MAX_BYTES): past it, a weight takes torch's int8 kernel
PACKED_MAX_BYTES = 1 << 30
# the kernel's packed copies, kept while their weight lives and is unchanged (outside it: nothing is added to
# what a weight saves, copies or pickles)
_PACKED = cpu_linear.Kept(PACKED_MAX_BYTES)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q int8 [out, in], scale bf16 [out]): symmetric per output row, the scale rounded
    up to a bf16 value (module docstring)."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1).clamp_min(1e-30)  # [out]
    scale = (absmax / 127).to(torch.bfloat16)  # [out], rounded to nearest
    # rounded down: one bf16 step up (a positive bf16's bits + 1)
    up = (scale.view(torch.int16) + 1).view(torch.bfloat16)
    scale = torch.where(scale.float() < absmax / 127, up, scale)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


class Int8Weight(torch.Tensor):
    """A weight [out, in] held as int8 values (qdata [out, in]) and a bf16 scale a row (scale [out]); its
    dtype is the model's (the dtype of what it computes). F.linear: the module docstring's matmul."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=False
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Int8Weight":
        q, scale = int8_rows(weight)
        return cls(q.to(weight.device), scale.to(weight.device), weight.dtype)

    def __repr__(self) -> str:
        return f"Int8Weight(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype, outer_size, outer_stride):
        return Int8Weight(inner["qdata"], inner["scale"], dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the layer applies, [out, in] in `dtype` (the model's): q * scale (exact in fp32)."""
        w = self.qdata.float() * self.scale.float()[:, None]
        return w.to(dtype or self.dtype)

    def packed(self, x: torch.Tensor):
        """gptkit's CPU kernel for x [M, in] (cpu_linear.Packed.int8, packed at the first call and kept while
        the int8 values are the same tensor, unchanged), or None where it does not run (module docstring)."""
        if x.dtype != torch.float32 or self.device.type != "cpu" or x.shape[0] > KERNEL_ROWS:
            return None
        if x.requires_grad and torch.is_grad_enabled():
            return None  # the kernel has no backward: torch's paths keep the graph (and say so at backward)
        if cpu_linear.available() is not None:
            return None
        make = lambda: cpu_linear.Packed.int8(self.qdata, self.scale.float())  # noqa: E731
        return _PACKED.get(self, (self.qdata, self.scale), make, nbytes=self.qdata.nbytes)

    def direct(self, rows: int) -> bool:
        """Whether a matmul of `rows` rows runs torch's int8 kernel (module docstring)."""
        return self.device.type == "cpu" and rows <= DIRECT_ROWS and self.shape[1] % KERNEL_STEP == 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return Int8Weight(w.qdata, w.scale, w.dtype)
        if func is aten._to_copy.default and set(kwargs) <= {"device", "dtype"}:
            device = kwargs.get("device") or w.device
            return Int8Weight(w.qdata.to(device), w.scale.to(device), kwargs.get("dtype") or w.dtype)
        # anything else: on the dequantized weight (plain tensors out)
        unwrap = lambda t: t.dequantize() if isinstance(t, Int8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., in], weight [out, in], bias) -> [..., out] (module docstring: which matmul)."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    packed = weight.packed(x2)
    if packed is not None:
        y = packed(x2)  # [M, out]
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return torch_linear(x, weight, bias)


def torch_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear() without gptkit's CPU kernel: torch's int8 kernel or the dequantized matmul (module docstring;
    `gptkit bench kernels` times it against the kernel)."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if weight.direct(x2.shape[0]):
        y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), weight.qdata, weight.scale)
        y = y.to(x.dtype)  # [M, out]
    else:
        y = x2 @ weight.dequantize(x.dtype).t()  # [M, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def quantize(model: Any, names: list[str], kind: type = None) -> Any:
    """Replace the weights `names` (state-dict names of Linear weights) of `model` by `kind` (Int8Weight, or
    a subclass such as quant_w8a8.W8A8Weight), in place."""
    kind = kind or Int8Weight
    for name in names:
        module = model.get_submodule(name.removesuffix(".weight"))
        module.weight = torch.nn.Parameter(kind.of(module.weight), requires_grad=False)
    return model
