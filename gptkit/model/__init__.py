"""The pure PyTorch model: `from gptkit.model import GPT, ModelConfig` needs no Lightning or Hydra.

Names are resolved lazily so that `gptkit.model.config` (used by the analytic accounting) can be
imported without importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "GPT": "gptkit.model.gpt",
    "GPTOutput": "gptkit.model.gpt",
    "ModelConfig": "gptkit.model.config",
    "KVCache": "gptkit.model.kv_cache",
    "StaticKVCache": "gptkit.model.kv_cache",
    "ATTENTION_BACKENDS": "gptkit.model.attention",
    "get_attention": "gptkit.model.attention",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gptkit.model' has no attribute {name!r}")
