"""MXFP4, the OCP Microscaling format gpt-oss ships its experts in, read back into full-precision weights.

    blocks  uint8 [..., G, 16]: G blocks of 32 FP4 (E2M1) values per row, two to a byte, the low nibble first
    scales  uint8 [..., G]:     one E8M0 scale per block: 2^(s - 127); 0xFF is NaN (OCP MX v1.0, 5.4)
    ->      [..., G * 32]:      value = E2M1(nibble) * 2^(s - 127)

E2M1 is a sign bit, two exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
(nibbles 0-7 positive, 8-15 negative). The values are exact in fp32 and bf16 for every scale a checkpoint
holds (2^-127 .. 2^127), so reading back loses nothing that the quantization had not already lost.
transformers' reader (integrations/mxfp4.py, convert_moe_packed_tensors) computes the same values; gpt-oss's
files hold `<name>_blocks` and `<name>_scales` per expert tensor, rows = output features.
"""

from __future__ import annotations

import torch

from gptkit.errors import GptkitError

# E2M1 by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# values per block, bytes per block
BLOCK, BLOCK_BYTES = 32, 16
# the E8M0 exponent bias, and the code that means NaN
E8M0_BIAS, E8M0_NAN = 127, 0xFF


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, name: str = "tensor"
) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> [..., G * 32] in dtype (module docstring);
    GptkitError, one line naming `name`, when the shapes or dtypes are not MXFP4's or a scale is NaN."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise GptkitError(
            f"MXFP4 {name}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise GptkitError(
            f"MXFP4 {name}: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: blocks "
            f"must be [..., G, {BLOCK_BYTES}] (32 FP4 values per block) and scales [..., G]"
        )
    if bool((scales == E8M0_NAN).any()):
        raise GptkitError(f"MXFP4 {name}: a block scale is 0xFF, which E8M0 defines as NaN")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low = table[(blocks & 0x0F).long()]  # [..., G, 16]: values 0, 2, 4, ...
    high = table[(blocks >> 4).long()]  # [..., G, 16]: values 1, 3, 5, ...
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - E8M0_BIAS  # [..., G]
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))  # [..., G, 32]
    return out.flatten(-2).to(dtype)  # [..., G * 32]
