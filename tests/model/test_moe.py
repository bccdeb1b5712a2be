"""The mixture-of-experts feed-forward (gptkit/model/moe.py behind gptkit/model/feedforward.py): its routing
equals a token-by-token reference for every router knob, the grouped matmul equals the loop, the balance and
z-losses mean what docs/moe.md says, the expert bias moves the choice only, the layers it names are MoE, the
counts and FLOPs are by active parameters, and bad settings are one line, exit 2."""

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import TINY_LLAMA, one_line_error, run_cli
from torch.utils.flop_counter import FlopCounterMode

from gptkit import accounting as acc
from gptkit.cli import main as gptkit_main
from gptkit.conf_tree import conf_dir
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.generate import generate
from gptkit.inference.sampling import SampleOptions
from gptkit.model import GPT, ModelConfig
from gptkit.model.moe import MoE

V = 48


def tiny(**moe) -> ModelConfig:
    """A 2-layer model, d_model 32, every layer 4 experts of width 24 (top-2) unless `moe` says otherwise."""
    moe = {"n_experts": 4, "top_k": 2, "d_expert": 24, **moe}
    return ModelConfig(**TINY_LLAMA, vocab_size=V, max_seq_len=32, tie_embeddings=False, moe=moe)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight (and the expert bias) moved off its init, so no expert or router entry is special."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(model.parameters()) + [b for n, b in model.named_buffers() if "expert_bias" in n]:
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def token_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer written out for one token at a time: scores, top-k (with the bias), weights, experts."""
    B, T, d = x.shape
    out = []
    for h in x.reshape(-1, d):
        logits = moe.router.weight @ h  # [E]
        scores = logits.softmax(-1) if moe.router_kind == "softmax" else logits.sigmoid()
        bias = moe.expert_bias if moe.expert_bias is not None else torch.zeros_like(scores)
        chosen = torch.topk(scores + bias, moe.top_k).indices
        w = scores[chosen]
        if moe.norm_topk_prob:
            w = w / w.sum()
        w = w * moe.route_scale
        y = torch.zeros(d)
        for weight, e in zip(w, chosen.tolist()):
            ex = moe.experts
            y += weight * (ex.down_proj[e] @ (F.silu(ex.gate_proj[e] @ h) * (ex.up_proj[e] @ h)))
        if moe.shared is not None:
            s = moe.shared
            y += s.down_proj.weight @ (F.silu(s.gate_proj.weight @ h) * (s.up_proj.weight @ h))
        out.append(y)
    return torch.stack(out).view(B, T, d)


KNOBS = [
    {},
    {"top_k": 1},
    {"norm_topk_prob": False},
    {"router": "sigmoid", "route_scale": 2.5},
    {"n_shared": 1, "bias_update_rate": 0.001},
    {"router": "sigmoid", "n_shared": 2, "bias_update_rate": 0.01, "top_k": 3},
]


@pytest.mark.parametrize(
    "knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default"
)
def test_routing_equals_a_token_by_token_reference(knobs):
    torch.manual_seed(0)
    model = perturbed(GPT(tiny(**knobs))).eval()
    moe = model.blocks[0].mlp
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        y, aux = moe(x)
        assert aux is None
        # fp32, outputs up to ~20: the two sums differ in the last bits
        torch.testing.assert_close(y, token_by_token(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_shared, norm, scale", [(2, True, 2.5), (0, False, 1.0)])
def test_group_limited_routing_equals_transformers_deepseek_v3_moe(n_shared, norm, scale):
    """model.moe.n_group / topk_group against transformers' DeepseekV3MoE (DeepseekV3TopkRouter: sigmoid
    scores, e_score_correction_bias for the choice only, the groups by their two best, norm_topk_prob,
    routed_scaling_factor, shared experts), every weight and the bias perturbed: fp32 within 1e-5. 8 experts
    in 4 groups of 2, 2 groups kept, top-3; without the groups the choice differs."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    theirs_cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=max(n_shared, 1),
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    moe = dict(n_experts=8, top_k=3, n_group=4, topk_group=2, router="sigmoid", bias_update_rate=0.001)
    cfg = tiny(**moe, n_shared=n_shared, norm_topk_prob=norm, route_scale=scale)
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(theirs_cfg).float()
    with torch.no_grad():
        for p in [*theirs.parameters(), theirs.gate.e_score_correction_bias]:
            p.normal_(0.0, 0.3)
        if not n_shared:
            # transformers always builds its shared experts: zero ones add nothing
            theirs.shared_experts.down_proj.weight.zero_()
    ours = MoE(cfg, 0).eval()
    ex, t = ours.experts, theirs.experts
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(theirs.gate.e_score_correction_bias)
        # [E, 2 * d_expert, d_model]: gate then up
        ex.gate_proj.copy_(t.gate_up_proj[:, :24])
        ex.up_proj.copy_(t.gate_up_proj[:, 24:])
        ex.down_proj.copy_(t.down_proj)
        if n_shared:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared, name).weight.copy_(getattr(theirs.shared_experts, name).weight)
        x = torch.randn(3, 11, 32)
        want = theirs(x)
        got, _ = ours(x)
        assert (got - want).abs().max().item() <= 1e-5
        # the groups matter: without them some token chooses other experts
        chosen = ours.route(x.reshape(-1, 32))[2]
        ours.n_group = 1
        assert not torch.equal(ours.route(x.reshape(-1, 32))[2].sort(-1).values, chosen.sort(-1).values)
        ours.n_group = 4
    # each token's experts lie in at most topk_group groups
    assert int((chosen // 2).sort(-1).values.diff(dim=-1).ne(0).sum(-1).max()) + 1 <= 2


def test_group_routing_off_is_bit_identical_to_no_groups():
    """n_group 1 (the default) routes as before the option: the same output bits as the same weights built
    without the keys; n_group == topk_group (every group kept) chooses the same experts too."""
    torch.manual_seed(0)
    a = perturbed(GPT(tiny(n_experts=8, router="sigmoid"))).eval()
    b = GPT(tiny(n_experts=8, router="sigmoid", n_group=1, topk_group=1)).eval()
    c = GPT(tiny(n_experts=8, router="sigmoid", n_group=4, topk_group=4)).eval()
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    x = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        assert torch.equal(a(x).logits, b(x).logits)
        torch.testing.assert_close(a(x).logits, c(x).logits, atol=0, rtol=0)


def test_the_expert_bias_moves_the_choice_not_the_weights():
    moe = perturbed(GPT(tiny(bias_update_rate=0.01))).blocks[0].mlp.eval()
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        moe.expert_bias.zero_()
        _, scores, chosen, weights = moe.route(x[0])
        # a large bias on expert 3: every token picks it, with its unbiased score as its weight
        moe.expert_bias[3] = 100.0
        _, scores_b, chosen_b, weights_b = moe.route(x[0])
    assert torch.equal(scores, scores_b) and bool((chosen_b == 3).any(-1).all())
    raw = scores_b.gather(-1, chosen_b)
    torch.testing.assert_close(weights_b, raw / raw.sum(-1, keepdim=True))


def test_a_correction_bias_without_updates_is_held_applied_and_never_moved():
    """model.moe.correction_bias (an imported DeepSeek-V3's e_score_correction_bias) with bias_update_rate 0:
    the buffer is in the state dict, moves the choice, and a step's update leaves it as it was."""
    assert "blocks.0.mlp.expert_bias" not in GPT(tiny(router="sigmoid")).state_dict()
    model = perturbed(GPT(tiny(router="sigmoid", correction_bias=True)))
    moe = model.blocks[0].mlp.eval()
    assert "blocks.0.mlp.expert_bias" in model.state_dict()
    x = torch.randn(5, 32)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[2] = 100.0
        assert bool((moe.route(x)[2] == 2).any(-1).all())
    held = moe.expert_bias.clone()
    moe.update_bias(torch.tensor([9.0, 0.0, 5.0, 1.0]))
    assert torch.equal(moe.expert_bias, held)
    with pytest.raises(ConfigError, match="correction_bias"):
        tiny(correction_bias="yes")


def test_grouped_matmul_equals_the_loop_forward_and_backward():
    torch.manual_seed(0)
    grouped = perturbed(GPT(tiny(impl="grouped_mm", n_shared=1)))
    loop = GPT(tiny(impl="loop", n_shared=1))
    loop.load_state_dict(grouped.state_dict())
    idx = torch.randint(0, V, (3, 16))
    for m in (grouped, loop):
        out = m(idx, idx)
        (out.loss + out.aux.loss).backward()
    for (name, a), (_, b) in zip(grouped.named_parameters(), loop.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


GPT_OSS = dict(router_bias=True, expert_biases=True, activation="clamped_swiglu", swiglu_limit=0.6)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_gpt_oss_experts_equal_transformers_gpt_oss_mlp(impl):
    """The router's bias, every expert's biases and the clamped SwiGLU (limit 0.6: most gates and ups clamp)
    against transformers' GptOssMLP (fused, interleaved gate/up; top-k of the logits, softmax over them) with
    every weight perturbed: fp32 outputs within 1e-5; our grouped matmul and loop alike."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = tiny(impl=impl, **GPT_OSS)
    theirs_cfg = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.6
    )
    torch.manual_seed(0)
    theirs = GptOssMLP(theirs_cfg).float()
    with torch.no_grad():
        # its experts are torch.empty until a checkpoint loads: every weight drawn here
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    ours = MoE(cfg, 0).eval()
    ex = ours.experts
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        ours.router.bias.copy_(theirs.router.bias)
        t = theirs.experts
        # [E, d_model, 2 * d_expert], gate and up interleaved -> [E, d_expert, d_model] each
        ex.gate_proj.copy_(t.gate_up_proj[..., ::2].transpose(1, 2))
        ex.up_proj.copy_(t.gate_up_proj[..., 1::2].transpose(1, 2))
        ex.gate_bias.copy_(t.gate_up_proj_bias[:, ::2])
        ex.up_bias.copy_(t.gate_up_proj_bias[:, 1::2])
        ex.down_proj.copy_(t.down_proj.transpose(1, 2))
        ex.down_bias.copy_(t.down_proj_bias)
        x = torch.randn(2, 9, 32)
        want = theirs(x)
        want = want[0] if isinstance(want, tuple) else want
        got, _ = ours(x)
    assert (got - want).abs().max().item() <= 1e-5
    # the clamp is reached on both sides, and the biases matter
    assert bool((x.reshape(-1, 32) @ t.gate_up_proj[0] > 0.6).any())
    with torch.no_grad():
        ex.down_bias.zero_()
        assert (ours(x)[0] - want).abs().max().item() > 1e-3


def test_gpt_oss_experts_count_train_on_muon_and_are_refused_by_the_other_families():
    """count-params equals the module (router bias, expert biases in total and inactive); Muon takes the
    stacked matrices, AdamW the stacked biases; the biases start at zero; Mixtral's family refuses them, and
    gpt-oss's (the family of these experts) needs its attention sinks too."""
    from gptkit.hf.families import family_of
    from gptkit.hf.moe import Mixtral
    from gptkit.training.optim import muon_split

    cfg = tiny(**GPT_OSS)
    model = GPT(cfg)
    c = acc.count_params(cfg)
    assert c.total == model.num_parameters()
    per_expert = 3 * 32 * 24 + 2 * 24 + 32
    assert c.inactive == 2 * (4 - 2) * per_expert and c.router == 2 * (32 + 1) * 4
    muon, adamw = muon_split(model)
    assert acc.muon_params(cfg) == sum(p.numel() for _, p in muon)
    assert {n.rsplit(".", 1)[1] for n, _ in adamw if ".experts." in n} == {
        "gate_bias",
        "up_bias",
        "down_bias",
    }
    assert all(not p.detach().any() for n, p in model.named_parameters() if n.endswith("_bias"))
    with pytest.raises(GptkitError, match=r"model.moe.router_bias=True .*refusing"):
        Mixtral().check(cfg)
    with pytest.raises(GptkitError, match=r"model.attn_sinks=False .*GptOssForCausalLM.*refusing"):
        family_of(cfg)


def test_balance_loss_is_one_when_balanced_and_e_over_k_when_collapsed():
    moe = GPT(tiny(n_experts=4, top_k=2)).blocks[0].mlp.train()
    x = torch.randn(3, 8, 32)
    with torch.no_grad():
        # a zero router: uniform probabilities, whatever the choice
        moe.router.weight.zero_()
        assert moe(x)[1].stats.balance.item() == pytest.approx(1.0)
        # every token to experts 0 and 1 (probabilities ~1/2 each): E / k = 2
        moe.router.weight.zero_()
        moe.router.weight[:2] = 0.0
        moe.router.weight[2:] = -1e3 * x.reshape(-1, 32).mean(0).sign()
        x = x.abs() * x.reshape(-1, 32).mean(0).sign()
        _, aux = moe(x)
    assert aux.stats.balance.item() == pytest.approx(2.0, rel=1e-4)
    assert aux.stats.counts.tolist() == [24.0, 24.0, 0.0, 0.0]
    # a collapsed router has no entropy left beyond the two experts' ln 2
    assert aux.stats.entropy.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), rel=1e-3)


def test_z_loss_is_the_squared_logsumexp_of_the_router_logits():
    moe = GPT(tiny(n_experts=4, top_k=2, z_loss_coef=0.5, aux_loss_coef=0.0)).blocks[0].mlp.train()
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        # zero logits: logsumexp = ln 4 for every token
        moe.router.weight.zero_()
        _, aux = moe(x)
        assert aux.stats.z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-6)
        assert aux.loss.item() == pytest.approx(0.5 * aux.stats.z.item(), rel=1e-6)
        # one token's logits (a, 0, 0, 0): logsumexp = log(e^a + 3); the mean over the tokens
        moe.router.weight[0] = 0.0
        h = torch.zeros(1, 2, 32)
        h[0, 0, 0] = 1.0
        moe.router.weight[0, 0] = 2.0
        _, aux = moe(h)
    lse = torch.log(torch.exp(torch.tensor(2.0)) + 3)
    want = (lse**2 + torch.log(torch.tensor(4.0)) ** 2) / 2
    assert aux.stats.z.item() == pytest.approx(want.item(), rel=1e-6)


