"""Generated instruction sets with exactly checkable answers, for recipes and tests (experiment=sft-tiny).

string_tasks: "upper <word>" -> the word in capitals, "reverse <word>" -> the word backwards, for random
              lowercase words of 3-6 letters; the held-out prompts never occur in the training set.
preference_pairs: the same tasks as DPO pairs (experiment=dpo-tiny): chosen the right response, rejected
              an off-by-one corruption of it (one letter moved to the next).
char_match:   a reward function for GRPO on them (experiment=grpo-tiny): the share of the answer's characters
              that the completion has right, in place.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def string_task(rng: random.Random) -> dict[str, str]:
    """One prompt/response record."""
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    if rng.random() < 0.5:
        return {"prompt": f"upper {word}", "response": word.upper()}
    return {"prompt": f"reverse {word}", "response": word[::-1]}


def string_tasks(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records with distinct prompts."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_heldout:
        r = string_task(rng)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            rows.append(r)
    return rows[:n_train], rows[n_train:]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Write rows as JSON lines to path (its folder made if needed); returns path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def off_by_one(answer: str, rng: random.Random) -> str:
    """The answer with one letter moved to the next one of the alphabet (z -> a, case kept): a wrong answer
    that differs from the right one in a single character."""
    i = rng.randrange(len(answer))
    c = answer[i]
    nxt = LETTERS[(LETTERS.index(c.lower()) + 1) % len(LETTERS)]
    return answer[:i] + (nxt.upper() if c.isupper() else nxt) + answer[i + 1 :]


def preference_pairs(rows: list[dict], seed: int = 0) -> list[dict]:
    """Preference records of string tasks (experiment=dpo-tiny): chosen = the right response, rejected = an
    off_by_one corruption of it."""
    rng = random.Random(seed)
    return [
        {"prompt": r["prompt"], "chosen": r["response"], "rejected": off_by_one(r["response"], rng)}
        for r in rows
    ]


def char_match(prompt, completion: str, row: dict) -> float:
    """A reward of objective=grpo (grpo.rewards entry gptkit.data.tasks:char_match): the characters of the
    completion equal to the record's answer at the same place, over the longer of the two (1 only for the
    answer itself). Partial credit: a completion with one letter wrong still scores, where exact gives 0."""
    answer = str(row["answer"])
    completion = completion.strip()
    right = sum(a == b for a, b in zip(answer, completion))
    return right / max(len(answer), len(completion), 1)
