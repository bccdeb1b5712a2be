"""Parameter counts equal the real models'; FLOPs equal what torch measures."""

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from gptkit import accounting as acc
from gptkit.conf_tree import conf_dir
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
    # the real module, without allocating the weights
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_parameters() == KNOWN[name]
    assert model.num_parameters(non_embedding=True) == acc.count_params(cfg).non_embedding


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_presets_count_their_real_modules(name):
    cfg = preset(name, vocab_size=65)
    assert acc.count_params(cfg).total == GPT(cfg).num_parameters()


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_forward_flops_equal_flop_counter(name):
    # eager: explicit matmuls for the scores
    cfg = preset(name, vocab_size=65, attention="eager")
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
    # 2T tokens
    flops = 6 * n * 2e12
    assert flops == pytest.approx(8.1e22, rel=0.01)
    hours = flops / (acc.peak_flops("a100", "bf16") * 0.40) / 3600
    # Meta reported 184,320 A100-hours
    assert hours == pytest.approx(180_000, rel=0.01)


def test_kv_cache_bytes_shrink_with_gqa():
    mha, gqa = preset("llama2-7b"), preset("llama3-8b")
    # 512 KiB
    assert acc.kv_cache_bytes_per_token(mha, "bf16") == 2 * 32 * 4096 * 2
    # 4x smaller
    assert acc.kv_cache_bytes_per_token(gqa, "bf16") == 2 * 32 * 1024 * 2


def test_training_memory_mixed_precision_bytes_per_param():
    cfg = preset("llama2-7b")
    n = acc.count_params(cfg).total
    mem = acc.training_memory(cfg, "bf16-mixed")
    # fp32 master (4) + bf16 working copy (2) + fp32 grads (4) + AdamW m, v (8) = 18 bytes/param
    assert mem["weights"] + mem["gradients"] + mem["optimizer"] == 18 * n
    sharded = acc.training_memory(cfg, "bf16-mixed", n_shards=8)
    assert sharded["optimizer"] == mem["optimizer"] / 8


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "moe-tiny", "qwen2.5-0.5b"])
def test_muon_params_are_the_weights_muon_steps_and_the_estimate_counts_its_one_buffer(name):
    """optim=muon's share (the block matrices: muon_split on the real module, biases and QK-norms of each
    family aside) keeps one momentum buffer, AdamW's two moments the rest; finetune=lora trains the adapters
    alone (all Muon's under optim=muon); a DPO reference of its own is a copy of the weights."""
    from gptkit.adapters import adapter_params
    from gptkit.training.optim import muon_split

    cfg = preset(name)
    with torch.device("meta"):
        muon, _ = muon_split(GPT(cfg))
    m, n = acc.muon_params(cfg), acc.count_params(cfg).total
    assert m == sum(p.numel() for _, p in muon)
    assert acc.training_memory(cfg, "32-true", optimizer="muon")["optimizer"] == 4 * m + 8 * (n - m)
    assert acc.training_memory(cfg, "32-true")["optimizer"] == 8 * n
    lora = {"rank": 4, "targets": ["q", "v"]}
    k = adapter_params(cfg, lora["targets"], 4)
    mem = acc.training_memory(cfg, "32-true", optimizer="muon", lora=lora, frozen=("reference",))
    assert (mem["weights"], mem["gradients"], mem["optimizer"]) == (4 * (n + k), 4 * k, 4 * k)
    assert "reference" not in mem
    full = acc.training_memory(cfg, "bf16-mixed", frozen=("reference", "teacher"))
    assert full["reference"] == full["teacher"] == full["weights"] == 6 * n


