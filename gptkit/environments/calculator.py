"""A toy environment: a calculator whose tools the model calls to answer "37 * 48 = ?" (docs/agentic.md).

    grpo.environment=gptkit.environments.calculator:Calculator

Calculator    tools add(a, b) and multiply(a, b); score 1 when the model's final answer (its last message
              without calls) is the record's answer, else 0; turn_reward 0.1 for a turn whose call returned
              the answer (the right tool on the right numbers)
records       prompts {"prompt": "37 * 48 = ?", "answer": "1776"} of two-digit operands, and the same as
              SFT transcripts (the call, its result, the answer) in the tool contract's record shape
CHAT_JSON     a chatml template with tool syntax (<tool_call>{"name", "arguments"}</tool_call>, results in a
              `tool` turn), short enough for a byte tokenizer; written as a run's chat.json by `write_data`

Held-out prompts never occur in the training prompts or transcripts (write_data).
`python -m gptkit.environments.calculator <folder> [n_sft] [n_train] [n_heldout] [seed]` writes the files.
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
            "description": f"{verb} two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, verb in (("add", "Add"), ("multiply", "Multiply"))
]


class Calculator:
    """Two tools; the episode scores 1 when the final answer is the record's answer."""

    def __init__(self, record: dict) -> None:
        self.answer = str(record.get("answer", "")).strip()

    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return int(a) + int(b)

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        return int(a) * int(b)

    def turn_reward(self, turn: int, message: dict, results: list[str]) -> float:
        return 0.1 if any(r.strip() == self.answer for r in results) else 0.0

    def score(self, messages: list[dict]) -> float:
        last = messages[-1] if messages else {}
        final = last.get("role") == "assistant" and not last.get("tool_calls")
        return float(final and str(last.get("content", "")).strip() == self.answer)


def prompt(rng: random.Random) -> dict:
    op = rng.choice(sorted(OPS))
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    value = a + b if op == "+" else a * b
    return {"prompt": f"{a} {op} {b} = ?", "answer": str(value), "op": op, "a": a, "b": b}


def transcript(p: dict) -> dict:
    """The SFT record of a prompt solved with its tool."""
    call = {"name": OPS[p["op"]], "arguments": {"a": p["a"], "b": p["b"]}}
    return {
        "messages": [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0_0", "function": call}]},
            {"role": "tool", "tool_call_id": "call_0_0", "name": call["name"], "content": p["answer"]},
            {"role": "assistant", "content": p["answer"]},
        ],
        "tools": TOOLS,
    }


def records(n_sft: int, n_train: int, n_heldout: int, seed: int = 0) -> tuple[list, list, list]:
    """(SFT transcripts, GRPO training prompts, held-out prompts), all of distinct prompts."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_sft + n_train + n_heldout:
        p = prompt(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(p)
    plain = [{k: p[k] for k in ("prompt", "answer")} for p in rows]
    sft = [transcript(p) for p in rows[:n_sft]]
    return sft, plain[n_sft : n_sft + n_train], plain[n_sft + n_train :]


def write_data(folder: Path, n_sft: int, n_train: int, n_heldout: int, seed: int = 0) -> dict[str, Path]:
    """sft.jsonl, prompts.jsonl, heldout.jsonl and chat.json (the template) in folder."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, rows in zip(("sft", "prompts", "heldout"), records(n_sft, n_train, n_heldout, seed)):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out["chat"] = folder / "chat.json"
    out["chat"].write_text(json.dumps(CHAT_JSON, indent=2), encoding="utf-8")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        print("usage: python -m gptkit.environments.calculator <folder> [n_sft n_train n_heldout seed]")
        sys.exit(2)
    nums = [int(a) for a in args[1:]] + [2000, 400, 200, 0][len(args) - 1 :]
    for name, path in write_data(Path(args[0]), *nums).items():
        print(f"{name}: {path}")
