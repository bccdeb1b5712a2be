"""Optimizer parameter groups and learning-rate schedules."""

import math

import pytest
import torch

from gptkit.model import GPT, ModelConfig
from gptkit.training.optim import lr_factor, param_groups


def test_weight_decay_only_on_matrices_and_tied_weights_once():
    # tied, biases
    model = GPT(ModelConfig(vocab_size=50, max_seq_len=16, n_layers=2, n_heads=2, d_model=16))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    # q/k/v/o and MLP matrices
    assert decayed and all(n.endswith("proj.weight") for n in decayed)
    kept = {names[id(p)] for p in no_decay["params"]}
    # embeddings (and the tied head) undecayed
    assert "tok_emb.weight" in kept and "pos_emb.weight" in kept
    assert any(n.endswith(".bias") for n in kept) and any("norm" in n for n in kept)
    n_grouped = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    # every parameter once, the tied head not twice
    assert n_grouped == model.num_parameters()
    with_emb, _ = param_groups(model, 0.1, decay_embeddings=True)
    assert any(p is model.tok_emb.weight for p in with_emb["params"])


def test_sinks_and_a_mixtures_biases_are_undecayed_as_biases_and_the_gates_decayed_as_matrices():
    """gpt-oss's blocks: the sinks [n_heads], the router's bias [E] and the experts' stacked biases [E, out]
    are biases (no decay unless optim.decay_norms_and_biases); the output gate and the expert stacks are
    weight matrices."""
    from gptkit.model.config import MoEConfig

    moe = MoEConfig(n_experts=4, top_k=2, d_expert=8, router_bias=True, expert_biases=True)
    cfg = dict(vocab_size=50, max_seq_len=16, n_layers=1, n_heads=2, d_model=16, position="rope")
    cfg.update(mlp="swiglu", norm="rmsnorm", bias=False, attn_sinks=True, attn_output_gate=True, moe=moe)
    model = GPT(ModelConfig(**cfg))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.1)
    biases = {f"blocks.0.mlp.experts.{t}_bias" for t in ("gate", "up", "down")}
    biases |= {"blocks.0.attn.sinks", "blocks.0.mlp.router.bias"}
    assert biases <= {names[id(p)] for p in no_decay["params"]}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "blocks.0.attn.gate_proj.weight" in decayed and "blocks.0.mlp.experts.up_proj" in decayed
    assert not decayed & biases
    every, _ = param_groups(model, 0.1, decay_norms_and_biases=True)
    assert biases <= {names[id(p)] for p in every["params"]}


KW = dict(max_steps=1000, warmup_steps=100, lr=1e-3, min_lr=1e-4)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_to_the_peak(schedule):
    assert lr_factor(0, schedule=schedule, **KW) == pytest.approx(1 / 100)
    assert lr_factor(99, schedule=schedule, **KW) == pytest.approx(1.0)


def test_cosine_linear_and_wsd_shapes():
    f = lambda step, s: lr_factor(step, schedule=s, **KW)  # noqa: E731
    assert f(100, "cosine") == pytest.approx(1.0)
    # halfway: halfway between peak and floor
    assert f(550, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(1000, "cosine") == pytest.approx(0.1) and f(5000, "cosine") == pytest.approx(0.1)
    assert f(550, "linear") == pytest.approx(1 - 0.9 * 0.5)
    # stable until the last 20% of steps
    assert f(799, "wsd") == 1.0
    assert f(900, "wsd") == pytest.approx(1 - 0.9 * 0.5) and f(1000, "wsd") == pytest.approx(0.1)
    assert f(700, "constant") == 1.0
    steps = [f(s, "cosine") for s in range(100, 1001)]
    # monotone after warm-up
    assert all(a >= b for a, b in zip(steps, steps[1:]))
    assert math.isclose(min(steps), 0.1)


def test_min_lr_defaults_to_a_tenth_of_lr_so_a_small_lr_alone_is_valid():
    """optim.lr=3e-5 alone (the README's fine-tuning line) must not trip over an absolute min_lr default."""
    from omegaconf import OmegaConf

    from gptkit.conf_tree import compose
    from gptkit.errors import ConfigError
    from gptkit.training.optim import build_scheduler, check_optim_config, min_lr

    cfg = compose("train", ["optim.lr=3e-5", "optim.warmup_steps=0"]).optim
    check_optim_config(cfg)
    assert cfg.min_lr is None and min_lr(cfg) == pytest.approx(3e-6)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-5)
    sched = build_scheduler(opt, cfg, max_steps=10)
    for _ in range(10):
        opt.step()
        sched.step()
    # decayed to lr / 10
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-6)
    explicit = OmegaConf.merge(cfg, {"min_lr": 0})
    check_optim_config(explicit)
    assert min_lr(explicit) == 0.0
    for bad, match in ((1e-3, r"must be in \[0, optim.lr=3e-05\]"), ("abc", "is not a number")):
        with pytest.raises(ConfigError, match=match):
            check_optim_config(OmegaConf.merge(cfg, {"min_lr": bad}))