# ---- MFU by the published convention ---------------------------------------------------------------------
# The two formulas below are written as their projects publish them, with their own N:
#   nanoGPT model.py, GPT.estimate_mfu: N = get_num_params() (non_embedding=True: all parameters but the
#     position embedding; the tied token embedding is the LM head), flops_per_token = 6*N + 12*L*H*Q*T with
#     Q = n_embd // n_head and T = block_size, and MFU = flops_per_token * T * fwdbwd_per_iter / dt / 312e12.
#   torchtitan get_num_flop_per_token(num_params, model_config, seq_len) = 6*num_params + 12*l*h*q*t with
#     num_params = get_num_params(model, exclude_embedding=True): all parameters but tok_embeddings
#     ("we follow the convention and do not account for sparsity in causal attention").
def nanogpt_estimate_mfu(cfg: ModelConfig, fwdbwd_per_iter: int, dt: float) -> float:
    N = acc.count_params(cfg).total - acc.count_params(cfg).pos_emb
    L, H, Q, T = cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.max_seq_len
    flops_per_token = 6 * N + 12 * L * H * Q * T
    flops_per_fwdbwd = flops_per_token * T
    flops_per_iter = flops_per_fwdbwd * fwdbwd_per_iter
    flops_achieved = flops_per_iter * (1.0 / dt)
    # A100 bf16
    flops_promised = 312e12
    return flops_achieved / flops_promised


def torchtitan_flop_per_token(cfg: ModelConfig, seq_len: int) -> int:
    # exclude_embedding=True
    num_params = acc.count_params(cfg).total - acc.count_params(cfg).tok_emb
    l, h, q, t = cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads, seq_len  # noqa: E741
    return 6 * num_params + 12 * l * h * q * t


def elementwise_params(cfg: ModelConfig) -> int:
    """Norm weights and biases: in nanoGPT's and torchtitan's N, not in gptkit's matmul N."""
    c = acc.count_params(cfg)
    return c.total - c.tok_emb - c.pos_emb - acc.matmul_params(cfg) + (c.tok_emb if cfg.tie_embeddings else 0)


def test_mfu_equals_nanogpt_estimate_mfu_on_gpt2_124m():
    cfg = preset("gpt2")
    f = acc.flops_per_token(cfg)
    # 2 LayerNorms (weight, bias); q/k/v, o, MLP biases
    per_layer = 2 * 2 * 768 + 3 * 768 + 768 + 3072 + 768
    assert elementwise_params(cfg) == 12 * per_layer + 2 * 768 == 121_344
    # one iteration: 16 sequences of 1024 tokens in 0.25 s
    B, dt = 16, 0.25
    tokens_per_s = B * cfg.max_seq_len / dt
    ours = acc.mfu(tokens_per_s, f.train_dense, acc.peak_flops("a100", "bf16"))
    theirs = nanogpt_estimate_mfu(cfg, B, dt)
    # the same count but for the elementwise parameters nanoGPT multiplies by 6: -0.085%
    nano_per_token = 6 * (acc.count_params(cfg).total - acc.count_params(cfg).pos_emb) + 12 * 12 * 768 * 1024
    assert f.train_dense == nano_per_token - 6 * elementwise_params(cfg)
    assert ours / theirs == pytest.approx(f.train_dense / nano_per_token, rel=1e-12)
    assert ours / theirs - 1 == pytest.approx(-0.000851, abs=5e-6)
    # perf/mfu_causal: the attention term halved, nothing else
    causal = acc.mfu(tokens_per_s, f.train_causal, acc.peak_flops("a100", "bf16"))
    assert f.train_dense - f.train_causal == 6 * 12 * 1024 * 768
    assert causal / ours == pytest.approx(f.train_causal / f.train_dense, rel=1e-12)
    assert causal < ours


def test_mfu_equals_torchtitan_get_num_flop_per_token_on_llama2_7b():
    cfg = preset("llama2-7b")
    T = 4096
    f = acc.flops_per_token(cfg, T)
    theirs = torchtitan_flop_per_token(cfg, T)
    assert theirs == 46_086_512_640
    # RMSNorm weights, no biases
    assert elementwise_params(cfg) == (2 * 32 + 1) * 4096
    # -0.0035%
    assert f.train_dense == theirs - 6 * elementwise_params(cfg)
    assert f.train_dense / theirs - 1 == pytest.approx(-0.0000347, abs=1e-7)
    assert f.train_dense - f.train_causal == 6 * 32 * T * 4096
    peak = acc.peak_flops("h100", "bf16")
    tokens_per_s = 3000.0
    assert acc.mfu(tokens_per_s, f.train_dense, peak) == pytest.approx(tokens_per_s * theirs / peak, rel=5e-5)
