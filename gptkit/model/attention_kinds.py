"""The attention seam: what a block's `attn` is, and what it keeps while decoding. One table of kinds.

    kind   module (file)                  cache layout per layer
    mha    MultiHeadAttention (mha.py)    K [n_kv_heads, head_dim] and V [n_kv_heads, head_dim] per position
                                          (a local layer's last W); GQA/MQA, windows, QK-norm, soft-capping
    mla    MultiHeadLatentAttention       one key of kv_lora_rank + qk_rope_head_dim per position (the
           (mla.py, model.mla)            latent and the rotated key; DeepSeek-V3: 512 + 64 = 576) and a
                                          value of width 0: the values are the key's first kv_lora_rank
                                          features (docs/mla.md); model.mla.absorb=false: K [n_heads,
                                          nope + rope] and V [n_heads, v_head_dim], expanded
    gdn    GatedDeltaNet                  no K/V: a state per sequence, the delta rule's
           (gated_deltanet.py, model.gdn) [n_value_heads, key_head_dim, value_head_dim] and the conv's last
                                          conv_kernel - 1 inputs [conv_dim, conv_kernel - 1], one flat vector
                                          (GDNConfig.state_shape; docs/linear-attention.md)

ModelConfig.attention_kind_of(layer) names a layer's kind (model.attention_kind, except the `linear` layers of
model.layer_types: gdn); `make_attention(cfg, layer)` builds its module and `cache_layout(cfg, layer)` says
what a decoding cache holds for it: a key and a value per position, each of its own heads and width
(multi-head latent attention: a key of its latent, a value of width 0), or a recurrent state of fixed shape
per sequence (linear attention: Gated DeltaNet) instead. Everything that sizes a cache reads this one
function: KVCache and StaticKVCache (gptkit/model/kv_cache.py, and through them generate, static decode and
rollouts), serve's SlotCache (gptkit/inference/slot_cache.py), and the accounting's KV figures
(count-params, decode roofline).

Every module is called the same way, `y, probs = attn(x, rope=, cache=, positions=, docs=, return_probs=)`
(x and y [B, T, d_model]; gptkit/model/mha.py documents it); a kind that keeps K/V writes them through
`cache.update(layer, k, v)`, a kind with a state reads and writes `cache.state(layer, like)` in place.

A new kind is its module file and one row of ATTENTION_KINDS: its module's import path and its layout; a kind
with projections of other shapes than multi-head attention's also teaches gptkit/accounting.py to count
them (tests/model/test_attention_kinds.py holds every row to its parameter count and its cache).
This file imports no torch: the accounting (count-params, config checks) reads layouts without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable, NamedTuple

# a gptkit.model.config.ModelConfig: config.py imports the kinds' names from here, so not the other way round
ModelConfig = Any


@dataclass(frozen=True)
class CacheLayout:
    """What a decoding cache keeps for one layer of one sequence.

    k, v    (heads, width) of the key and of the value cached per position, or None (a layer with a state);
            a value of width 0 caches nothing (multi-head latent attention reads its values from its key)
    window  None: every position is kept; W: at most the last W (a local layer's rolling cache)
    state   None, or the shape of the fixed-size state kept per sequence (a recurrent layer: no k, v)
    state_fp32  the state is kept in fp32 whatever the cache's dtype (a sum over every position so far: a
            bf16 state would round it again at each token; transformers keeps Qwen3-Next's in fp32 too)
    """

    k: tuple[int, int] | None
    v: tuple[int, int] | None
    window: int | None = None
    state: tuple[int, ...] | None = None
    state_fp32: bool = False

    def __post_init__(self) -> None:
        if (self.k is None) != (self.v is None) or (self.k is None) == (self.state is None):
            raise ValueError(f"a cache layout keeps k and v, or a state: {self}")

    @property
    def per_position(self) -> int:
        """Elements cached per position (k and v), 0 for a state."""
        return 0 if self.k is None else math.prod(self.k) + math.prod(self.v)

    @property
    def state_elements(self) -> int:
        """Elements of the per-sequence state (0 for a K/V layer)."""
        return 0 if self.state is None else math.prod(self.state)

    def positions(self, context: int) -> int:
        """How many positions this layer keeps of a sequence of `context` tokens (its window at most)."""
        return 0 if self.k is None else min(self.window or context, context)

    def elements(self, context: int) -> int:
        """Elements this layer keeps for one sequence of `context` tokens."""
        return self.positions(context) * self.per_position + self.state_elements

    def nbytes(self, context: int, dtype_bytes: int) -> int:
        """Bytes this layer keeps for one sequence of `context` tokens in a cache of `dtype_bytes` per element
        (an fp32 state at 4 bytes whatever the cache's dtype)."""
        state_bytes = 4 if self.state_fp32 else dtype_bytes
        return self.positions(context) * self.per_position * dtype_bytes + self.state_elements * state_bytes


class AttentionKind(NamedTuple):
    # "package.module:Class": the module, built as Class(cfg, layer) (imported on use: torch)
    module: str
    # (cfg, layer) -> the layer's CacheLayout
    layout: Callable[[ModelConfig, int], CacheLayout]


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "mha": AttentionKind(
        "gptkit.model.mha:MultiHeadAttention",
        lambda cfg, layer: CacheLayout(
            (cfg.n_kv_heads, cfg.head_dim), (cfg.n_kv_heads, cfg.head_dim), cfg.window(layer)
        ),
    ),
    "mla": AttentionKind(
        "gptkit.model.mla:MultiHeadLatentAttention",
        lambda cfg, layer: (
            CacheLayout((1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim), (1, 0), cfg.window(layer))
            if cfg.mla.absorb
            # model.mla.absorb=false: each head's expanded key and value (the uncompressed path)
            else CacheLayout(
                (cfg.n_heads, cfg.mla.qk_head_dim), (cfg.n_heads, cfg.mla.v_head_dim), cfg.window(layer)
            )
        ),
    ),
    "gdn": AttentionKind(
        "gptkit.model.gated_deltanet:GatedDeltaNet",
        lambda cfg, layer: CacheLayout(None, None, state=cfg.gdn.state_shape(), state_fp32=True),
    ),
}


def cache_layout(cfg: ModelConfig, layer: int) -> CacheLayout:
    """What a decoding cache keeps for layer `layer` (from 0)."""
    return ATTENTION_KINDS[cfg.attention_kind_of(layer)].layout(cfg, layer)


def cache_layouts(cfg: ModelConfig) -> list[CacheLayout]:
    """Every layer's cache layout, in order."""
    return [cache_layout(cfg, i) for i in range(cfg.n_layers)]


def attention_class(kind: str) -> type:
    """The module class of an attention kind (imports its file)."""
    path, name = ATTENTION_KINDS[kind].module.split(":")
    return getattr(import_module(path), name)


def make_attention(cfg: ModelConfig, layer: int):
    """The attention module of layer `layer` (ModelConfig.attention_kind_of names its kind)."""
    return attention_class(cfg.attention_kind_of(layer))(cfg, layer)