def test_the_per_sequence_balance_loss_does_not_depend_on_how_the_batch_is_split():
    """What lets DDP and FSDP2 (each rank a part of the step's sequences) train as one process does."""
    model = perturbed(GPT(tiny(z_loss_coef=0.01))).train()
    idx = torch.randint(0, V, (4, 16))
    whole = model(idx).aux.loss
    halves = (model(idx[:2]).aux.loss + model(idx[2:]).aux.loss) / 2
    torch.testing.assert_close(whole, halves, atol=1e-6, rtol=0)
    batch = GPT(tiny(aux_loss_group="batch"))
    batch.load_state_dict(model.state_dict())
    batch.train()
    # over the micro-batch instead: the split matters
    assert abs(batch(idx).aux.loss - (batch(idx[:2]).aux.loss + batch(idx[2:]).aux.loss) / 2) > 1e-6


def test_aux_loss_is_the_weighted_sum_over_layers_and_reaches_the_router():
    model = perturbed(GPT(tiny(aux_loss_coef=0.1, z_loss_coef=0.01))).train()
    idx = torch.randint(0, V, (2, 16))
    out = model(idx, idx)
    layers = out.aux.layers
    assert len(layers) == 2
    want = sum(0.1 * s.balance + 0.01 * s.z for s in layers)
    torch.testing.assert_close(out.aux.loss, want)
    out.aux.loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    # eval mode: no aux at all
    assert model.eval()(idx).aux is None


