"""The front door cannot drift: the README's tour runs as written (with tiny sizes), in order, and
training runs from Python without Hydra's globals."""

import re
import shlex
from pathlib import Path

import pytest
from conftest import HANG_S, REPO, run_main
from omegaconf import OmegaConf

# appended to the tour's `gptkit train` line: the same recipe, a model and a run small enough for a test
TINY = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "trainer.max_steps=4",
    "trainer.val_every=2",
    "trainer.val_windows=2",
    "trainer.checkpoint_every=2",
    "trainer.log_every=2",
    "trainer.progress=off",
    "trainer.threads=1",
]


def readme_tour() -> list[list[str]]:
    """The commands of the README's tour block (the bash block under "## A tour"), split as a shell does."""
    text = (REPO / "README.md").read_text()
    section = text.split("## A tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch, capsys):
    # the tour's paths (runs/...) are relative to where the user stands
    monkeypatch.chdir(tmp_path)
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
    # the sample continues the prompt
    assert outputs[1][0].startswith("ROMEO:")
    assert "perplexity" in outputs[2][0]


# a 2-step run from Python
PY_TINY = [
    "model=gpt2-tiny",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.max_seq_len=16",
    "data=shakespeare",
    "tokenizer=char",
    "trainer.batch_size=2",
    "trainer.max_steps=2",
    "trainer.val_every=2",
    "trainer.val_windows=1",
    "trainer.checkpoint_every=2",
    "trainer.progress=off",
    "trainer.threads=1",
]


def test_train_runs_from_python_without_hydra(tmp_path):
    from hydra.core.hydra_config import HydraConfig

    import gptkit

    runs = tmp_path / "runs"
    result = gptkit.train([*PY_TINY, f"runs_dir={runs}", "name=from-python"])
    assert not HydraConfig.initialized()
    assert result.run_dir == Path(runs / "from-python") and result.step == 2 and result.val_loss is not None
    assert (result.run_dir / "config.yaml").is_file() and result.last_checkpoint.exists()


def test_train_runs_a_plan_looked_at_first(tmp_path):
    """gptkit.plan resolves the run as `gptkit train` does (run folder, data, every fact once);
    gptkit.train(plan) runs exactly that plan."""
    import gptkit

    plan = gptkit.plan([*PY_TINY, f"runs_dir={tmp_path}", "name=planned"])
    assert (plan.max_steps, plan.seq_len, plan.tokens_per_step, plan.world_size) == (2, 16, 32, 1)
    # from the tokenizer
    assert plan.data is not None and plan.model.vocab_size == plan.data.vocab_size
    assert plan.run_dir == tmp_path / "planned" and not (plan.run_dir / "config.yaml").exists()
    with pytest.raises(TypeError, match="takes no other arguments"):
        gptkit.train(plan, run_dir=tmp_path / "elsewhere")
    result = gptkit.train(plan)
    assert result.run_dir == plan.run_dir and result.step == 2 and result.val_loss is not None
    saved = OmegaConf.load(result.run_dir / "config.yaml")
    assert saved.model.vocab_size == plan.model.vocab_size and saved.trainer.max_steps == 2


def test_train_runs_a_plan_made_without_data_or_folder(tmp_path):
    """A plan from make_plan alone (as preflight makes one: no data, no run folder): gptkit.train prepares
    the data for the plan's own model and trains in <runs_dir>/<name>; a tokenizer larger than the plan's
    vocabulary is one line, before the run folder gets any file."""
    import gptkit
    from gptkit.conf_tree import compose
    from gptkit.errors import GptkitError
    from gptkit.model import ModelConfig
    from gptkit.training.plan import make_plan

    def plan_of(name, *extra):
        cfg = compose("train", [*PY_TINY, f"runs_dir={tmp_path}", f"name={name}", *extra])
        return make_plan(cfg, None, ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True)))

    small = plan_of("small", "model.vocab_size=8")
    with pytest.raises(GptkitError, match="vocab"):
        gptkit.train(small)
    assert not (tmp_path / "small" / "config.yaml").exists()
    plan = plan_of("outside", "model.vocab_size=96")
    assert plan.data is None and plan.run_dir is None
    result = gptkit.train(plan)
    assert result.run_dir == tmp_path / "outside" and result.step == 2
    # the plan's model, kept
    assert OmegaConf.load(result.run_dir / "config.yaml").model.vocab_size == 96


@pytest.mark.long
def test_train_derives_each_fact_of_the_plan_once():
    """.ci/rederivations: one 2-step `gptkit train` derives the window, compile mode, precision, model
    config, devices, accelerator and options once each (issue 26: 2, 2, 3, 2, 3, 4, 3 before)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "rederivations"), "--check"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    counts = dict(line.rsplit(None, 1) for line in r.stdout.splitlines() if line.strip())
    assert counts["precision()"] == "1" and counts["parse_options"] == "1", counts
