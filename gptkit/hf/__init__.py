"""Hugging Face `transformers` interop: a gptkit GPT to and from the transformers architectures.

    folders.py     Hugging Face folders: safetensors and tokenizer files, a local folder or a Hub model,
                   `gptkit import`, `init_from=hf:`
    peft.py        a LoRA run's adapters in PEFT's format
    convert.py     config.json and state dicts to and from a ModelConfig and a GPT, asking the family
    families.py    the table: FAMILIES, one row per transformers model_type
    llama.py, gemma.py, moe.py, gpt2.py, olmo3.py, smollm3.py, phi3.py, gpt_oss.py,
                   glm4_moe.py, deepseek_v3.py
                   the families, one file per family group (Llama, Qwen2, Qwen3, OLMo-2, Mistral; Gemma 2
                   and 3; Mixtral, Qwen3-MoE, OLMoE; GPT-2; OLMo 3; SmolLM3; Phi-3; gpt-oss;
                   GLM-4.5; DeepSeek-V3 and V2)
    decoder.py     the RoPE decoder layout the Llama-style families share
    rope.py        RoPE and its scalings in config.json
    mxfp4.py       MXFP4 blocks and scales read back (gpt-oss's experts)
    family.py      the interface every family implements, and the data all may read

Arrows point down that list (pyproject.toml's import-linter contract). See docs/hf.md. Names are resolved
lazily, as gptkit.model's: the family table (families.py) imports no torch, so `gptkit --help` lists the
families from it.
"""

from importlib import import_module

_EXPORTS = {
    "architecture": "gptkit.hf.convert",
    "architecture_class": "gptkit.hf.convert",
    "from_hf_state_dict": "gptkit.hf.convert",
    "from_transformers": "gptkit.hf.convert",
    "hf_config": "gptkit.hf.convert",
    "model_config_from_hf": "gptkit.hf.convert",
    "to_hf_state_dict": "gptkit.hf.convert",
    "to_transformers": "gptkit.hf.convert",
    "ARCHITECTURES": "gptkit.hf.families",
    "CONFIG_CLASSES": "gptkit.hf.families",
    "FAMILIES": "gptkit.hf.families",
    "family_of": "gptkit.hf.families",
    "peft_adapters": "gptkit.hf.peft",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gptkit.hf' has no attribute {name!r}")