def test_the_bias_update_lowers_the_loaded_experts_and_is_centred():
    moe = GPT(tiny(bias_update_rate=0.01)).blocks[0].mlp
    moe.update_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]))
    assert moe.expert_bias.tolist() == pytest.approx([-0.015, 0.005, 0.005, 0.005])
    assert abs(moe.expert_bias.sum().item()) < 1e-7
    assert "blocks.0.mlp.expert_bias" in GPT(tiny(bias_update_rate=0.01)).state_dict()
    assert "blocks.0.mlp.expert_bias" not in GPT(tiny()).state_dict()


@pytest.mark.parametrize(
    "knobs, moe_layers", [({}, [0, 1, 2, 3]), ({"every": 2}, [1, 3]), ({"first_dense": 1}, [1, 2, 3])]
)
def test_the_layers_it_names_are_moe_and_the_others_dense(knobs, moe_layers):
    cfg = ModelConfig.from_dict({**tiny(**knobs).to_dict(), "n_layers": 4})
    model = GPT(cfg)
    assert cfg.moe_layers == moe_layers
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)] == moe_layers
    assert acc.count_params(cfg).total == model.num_parameters()


def test_kv_cache_decoding_equals_recomputing():
    model = perturbed(GPT(tiny(n_shared=1))).eval()
    opts = SampleOptions(max_new_tokens=12, temperature=0.0, decode="eager")
    prompt = torch.randint(0, V, (6,)).tolist()
    assert generate(model, prompt, opts).tokens[0] == generate(model, prompt, opts, use_cache=False).tokens[0]


