"""Hugging Face interop: gptkit <-> transformers give the same logits, generations and tensors.

Everything is built here with random weights (no download): gptkit models exported and loaded by
`transformers`, and `transformers` models saved with save_pretrained and imported by gptkit.
"""

import json

import pytest
import torch
from conftest import HF_EOS as EOS
from conftest import HF_TEXT as TEXT
from conftest import HF_VARIANTS as VARIANTS
from conftest import char_tokenizer, gptkit_greedy, hf_gpt2, hf_llama, random_gpt

from gptkit import hf
from gptkit.cli import main as gptkit_main
from gptkit.errors import GptkitError
from gptkit.model import GPT, ModelConfig
from gptkit.runs import load_model, load_run, write_run_folder

transformers = pytest.importorskip("transformers")


def cli(*args: str) -> int:
    return gptkit_main(list(args))


# ---- in memory -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_to_transformers_same_logits_and_back_exactly(variant):
    model = random_gpt(variant)
    hf_model = hf.to_transformers(model)
    want = "LlamaForCausalLM" if variant.startswith("llama") else "GPT2LMHeadModel"
    assert type(hf_model).__name__ == want
    assert not hf_model.training and next(hf_model.parameters()).dtype == torch.float32
    idx = torch.randint(0, 40, (2, 48))  # [B, T]: the whole context, so every position is checked
    with torch.no_grad():
        diff = (model(idx).logits - hf_model(idx).logits).abs().max().item()
    assert diff <= 1e-4
    back = hf.from_transformers(hf_model)
    assert back.cfg == model.cfg
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert (back.lm_head.weight is back.tok_emb.weight) == model.cfg.tie_embeddings


@pytest.mark.parametrize(
    "kw, named",
    [
        (dict(position="rope", mlp="gelu", norm="rmsnorm"), "model.mlp=gelu"),
        (dict(position="rope", mlp="swiglu", norm="layernorm"), "model.norm=layernorm"),
        (dict(position="learned", mlp="gelu", norm="layernorm", n_kv_heads=2), "model.n_kv_heads=2"),
        (dict(position="learned", mlp="gelu", norm="layernorm", bias=False), "model.bias=False"),
        (dict(position="learned", mlp="swiglu", norm="rmsnorm"), "model.mlp=swiglu"),
    ],
)
def test_unmappable_variant_is_refused_by_name(kw, named):
    cfg = ModelConfig(vocab_size=40, max_seq_len=16, n_layers=1, n_heads=4, d_model=32, **kw)
    with pytest.raises(GptkitError, match=named.replace(".", r"\.")):
        hf.hf_config(cfg)


# ---- export: gptkit run folder -> transformers folder ------------------------------------------
@pytest.mark.parametrize("variant", ["llama-gqa-untied", "llama-mha-tied-bias", "gpt2-tied", "gpt2-untied"])
def test_export_loads_with_auto_classes_same_logits_and_generations(tmp_path, variant):
    tok = char_tokenizer()
    model = random_gpt(variant, vocab_size=tok.get_vocab_size())
    write_run_folder(tmp_path / "run", {"tokenizer": {"eos_token": EOS}}, model, tok)
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}") == 0

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    eos = tok.token_to_id(EOS)
    assert hf_tok.eos_token == EOS and hf_model.generation_config.eos_token_id == eos
    ids = hf_tok(TEXT, return_tensors="pt").input_ids  # [1, T]
    assert ids[0].tolist() == tok.encode(TEXT).ids
    with torch.no_grad():
        assert (model(ids).logits - hf_model(ids).logits).abs().max().item() <= 1e-4
        generated = hf_model.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    assert generated == gptkit_greedy(model, ids, 6, eos)


def test_export_shards_large_weights_and_transformers_reads_the_index(tmp_path):
    model = random_gpt("llama-gqa-untied")
    write_run_folder(tmp_path / "run", {}, model, char_tokenizer())
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}", "max_shard_size=8KB") == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "hf" / "model.safetensors").exists()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    idx = torch.randint(0, 40, (1, 20))
    with torch.no_grad():
        assert (model(idx).logits - hf_model(idx).logits).abs().max().item() <= 1e-4


