"""Nothing to copy: the commands of docs/chat.md, docs/dpo.md and docs/grpo.md run as written on the example
data `gptkit example-data` writes (shipped inside gptkit), with tiny sizes appended; a command that needs what
the pages cannot ship (an imported Hub model, the user's own run) or a bench is left out."""

import re
import shlex

import pytest
from conftest import REPO, run_main

from gptkit.data.example_data import EXAMPLES, example_file

# appended to each `gptkit train` line: the same command, a run small enough for a test
TINY = [
    "trainer.max_steps=2",
    "trainer.val_every=2",
    "trainer.val_windows=2",
    "trainer.checkpoint_every=2",
    "trainer.batch_size=2",
    "trainer.progress=off",
    "trainer.threads=1",
    "grpo.group_size=2",
    "grpo.max_new_tokens=4",
]
# what a test cannot have: a model from the Hub, the user's own runs, a placeholder (<run>, elided options:
# `gptkit train ... grpo.rewards=`), a benchmark, a precomputed frozen model (its `gptkit prepare ...
# reference=` first: tests/training/test_dpo.py runs those commands)
LEFT_OUT = re.compile(r"hf=|runs/qwen|runs/mine|<|gptkit train \.\.\.|gptkit bench|=precomputed")


def page_commands(page: str) -> list[list[str]]:
    """The `gptkit example-data` and `gptkit train` lines of a page's bash blocks, split as a shell does."""
    text = (REPO / "docs" / page).read_text()
    lines = [
        line.strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if line.startswith(("gptkit example-data", "gptkit train")) and not LEFT_OUT.search(line)
    ]
    return [shlex.split(line.split("  #")[0]) for line in dict.fromkeys(lines)]


@pytest.mark.parametrize(
    "page, uses",
    [
        ("chat.md", ["train.jsonl"]),
        ("dpo.md", ["train.jsonl", "pairs.jsonl", "completions.jsonl"]),
        ("grpo.md", ["train.jsonl", "prompts.jsonl"]),
    ],
)
def test_the_pages_commands_run_as_written_on_the_example_data(page, uses, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = page_commands(page)
    # the page writes the example data first, then trains on the files it names
    assert commands[0] == ["gptkit", "example-data"], commands
    trains = commands[1:]
    assert trains and all(c[:2] == ["gptkit", "train"] for c in trains)
    for name in uses:
        assert any(f"data.paths=[{name}]" in c for c in trains), (page, name)
    for i, cmd in enumerate(commands):
        args = cmd[1:] + (TINY if cmd[1] == "train" else [])
        # a command without name= takes <model>-<the second it starts>: two of them in one second would
        # name the same folder, which a user typing them never meets
        if cmd[1] == "train" and not any(a.startswith("name=") for a in cmd):
            args.append(f"name=page-{i}")
        code, _, err = run_main(capsys, *args)
        assert code == 0, (cmd, err[-3000:])
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == sorted(EXAMPLES)


def test_example_data_is_shipped_and_never_replaced_unasked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_main(capsys, "example-data", "out=data")
    assert code == 0 and out.split() == [f"data/{n}" for n in EXAMPLES]
    for name in EXAMPLES:
        assert (tmp_path / "data" / name).read_bytes() == example_file(name).read_bytes()
    (tmp_path / "data" / "pairs.jsonl").write_text("mine\n")
    code, _, err = run_main(capsys, "example-data", "out=data")
    assert code == 2 and err.startswith(
        "error: data/train.jsonl, data/prompts.jsonl, data/pairs.jsonl, data/completions.jsonl already"
    )
    assert (tmp_path / "data" / "pairs.jsonl").read_text() == "mine\n"
    code, _, _ = run_main(capsys, "example-data", "out=data", "force=true")
    assert (
        code == 0
        and (tmp_path / "data" / "pairs.jsonl").read_bytes() == example_file("pairs.jsonl").read_bytes()
    )
