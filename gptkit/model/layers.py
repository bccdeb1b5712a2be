"""Norms, MLPs and rotary position embeddings: the small parts a block is made of."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model import fused


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, reduced in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float, bias: bool, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm of x [..., d_model] with fp32 statistics (the fused kernel where enabled)."""
        if self.fused and fused.usable(x, "norm"):
            return fused.layer_norm(x, self.weight, self.bias, self.eps)
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm as in the Llama reference: the mean square is taken in fp32, then cast back."""

    def __init__(self, dim: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., d_model] with fp32 statistics (the fused kernel where enabled)."""
        if self.fused and fused.usable(x, "norm"):
            return fused.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(kind: str, dim: int, eps: float, bias: bool, fused: bool = False) -> nn.Module:
    """The norm of model.norm (layernorm | rmsnorm) over `dim` features."""
    return LayerNorm(dim, eps, bias, fused) if kind == "layernorm" else RMSNorm(dim, eps, fused)


class LayerAux(NamedTuple):
    """What a feed-forward returns beside y in training, when it has more to say
    (gptkit/model/feedforward.py): a term for the training loss and the figures behind it."""

    # scalar: already weighted by its coefficients; the training loop adds it to the loss
    loss: torch.Tensor
    # the layer's own figures (an MoE layer's MoEStats), detached
    stats: Any


class GeluMLP(nn.Module):
    """GPT-2 MLP: d_model -> d_ff -> GELU (tanh approximation, as GPT-2) -> d_model."""

    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [B, T, d_model] -> (down(gelu(up(x))) [B, T, d_model], no LayerAux)."""
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh")), None


class SwiGLUMLP(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [B, T, d_model] -> (down(silu(gate(x)) * up(x)) [B, T, d_model], no LayerAux)."""
        gate, up = self.gate_proj(x), self.up_proj(x)  # [B, T, d_ff] each
        if self.fused and fused.usable(gate, "swiglu"):
            return self.down_proj(fused.swiglu(gate, up)), None
        return self.down_proj(F.silu(gate) * up), None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (the Hugging Face Llama layout).

    cos/sin tables are computed in fp32 for every position up to max_seq_len and kept as
    non-persistent buffers (they are a function of the config, not learned state). `scaling`
    (model.rope_scaling) rescales the frequencies first, e.g. Llama 3.1's `llama3` scheme.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, fused: bool = False, scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.fused = head_dim, max_seq_len, theta, fused
        self.scaling = scaling
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        # In fp32, step by step as Meta's reference and transformers compute them: the angles the weights were
        # trained with (an fp64 angle differs from that fp32 one by up to an fp32 ulp of position * frequency)
        f32 = dict(dtype=torch.float32, device=device)
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device)  # [head_dim/2]
        exponents = steps.float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)  # [head_dim/2]
        if self.scaling is not None:
            inv_freq = llama3_frequencies(inv_freq, self.scaling)
        t = torch.arange(self.max_seq_len, **f32)
        freqs = torch.outer(t, inv_freq)  # [max_seq_len, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq_len, head_dim]
        return emb.cos(), emb.sin()

    def _apply(self, fn, recurse=True):
        """`model.to(torch.bfloat16)` would round the tables to bf16 and shift every position, and
        `to_empty` leaves them uninitialized: after any cast or move they are recomputed in fp32 on the
        new device (a function of the config, cheap next to the weights)."""
        super()._apply(fn, recurse)
        if not self.cos.is_meta:
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: int | torch.Tensor = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [B, H, T, D] and k [B, Hkv, T, D] for their positions: an int p (positions p..p+T-1),
        a [T] tensor (decoding with fixed shapes) or a [B, T] tensor (e.g. restarting at every packed
        document)."""
        one_row = isinstance(positions, torch.Tensor) and positions.dim() == 1
        if self.fused and not one_row and fused.usable(q, "rope"):
            return fused.rope(q, k, self.cos, self.sin, positions)
        if isinstance(positions, int):
            T = q.shape[-2]
            cos = self.cos[positions : positions + T]  # [T, D]
            sin = self.sin[positions : positions + T]
        elif one_row:
            cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        else:
            cos = self.cos[positions][:, None]  # [B, 1, T, D]
            sin = self.sin[positions][:, None]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def llama3_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: wavelengths longer than original_max_seq_len / low_freq_factor are divided
    by `factor`, those shorter than original_max_seq_len / high_freq_factor stay, and the band between
    is interpolated smoothly (Meta's reference `apply_scaling`, transformers' rope_type llama3)."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_seq_len"]
    wavelen = 2 * math.pi / inv_freq  # [head_dim/2]
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    # 0 at the long end of the band, 1 at the short end
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
