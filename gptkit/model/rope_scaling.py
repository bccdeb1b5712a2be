"""RoPE frequency scaling (model.rope_scaling): one function per type, one table keyed by the type.

    ROPE_SCALINGS[type](inv_freq, s, head_dim, theta, seq_len) -> (inv_freq, attention_factor)

    inv_freq   [head_dim/2] fp32, the plain frequencies 1 / theta^(2i / head_dim)
    s          the checked model.rope_scaling (gptkit.model.config.check_rope_scaling: every key present)
    seq_len    the length of the sequence the tables are for (None: any up to the original context); only
               `dynamic` (LENGTH_DEPENDENT) and `longrope` (SWITCHED) read it
    attention_factor   cos and sin are multiplied by it (YaRN's and LongRoPE's; 1.0 for the others)

The arithmetic is that of transformers' modeling_rope_utils (the same fp32 operations in the same order), so
an imported model rotates its queries and keys with the angles it was trained with. The keys each type takes
are config.py's ROPE_SCALING_KEYS (one list); a new type is a function here and a row in both tables.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ScalingFn = Callable[[torch.Tensor, dict, int, float, "int | None"], tuple[torch.Tensor, float]]


def llama3(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, seq_len=None):
    """Llama 3.1: wavelengths longer than original_max_seq_len / low_freq_factor are divided by `factor`,
    those shorter than original_max_seq_len / high_freq_factor stay, and the band between is interpolated
    smoothly (Meta's reference `apply_scaling`, transformers' rope_type llama3)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_seq_len"]
    wavelen = 2 * math.pi / inv_freq  # [head_dim/2]
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    # 0 at the long end of the band, 1 at the short end
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0


def linear(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, seq_len=None):
    """Position interpolation: every frequency divided by `factor` (transformers' rope_type linear)."""
    return inv_freq / s["factor"], 1.0


def dynamic(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, seq_len=None):
    """Dynamic NTK: up to original_max_seq_len plain RoPE; beyond, the base grows with the sequence length L
    to theta * (factor * L / original - (factor - 1))^(head_dim / (head_dim - 2)) (transformers' rope_type
    dynamic, whose original is the config's max_position_embeddings)."""
    old = s["original_max_seq_len"]
    if seq_len is None or seq_len <= old:
        return inv_freq, 1.0
    factor = s["factor"]
    base = theta * ((factor * seq_len / old) - (factor - 1)) ** (head_dim / (head_dim - 2))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=inv_freq.device).float()  # [head_dim/2]
    return 1.0 / (base ** (steps / head_dim)), 1.0


def yarn_attention_factor(s: dict) -> float:
    """YaRN's factor on cos and sin: attention_factor when given, else 0.1 * mscale * ln(factor) + 1 (the
    ratio of two such terms with mscale and mscale_all_dim, DeepSeek's), 1 when factor <= 1."""
    if s["attention_factor"] is not None:
        return s["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s["factor"]
    if s["mscale"] and s["mscale_all_dim"]:
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def yarn(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, seq_len=None):
    """YaRN (Peng et al. 2023; transformers' rope_type yarn): frequencies that turn fewer than beta_slow times
    over the original context are interpolated (divided by factor), those that turn more than beta_fast times
    are kept, with a linear ramp between; cos and sin are scaled by yarn_attention_factor."""
    factor, old = s["factor"], s["original_max_seq_len"]
    half = head_dim // 2

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return (head_dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    steps = torch.arange(0, head_dim, 2, device=inv_freq.device).float()  # [head_dim/2]
    pos_freqs = theta ** (steps / head_dim)  # [head_dim/2]
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(half, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(
        0, 1
    )
    # 1: keep the frequency (fast rotations), 0: interpolate it
    keep = 1 - ramp  # [head_dim/2]
    return interpolation * (1 - keep) + extrapolation * keep, yarn_attention_factor(s)


def longrope_attention_factor(s: dict) -> float:
    """LongRoPE's factor on cos and sin: attention_factor when given, else sqrt(1 + ln(factor) /
    ln(original_max_seq_len)), 1 when factor <= 1."""
    if s["attention_factor"] is not None:
        return s["attention_factor"]
    if s["factor"] <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s["factor"]) / math.log(s["original_max_seq_len"]))


def longrope(inv_freq: torch.Tensor, s: dict, head_dim: int, theta: float, seq_len=None):
    """LongRoPE (Phi-3.5, Phi-4-mini; transformers' rope_type longrope): frequency i divided by its own
    factor, short_factor[i] for a sequence within original_max_seq_len (seq_len None or <= it), long_factor[i]
    for a longer one (SWITCHED: RotaryEmbedding keeps both tables); cos and sin scaled by
    longrope_attention_factor."""
    long = seq_len is not None and seq_len > s["original_max_seq_len"]
    ext = torch.tensor(
        s["long_factor" if long else "short_factor"], dtype=torch.float32, device=inv_freq.device
    )
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=inv_freq.device).float() / head_dim
    return 1.0 / (ext * theta**shape), longrope_attention_factor(s)


# model.rope_scaling.type -> its frequencies (the names are config.py's ROPE_SCALINGS)
ROPE_SCALINGS: dict[str, ScalingFn] = {
    "llama3": llama3,
    "linear": linear,
    "dynamic": dynamic,
    "yarn": yarn,
    "longrope": longrope,
}
# types whose tables depend on the length of the sequence (computed per forward past the original context)
LENGTH_DEPENDENT = ("dynamic",)
# types with two fixed sets of frequencies, one for sequences within the original context (seq_len None) and
# one for longer sequences (seq_len original + 1): both tables are kept, and each sequence reads the one its
# length (its last position + 1) picks, as transformers' dynamic_rope_update does per forward
SWITCHED = ("longrope",)
