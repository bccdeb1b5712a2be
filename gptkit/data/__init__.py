"""Corpora, tokenization into token shards, the manifest, the stateless sampler, the DataModule.

    from gptkit.data import prepare, PreparedData, MixedData, TokenDataModule, check_vocab

Every name is resolved on first use: a tokenization worker process imports gptkit.data.tokenize, which
imports this package first, and must not pay for torch (imported by the sampler's module, windows.py:
1.3 s of CPU per worker, which was a third of a 2-worker prepare of 60 MB on 2 cores).
"""

from importlib import import_module

_LAZY = {
    "prepare": "gptkit.data.mixture",
    "MixedData": "gptkit.data.mixture",
    "check_tokenizer": "gptkit.data.build",
    "PreparedData": "gptkit.data.prepared",
    "check_vocab": "gptkit.data.prepared",
    "load_prepared": "gptkit.data.prepared",
    "TokenDataModule": "gptkit.data.datamodule",
    "WindowSampler": "gptkit.data.windows",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptkit.data' has no attribute {name!r}")
