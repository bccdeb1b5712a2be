"""The front door cannot drift: the README's tour runs as written (with tiny sizes), in order, and
training runs from Python without Hydra's globals."""

import re
import shlex
from pathlib import Path

from conftest import REPO, run_main

# appended to the tour's `gptkit train` line: the same recipe, a model and a run small enough for a test
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "trainer.max_steps=4",
        "trainer.val_every=2", "trainer.val_windows=2", "trainer.checkpoint_every=2", "trainer.log_every=2",
        "trainer.progress=off", "trainer.threads=1"]


def readme_tour() -> list[list[str]]:
    """The commands of the README's tour block (the bash block under "## A tour"), split as a shell does."""
    text = (REPO / "README.md").read_text()
    section = text.split("## A tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the tour's paths (runs/...) are relative to where the user stands
    tour = readme_tour()
    assert [cmd[:2] for cmd in tour] == [["gptkit", "train"], ["gptkit", "sample"], ["gptkit", "eval"]]
    outputs = []
    for cmd in tour:
        args = cmd[1:] + (TINY if cmd[1] == "train" else ["threads=1"])
        code, out, err = run_main(capsys, *args)
        assert code == 0, f"{' '.join(cmd)}: {err}"
        outputs.append((out, err))
    run = tmp_path / "runs" / "shakespeare-char"
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").exists()
    assert "gptkit train -> " in outputs[0][1] and "done: step 4" in outputs[0][1]
    assert outputs[1][0].startswith("ROMEO:")  # the sample continues the prompt
    assert "perplexity" in outputs[2][0]


def test_train_runs_from_python_without_hydra(tmp_path):
    from hydra.core.hydra_config import HydraConfig

    import gptkit

    runs = tmp_path / "runs"
    result = gptkit.train(["model=gpt2-tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                           "model.max_seq_len=16", "data=shakespeare", "tokenizer=char",
                           "trainer.batch_size=2", "trainer.max_steps=2", "trainer.val_every=2",
                           "trainer.val_windows=1", "trainer.checkpoint_every=2", "trainer.progress=off",
                           "trainer.threads=1", f"runs_dir={runs}", "name=from-python"])
    assert not HydraConfig.initialized()
    assert result.run_dir == Path(runs / "from-python") and result.step == 2 and result.val_loss is not None
    assert (result.run_dir / "config.yaml").is_file() and result.last_checkpoint.exists()
