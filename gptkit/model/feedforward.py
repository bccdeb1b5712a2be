"""The feed-forward seam: what a block's `mlp` is, one interface and a table of implementations.

    kind     module (file)                 ModelConfig.feed_forward(layer) chooses it
    gelu     GeluMLP (layers.py)           model.mlp=gelu (GPT-2)
    swiglu   SwiGLUMLP (layers.py)         model.mlp=swiglu (Llama and its kin)
    geglu    GeGLUMLP (layers.py)          model.mlp=geglu (Gemma: the tanh GELU for SiLU)
    moe      MoE (moe.py)                  model.moe set, in the layers it names (every, first_dense)

Every one is called the same way, `y, aux = mlp(x)`: x and y [B, T, d_model], aux a LayerAux (a loss term,
already weighted, and the layer's figures) or None. A dense MLP always returns None; an MoE layer returns its
balance and z-losses and its router figures in training, None in eval mode. GPT.forward sums the layers'
terms into one ModelAux on its output (GPTOutput.aux): the model stays a pure function of its inputs (no
state written during a forward, so torch.compile, activation checkpointing and FSDP see nothing new), and
whoever trains it decides what to do with the terms (gptkit/training/moe.py adds them to every objective's
loss). A new kind is a module with that forward and one row of FEED_FORWARDS.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from gptkit.model.config import ModelConfig
from gptkit.model.layers import GeGLUMLP, GeluMLP, LayerAux, SwiGLUMLP
from gptkit.model.moe import MoE


class ModelAux(NamedTuple):
    """The auxiliary outputs of one forward, over the layers that have any (in block order)."""

    # scalar: the sum of the layers' weighted loss terms (add it to the training loss)
    loss: torch.Tensor
    # each such layer's figures (LayerAux.stats)
    layers: tuple[Any, ...]


FEED_FORWARDS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "gelu": lambda cfg, layer: GeluMLP(cfg.d_model, cfg.d_ff, cfg.bias),
    "swiglu": lambda cfg, layer: SwiGLUMLP(
        cfg.d_model, cfg.d_ff, bias=cfg.bias, fused="swiglu" in cfg.kernels
    ),
    "geglu": lambda cfg, layer: GeGLUMLP(cfg.d_model, cfg.d_ff, bias=cfg.bias),
    "moe": MoE,
}


def make_feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward module of layer `layer` (ModelConfig.feed_forward names its kind)."""
    return FEED_FORWARDS[cfg.feed_forward(layer)](cfg, layer)


def combine(auxes: list[LayerAux]) -> ModelAux | None:
    """The layers' LayerAux of one forward as one ModelAux (None when no layer returned any)."""
    if not auxes:
        return None
    loss = auxes[0].loss
    for a in auxes[1:]:
        loss = loss + a.loss
    return ModelAux(loss, tuple(a.stats for a in auxes))
