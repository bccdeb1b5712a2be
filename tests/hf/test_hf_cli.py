"""`gptkit export` / `gptkit import` on bad input, as a user runs them: one-line errors, exit 2,
and `out` never half-written (nor left with temporary folders next to it)."""

import json

import pytest
import torch
from conftest import char_tokenizer, one_line_error, random_gpt

from gptkit.errors import GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.runs import write_run_folder


def only(parent, *names):
    """The folder holds exactly these entries (no temporary leftovers)."""
    assert sorted(p.name for p in parent.iterdir()) == sorted(names)


def test_export_refuses_a_model_transformers_cannot_hold(tmp_path, cli):
    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=16,
        n_layers=1,
        n_heads=4,
        d_model=32,
        position="rope",
        mlp="gelu",
        norm="layernorm",
    )
    write_run_folder(tmp_path / "run", {}, GPT(cfg), char_tokenizer())
    r = cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}")
    one_line_error(r, "model.mlp=gelu", "Llama", "swiglu")
    only(tmp_path, "run")


def test_export_refuses_a_non_empty_out_and_force_replaces_it(tmp_path, cli):
    # and no tokenizer.json
    write_run_folder(tmp_path / "run", {}, random_gpt("gpt2-tied"), None)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    one_line_error(
        cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}"), "not empty", "force=true"
    )
    only(tmp_path / "hf", "keep.txt")

    r = cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}", "force=true")
    assert r.returncode == 0, r.stderr
    # the model is still exported, and the gap is named
    assert "tokenizer.json is missing" in r.stderr
    only(tmp_path / "hf", "config.json", "generation_config.json", "model.safetensors")
    only(tmp_path, "run", "hf")


@pytest.mark.parametrize(
    "kw, note", [(dict(position="rope", mlp="swiglu", norm="rmsnorm"), True), ({}, False)]
)
def test_export_notes_model_dropout_where_the_family_has_attention_dropout_only(tmp_path, cli, kw, note):
    """The family says it (Family.attention_dropout_only): Llama's model has dropout in attention only, so
    model.dropout > 0 is noted; GPT-2's has residual and embedding dropout too, so nothing is said."""
    cfg = ModelConfig(vocab_size=40, max_seq_len=16, n_layers=1, n_heads=4, d_model=32, dropout=0.1, **kw)
    write_run_folder(tmp_path / "run", {}, GPT(cfg), char_tokenizer())
    r = cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}")
    assert r.returncode == 0, r.stderr
    said = "note: LlamaForCausalLM has attention dropout only, so model.dropout=0.1 applies there"
    assert (said in r.stderr) is note and ("attention dropout only" in r.stderr) is note


def test_import_refuses_what_is_not_a_supported_model(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    one_line_error(cli("import", f"hf={tmp_path / 'empty'}", f"out={tmp_path / 'a'}"), "no config.json")
    (tmp_path / "phi").mkdir()
    (tmp_path / "phi" / "config.json").write_text(
        json.dumps({"model_type": "phi", "architectures": ["PhiForCausalLM"]})
    )
    one_line_error(
        cli("import", f"hf={tmp_path / 'phi'}", f"out={tmp_path / 'a'}"),
        "phi",
        "PhiForCausalLM",
        "Llama",
        "GPT-2",
        "Phi-3",
    )
    only(tmp_path, "empty", "phi")


def test_import_refuses_weights_that_contradict_the_config_or_run_code(tmp_path, cli):
    from conftest import hf_llama

    hf_llama(tie=False, bias=False).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # the tensors say 56
    config["intermediate_size"] = 64
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    one_line_error(
        cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}"),
        "contradicts its config.json",
        "mlp.gate_proj.weight",
        "(56, 32)",
        "(64, 32)",
    )

    # only a pickle that would run code on load
    (tmp_path / "hf" / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1), "evil": Exploit()}, tmp_path / "hf" / "pytorch_model.bin")
    r = cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}")
    one_line_error(r, "pytorch_model.bin could not be loaded safely", "weights_only")
    assert "this must never run" not in r.stdout
    only(tmp_path, "hf")


