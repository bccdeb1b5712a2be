"""Corpora, tokenization into token shards, the manifest, the stateless sampler, the DataModule.

    from gptkit.data import prepare, PreparedData, MixedData, TokenDataModule, check_vocab

TokenDataModule (and WindowSampler) are resolved lazily: importing them imports Lightning/torch.
"""

from importlib import import_module

from gptkit.data.build import check_tokenizer
from gptkit.data.mixture import MixedData, prepare
from gptkit.data.prepared import PreparedData, check_vocab, load_prepared

_LAZY = {
    "TokenDataModule": "gptkit.data.datamodule",
    "WindowSampler": "gptkit.data.windows",
}

__all__ = ["prepare", "PreparedData", "MixedData", "check_vocab", "check_tokenizer", "load_prepared", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptkit.data' has no attribute {name!r}")