def test_export_then_import_reproduces_the_weights_exactly(tmp_path):
    model = random_gpt("llama-gqa-untied")
    write_run_folder(tmp_path / "run", {}, model, char_tokenizer())
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}") == 0
    assert cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'back'}") == 0
    back = load_run(tmp_path / "back")
    assert back.model_cfg == model.cfg
    for k, v in model.state_dict().items():
        assert torch.equal(back.model.state_dict()[k], v), k
    assert back.tokenizer.encode(TEXT).ids == char_tokenizer().encode(TEXT).ids


def test_export_in_bf16_writes_bf16_tensors(tmp_path):
    from safetensors.torch import load_file

    model = random_gpt("gpt2-tied")
    write_run_folder(tmp_path / "run", {}, model, char_tokenizer())
    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'hf'}", "dtype=bf16") == 0
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert torch.equal(tensors["transformer.wte.weight"], model.tok_emb.weight.detach().bfloat16())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


# ---- import: transformers folder -> gptkit run folder ------------------------------------------
def randomize(hf_model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return hf_model.eval()


@pytest.mark.parametrize(
    "make",
    [
        lambda: hf_llama(tie=False, bias=False),
        lambda: hf_llama(tie=True, bias=True),
        lambda: hf_gpt2(tie=True),
        lambda: hf_gpt2(tie=False),
    ],
    ids=["llama-gqa-untied", "llama-gqa-tied-bias", "gpt2-tied", "gpt2-untied"],
)
def test_import_same_logits_and_export_reproduces_the_files_tensors(tmp_path, make):
    from safetensors.torch import load_file

    hf_model = randomize(make())
    hf_model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(char_tokenizer().to_str())
    assert cli("import", f"hf={tmp_path / 'hf'}", f"out={tmp_path / 'run'}") == 0

    run = load_run(tmp_path / "run")
    idx = torch.randint(0, 40, (2, 48))  # [B, T]
    with torch.no_grad():
        assert (run.model(idx).logits - hf_model(idx).logits).abs().max().item() <= 1e-4
    assert run.tokenizer.encode(TEXT).ids == char_tokenizer().encode(TEXT).ids

    assert cli("export", f"run={tmp_path / 'run'}", f"out={tmp_path / 'again'}") == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(original)
    for k, v in original.items():
        assert torch.equal(again[k], v), k


def test_import_sharded_and_pytorch_bin_folders(tmp_path):
    hf_model = randomize(hf_llama(tie=False, bias=False))
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(hf_model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    for src in ("sharded", "bin"):
        assert cli("import", f"hf={tmp_path / src}", f"out={tmp_path / ('run-' + src)}") == 0
        _, _, _, cfg, model = load_model(tmp_path / ("run-" + src))
        for k, v in hf.from_hf_state_dict(hf_model.state_dict(), cfg).items():
            assert torch.equal(model.state_dict()[k], v), (src, k)


def test_import_maps_the_config_fields(tmp_path):
    cfg = hf.model_config_from_hf(hf_llama(tie=False, bias=True).config.to_dict())
    assert (cfg.position, cfg.mlp, cfg.norm, cfg.bias, cfg.tie_embeddings) == (
        "rope",
        "swiglu",
        "rmsnorm",
        True,
        False,
    )
    assert (
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.rope_theta,
        cfg.norm_eps,
        cfg.max_seq_len,
    ) == (4, 2, 8, 56, 1000.0, 1e-6, 48)
    cfg = hf.model_config_from_hf(hf_gpt2(tie=True).config.to_dict())
    assert (cfg.position, cfg.mlp, cfg.norm, cfg.bias, cfg.tie_embeddings, cfg.d_ff) == (
        "learned",
        "gelu",
        "layernorm",
        True,
        True,
        128,
    )


def test_hub_style_gpt2_keys_without_prefix_and_with_mask_buffers():
    """The original gpt2 checkpoints hold GPT2Model keys (no `transformer.`, no lm_head) plus attn.bias
    masks."""
    hf_model = randomize(hf_gpt2(tie=True))
    cfg = hf.model_config_from_hf(hf_model.config.to_dict())
    hub = {
        k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"
    }
    hub.update({f"h.{i}.attn.bias": torch.ones(1, 1, 48, 48) for i in range(2)})
    model = GPT.from_state(cfg, hf.from_hf_state_dict(hub, cfg))
    idx = torch.randint(0, 40, (1, 48))
    with torch.no_grad():
        assert (model(idx).logits - hf_model(idx).logits).abs().max().item() <= 1e-4
