"""The CPU decoding layout: every Linear layer swapped, for one generation, for a copy whose weight is laid
out for the few rows per step that decoding feeds it.

    decoding_layout(model, batch)   a context manager; the model's own modules come back afterwards
    decoding_copy(linear, batch)    one layer's copy (kernel=False: torch's, which `gptkit bench kernels`
                                    times against the kernel's)

    fp32, weight >= PACK_MIN_BYTES, gptkit's CPU kernel available
                                              gptkit_kernels.cpu_linear for up to KERNEL_MAX_ROWS rows a call
                                              (weight packed in blocks of 16 outputs, the memory stream
                                              prefetched: _KernelLinear); more rows (a prefill) on the layer's
                                              own weight (F.linear), so one copy of the weights
    else, batch 1, widening layer (out >= in) MKL on W^T            (_TransposedLinear)
    else, batch 1, narrowing layer (out < in) MKL on W itself       (the layer, unchanged)
    else, batch 2+, fp32, weight >= PACK_MIN_BYTES
                                              oneDNN, weight packed once for `batch` rows (_PackedLinear);
                                              a step of ONE row still takes the batch-1 copy above (a server
                                              laid out for 16 rows serving one client: the packed weight at
                                              one row cost it ~6 ms a token on a 56M Llama, ~35% of the step)
    else, batch 2+, smaller weights / other dtypes  MKL on W^T      (_TransposedLinear)

The kernel needs x86-64 with AVX-512 and a C compiler (gptkit_kernels/cpu_linear.py says why it is not
available, and GPTKIT_CPU_LINEAR=0 turns it off). Only on CPU, and only while the matmul weights take less
than DECODING_LAYOUT_MAX_BYTES (the copies cost one more set of them, and at batch 2+ without the kernel the
widening layers' W^T for one-row steps); a quantized weight (quantize=: a torchao tensor) keeps its layer,
which a copy would dequantize. CUDA decoding uses gptkit.inference.static_decode instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from gptkit_kernels import cpu_linear

# above this, a second copy of the weights is not worth the memory
DECODING_LAYOUT_MAX_BYTES = 1 << 30
# Below this weight size oneDNN's per-call overhead outweighs the packed layout at 2-16 rows (one thread,
# whole decode steps: llama-tiny's 128x256..352x128 layers run faster on W^T; gpt2-15m's 384x384 and up
# run faster packed).
PACK_MIN_BYTES = 512 * 1024
# Up to this many rows a call, gptkit's CPU kernel; more on F.linear. One thread, a 56M Llama's weights
# (158 MB) a step, `gptkit bench kernels`' cpu-linear rows (docs/kernels.md): the kernel 1.35x faster than
# torch's best layout at 16 rows, even at 64 (35.5 vs 35.5 ms), slower at 256 (135 vs 115).
KERNEL_MAX_ROWS = 64


class _TransposedLinear(torch.nn.Module):
    """A Linear layer as x @ W^T with W^T stored contiguous [in_features, out_features] (MKL addmm).

    On CPU, for the one row per step that batch-1 decoding feeds a layer, this layout runs 2-3x faster
    than F.linear on the [out_features, in_features] weight (measured for the 32000x128 and 12000x384 LM
    heads in fp32); it is also the layout of GPT-2's Conv1D in transformers.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight_t = linear.weight.detach().t().contiguous()  # [in_features, out_features]
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in_features]: mm directly, without matmul's reshaping logic
        if self.bias is None:
            return torch.mm(rows, self.weight_t).view(*x.shape[:-1], -1)  # [..., out_features]
        return torch.addmm(self.bias, rows, self.weight_t).view(*x.shape[:-1], -1)


