"""Norms, MLPs and rotary position embeddings: the small parts a block is made of."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.model import fused
from gptkit.model.rope_scaling import LENGTH_DEPENDENT, ROPE_SCALINGS, SWITCHED


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, reduced in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float, bias: bool, fused: bool = False) -> None:
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: weight 1, bias 0."""
        self.weight.fill_(1.0)
        if self.bias is not None:
            self.bias.zero_()

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
        if (
            not torch.is_grad_enabled()
            and x.dtype == self.weight.dtype == torch.float32
            and type(x) is torch.Tensor
            and x.device.type == "cpu"
        ):
            # inference in fp32 on the CPU: torch's rms_norm, one op for the seven below, the same numbers
            # (bit for bit on 300 random inputs, torch 2.13); a decode step's norm of one row costs ~25% less
            # (the seven in place from Python: no faster, 2026-12-06)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: weight 1."""
        self.weight.fill_(1.0)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm (model.norm=rmsnorm_unit_offset): x / rms(x) * (1 + weight), all in fp32 and then cast
    (Llama casts before the weight), the weight starting at 0; the files store that weight as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [..., d_model] times (1 + weight) (the fused kernel, given 1 + weight, where
        enabled)."""
        if self.fused and fused.usable(x, "norm"):
            return fused.rms_norm(x, 1.0 + self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: weight 0 (a scale of 1 + 0)."""
        self.weight.zero_()


# model.norm -> its module (the names are config.py's NORMS)
NORMS = {
    "layernorm": lambda dim, eps, bias, fused: LayerNorm(dim, eps, bias, fused),
    "rmsnorm": lambda dim, eps, bias, fused: RMSNorm(dim, eps, fused),
    "rmsnorm_unit_offset": lambda dim, eps, bias, fused: UnitOffsetRMSNorm(dim, eps, fused),
}


def make_norm(kind: str, dim: int, eps: float, bias: bool, fused: bool = False) -> nn.Module:
    """The norm of model.norm (NORMS) over `dim` features."""
    return NORMS[kind](dim, eps, bias, fused)


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


