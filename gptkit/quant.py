"""Quantized weights, through torchao (the `quant` extra: pip install 'gptkit[quant]'): NF4 for QLoRA's
frozen base (finetune=qlora) and int8 / int4 / nf4 weight-only for inference (quantize= of sample, chat,
eval and serve). One place for which weights are quantized, how, and what torchao can and cannot do here.

    what       every block's linear projections (attn.qkv_proj, attn.o_proj, mlp.gate/up/down_proj; under
               multi-head latent attention attn.q_proj or q_a_proj and q_b_proj, kv_a_proj_with_mqa,
               kv_b_proj, o_proj: decoding's absorbed path reads kv_b_proj dequantized; in a Gated
               DeltaNet layer in_proj_qkvz, in_proj_ba, out_proj, its A_log, dt_bias and conv1d kept); the
               embeddings, norms, LM head and biases keep the model's dtype. A mixture's stacked experts
               have no torchao layout: one-line error.
    nf4        QLoRA's NormalFloat4 (Dettmers et al., arXiv:2305.14314), torchao's NF4Tensor: blocks of 64
               values share an absmax scale; the scales are quantized again to int8 in blocks of up to 256
               (double quantization), with one fp32 factor per such block and their mean. 4.13-4.25 bits a
               value. Dequantized in each matmul; runs on the CPU and on CUDA.
    int8       one int8 per value, a scale per output row (symmetric). On the CPU: gptkit/quant_int8.py,
               gptkit's CPU kernel for fp32 decode steps (int8 weights widened in registers, fp32 sums),
               else torch's own int8 kernel (torch._weight_int8pack_mm: bf16 activations, fp32 sums; no
               torchao either way), the LM head quantized too (a tied head: its own int8 copy). On CUDA:
               torchao's Int8WeightOnlyConfig (x @ dequant(W)), the LM head kept. int8_layout() chooses, by
               device.
    w8a8       the CPU only: int8's weights (the LM head too) and int8 activations, quantized per row at
               each matmul, summed int8 x int8 -> int32 by fbgemm (gptkit/quant_w8a8.py; no torchao).
    int4       torchao's Int4WeightOnlyConfig, tinygemm's tile-packed layout (groups of 128 along the input,
               bf16 scales and zeros): CUDA GPUs of compute capability >= 8.0 and dtype=bf16 only (torchao
               0.18 has no CPU int4 kernel for torch 2.13: its other layouts need the mslk package or CUDA).

Entry points: `check_quantize(kind, cfg, device, dtype)` and `quantize_model(model, kind)` for inference (what
gptkit.runs.load_for_inference calls, with quantize=), `to_nf4` / `nf4_round_trip` / `check_nf4` for QLoRA,
`quantized_names(cfg)`, and `require_torchao()` / `torchao()` (found / imported quietly; absent: one line
naming the extra).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from gptkit.errors import ConfigError, GptkitError
from gptkit.extras import TORCHAO_PIN, pip, require
from gptkit.model.config import LINEAR_KIND

# torch and torchao are imported inside the functions: gptkit.accounting (count-params, which the CLI runs
# without importing torch) reads the tables and block sizes here.

QUANTIZE = ("int8", "w8a8", "int4", "nf4")
# the linear projections of a block that are quantized (any of them the model has)
LINEARS = (
    "attn.qkv_proj",
    "attn.q_proj",
    "attn.q_a_proj",
    "attn.q_b_proj",
    "attn.kv_a_proj_with_mqa",
    "attn.kv_b_proj",
    "attn.o_proj",
    "attn.in_proj_qkvz",
    "attn.in_proj_ba",
    "attn.in_proj_qkv",
    "attn.in_proj_z",
    "attn.in_proj_b",
    "attn.in_proj_a",
    "attn.out_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# NF4: values per absmax block (the QLoRA paper's), and the largest block of scales quantized together
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
# int4: values per group along a row (scale and zero point each)
INT4_GROUP = 128
# the QLoRA paper's NF4 values (appendix E; bitsandbytes' table), for the reference round trip
NF4_CODEBOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# values torchao's NF4 quantization compares with the 16 codes at once: two [chunk, 16] transients (its own
# 1M-value chunk makes 64 MiB of them in bf16, more than a 100M-parameter NF4 base's largest weights; 64K
# values: 4 MiB, at 1.3x the time, measured on a [2048, 768] bf16 weight)
NF4_CHUNK = 16384


def require_torchao() -> None:
    """torchao is installed (found, not imported: its import costs ~3 s), else one line naming the extra
    (gptkit.extras)."""
    require("quant", load=False)


def torchao():
    """The torchao package, imported without the warnings its import prints on a CPU-only torch (its CUDA
    extensions fail to load; torch notes an Enum it registers, and torch.compile that NF4Tensor has no
    cache hash); its absence is one line naming the extra."""
    import warnings

    with _quiet("torchao", "torch.utils._pytree"):
        require("quant")
        import torchao as ao
    warnings.filterwarnings("ignore", message=r"NF4Tensor does not implement _stable_hash_for_caching")
    return ao


def _nf4_module():
    """torchao's NF4Tensor module (its path in the pinned version)."""
    ao = torchao()
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as exc:
        raise GptkitError(
            f"torchao {getattr(ao, '__version__', '?')} has no NF4Tensor where {TORCHAO_PIN} keeps it; "
            f"install the pinned version: {pip('quant')}"
        ) from exc
    return nf4_tensor


