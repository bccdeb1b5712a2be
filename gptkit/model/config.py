"""The model configuration: one dataclass whose fields switch the variants.

Presets are data (YAML under conf/model/); this file only knows the fields and their rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from gptkit.errors import ConfigError

POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
ATTENTIONS = ("eager", "sdpa", "triton")
KERNELS = ("norm", "swiglu", "rope", "loss")  # fused kernels model.kernels may switch on (gptkit/model/fused.py)


@dataclass
class ModelConfig:
    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: = n_heads (MHA); fewer: GQA; 1: MQA
    d_model: int = 768
    d_ff: int | None = None  # None: 4 * d_model (gelu) or the Llama rule (swiglu)
    head_dim: int | None = None  # None: d_model // n_heads
    position: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    mlp: str = "gelu"  # gelu | swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    bias: bool = True  # biases in the linear layers and LayerNorm
    tie_embeddings: bool = True
    dropout: float = 0.0
    attention: str = "sdpa"  # eager | sdpa | triton
    kernels: list[str] = field(default_factory=list)  # fused kernels to use, any of KERNELS; [] = eager torch
    position_reset: bool = False  # with packed documents (data.pack=documents): positions restart per document
    init_std: float = 0.02
    name: str = field(default="custom", compare=False)

    # ---- derived sizes -------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.d_model // self.n_heads
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model if self.mlp == "gelu" else swiglu_hidden(self.d_model)

    @property
    def d_attn(self) -> int:
        """Width of the concatenated query heads (n_heads * head_dim)."""
        return self.n_heads * self.head_dim

    @property
    def d_kv(self) -> int:
        """Width of the concatenated key (or value) heads (n_kv_heads * head_dim)."""
        return self.n_kv_heads * self.head_dim

    def validate(self) -> None:
        """Raise ConfigError (one line: the problem and the fix) for any invalid field."""
        for name in ("vocab_size", "max_seq_len", "n_layers", "n_heads", "d_model"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{name}={v!r} must be a positive integer")
        for name in ("n_kv_heads", "d_ff", "head_dim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"model.{name}={v!r} must be a positive integer (or null for the default)")
        for name, allowed in (("position", POSITIONS), ("mlp", MLPS), ("norm", NORMS), ("attention", ATTENTIONS)):
            v = getattr(self, name)
            if v not in allowed:
                raise ConfigError(f"model.{name}={v!r} is not one of {', '.join(allowed)}")
        if not isinstance(self.kernels, (list, tuple)) or any(k not in KERNELS for k in self.kernels):
            raise ConfigError(f"model.kernels={self.kernels!r} must be a list of {', '.join(KERNELS)} "
                              f"(e.g. model.kernels=[norm,loss]; [] for none)")
        self.kernels = list(dict.fromkeys(self.kernels))
        if not isinstance(self.position_reset, bool):
            raise ConfigError(f"model.position_reset={self.position_reset!r} must be true or false")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                f"choose d_model a multiple of n_heads (or set model.head_dim)"
            )
        n_kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.n_heads % n_kv:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={n_kv}; "
                f"n_kv_heads must divide n_heads (n_heads for MHA, 1 for MQA)"
            )
        hd = self.head_dim if self.head_dim is not None else self.d_model // self.n_heads
        if self.position == "rope" and hd % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {hd}; change model.d_model or model.n_heads")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not float(self.norm_eps) > 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be > 0")
        if not float(self.rope_theta) > 0:
            raise ConfigError(f"model.rope_theta={self.rope_theta} must be > 0")

    # ---- conversion ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """A ModelConfig from the `model` group (unknown keys are an error), validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(
                f"unknown model field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(names))}"
            )
        return cls(**{k: v for k, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        """The config as the plain dict a run folder's config.yaml holds."""
        return dataclasses.asdict(self)


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's rule for the SwiGLU width: 2/3 of 4*d_model, rounded up to a multiple."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
