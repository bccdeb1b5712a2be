"""The data wing: every data kind behind one face (gptkit/data/face.py), prepared by one call.

    from gptkit.data import prepare, TokenDataModule, check_vocab, check_scored, for_model

    prepared = prepare(cfg.data, cfg.tokenizer)     # any kind (the table in gptkit/data/kinds.py)
    datamodule = TokenDataModule(prepared, batch_size, seq_len, seed)

Every name is resolved on first use: a tokenization worker process imports gptkit.data.workers and
gptkit.data.tokenize, which import this package first, and must not pay for torch (imported by the
sampler's module, windows.py: 1.3 s of CPU per worker, a third of a 2-worker prepare of 60 MB on 2 cores).
"""

from importlib import import_module

_LAZY = {
    "prepare": "gptkit.data.kinds",
    "check_scored": "gptkit.data.kinds",
    "KINDS": "gptkit.data.kinds",
    "for_model": "gptkit.data.settings",
    "Prepared": "gptkit.data.face",
    "Feed": "gptkit.data.face",
    "check_vocab": "gptkit.data.face",
    "PreparedData": "gptkit.data.prepared",
    "load_prepared": "gptkit.data.prepared",
    "check_tokenizer": "gptkit.data.prepared",
    "MixedData": "gptkit.data.mixture",
    "TokenDataModule": "gptkit.data.datamodule",
    "WindowSampler": "gptkit.data.windows",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptkit.data' has no attribute {name!r}")
