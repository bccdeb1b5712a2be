"""`gptkit export` / `gptkit import` on bad input, as a user runs them: one-line errors, exit 2,
and `out` never half-written (nor left with temporary folders next to it)."""

import json

import torch
from conftest import char_tokenizer, one_line_error, random_gpt

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


def test_import_refuses_what_is_not_a_supported_model(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    one_line_error(cli("import", f"hf={tmp_path / 'empty'}", f"out={tmp_path / 'a'}"), "no config.json")
    (tmp_path / "phi3").mkdir()
    (tmp_path / "phi3" / "config.json").write_text(
        json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]})
    )
    one_line_error(
        cli("import", f"hf={tmp_path / 'phi3'}", f"out={tmp_path / 'a'}"),
        "phi3",
        "Phi3ForCausalLM",
        "Llama",
        "GPT-2",
    )
    only(tmp_path, "empty", "phi3")


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
