"""Parameter counts equal the real models'; FLOPs equal what torch measures."""

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from gptkit import accounting as acc
from gptkit.config import conf_dir
from gptkit.model import GPT, ModelConfig


def preset(name: str, **kw) -> ModelConfig:
    d = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())
    d.update(kw)
    return ModelConfig.from_dict(d)


# published totals (HF model cards / the papers' reference implementations)
KNOWN = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_preset_counts_match_published_and_real_module(name):
    cfg = preset(name)
    assert acc.count_params(cfg).total == KNOWN[name]
    with torch.device("meta"):  # the real module, without allocating the weights
        model = GPT(cfg)
    assert model.num_parameters() == KNOWN[name]
    assert model.num_parameters(non_embedding=True) == acc.count_params(cfg).non_embedding


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_presets_count_their_real_modules(name):
    cfg = preset(name, vocab_size=65)
    assert acc.count_params(cfg).total == GPT(cfg).num_parameters()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forward_flops_equal_flop_counter(name):
    cfg = preset(name, vocab_size=65, attention="eager")  # eager: explicit matmuls for the scores
    model = GPT(cfg).eval()
    B, T = 2, cfg.max_seq_len
    idx = torch.randint(0, 65, (B, T))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(idx)
    measured = counter.get_total_flops()
    analytic = acc.flops_per_token(cfg, T).forward_dense * B * T
    assert measured == analytic


def test_training_flops_are_three_forwards_and_causal_halves_attention():
    cfg = preset("gpt2")
    f = acc.flops_per_token(cfg)
    assert f.train_dense == 3 * f.forward_dense
    assert f.forward_dense - f.forward_causal == f.attention_forward_dense / 2
    assert f.attention_forward_dense == 4 * 12 * 1024 * 768


def test_llama2_7b_worked_check_from_the_literature():
    cfg = preset("llama2-7b")
    n = acc.count_params(cfg).total
    flops = 6 * n * 2e12  # 2T tokens
    assert flops == pytest.approx(8.1e22, rel=0.01)
    hours = flops / (acc.peak_flops("a100", "bf16") * 0.40) / 3600
    assert hours == pytest.approx(180_000, rel=0.01)  # Meta reported 184,320 A100-hours


def test_kv_cache_bytes_shrink_with_gqa():
    mha, gqa = preset("llama2-7b"), preset("llama3-8b")
    assert acc.kv_cache_bytes_per_token(mha, "bf16") == 2 * 32 * 4096 * 2  # 512 KiB
    assert acc.kv_cache_bytes_per_token(gqa, "bf16") == 2 * 32 * 1024 * 2  # 4x smaller


def test_training_memory_mixed_precision_bytes_per_param():
    cfg = preset("llama2-7b")
    n = acc.count_params(cfg).total
    mem = acc.training_memory(cfg, "bf16-mixed")
    # fp32 master (4) + bf16 working copy (2) + fp32 grads (4) + AdamW m, v (8) = 18 bytes/param
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == 18 * n
    sharded = acc.training_memory(cfg, "bf16-mixed", n_shards=8)
    assert sharded["optimizer"] == mem["optimizer"] / 8
