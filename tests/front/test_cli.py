"""The CLI as a user meets it: verbs, help, count-params, one-line errors."""

import json

import pytest


def test_help_lists_verbs(cli):
    r = cli("--help")
    assert r.returncode == 0
    assert "count-params" in r.stdout and "usage: gptkit <verb>" in r.stdout


def test_verb_help_shows_config_and_presets(cli):
    r = cli("count-params", "--help")
    assert r.returncode == 0
    assert "llama2-7b" in r.stdout and "n_layers:" in r.stdout


def test_count_params_llama2_7b_is_exact_and_builds_no_model(capsys, monkeypatch):
    """Analytic: no 7B model (nor any module or weight) is built, which is what keeps it instant."""
    import torch
    from conftest import run_main

    def built(*args, **kwargs):
        raise AssertionError("count-params built a torch module")

    monkeypatch.setattr(torch.nn.Module, "__init__", built)
    code, out, err = run_main(capsys, "count-params", "model=llama2-7b")
    assert code == 0, err
    assert "6,738,415,616" in out


def test_count_params_json(cli):
    r = cli("count-params", "model=gpt2", "format=json", "tokens=1e9", "gpu=h100")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["params"]["total"] == 124_439_808
    assert d["plan"]["tokens"] == 1e9
    assert d["plan"]["peak_flops_per_gpu"] == 989e12


def test_count_params_knows_muon_lora_and_the_dpo_reference(capsys):
    """optim's state, the trainable adapters and a reference of its own, as `train`'s estimate counts them."""
    from conftest import run_main

    code, out, err = run_main(capsys, "count-params", "model=llama-tiny", "precision=32-true", "format=json")
    base = json.loads(out)["plan"]["memory_per_gpu"]
    code, out, err = run_main(
        capsys,
        "count-params",
        "model=llama-tiny",
        "precision=32-true",
        "optimizer=muon",
        "objective=dpo",
        "format=json",
    )
    plan = json.loads(out)["plan"]
    mem = plan["memory_per_gpu"]
    assert code == 0 and mem["optimizer"] == base["optimizer"] - 4 * plan["muon_params"]
    assert mem["reference"] == mem["weights"] and mem["logits"] == 2 * base["logits"]
    code, out, err = run_main(
        capsys, "count-params", "model=llama-tiny", "finetune=lora", "lora.rank=2", "format=json"
    )
    plan = json.loads(out)["plan"]
    assert plan["memory_per_gpu"]["gradients"] == 4 * plan["trainable_params"] < base["gradients"] / 50
    code, _, err = run_main(capsys, "count-params", "model=gpt2-tiny", "optimizer=sgd")
    assert code == 2 and err.strip() == "error: optimizer='sgd' is not one of adamw, muon"


def test_override_a_field(cli):
    r = cli("count-params", "model=gpt2", "model.n_layers=2", "format=json")
    d = json.loads(r.stdout)
    assert d["model"]["n_layers"] == 2 and d["params"]["total"] < 124_439_808


@pytest.mark.parametrize(
    "args, needle",
    [
        (["model=nope"], "model=nope is not a preset"),
        (["model.n_heads=5"], "not divisible by model.n_heads=5"),
        (["model=llama-tiny", "model.n_kv_heads=3"], "n_kv_heads"),
        (["model.n_layers=0"], "positive integer"),
        (["model.position=alibi"], "model.position"),
        (["model=llama-tiny", "model.d_model=120", "model.n_heads=8"], "even head_dim"),
        (["no_such_key=1"], "no_such_key"),
        (["model.n_layers"], "n_layers"),
        (["gpu=tpu9"], "unknown gpu"),
    ],
)
def test_bad_input_is_one_line(cli, args, needle):
    r = cli("count-params", *args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_verb(cli):
    r = cli("frobnicate")
    assert r.returncode == 2 and "unknown verb" in r.stderr


def test_debug_shows_traceback(cli):
    r = cli("count-params", "model.n_heads=5", env={"GPTKIT_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_verb_help_lists_groups_that_are_unchosen_by_default(cli):
    groups = [line.strip() for line in cli("train", "--help").stdout.splitlines()]
    assert any(line.startswith("experiment: ") and "shakespeare-char" in line for line in groups)
    assert "data: chat, files, hub" in cli("eval", "--help").stdout


def test_the_verb_table_is_the_commands_folder():
    """cli.VERBS is the whole wiring: every command module has a verb, every verb a module with run()
    and a config in conf/."""
    import pkgutil

    import gptkit.commands
    from gptkit.cli import VERBS, command
    from gptkit.conf_tree import conf_dir

    modules = {m.name for m in pkgutil.iter_modules(gptkit.commands.__path__) if not m.name.startswith("_")}
    assert modules == {v.module for v in VERBS.values()}
    for verb, v in VERBS.items():
        assert callable(command(verb).run), verb
        assert (conf_dir() / f"{v.config}.yaml").is_file(), verb


@pytest.mark.parametrize(
    "args, message",
    [
        (["sample", "--run", "runs/x"], "options are key=value, not --run: did you mean run=runs/x?"),
        (["train", "--max_steps", "10"], "did you mean trainer.max_steps=10?"),
        (["eval", "--stride=8"], "did you mean stride=8?"),
    ],
)
def test_flags_are_one_line_naming_the_key_value_spelling(capsys, args, message):
    from gptkit.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
