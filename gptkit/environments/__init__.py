"""Environments shipped with gptkit for multi-turn GRPO (grpo.environment=<module>:<Class>): the contract
is gptkit/inference/environment.py's, docs/agentic.md."""