class _PackedLinear(torch.nn.Module):
    """A Linear layer through oneDNN (torch's mkldnn backend) with its weight reordered once into the
    blocked layout oneDNN picks for `rows` input rows: the op torch.compile's CPU freezing pass emits.

    Measured on whole decode steps of a 6-layer d=384 model with a 12000-token head (one thread, 8 rows):
    faster than MKL on either weight layout; for small weights (llama-tiny's d=128 layers) its per-call
    overhead makes it slower than W^T, hence PACK_MIN_BYTES. Results are fp32 (max |diff| vs F.linear
    ~1e-6, MKL's own rounding size).
    """

    def __init__(self, linear: torch.nn.Linear, rows: int, one: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the batch-1 layout (_one_row_copy), for a step that feeds one row; not a registered submodule (it
        # may be the model's own layer, which must not appear twice in modules())
        self.__dict__["one"] = one
        # its weight, run here without a second module call (W^T for mm, or W for F.linear)
        self.one_t = one.weight_t if isinstance(one, _TransposedLinear) else None
        self.one_w = None if one is None or self.one_t is not None else one.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one is not None and x.numel() == x.shape[-1]:
            # one row: the batch-1 copy's op, inlined (a nested module call costs ~1% of a 56M model's step)
            row = x.reshape(1, -1)
            if self.one_t is None:
                return F.linear(row, self.one_w, self.bias).view(*x.shape[:-1], -1)
            if self.bias is None:
                return torch.mm(row, self.one_t).view(*x.shape[:-1], -1)
            return torch.addmm(self.bias, row, self.one_t).view(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")


# The packed weights of the kernel's layers, kept between layouts while the layer lives and its weight and
# bias are unchanged: a layout entered again (every generate() call, every chat turn) reuses them. Packing a
# 56M Llama took ~75 ms a layout, ~1.2 ms a token of a 64-token answer.
_PACKED = cpu_linear.Kept()


def _packed(linear: torch.nn.Linear) -> cpu_linear.Packed:
    return _PACKED.get(
        linear, (linear.weight, linear.bias), lambda: cpu_linear.Packed(linear.weight, linear.bias)
    )


class _KernelLinear(torch.nn.Module):
    """A Linear layer through gptkit_kernels.cpu_linear (its weight packed in blocks of 16 outputs, once
    while the weight stays the same: _PACKED) for up to KERNEL_MAX_ROWS rows a call; a larger call (a
    prefill) runs F.linear on the layer's own weight, which this copy holds without copying."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.packed = _packed(linear)
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, in_features]
        if rows.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return self.packed(rows).view(*x.shape[:-1], self.packed.n)


def _kernel_usable(weight: torch.Tensor) -> bool:
    """Whether the layout runs this layer on gptkit's kernel: fp32 weights of PACK_MIN_BYTES or more (smaller
    ones stay in cache between steps, where MKL's call costs less: llama-tiny's 128x352 layer 2.1 vs 2.4 us a
    row), when the kernel runs on this machine."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.numel() * weight.element_size() >= PACK_MIN_BYTES
        and cpu_linear.available() is None
    )


def _onednn_usable(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packs(linear: torch.nn.Linear, batch: int) -> bool:
    """Whether the layout packs this layer for oneDNN (see the table in the module docstring)."""
    weight = linear.weight
    return batch > 1 and weight.numel() * weight.element_size() >= PACK_MIN_BYTES and _onednn_usable(weight)


def decoding_copy(linear: torch.nn.Linear, batch: int, kernel: bool = True) -> torch.nn.Module:
    """The layer's decoding copy for `batch` rows a step; kernel=False: torch's (`gptkit bench kernels`
    times the two)."""
    if kernel and _kernel_usable(linear.weight):
        return _KernelLinear(linear)
    if _packs(linear, batch):
        try:
            packed = _PackedLinear(linear, batch, one=_one_row_copy(linear))
            # fails here, not mid-generation
            packed(linear.weight.new_zeros(batch, linear.in_features))
            return packed
        # a torch build whose oneDNN cannot pack or run this layer
        except RuntimeError:
            pass
    return _one_row_copy(linear) if batch == 1 else _TransposedLinear(linear)


def _one_row_copy(linear: torch.nn.Linear) -> torch.nn.Module:
    """The batch-1 layout of a layer (module docstring's table)."""
    if linear.out_features < linear.in_features:
        # a narrowing layer (MLP down-projection): MKL's matrix-vector product is faster on W itself
        # (cold weights, one row: 1536 -> 384 in 200-250 us on W vs 270-325 us on W^T; the other way round
        # for widening layers, 384 -> 1536 in 165-180 vs 310-340 us)
        return linear
    return _TransposedLinear(linear)


def plain_linear(module: torch.nn.Module) -> bool:
    """A Linear layer whose weight is a plain tensor (not a torchao quantized one)."""
    return type(module) is torch.nn.Linear and type(module.weight) is torch.nn.Parameter


def _left_alone(model) -> Optional[str]:
    """Why the layout leaves the model's own layers in place (not on the CPU, or weights over the cap); None
    when it lays them out."""
    if model.lm_head.weight.device.type != "cpu":
        return "no CPU decoding layout on this device"
    linears = [m for m in model.modules() if plain_linear(m)]
    if sum(m.weight.numel() * m.weight.element_size() for m in linears) > DECODING_LAYOUT_MAX_BYTES:
        return "its weights exceed the decoding layout's memory cap"
    return None


def describe(model) -> str:
    """The layout's matmuls in words (serve's banner), for a model whose layout is not in place: gptkit's
    kernel, torch's, or the model's own."""
    why = _left_alone(model)
    if why is not None:
        return f"the model's own ({why})"
    linears = [m for m in model.modules() if plain_linear(m)]
    kernel = sum(_kernel_usable(m.weight) for m in linears)
    if kernel:
        rest = ", torch's for the rest" if kernel < len(linears) else ""
        return (
            f"gptkit's CPU kernel for {kernel} of {len(linears)} Linear layers (fp32, >= "
            f"{PACK_MIN_BYTES // 1024} KB; up to {KERNEL_MAX_ROWS} rows a call){rest}"
        )
    why = cpu_linear.available()
    return "torch's (oneDNN, MKL)" + (f"; gptkit's CPU kernel is not used: {why}" if why else "")


@contextmanager
def decoding_layout(model, batch: int = 1):
    """Swap every Linear layer of `model` for its decoding copy (module docstring) while the block runs."""
    if _left_alone(model) is not None:
        yield
        return
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if plain_linear(child):
                swapped.append((parent, name, child))
                setattr(parent, name, decoding_copy(child, batch))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
