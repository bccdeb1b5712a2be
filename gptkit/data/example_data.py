"""The small example data sets the docs' commands use as written (docs/chat.md, docs/dpo.md, docs/grpo.md),
shipped inside gptkit (gptkit/data/examples/, package data: they come with a pip install) and written into a
folder by `gptkit example-data [out=.]`:

    train.jsonl    1,000 chat records {"prompt", "response"}        data=chat (experiment=sft-tiny)
    prompts.jsonl    200 prompts with answers {"prompt", "answer"}   data=prompts (objective=grpo)
    pairs.jsonl      200 preference pairs {"prompt", "chosen", "rejected"}   data=preference (objective=dpo)
    completions.jsonl  400 labelled completions {"prompt", "completion", "label"}: each pair's chosen (true)
                     and rejected (false)                            data=unpaired (objective=kto)

They are gptkit/data/tasks.py's string tasks ("upper abc" -> "ABC", "reverse abc" -> "cba"; examples/README.md
says how they were made): the prompts and the pairs are other words than the chat records'.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from gptkit.errors import GptkitError

# file -> what it is (the order `gptkit example-data` writes and prints them in)
EXAMPLES = {
    "train.jsonl": "1,000 conversations (data=chat: experiment=sft-tiny, docs/chat.md)",
    "prompts.jsonl": "200 prompts with answers (data=prompts: objective=grpo, docs/grpo.md)",
    "pairs.jsonl": "200 preference pairs (data=preference: objective=dpo, docs/dpo.md)",
    "completions.jsonl": "400 labelled completions (data=unpaired: objective=kto, docs/dpo.md)",
}


def example_file(name: str) -> Path:
    """The shipped file `name` (one of EXAMPLES)."""
    return Path(str(resources.files("gptkit.data") / "examples" / name))


def write_examples(out: str | Path, force: bool = False) -> list[Path]:
    """Copy every example file into folder `out` (made if needed); a file there already is a one-line
    GptkitError (nothing written) unless force. Returns the files written."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise GptkitError(f"out={out} is a file; pass a folder (out=. writes into the current folder)")
    there = [out / n for n in EXAMPLES if (out / n).exists()]
    if there and not force:
        raise GptkitError(
            f"{', '.join(map(str, there))} already exist{'s' if len(there) == 1 else ''}; pass force=true to "
            "replace them or choose another out="
        )
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in EXAMPLES:
        src, dst = example_file(name), out / name
        tmp = dst.with_name(f".{name}.tmp")
        shutil.copyfile(src, tmp)
        tmp.replace(dst)
        written.append(dst)
    return written
