"""gptkit: train decoder-only transformer language models (GPT-2 and Llama style)."""

__version__ = "0.1.0"