@contextlib.contextmanager
def _quiet(*loggers: str):
    """Raise these loggers to ERROR for the block (torchao's import logs a warning per CUDA library)."""
    saved = [(log, log.level) for log in (logging.getLogger(n) for n in loggers)]
    for log, _ in saved:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in saved:
            log.setLevel(level)


# ---- which weights -----------------------------------------------------------------------------------------
def quantized_names(cfg: Any) -> dict[str, tuple[int, int]]:
    """The state-dict names of the weights quantization replaces, with their [out, in] shape, for a model
    config (ModelConfig): every block's linear projections. A mixture of experts is a one-line ConfigError
    (its stacked experts run through grouped matmuls that torchao's weight-only tensors do not implement)."""
    if cfg.moe is not None:
        raise ConfigError(
            "quantized weights: a mixture of experts (model.moe) keeps its experts stacked [E, out, in] for "
            "grouped matmuls, which torchao's NF4/int8/int4 weights do not run; use finetune=lora and "
            "sample without quantize="
        )
    shapes = {
        "attn.qkv_proj": (cfg.d_attn + 2 * cfg.d_kv, cfg.d_model),
        "attn.o_proj": (cfg.d_model, cfg.d_attn),
        "mlp.up_proj": (cfg.d_ff, cfg.d_model),
        "mlp.down_proj": (cfg.d_model, cfg.d_ff),
    }
    if cfg.mlp == "swiglu":
        shapes["mlp.gate_proj"] = (cfg.d_ff, cfg.d_model)
    mla = dict(shapes)
    if cfg.attention_kind == "mla":
        # multi-head latent attention's projections instead of qkv_proj (kv_b_proj too: its absorbed decoding
        # reads it dequantized, gptkit.model.mla.dense_weight)
        m, H, d = cfg.mla, cfg.n_heads, cfg.d_model
        del mla["attn.qkv_proj"]
        if m.q_lora_rank is None:
            mla["attn.q_proj"] = (H * m.qk_head_dim, d)
        else:
            mla["attn.q_a_proj"] = (m.q_lora_rank, d)
            mla["attn.q_b_proj"] = (H * m.qk_head_dim, m.q_lora_rank)
        mla["attn.kv_a_proj_with_mqa"] = (m.kv_lora_rank + m.qk_rope_head_dim, d)
        mla["attn.kv_b_proj"] = (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        mla["attn.o_proj"] = (d, H * m.v_head_dim)
    linear = dict(shapes)
    if cfg.linear_layers:
        # a Gated DeltaNet layer's 2-D projections (gptkit.model.gated_deltanet); A_log, dt_bias, the conv1d's
        # taps and the gated norm keep the model's dtype
        g, d = cfg.gdn, cfg.d_model
        key, value = g.n_key_heads * g.key_head_dim, g.n_value_heads * g.value_head_dim
        del linear["attn.qkv_proj"], linear["attn.o_proj"]
        if g.layout == "split":  # Qwen3.5's: the same rows held apart
            linear["attn.in_proj_qkv"] = (2 * key + value, d)
            linear["attn.in_proj_z"] = (value, d)
            linear["attn.in_proj_b"] = linear["attn.in_proj_a"] = (g.n_value_heads, d)
        else:
            linear["attn.in_proj_qkvz"] = (2 * key + 2 * value, d)
            linear["attn.in_proj_ba"] = (2 * g.n_value_heads, d)
        linear["attn.out_proj"] = (d, value)
    names = {}
    for i in range(cfg.n_layers):
        kind = cfg.attention_kind_of(i)
        here = mla if kind == "mla" else linear if kind == LINEAR_KIND else shapes
        names.update({f"blocks.{i}.{m}.weight": here[m] for m in LINEARS if m in here})
    return names


# ---- NF4 ---------------------------------------------------------------------------------------------------
def scaler_block_size(n_blocks: int, setting: Any = "auto") -> int:
    """How many absmax scales are quantized together (double quantization) for a weight of n_blocks blocks:
    setting "auto", the largest divisor of n_blocks up to 256 (256 itself, the QLoRA paper's, wherever it
    divides); a number, that number (check_nf4 checks it divides)."""
    if setting in (None, "auto"):
        return max(d for d in range(1, min(n_blocks, NF4_SCALER_BLOCK) + 1) if n_blocks % d == 0)
    return int(setting)


def check_nf4_settings(block_size: Any, scaler: Any, prefix: str = "qlora") -> None:
    """The settings alone: block_size a positive even integer, scaler_block_size auto or a positive
    integer."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ConfigError(
            f"{prefix}.block_size={block_size} must be an even integer >= 2 (values sharing one absmax "
            f"scale; the QLoRA paper's is {NF4_BLOCK})"
        )
    if scaler not in (None, "auto") and (
        isinstance(scaler, bool) or not isinstance(scaler, int) or scaler < 1
    ):
        raise ConfigError(
            f"{prefix}.scaler_block_size={scaler} must be auto or a positive integer (scales quantized "
            f"together; auto: the largest divisor of a weight's block count up to {NF4_SCALER_BLOCK})"
        )


def check_nf4(cfg: Any, block_size: int, scaler: Any, prefix: str = "qlora", shards: int = 1) -> None:
    """Every quantized weight of the model splits into whole blocks of block_size values, and its blocks into
    whole groups of scales (scaler_block_size); with FSDP2 over `shards` processes each weight's rows, blocks
    and groups of scales also split evenly. A weight that does not: one line naming it."""
    check_nf4_settings(block_size, scaler, prefix)
    for name, (out, n_in) in quantized_names(cfg).items():
        numel = out * n_in
        if numel % block_size:
            raise ConfigError(
                f"{prefix}.block_size={block_size} does not divide {name} [{out}, {n_in}] "
                f"({numel:,} values); choose a block size that divides every projection (e.g. "
                f"{NF4_BLOCK} or a power of two dividing model.d_model)"
            )
        n_blocks = numel // block_size
        group = scaler_block_size(n_blocks, scaler)
        if n_blocks % group:
            raise ConfigError(
                f"{prefix}.scaler_block_size={scaler} does not divide the {n_blocks:,} blocks of {name} "
                f"[{out}, {n_in}]; use {prefix}.scaler_block_size=auto (the largest divisor up to "
                f"{NF4_SCALER_BLOCK})"
            )
        if shards > 1 and (out % shards or (n_blocks // group) % shards):
            raise ConfigError(
                f"trainer=fsdp over {shards} processes shards {name} [{out}, {n_in}] by rows: its rows and "
                f"its {n_blocks // group} group(s) of scales must split evenly ({prefix}.scaler_block_size="
                f"{group}); choose a smaller {prefix}.scaler_block_size, another world size, or trainer=ddp"
            )


def to_nf4(weight: Any, block_size: int = NF4_BLOCK, scaler: Any = "auto") -> Any:
    """`weight` [out, in] as torchao's NF4Tensor (its dtype kept: the dtype it dequantizes to), quantized
    NF4_CHUNK values at a time (torchao's chunk size, a module setting of its, set for the call)."""
    module = _nf4_module()
    n_blocks = weight.numel() // block_size
    saved, module.CHUNK_SIZE = module.CHUNK_SIZE, NF4_CHUNK
    try:
        return module.to_nf4(weight.contiguous(), block_size, scaler_block_size(n_blocks, scaler))
    finally:
        module.CHUNK_SIZE = saved


def is_nf4(tensor: Any) -> bool:
    """Whether `tensor` (or a DTensor's local shard) is an NF4Tensor."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def nf4_round_trip(
    state: dict[str, Any], cfg: Any, block_size: int, scaler: Any, dtype: str
) -> dict[str, Any]:
    """`state` (a GPT state dict) with every quantized weight replaced by dequantize(NF4(weight)) computed in
    `dtype` (the one the QLoRA run quantized in), stored in the weight's own dtype: the base its adapters
    trained on. The input is not modified."""
    import torch

    out = dict(state)
    for name in quantized_names(cfg):
        w = state[name]
        q = to_nf4(w.to(getattr(torch, dtype)), block_size, scaler)
        out[name] = q.get_original_weight().to(w.dtype)  # [out, in]
    return out


def reference_nf4(weight: Any, block_size: int = NF4_BLOCK, scales: Any = None) -> Any:
    """The QLoRA paper's blockwise NF4 round trip of `weight`, in fp64 with its exact code book: each value to
    the nearest code of its value over its block's absmax, dequantized with that absmax (or with `scales`
    [n_blocks], e.g. torchao's double-quantized ones, to compare the code books alone). What torchao's
    NF4Tensor (a 4-decimal code book, double-quantized scales) is measured against (gptkit bench qlora)."""
    import torch

    w = weight.detach().to(torch.float64).reshape(-1, block_size)  # [n_blocks, block_size]
    absmax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [n_blocks, 1]
    codes = torch.tensor(NF4_CODEBOOK, dtype=torch.float64)  # [16]
    nearest = ((w / absmax).unsqueeze(-1) - codes).abs().argmin(-1)  # [n_blocks, block_size]
    scale = absmax if scales is None else scales.to(torch.float64).reshape(-1, 1)  # [n_blocks, 1]
    return (codes[nearest] * scale).reshape(weight.shape)


def nf4_scales(q: Any) -> Any:
    """The absmax scales an NF4Tensor dequantizes with (after double quantization) [n_blocks]."""
    return q.dequantize_scalers(q.quantized_scalers, q.quantization_factor, q.scaler_block_size)


# ---- inference ---------------------------------------------------------------------------------------------
# the LM head's weight: quantized too by quantize=int8 on the CPU
HEAD = "lm_head.weight"


def int8_layout(device: Any) -> str:
    """Which int8 runs quantize=int8 on `device`: "torch" (the CPU: gptkit/quant_int8.py, gptkit's or torch's
    int8 kernel, the LM head included) or "torchao" (CUDA and the rest: Int8WeightOnlyConfig, the block
    projections)."""
    return "torch" if str(device).split(":")[0] == "cpu" else "torchao"


def inference_names(cfg: Any, kind: str, device: Any = "cpu") -> dict[str, tuple[int, int]]:
    """The state-dict names (and [out, in] shapes) that quantize=<kind> replaces on `device`: the block
    projections, and the LM head for int8 on the CPU."""
    names = quantized_names(cfg)
    if (kind == "int8" and int8_layout(device) == "torch") or kind == "w8a8":
        names[HEAD] = (cfg.vocab_size, cfg.d_model)
    return names


def check_quantize(
    kind: Any, cfg: Any, device: str = "cpu", dtype: str = "fp32", option: str = "quantize"
) -> None:
    """quantize=<kind> for a model of config `cfg` on `device` in `dtype`: one-line errors for what torchao
    cannot do (an unknown kind, a mixture of experts, a block or group size that does not divide, int4 off a
    CUDA GPU or in another dtype than bf16), and the torchao import."""
    if kind not in QUANTIZE:
        raise ConfigError(f"{option}={kind} is not one of {', '.join(QUANTIZE)} (or null: the run's weights)")
    names = quantized_names(cfg)
    if kind == "nf4":
        odd = next(((n, s) for n, s in names.items() if (s[0] * s[1]) % NF4_BLOCK), None)
        if odd is not None:
            raise ConfigError(
                f"{option}=nf4 quantizes blocks of {NF4_BLOCK} values, which do not divide {odd[0]} "
                f"[{odd[1][0]}, {odd[1][1]}]; use {option}=int8"
            )
    if kind == "int4":
        if not str(device).startswith("cuda"):
            raise GptkitError(
                f"{option}=int4 needs a CUDA GPU (torchao {TORCHAO_PIN}'s int4 weight-only kernel is "
                f"tinygemm's, CUDA and bf16 only); on the CPU use {option}=int8 or {option}=nf4"
            )
        if str(dtype) not in ("bf16", "bfloat16"):
            raise ConfigError(f"{option}=int4 runs in bf16 (tinygemm's layout): add dtype=bf16")
        odd = next(((n, s) for n, s in names.items() if s[1] % INT4_GROUP), None)
        if odd is not None:
            raise ConfigError(
                f"{option}=int4 quantizes groups of {INT4_GROUP} values along each row, which do not divide "
                f"{odd[0]} [{odd[1][0]}, {odd[1][1]}]; use {option}=int8 or {option}=nf4"
            )
    if kind == "w8a8":
        from gptkit import quant_w8a8

        if str(device).split(":")[0] != "cpu":
            raise GptkitError(
                f"{option}=w8a8 runs on the CPU only (fbgemm's int8 x int8 kernel); on {device} use "
                f"{option}=int8"
            )
        if not quant_w8a8.available():
            raise GptkitError(
                f"{option}=w8a8 needs torch's fbgemm kernels (x86 builds); this torch has none: use "
                f"{option}=int8"
            )
        return
    if not (kind == "int8" and int8_layout(device) == "torch"):
        require_torchao()


def quantize_model(model: Any, kind: str) -> Any:
    """Quantize `model`'s weights (inference_names: its block projections, and its LM head for int8 on the
    CPU) in place for inference (weight-only; the model's device and dtype are the ones it runs in: cast
    first, then quantize) and return it. check_quantize says first what cannot run."""
    import torch

    device = model.lm_head.weight.device
    if kind == "w8a8":
        from gptkit import quant_int8, quant_w8a8

        names = list(inference_names(model.cfg, kind, device))
        return quant_int8.quantize(model, names, quant_w8a8.W8A8Weight)
    if kind == "int8" and int8_layout(device) == "torch":
        from gptkit import quant_int8

        return quant_int8.quantize(model, list(inference_names(model.cfg, kind, device)))
    names = set(quantized_names(model.cfg))
    if kind == "nf4":
        for name in names:
            module = model.get_submodule(name.removesuffix(".weight"))
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
        return model
    # quietly, first
    torchao()
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = (
        Int8WeightOnlyConfig()
        if kind == "int8"
        else Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d")
    )
    quantize_(model, config, filter_fn=lambda m, fqn: f"{fqn}.weight" in names)
    return model


def weight_bytes(tensor: Any) -> int:
    """Bytes a (possibly quantized) weight holds: its inner tensors' for a torchao tensor subclass."""
    local = getattr(tensor, "_local_tensor", tensor)
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None or type(local).__name__ in ("Parameter", "Tensor"):
        return local.numel() * local.element_size()
    return sum(weight_bytes(getattr(local, name)) for name in flatten()[0])


def bits_per_value(
    kind: str, numel: int, rows: int, dtype_bytes: int, block_size: int = NF4_BLOCK, scaler: Any = "auto"
) -> float:
    """The analytic size of one quantized [rows, numel / rows] weight in bits per value (count-params):
    nf4: 4 + 8 per block (its int8 scale) + a dtype factor per group of scales + the mean and the 16-value
    code book; int8: the CPU's layout (int8_layout), 8 + a bf16 scale per row (torchao's, on CUDA, holds a
    dtype scale and an int8 zero point a row: 1-3 bytes a row more); int4: tinygemm's layout, 4 per value
    and a bf16 scale and zero per group of 128, over the weight padded to rows of a multiple of 8 and
    columns of a multiple of 1024 (so more than 4.25 for a narrow model)."""
    if kind == "nf4":
        n_blocks = numel // block_size
        groups = n_blocks // scaler_block_size(n_blocks, scaler)
        extra = n_blocks * 8 + (groups + 1 + 16) * dtype_bytes * 8
        return 4 + extra / numel
    if kind == "int8":
        return 8 + rows * 16 / numel
    if kind == "int4":
        padded = -(-rows // 8) * 8 * (-(-(numel // rows) // 1024) * 1024)
        return (4 * padded + (padded // INT4_GROUP) * 2 * 2 * 8) / numel
    raise ConfigError(f"quantize={kind} is not one of {', '.join(QUANTIZE)}")