class GeGLUMLP(nn.Module):
    """Gemma MLP: down(gelu_tanh(gate(x)) * up(x)) (transformers' gelu_pytorch_tanh)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        """x [B, T, d_model] -> (down(gelu_tanh(gate(x)) * up(x)) [B, T, d_model], no LayerAux)."""
        gate, up = self.gate_proj(x), self.up_proj(x)  # [B, T, d_ff] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up), None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (the Hugging Face Llama layout).

    cos/sin tables are computed in fp32 for every position up to max_seq_len and kept as
    non-persistent buffers (they are a function of the config, not learned state). `scaling`
    (model.rope_scaling) rescales the frequencies first (gptkit/model/rope_scaling.py: llama3, linear,
    yarn, dynamic, longrope); a `dynamic` scaling computes its tables per forward once the sequence outgrows
    its original context (from the forward's last position, as transformers does per call). A `longrope`
    scaling (SWITCHED) keeps a second pair of tables, cos_long and sin_long, for sequences longer than its
    original context: a forward whose sequence reaches past it (its last position + 1 > original) rotates its
    queries and keys with those. Keys cached before are then stale (`restart`): as transformers' Phi-3
    generate, every decode path runs the whole sequence again. With [B, T] positions each row is its own
    sequence (a row of serve's slot cache: as that request alone).

    `head_dim` is the width it rotates: the first head_dim features of each head (model.rotary_dim, partial
    RoPE as Phi's), its frequencies those of that width; the features past it pass through unchanged.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, fused: bool = False, scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.fused = head_dim, max_seq_len, theta, fused
        self.scaling = scaling
        self.dynamic = scaling is not None and scaling["type"] in LENGTH_DEPENDENT
        # a longrope scaling's original context (None: one set of tables)
        self.switch_at = scaling["original_max_seq_len"] if scaling and scaling["type"] in SWITCHED else None
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if self.switch_at is not None:
            cos, sin = self._long_tables(None)
            self.register_buffer("cos_long", cos, persistent=False)
            self.register_buffer("sin_long", sin, persistent=False)

    def _long_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A switched scaling's (cos, sin) [max_seq_len, head_dim] for sequences past its original context."""
        return self._tables(device, self.switch_at + 1, self.max_seq_len)

    def _tables(
        self, device, seq_len: int | None = None, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [length, head_dim] fp32 for positions 0..length-1 (default: max_seq_len of them, or
        seq_len) of a sequence seq_len long (a `dynamic` or `longrope` scaling's frequencies depend on it)."""
        # In fp32, step by step as Meta's reference and transformers compute them: the angles the weights were
        # trained with (an fp64 angle differs from that fp32 one by up to an fp32 ulp of position * frequency)
        f32 = dict(dtype=torch.float32, device=device)
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device)  # [head_dim/2]
        exponents = steps.float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)  # [head_dim/2]
        factor = 1.0
        if self.scaling is not None:
            fn = ROPE_SCALINGS[self.scaling["type"]]
            inv_freq, factor = fn(inv_freq, self.scaling, self.head_dim, self.theta, seq_len)
        t = torch.arange(length or seq_len or self.max_seq_len, **f32)
        freqs = torch.outer(t, inv_freq)  # [length, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        if factor == 1.0:
            return emb.cos(), emb.sin()
        # YaRN's and LongRoPE's attention factor rides on cos and sin (as transformers applies it)
        return emb.cos() * factor, emb.sin() * factor

    def _apply(self, fn, recurse=True):
        """`model.to(torch.bfloat16)` would round the tables to bf16 and shift every position, and
        `to_empty` leaves them uninitialized: after any cast or move they are recomputed in fp32 on the
        new device (a function of the config, cheap next to the weights)."""
        super()._apply(fn, recurse)
        if not self.cos.is_meta:
            self.cos, self.sin = self._tables(self.cos.device)
            if self.switch_at is not None:
                self.cos_long, self.sin_long = self._long_tables(self.cos.device)
        return self

    def tables(self, positions: int | torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables for a forward of T tokens at `positions`: the stored ones, or, for a
        `dynamic` scaling past its original context, ones computed for this forward's length (its last
        position + 1; a tensor of positions is read on the host); a `longrope` scaling's long ones for an int
        position past its original context (tensor positions: _switched)."""
        if self.switch_at is not None and isinstance(positions, int) and positions + T > self.switch_at:
            return self.cos_long, self.sin_long
        if not self.dynamic:
            return self.cos, self.sin
        length = positions + T if isinstance(positions, int) else int(positions.max()) + 1
        if length <= self.scaling["original_max_seq_len"]:
            return self.cos, self.sin
        return self._tables(self.cos.device, length)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: int | torch.Tensor = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [B, H, T, D] and k [B, Hkv, T, D] for their positions: an int p (positions p..p+T-1),
        a [T] tensor (decoding with fixed shapes) or a [B, T] tensor (e.g. restarting at every packed
        document). With D > head_dim (partial RoPE) only the first head_dim features of each head turn
        (transformers' apply_rotary_pos_emb: cat(rotated q[..., :r], q[..., r:]))."""
        r = self.head_dim
        if q.shape[-1] == r:
            return self._rotate_all(q, k, positions)
        q_rot, k_rot = self._rotate_all(q[..., :r], k[..., :r], positions)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def rotate(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> torch.Tensor:
        """x [B, H, T, D] rotated for its positions as `forward` rotates q and k, never by the fused kernel:
        the queries and keys of one projection side by side (H = n_heads + n_kv_heads) in one pass (multi-head
        attention's: half the small ops of rotating them apart, the same numbers)."""
        r = self.head_dim
        cos, sin_signed = self._signed_angles(positions, x.shape[-2])
        if x.shape[-1] == r:
            return _rotate_signed(x, cos, sin_signed)
        return torch.cat((_rotate_signed(x[..., :r], cos, sin_signed), x[..., r:]), dim=-1)

    def forget(self) -> None:
        """A new forward begins: the angles remembered for the last one (_signed_angles) are dropped (its
        positions tensor may be one a caller since changed in place). GPT.forward calls it first."""
        if not torch.compiler.is_compiling():
            self.__dict__["_memo"] = None

    def _signed_angles(self, positions: int | torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """_angles' (cos, sin), sin's first half negated (_rotate_signed's), remembered within one forward
        (until `forget`): every layer rotates at the same positions, so a decode step looks them up once, not
        once a layer (two index ops and a negation a layer, ~6 us each in a CPU decode step). torch.compile
        traces the lookup instead."""
        tracing = torch.compiler.is_compiling()
        memo = self.__dict__.get("_memo")
        if not tracing and memo is not None and memo[0] is positions and memo[1] == T and memo[2] is self.cos:
            return memo[3]
        cos, sin = self._angles(positions, T)
        h = sin.shape[-1] // 2
        angles = (cos, torch.cat((-sin[..., :h], sin[..., h:]), dim=-1))
        if not tracing:
            # not a module attribute: no Module.__setattr__ per forward, nothing in the state dict
            self.__dict__["_memo"] = (positions, T, self.cos, angles)
        return angles

    def _rotate_all(
        self, q: torch.Tensor, k: torch.Tensor, positions: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated over their whole last dimension (head_dim wide)."""
        one_row = isinstance(positions, torch.Tensor) and positions.dim() == 1
        switched = self.switch_at is not None and isinstance(positions, torch.Tensor)
        if self.fused and not one_row and not switched and fused.usable(q, "rope"):
            cos_table, sin_table = self.tables(positions, q.shape[-2])
            return fused.rope(q, k, cos_table, sin_table, positions)
        cos, sin = self._angles(positions, q.shape[-2])
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _angles(self, positions: int | torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for T tokens at `positions`: [T, D] (an int, [T] positions) or [B, 1, T, D] ([B, T])."""
        if self.switch_at is not None and isinstance(positions, torch.Tensor):
            return self._switched(positions)
        cos_table, sin_table = self.tables(positions, T)
        if isinstance(positions, int):
            return cos_table[positions : positions + T], sin_table[positions : positions + T]  # [T, D]
        if positions.dim() == 1:
            return cos_table[positions], sin_table[positions]  # [T, D]
        return cos_table[positions][:, None], sin_table[positions][:, None]  # [B, 1, T, D]

    def restart(self, cached: int, length: int) -> bool:
        """Whether keys a cache holds, computed while its sequence was `cached` long, are stale for the
        sequence `length` long: a longrope scaling whose switch lies between the two (transformers' Phi-3
        generate recomputes every key when a sequence first outgrows the original context). A decode path
        then runs the whole sequence again (a prefill), as recomputing without a cache would."""
        if self.switch_at is None or cached <= 0:
            return False
        return (cached > self.switch_at) != (length > self.switch_at)

    def _switched(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A longrope scaling's (cos, sin) at tensor positions, [T] -> [T, D] or [B, T] -> [B, 1, T, D]: a row
        whose last position + 1 is past the original context reads the long tables, the others the short ones
        (chosen on the device: no host read, a compiled step or a CUDA graph replays it)."""
        long = (positions.amax(dim=-1, keepdim=True) >= self.switch_at)[..., None]  # [1, 1] or [B, 1, 1]
        cos = torch.where(long, self.cos_long[positions], self.cos[positions])  # [T, D] or [B, T, D]
        sin = torch.where(long, self.sin_long[positions], self.sin[positions])
        if positions.dim() == 2:
            return cos[:, None], sin[:, None]
        return cos, sin


def _rotate_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """_rotate with sin's first half negated beforehand: x * cos + cat(x2, x1) * sin_signed, the same numbers
    ((-a) * b and a * (-b) round alike), one op fewer."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin_signed).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