class Exploit:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_import_refuses_a_tokenizer_larger_than_the_model_s_vocabulary(tmp_path, cli):
    from conftest import big_vocab_tokenizer, hf_llama

    # 40 embedding rows; a tokenizer of 100 would give ids the model has no row for
    hf_llama(tie=False, bias=False).save_pretrained(tmp_path / "hf")
    big_vocab_tokenizer(tmp_path / "hf" / "tokenizer.json", n=100)
    one_line_error(
        cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}"),
        f"{tmp_path / 'hf' / 'tokenizer.json'} has 100 tokens but the model has 40",
        "config.json",
    )
    only(tmp_path, "hf")


def _hf_folder(path, changes, drop=()):
    """A tiny transformers Llama folder whose config.json has `changes` applied (and `drop` removed)."""
    from conftest import hf_llama

    hf_llama(tie=False, bias=False).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for k in drop:
        config.pop(k)
    (path / "config.json").write_text(json.dumps(config))
    return path


# (config.json changes, fields dropped, what the one line says)
BAD_CONFIGS = {
    "no heads, no head_dim": (
        {"num_attention_heads": 0},
        ["head_dim"],
        ["num_attention_heads=0", "positive"],
    ),
    "a float": ({"num_hidden_layers": 1e9}, [], ["num_hidden_layers=1000000000.0", "positive integer"]),
    "a bool": ({"hidden_size": True}, [], ["hidden_size=True", "positive integer"]),
    "a string": ({"vocab_size": "40"}, [], ["vocab_size='40'", "positive integer"]),
    "negative": ({"intermediate_size": -5}, [], ["intermediate_size=-5", "positive integer"]),
    "kv heads 0": ({"num_key_value_heads": 0}, [], ["num_key_value_heads=0", "positive integer"]),
    "kv heads not dividing": (
        {"num_key_value_heads": 3},
        [],
        ["num_attention_heads=4", "num_key_value_heads=3"],
    ),
    "hidden not dividing": ({"hidden_size": 30}, ["head_dim"], ["hidden_size=30", "num_attention_heads=4"]),
    "1e9 layers": (
        {"num_hidden_layers": 10**9},
        [],
        ["num_hidden_layers=1,000,000,000", "the weights hold 2 layers", "model.layers.0 .. model.layers.1"],
    ),
    "layers": ({"num_hidden_layers": 3}, [], ["num_hidden_layers=3", "the weights hold 2 layers"]),
    "hidden size": ({"hidden_size": 64}, [], ["hidden_size=64", "the weights hold 32", "(40, 32)"]),
    "vocab": ({"vocab_size": 10**9}, [], ["vocab_size=1,000,000,000", "the weights hold 40 tokens"]),
    "heads": (
        {"num_attention_heads": 8},
        [],
        ["num_attention_heads=8 x head_dim=8 = 64", "q_proj", "(32, 32)"],
    ),
    "kv heads": (
        {"num_key_value_heads": 4},
        [],
        ["num_key_value_heads=4 x head_dim=8 = 32", "k_proj", "(16, 32)"],
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_import_checks_config_numbers_and_sizes_against_the_weights_headers(tmp_path, monkeypatch, case):
    from gptkit.hf import folders

    changes, drop, needles = BAD_CONFIGS[case]
    src = folders.Source(_hf_folder(tmp_path / "hf", changes, drop), "hf", str(tmp_path / "hf"))

    # refused before a tensor is read or a model built (the headers alone)
    def never(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(folders, "load_weights", never)
    with pytest.raises(GptkitError) as err:
        folders.import_folder(src, tmp_path / "run")
    line = str(err.value)
    assert "\n" not in line
    for n in needles:
        assert n in line, (n, line)
    only(tmp_path, "hf")


def test_import_of_a_config_with_no_heads_or_a_billion_layers_is_one_line(tmp_path, capsys):
    from conftest import run_main

    _hf_folder(tmp_path / "heads", {"num_attention_heads": 0}, ["head_dim"])
    _hf_folder(tmp_path / "layers", {"num_hidden_layers": 10**9})
    for name, needle in (("heads", "num_attention_heads=0"), ("layers", "num_hidden_layers=1,000,000,000")):
        code, _, err = run_main(capsys, "import", f"hf={tmp_path / name}", f"out={tmp_path / 'run'}")
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
    only(tmp_path, "heads", "layers")
