"""Writes the small example data sets that docs/chat.md, docs/dpo.md and docs/grpo.md use as written
(gptkit/data/example_data.py): train.jsonl (conversations), prompts.jsonl (prompts with answers) and
pairs.jsonl (preference pairs), shipped inside gptkit.

Examples:
  gptkit example-data                  (into the current folder)
  gptkit example-data out=data/        (into data/, made if needed)
"""

from __future__ import annotations

import sys

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def run(cfg) -> int:
    from gptkit.data.example_data import EXAMPLES, write_examples

    for path in write_examples(str(cfg.out), bool(cfg.force)):
        print(f"  {path}: {EXAMPLES[path.name]}", file=sys.stderr)
        print(path)
    return 0
