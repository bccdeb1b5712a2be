"""A toy environment: a calculator whose tools the model calls to answer "37 * 48 = ?" (docs/agentic.md).

    grpo.environment=gptkit.environments.calculator:Calculator

Calculator    tools add(a, b) and multiply(a, b); score 1 when the model's final answer (its last message
              without calls) is the record's answer, else half the share of its characters in place (0
              without a final answer); turn_reward 0.1 for a turn whose call returned the answer (the right
              tool on the right numbers). Success (docs/agentic.md) is a score of 1.
records       prompts {"prompt": "37 * 48 = ?", "answer": "1776"} of two-digit operands, and the same as
              SFT transcripts (the call, its result, the answer) in the tool contract's record shape
CHAT_JSON     a chatml template with tool syntax (<tool_call>{"name", "arguments"}</tool_call>, results in a
              `tool` turn), short enough for a byte tokenizer; written as a run's chat.json by `write_data`

Held-out prompts never occur in the training prompts or transcripts (write_data).
`python -m gptkit.environments.calculator <folder> [n_sft n_train n_heldout seed low high]` writes the files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\ntools:' }}{%- for t in tools %}{{ ' ' + t.function.name }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{ message.content + '\\n' }}{%- endif %}"
    "{%- for c in message.tool_calls %}{%- if c.function is defined %}{%- set c = c.function %}{%- endif %}"
    '{{ \'<tool_call>{"name": "\' + c.name + \'", "arguments": \' }}{{ c.arguments | tojson }}'
    "{{ '}</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_JSON = {"name": "chatml-tools", "template": TEMPLATE, "variables": {}, "special_tokens": SPECIAL_TOKENS}
OPS = {"+": "add", "*": "multiply"}
# the tools' specs as the environment's loader makes them from the methods (gptkit/inference/environment.py)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{verb} two integers (the question's when none are given).",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": [],
            },
        },
    }
    for name, verb in (("add", "Add"), ("multiply", "Multiply"))
]


class Calculator:
    """Two tools, on the question's operands unless given others; the episode scores 1 for the right final
    answer, 0.5 for a final answer after the right tool returned the answer, else 0."""

    def __init__(self, record: dict) -> None:
        self.answer = str(record.get("answer", "")).strip()
        self.operands = (record.get("a"), record.get("b"))
        self.solved = False

    def _pair(self, a, b) -> tuple[int, int]:
        return (int(a), int(b)) if a is not None and b is not None else tuple(map(int, self.operands))

    def add(self, a: int = None, b: int = None) -> int:
        """Add two integers (the question's when none are given)."""
        x, y = self._pair(a, b)
        return self._said(x + y)

    def multiply(self, a: int = None, b: int = None) -> int:
        """Multiply two integers (the question's when none are given)."""
        x, y = self._pair(a, b)
        return self._said(x * y)

    def _said(self, value: int) -> int:
        self.solved |= str(value) == self.answer
        return value

    def turn_reward(self, turn: int, message: dict, results: list[str]) -> float:
        return 0.1 if any(r.strip() == self.answer for r in results) else 0.0

    def score(self, messages: list[dict]) -> float:
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant" or last.get("tool_calls"):
            return 0.0
        if str(last.get("content", "")).strip() == self.answer:
            return 1.0
        return 0.5 if self.solved else 0.0


def prompt(rng: random.Random, low: int = 10, high: int = 99) -> dict:
    op = rng.choice(sorted(OPS))
    a, b = rng.randint(low, high), rng.randint(low, high)
    value = a + b if op == "+" else a * b
    return {"prompt": f"{a} {op} {b} = ?", "answer": str(value), "op": op, "a": a, "b": b}


def transcript(p: dict) -> dict:
    """The SFT record of a prompt solved with its tool."""
    # the question's operands: no arguments
    call = {"name": OPS[p["op"]], "arguments": {}}
    return {
        "messages": [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0_0", "function": call}]},
            {"role": "tool", "tool_call_id": "call_0_0", "name": call["name"], "content": p["answer"]},
            {"role": "assistant", "content": p["answer"]},
        ],
        "tools": TOOLS,
    }


def records(
    n_sft: int, n_train: int, n_heldout: int, seed: int = 0, low: int = 10, high: int = 99
) -> tuple[list, list, list]:
    """(SFT transcripts, GRPO training prompts, held-out prompts), all of distinct prompts, operands in
    [low, high]."""
    if n_sft + n_train + n_heldout > 2 * (high - low + 1) ** 2:
        raise ValueError(f"operands in [{low}, {high}] make fewer prompts than {n_sft + n_train + n_heldout}")
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_sft + n_train + n_heldout:
        p = prompt(rng, low, high)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(p)
    plain = [{k: p[k] for k in ("prompt", "answer", "a", "b")} for p in rows]
    sft = [transcript(p) for p in rows[:n_sft]]
    return sft, plain[n_sft : n_sft + n_train], plain[n_sft + n_train :]


def write_data(
    folder: Path, n_sft: int, n_train: int, n_heldout: int, seed: int = 0, low: int = 10, high: int = 99
) -> dict[str, Path]:
    """sft.jsonl, prompts.jsonl, heldout.jsonl and chat.json (the template) in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    split = records(n_sft, n_train, n_heldout, seed, low, high)
    for name, rows in zip(("sft", "prompts", "heldout"), split):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out["chat"] = folder / "chat.json"
    out["chat"].write_text(json.dumps(CHAT_JSON, indent=2), encoding="utf-8")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        print(
            "usage: python -m gptkit.environments.calculator <folder> [n_sft n_train n_heldout seed low high]"
        )
        sys.exit(2)
    nums = [int(a) for a in args[1:]] + [2000, 400, 200, 0, 10, 99][len(args) - 1 :]
    for name, path in write_data(Path(args[0]), *nums).items():
        print(f"{name}: {path}")