def test_forward_flops_equal_flop_counter_by_active_parameters():
    """The loop path runs one matmul per expert over its tokens: torch counts exactly the top-k work."""
    cfg = ModelConfig.from_dict({**tiny(impl="loop", n_shared=1).to_dict(), "attention": "eager"})
    model = GPT(cfg).eval()
    B, T = 2, cfg.max_seq_len
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, V, (B, T)))
    assert counter.get_total_flops() == acc.flops_per_token(cfg, T).forward_dense * B * T


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_dict(yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text()))


# total, active
COUNTS = {
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "olmoe-1b-7b": (6_919_161_856, 1_282_017_280),
}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_preset_counts_total_and_active_as_transformers_builds_them(name):
    transformers = pytest.importorskip("transformers")
    from gptkit import hf

    cfg = preset(name)
    c = acc.count_params(cfg)
    assert (c.total, c.active) == COUNTS[name]
    d = hf.hf_config(cfg)
    config = getattr(transformers, hf.CONFIG_CLASSES[d.pop("model_type")])(
        **{k: v for k, v in d.items() if k not in ("architectures", "dtype")}
    )
    with torch.device("meta"):
        theirs = getattr(transformers, hf.ARCHITECTURES[hf.architecture(cfg)])(config)
        assert GPT(cfg).num_parameters() == c.total
    total = sum(p.numel() for p in theirs.parameters())
    # a token uses top_k of the n_experts experts of every layer
    experts = sum(p.numel() for n, p in theirs.named_parameters() if ".experts." in n)
    m = cfg.moe
    assert (total, total - experts * (m.n_experts - m.top_k) // m.n_experts) == COUNTS[name]
    assert hf.model_config_from_hf(config.to_dict(), name=cfg.name) == cfg


def test_flops_and_memory_use_active_and_total_parameters():
    cfg = preset("mixtral-8x7b")
    c = acc.count_params(cfg)
    f = acc.flops_per_token(cfg, 4096)
    # the matmul weights a token meets: the active ones but the embedding lookup and the norms
    assert f.n_matmul == c.active - c.tok_emb - c.norms - c.final_norm
    assert f.train_dense == 6 * f.n_matmul + 12 * cfg.n_layers * 4096 * cfg.d_attn
    mem = acc.training_memory(cfg, "bf16-mixed")
    assert mem["optimizer"] == c.total * 8
    # trainer.expert_parallel=8 on 16 GPUs: the routed experts over 8, the rest over 16
    ep = acc.training_memory(cfg, "32-true", 16, expert_shards=8)
    assert ep["weights"] == (c.total - c.experts) * 4 / 16 + c.experts * 4 / 8
    dense = preset("moe-tiny")
    assert acc.count_params(dense).active < acc.count_params(dense).total


def test_moe_tiny_has_the_active_parameters_of_llama_tiny_plus_its_routers():
    moe, dense = acc.count_params(preset("moe-tiny")), acc.count_params(preset("llama-tiny"))
    assert moe.active - dense.total == moe.router == 4 * 8 * 128


def test_count_params_prints_total_and_active(capsys):
    assert gptkit_main(["count-params", "model=mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704" in out and "12,879,925,248" in out


@pytest.mark.parametrize(
    "change, named",
    [
        ({"top_k": 5}, "model.moe.top_k=5 exceeds model.moe.n_experts=4"),
        ({"n_experts": 1, "top_k": 1}, "model.moe.n_experts=1 must be at least 2"),
        ({"router": "softmax_topk"}, "model.moe.router='softmax_topk' is not one of softmax, sigmoid"),
        ({"capacity": 1.0}, "unknown model.moe field(s) capacity"),
        ({"first_dense": 2}, "no layer of the 2 is MoE"),
        ({"aux_loss_coef": -1}, "model.moe.aux_loss_coef=-1 must be a number >= 0"),
        ({"activation": "geglu"}, "model.moe.activation='geglu' is not one of swiglu, clamped_swiglu"),
        ({"swiglu_limit": 0}, "model.moe.swiglu_limit=0 must be a number > 0"),
        ({"router_bias": "yes"}, "model.moe.router_bias='yes' must be true or false"),
        ({"n_group": 2, "topk_group": 3}, "model.moe.topk_group=3 exceeds model.moe.n_group=2"),
        ({"n_experts": 6, "n_group": 4}, "model.moe.n_experts=6 is not divisible by model.moe.n_group=4"),
        ({"n_group": 4}, "model.moe.n_group=4 leaves 1 expert per group"),
        ({"n_experts": 8, "n_group": 4, "top_k": 3}, "model.moe.top_k=3 exceeds the 2 experts"),
        ({"n_group": 0}, "model.moe.n_group=0 must be an integer >= 1"),
    ],
)
def test_bad_moe_settings_are_one_line_config_errors(change, named):
    with pytest.raises(ConfigError, match=None) as e:
        tiny(**change)
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "arg, named",
    [
        ("model.moe.top_k=9", "model.moe.top_k=9 exceeds model.moe.n_experts=8"),
        ("model.moe.n_experts=1", "model.moe.n_experts=1 must be at least 2"),
        ("model.moe.router=nope", "model.moe.router='nope' is not one of softmax, sigmoid"),
        ("expert_parallel=3", "expert_parallel=3 must be a divisor of n_gpus=1"),
        ("model.moe.topk_group=2", "model.moe.topk_group=2 exceeds model.moe.n_group=1"),
        ("model.moe.n_group=3", "model.moe.n_experts=8 is not divisible by model.moe.n_group=3"),
    ],
)
def test_bad_moe_settings_on_the_command_line_exit_2_with_one_line(capsys, arg, named):
    with pytest.raises(SystemExit) as e:
        gptkit_main(["count-params", "model=moe-tiny", arg])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and named in err[0], err


def test_train_refuses_a_bad_moe_setting_before_it_writes_anything(tmp_path):
    r = run_cli("train", "model=moe-tiny", "model.moe.top_k=9", f"runs_dir={tmp_path}")
    one_line_error(r, "model.moe.top_k=9 exceeds model.moe.n_experts=8")
    assert not any(tmp_path.iterdir())


def test_experts_need_swiglu():
    with pytest.raises(ConfigError, match="the experts are SwiGLU"):
        ModelConfig.from_dict({**tiny().to_dict(), "mlp": "gelu"})


@pytest.mark.long
def test_a_compiled_mixture_equals_eager_forward_and_backward(impl="auto"):
    """torch.compile traces torch._grouped_mm through a meta kernel that takes bf16 only: an fp32 model
    compiles through the loop (aot_eager: the same tracing as inductor, no code generation)."""
    torch.manual_seed(0)
    eager = perturbed(GPT(tiny(impl=impl, n_shared=1))).train()
    compiled = GPT(tiny(impl=impl, n_shared=1)).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend="aot_eager")
    idx = torch.randint(0, V, (2, 16))
    for m in (eager, compiled):
        out = m(idx, idx)
        (out.loss + out.aux.loss).backward()
    torch.testing.assert_close(compiled(idx, idx).loss, eager(idx, idx).loss)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_recomputes_a_mixture_exactly():
    """trainer.activation_checkpointing: each block recomputed in the backward, its aux loss included."""
    from gptkit.training.module import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = perturbed(GPT(tiny(n_shared=1))).train()
    recomputed = GPT(tiny(n_shared=1)).train()
    recomputed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(recomputed)
    idx = torch.randint(0, V, (2, 16))
    for m in (plain, recomputed):
        out = m(idx, idx)
        (out.loss + out.aux.loss).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
