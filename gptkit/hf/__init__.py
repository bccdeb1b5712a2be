"""Hugging Face `transformers` interop: a gptkit GPT to and from the transformers architectures.

    folders.py     Hugging Face folders: safetensors and tokenizer files, a local folder or a Hub model,
                   `gptkit import`, `init_from=hf:`
    peft.py        a LoRA run's adapters in PEFT's format
    convert.py     config.json and state dicts to and from a ModelConfig and a GPT, asking the family
    families.py    the table: FAMILIES, one row per transformers model_type
    llama.py, gemma.py, moe.py, gpt2.py
                   the families, one file per family group (Llama, Qwen2, Qwen3, OLMo-2, Mistral; Gemma 2
                   and 3; Mixtral, Qwen3-MoE, OLMoE; GPT-2)
    decoder.py     the RoPE decoder layout the Llama-style families share
    rope.py        RoPE and its scalings in config.json
    family.py      the interface every family implements, and the data all may read

Arrows point down that list (pyproject.toml's import-linter contract). See docs/hf.md.
"""

from gptkit.hf.convert import (
    architecture,
    from_hf_state_dict,
    from_transformers,
    hf_config,
    model_config_from_hf,
    to_hf_state_dict,
    to_transformers,
)
from gptkit.hf.families import ARCHITECTURES, CONFIG_CLASSES, FAMILIES, family_of
from gptkit.hf.peft import peft_adapters

__all__ = [
    "ARCHITECTURES",
    "CONFIG_CLASSES",
    "FAMILIES",
    "architecture",
    "family_of",
    "from_hf_state_dict",
    "from_transformers",
    "hf_config",
    "model_config_from_hf",
    "peft_adapters",
    "to_hf_state_dict",
    "to_transformers",
]
