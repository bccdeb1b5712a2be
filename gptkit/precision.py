"""Numeric formats, in one place: the training precisions (Lightning's names) and the tensor dtypes.

Every other module asks here: `train` and `preflight` validate trainer.precision against PRECISIONS,
the accounting reads its bytes per parameter, the throughput monitor its compute dtype (for the peak
FLOP/s of the device), FSDP whether it can shard it; `sample`, `eval` and `export` turn dtype=bf16
into a torch dtype with torch_dtype().
"""

from __future__ import annotations

from dataclasses import dataclass

from gptkit.errors import ConfigError

# torch is imported in torch_dtype only: the precision table is read by the CLI's checks without it.


@dataclass(frozen=True)
class Precision:
    # Lightning's precision string (trainer.precision)
    name: str
    # dtype of the matmuls: fp32 (or tf32 when torch allows it), bf16 or fp16
    compute: str
    # bytes per parameter of the kept weights...
    weight_bytes: int
    # ...of the gradients...
    grad_bytes: int
    # ...and of AdamW's two moments
    optimizer_bytes: int
    # FSDP2 trains it (fp16 would need a sharded gradient scaler)
    fsdp: bool

    @property
    def mixed(self) -> bool:
        """fp32 master weights with half-precision compute: a half working copy exists during compute."""
        return self.name.endswith("-mixed")


# Mixed precision keeps fp32 master weights, fp32 grads and fp32 AdamW moments; "true" half precision
# keeps everything in that dtype.
PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("32-true", "fp32", 4, 4, 8, fsdp=True),
        Precision("bf16-mixed", "bf16", 4, 4, 8, fsdp=True),
        Precision("16-mixed", "fp16", 4, 4, 8, fsdp=False),
        Precision("bf16-true", "bf16", 2, 2, 4, fsdp=True),
        Precision("16-true", "fp16", 2, 2, 4, fsdp=False),
    )
}


def precision(name: "str | Precision", option: str = "trainer.precision") -> Precision:
    """The Precision named `name` (a Precision is returned as it is: a run plan's, already resolved);
    a one-line ConfigError naming `option` otherwise."""
    if isinstance(name, Precision):
        return name
    try:
        return PRECISIONS[str(name)]
    except KeyError:
        raise ConfigError(f"{option}={name!r} is not one of {', '.join(PRECISIONS)}") from None


# Tensor dtypes by their short names: torch's name and bytes per element. tf32 and fp8 are compute
# formats (accounting and peak FLOP/s tables), not dtypes a model is cast to.
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def torch_dtype(name: str, option: str = "dtype"):
    """dtype=fp32|bf16|fp16 (float32/bfloat16/float16 are accepted too) as a torch.dtype."""
    import torch

    aliases = {v: k for k, v in TORCH_DTYPES.items()}
    short = aliases.get(str(name), str(name))
    if short not in TORCH_DTYPES:
        raise ConfigError(f"{option}={name!r} is not one of {', '.join(TORCH_DTYPES)}")
    return getattr(torch, TORCH_DTYPES[short])
