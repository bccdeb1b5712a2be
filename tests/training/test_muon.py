"""optim=muon: torch.optim.Muon for the block matrices, AdamW for the rest, as one optimizer that Lightning
steps, schedules, clips, scales and checkpoints; the same arithmetic as the two torch optimizers side by side;
bad settings are one line."""

import copy
import dataclasses
import logging
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_run
from omegaconf import OmegaConf

from gptkit.conf_tree import compose
from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.training.optim import (
    MuonWithAdamW,
    build_optimizer,
    build_scheduler,
    check_optim_config,
    describe_optimizer,
    muon_split,
    muon_step,
    newton_schulz,
)

TINY = dict(vocab_size=64, max_seq_len=16, n_layers=2, n_heads=2, d_model=32)


def muon_cfg(*overrides: str):
    return compose("train", ["optim=muon", *overrides]).optim


def gpt2(**kw) -> GPT:
    torch.manual_seed(0)
    # tied embeddings, biases, LayerNorm, learned positions
    return GPT(ModelConfig(**{**TINY, **kw}))


def llama(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(
        ModelConfig(
            **{
                **TINY,
                "position": "rope",
                "mlp": "swiglu",
                "norm": "rmsnorm",
                "bias": False,
                "tie_embeddings": False,
                "n_kv_heads": 1,
                "d_ff": 64,
                **kw,
            }
        )
    )


def backward(model: GPT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)  # [B, T]
    loss = model(x, torch.roll(x, -1, 1)).loss
    loss.backward()
    return loss


def gated(**kw) -> GPT:
    """llama with attention sinks and the output gate (issue 49's blocks)."""
    return llama(attn_sinks=True, attn_output_gate=True, **kw)


@pytest.mark.parametrize("make", [gpt2, llama, gated])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(make):
    model = make()
    muon, adamw = muon_split(model)
    assert muon and all(
        n.startswith("blocks.") and n.endswith("proj.weight") and p.ndim == 2 for n, p in muon
    )
    # per layer: qkv, o (and the output gate) + the MLP matrices
    assert len(muon) == 2 * (2 + (make is gated) + (2 if make is gpt2 else 3))
    rest = {n for n, _ in adamw}
    # the sinks are AdamW's (a vector), undecayed
    assert ({"blocks.0.attn.sinks", "blocks.1.attn.sinks"} <= rest) == (make is gated)
    assert "tok_emb.weight" in rest and all(p.ndim == 1 or not n.startswith("blocks.") for n, p in adamw)
    # tied: the token embedding is the head
    assert ("lm_head.weight" in rest) == (make is not gpt2)
    assert any("norm" in n for n in rest) and (make is not gpt2 or any(n.endswith(".bias") for n in rest))
    # every parameter once
    assert sum(p.numel() for _, p in muon + adamw) == model.num_parameters()

    opt = build_optimizer(model, muon_cfg())
    assert isinstance(opt, MuonWithAdamW)
    groups = opt.param_groups
    assert groups[0]["params"] == [p for _, p in muon] and groups[0]["weight_decay"] == 0.1
    assert groups[0]["adjust_lr_fn"] == "match_rms_adamw" and groups[0]["ns_steps"] == 5
    by_id = {id(p): n for n, p in model.named_parameters()}
    decayed = {by_id[id(p)] for g in groups[1:] if g["weight_decay"] for p in g["params"]}
    # AdamW's own rules for the rest
    assert decayed == (set() if make is gpt2 else {"lm_head.weight"})
    line = describe_optimizer(muon_cfg(), model, "cpu")
    n_muon, n_rest = sum(p.numel() for _, p in muon), sum(p.numel() for _, p in adamw)
    assert f"Muon (torch.optim.Muon: {n_muon:,} parameters in {len(muon)} block matrices" in line
    assert f"AdamW (fused) for {n_rest:,} parameters in {len(adamw)} tensors" in line


MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize(
    "preset, over",
    [
        ("mla-tiny", {}),
        ("mtp-tiny", {}),
        ("mtp-tiny", {"bias": True, "attn_sinks": True, "norm": "layernorm", "moe": None, "mlp": "gelu"}),
        ("mtp-tiny", {"attention_kind": "mla", "n_kv_heads": None, "mla": MLA}),
    ],
    ids=["mla", "mtp-moe", "mtp-biases", "mtp-mla"],
)
def test_muon_takes_mlas_and_mtps_matrices_as_the_accounting_counts(preset, over):
    """Multi-head latent attention's projections and the multi-token prediction modules' matrices (its
    projection, its block's) are Muon's, their norms, sinks and biases AdamW's; count-params' Muon share
    (the memory estimate's) is the optimizer's."""
    import yaml

    from gptkit import accounting
    from gptkit.conf_tree import conf_dir

    d = yaml.safe_load((conf_dir() / "model" / f"{preset}.yaml").read_text())
    cfg = ModelConfig.from_dict({**d, "vocab_size": 64, "n_layers": 2, "d_model": 64, **over})
    model = GPT(cfg)
    muon, adamw = muon_split(model)
    names = {n for n, _ in muon}
    assert sum(p.numel() for _, p in muon) == accounting.muon_params(cfg)
    assert all(p.ndim == 1 or not n.startswith(("blocks.", "mtp.")) for n, p in adamw)
    if cfg.attention_kind == "mla":
        assert "blocks.1.attn.kv_b_proj.weight" in names and "blocks.1.attn.q_a_proj.weight" in names
        assert "blocks.1.attn.kv_a_layernorm.weight" in {n for n, _ in adamw}
    if cfg.mtp_depth:
        assert "mtp.layers.0.proj.weight" in names and "mtp.layers.0.block.attn.o_proj.weight" in names


def test_the_steps_are_torch_muon_and_adamw_side_by_side():
    """Two steps of MuonWithAdamW equal torch.optim.Muon + torch.optim.AdamW stepped separately, bit for
    bit."""
    cfg = muon_cfg("optim.muon.momentum=0.9", "optim.muon.ns_steps=3")
    model = llama()
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    muon_ref = torch.optim.Muon(
        [p for n, p in ref.named_parameters() if n.startswith("blocks.") and p.ndim == 2],
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=True,
        ns_steps=3,
        adjust_lr_fn="match_rms_adamw",
    )
    rest = [(n, p) for n, p in ref.named_parameters() if not (n.startswith("blocks.") and p.ndim == 2)]
    adamw_ref = torch.optim.AdamW(
        [
            {"params": [p for n, p in rest if n == "lm_head.weight"], "weight_decay": 0.1},
            {"params": [p for n, p in rest if n != "lm_head.weight"], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    for step in range(2):
        backward(model, step)
        backward(ref, step)
        opt.step()
        muon_ref.step()
        adamw_ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_newton_schulz_is_torchs_in_bfloat16_and_closer_to_orthogonal_in_float32():
    """gptkit's Newton-Schulz in bfloat16 is torch.optim.Muon's bit for bit (tall, wide, square); in float32
    its singular values are those of the same polynomial iteration computed in float64 to 1e-5."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    g = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 40), (24, 24)]:
        grad = torch.randn(shape, generator=g)
        want = _zeropower_via_newtonschulz(grad.clone(), coefficients, 5, 1e-7)
        assert torch.equal(newton_schulz(grad, coefficients, 5, 1e-7), want), shape
        exact = newton_schulz(grad.double(), coefficients, 5, 1e-7, dtype=torch.float64)
        fp32 = newton_schulz(grad, coefficients, 5, 1e-7, dtype=torch.float32)
        assert fp32.dtype == torch.float32 and fp32.shape == shape
        err32, err16 = ((x.double() - exact).abs().max().item() for x in (fp32, want))
        assert err32 < 1e-5 < 1e-3 < err16, (shape, err32, err16)


@pytest.mark.parametrize("nesterov", [True, False])
def test_gptkits_muon_step_is_torchs_bit_for_bit(nesterov):
    """muon_step (what float32 Newton-Schulz and FSDP2 use) in bfloat16 is torch.optim.Muon.step, bit for bit
    over 3 steps (momentum, Nesterov or not, weight decay, the lr adjustment)."""
    cfg = muon_cfg(f"optim.muon.nesterov={str(nesterov).lower()}")
    model, ref = llama(), llama()
    opt, opt_ref = build_optimizer(model, cfg), build_optimizer(ref, cfg)
    for step in range(3):
        backward(model, step)
        backward(ref, step)
        muon_step(opt.muon, torch.bfloat16)
        opt_ref.muon.step()
        model.zero_grad()
        ref.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    assert opt.state_dict()["state"].keys() == opt_ref.state_dict()["state"].keys()


def test_a_mixtures_experts_are_each_orthogonalized_as_a_matrix_of_its_own():
    """model.moe: the stacked expert weights [E, out, in] are Muon's, and each expert's matrix moves as
    torch.optim.Muon moves that matrix as a parameter of its own (its momentum, its Newton-Schulz, its lr
    adjustment), bit for bit over 3 steps; the router [E, d_model] is a block matrix as any other."""
    model = llama(moe={"n_experts": 4, "top_k": 2, "d_expert": 24})
    cfg = muon_cfg()
    opt = build_optimizer(model, cfg)
    stacks = {n: p for n, p in model.named_parameters() if p.ndim == 3}
    assert sorted(stacks) == [
        f"blocks.{i}.mlp.experts.{w}_proj" for i in (0, 1) for w in ("down", "gate", "up")
    ]
    muon_params = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    assert all(id(p) in muon_params for p in stacks.values())
    assert id(model.blocks[0].mlp.router.weight) in muon_params
    # per layer qkv, o, the router and 3 x 4 experts
    assert "in 30 block matrices" in describe_optimizer(cfg, model, "cpu")
    # each expert of each stack a 2-D parameter of torch's own Muon
    alone = {(n, e): p[e].detach().clone().requires_grad_() for n, p in stacks.items() for e in range(4)}
    m = cfg.muon
    ref = torch.optim.Muon(
        list(alone.values()),
        lr=float(cfg.lr),
        weight_decay=float(cfg.weight_decay),
        momentum=float(m.momentum),
        nesterov=bool(m.nesterov),
        ns_steps=int(m.ns_steps),
        adjust_lr_fn=str(m.adjust_lr),
    )
    for step in range(3):
        backward(model, step)
        for (n, e), q in alone.items():
            q.grad = stacks[n].grad[e].clone()
        opt.step()
        ref.step()
        model.zero_grad()
    for (n, e), q in alone.items():
        assert torch.equal(stacks[n][e], q), (n, e)


def test_bf16_weights_without_nesterov_keep_their_momentum():
    """trainer.precision=bf16-true with optim.muon.nesterov=false: the momentum buffer after one step is
    (1 - momentum) x grad (torch.optim.Muon's own step divides it in place by its norm there)."""
    model = llama().to(torch.bfloat16)
    opt = build_optimizer(model, muon_cfg("optim.muon.nesterov=false"))
    backward(model)
    p = model.blocks[0].mlp.up_proj.weight
    grad = p.grad.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.zeros_like(grad).lerp_(grad, 0.05))


def test_float32_newton_schulz_steps_and_says_so():
    """optim.muon.ns_dtype=float32: a step is w (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS_float32(update), the
    Nesterov update of the first step (torch's arithmetic), and the start-up line names the dtype."""
    cfg = muon_cfg("optim.muon.ns_dtype=float32")
    model = llama()
    opt = build_optimizer(model, cfg)
    assert opt.ns_dtype == torch.float32 and build_optimizer(llama(), muon_cfg()).ns_dtype == torch.bfloat16
    assert "5 Newton-Schulz steps in float32" in describe_optimizer(cfg, model, "cpu")
    p = model.blocks[0].mlp.up_proj.weight  # [d_ff, d_model]
    start = p.detach().clone()
    backward(model)
    grad, lr, wd, m = p.grad.clone(), cfg.lr, cfg.weight_decay, cfg.muon.momentum
    opt.step()
    # Nesterov, first step
    update = grad.lerp(torch.zeros_like(grad).lerp_(grad, 1 - m), m)
    ortho = newton_schulz(update, opt.muon.param_groups[0]["ns_coefficients"], 5, 1e-7, torch.float32)
    want = start * (1 - lr * wd) - lr * 0.2 * max(p.shape) ** 0.5 * ortho
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-8)
    bf16 = newton_schulz(update, opt.muon.param_groups[0]["ns_coefficients"], 5, 1e-7)
    # not what torch's bfloat16 Newton-Schulz gives
    assert (bf16.float() - ortho).abs().max() > 1e-3


def test_lr_and_weight_decay_mean_what_they_mean_with_adamw():
    """match_rms_adamw: a Muon update has RMS ~0.2 x lr (the steady-state RMS of AdamW's, Moonlight); weight
    decay is decoupled, w <- w (1 - lr x weight_decay), for Muon's matrices as for AdamW's."""
    model = llama()
    cfg = muon_cfg("optim.weight_decay=0.0", "optim.lr=0.01")
    opt = build_optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backward(model)
    opt.step()
    for name, p in muon_split(model)[0]:
        rms = (p.detach() - before[name]).pow(2).mean().sqrt().item() / 0.01
        # Newton-Schulz leaves singular values in ~(0.7, 1.2)
        assert 0.12 < rms < 0.25, (name, rms)
    # weight decay alone (zero gradients): both optimizers shrink their decayed weights by the same factor
    model = llama()
    opt = build_optimizer(model, muon_cfg("optim.weight_decay=0.5", "optim.lr=0.01"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name in ("blocks.0.attn.o_proj.weight", "lm_head.weight"):
        torch.testing.assert_close(
            dict(model.named_parameters())[name].detach(), before[name] * (1 - 0.01 * 0.5)
        )


def test_the_schedule_and_the_checkpoint_cover_both_optimizers():
    model = gpt2()
    cfg = muon_cfg("optim.warmup_steps=2", "optim.schedule=linear")
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, max_steps=4)
    for step in range(2):
        backward(model, step)
        opt.step()
        sched.step()
        opt.zero_grad()
    # warm-up over: all at the peak
    assert all(g["lr"] == pytest.approx(1e-3) for g in opt.param_groups)
    assert (
        opt.muon.param_groups[0] is opt.param_groups[0] and opt.adamw.param_groups[-1] is opt.param_groups[-1]
    )
    saved = copy.deepcopy(opt.state_dict())
    assert {"momentum_buffer"} <= set(saved["state"][0]) and "exp_avg" in saved["state"][
        len(saved["state"]) - 1
    ]
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(twin, cfg)
    twin_opt.load_state_dict(saved)
    assert twin_opt.muon.state is twin_opt.state and twin_opt.muon.param_groups[0] is twin_opt.param_groups[0]
    for m, o in ((model, opt), (twin, twin_opt)):
        backward(m, 7)
        o.step()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.muon.momentum=1.0", r"optim.muon.momentum=1.0 must be a number in \[0, 1\)"),
        ("optim.muon.momentum=-0.1", r"must be a number in \[0, 1\)"),
        ("optim.muon.ns_steps=0", r"optim.muon.ns_steps=0 must be an integer in \[1, 99\]"),
        ("optim.muon.ns_steps=2.5", "must be an integer"),
        ("optim.muon.adjust_lr=moonlight", "must be one of match_rms_adamw, original"),
        ("optim.muon.nesterov=1", "must be true or false"),
        ("optim.muon.ns_dtype=float16", r"optim.muon.ns_dtype='float16' must be one of bfloat16, float32"),
    ],
)
def test_bad_muon_settings_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        check_optim_config(muon_cfg(override))


def test_muon_needs_a_torch_that_has_it_and_a_block_matrix_to_train(monkeypatch):
    model = gpt2()
    for p in model.blocks.parameters():
        # e.g. only the embeddings train
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable 2-D weight inside its blocks for Muon"):
        build_optimizer(model, muon_cfg())
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(
        ConfigError, match=r"optim=muon needs torch >= 2.9 \(torch.optim.Muon\); this is torch"
    ):
        check_optim_config(muon_cfg())


def test_a_bad_muon_setting_on_the_command_line_is_one_line_and_writes_nothing(capsys, tmp_path):
    from conftest import run_main

    code, _, err = run_main(
        capsys, "train", "optim=muon", "optim.muon.ns_steps=0", f"runs_dir={tmp_path}", "name=bad"
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: optim.muon.ns_steps=0 must be an integer in [1, 99] (Newton-Schulz iterations)"
    ]
    assert not (tmp_path / "bad").exists()


# ---- through Lightning: precisions, clipping, compile, accumulation ----------------------------------------
SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def prepared():
    from gptkit.data import prepare

    return prepare({"kind": "shakespeare"}, {"kind": "byte"}, progress=False)


def fit(prepared, tmp_path, steps=3, batch=BATCH, peak=None, **trainer):
    from gptkit.data import TokenDataModule
    from gptkit.training.module import LitGPT
    from gptkit.training.plan import make_plan
    from gptkit.training.trainer import build_trainer, check_trainer_config

    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    cfg = compose(
        "train",
        [
            "optim=muon",
            *tiny_model(model="llama-tiny", kv_heads=1, d_ff=64, seq_len=SEQ),
            "model.vocab_size=256",
            f"trainer.batch_size={batch}",
            "trainer.progress=off",
            "trainer.val_every=1000",
            "trainer.checkpoint_every=1000",
            "optim.warmup_steps=0",
            f"trainer.log_every={steps}",
        ],
    )
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for k, v in trainer.items():
        cfg.trainer[k] = v
    check_trainer_config(cfg.trainer)
    cfg.trainer.max_steps = steps
    torch.manual_seed(0)
    plan = make_plan(cfg, tmp_path, ModelConfig.from_dict(OmegaConf.to_container(cfg.model)))
    # 1.0 training FLOPs per token by the full-attention count, 0.75 by the causal one
    plan = dataclasses.replace(plan, flops_per_token=1.0, causal_flops_per_token=0.75, peak_flops=peak)
    module = LitGPT(plan)
    dm = TokenDataModule(prepared, batch_size=batch, seq_len=SEQ, seed=1, val_windows=2)
    tr, _, metrics = build_trainer(plan, [])
    tr.fit(module, datamodule=dm)
    assert tr.global_step == steps and isinstance(tr.optimizers[0], MuonWithAdamW)
    return module, metrics


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_precision_trains_with_clipping_and_compile(prepared, tmp_path, precision):
    _, metrics = fit(
        prepared,
        tmp_path,
        precision=precision,
        gradient_clip_val=0.5,
        compile=precision == "32-true",
        compile_backend="aot_eager",
        peak=1e9,
    )
    assert torch.isfinite(torch.tensor(metrics.last["train/loss"]))
    # perf/mfu by the full-attention count (1.0 FLOP per token here), perf/mfu_causal by the causal (0.75)
    last = metrics.last
    assert last["perf/mfu"] == pytest.approx(last["perf/tokens_per_s"] * 1.0 / 1e9)
    assert last["perf/mfu_causal"] == pytest.approx(0.75 * last["perf/mfu"])
    assert last["perf/flops_per_s"] == pytest.approx(last["perf/tokens_per_s"])


def test_gradient_accumulation_steps_once_on_the_mean_gradient(prepared, tmp_path):
    """Lightning with 2 micro-batches per step equals stepping MuonWithAdamW by hand on the mean gradient
    of the same micro-batches."""
    module, _ = fit(prepared, tmp_path, steps=2, batch=2, accumulate_grad_batches=2, gradient_clip_val=None)
    from gptkit.data import TokenDataModule

    sampler = TokenDataModule(prepared, batch_size=2, seq_len=SEQ, seed=1, val_windows=2).sampler
    torch.manual_seed(0)
    ref = GPT(module.model.cfg)
    opt = build_optimizer(ref, module.optim_cfg)
    sched = build_scheduler(opt, module.optim_cfg, 2)
    for micro in range(4):
        x, y, *_ = sampler.batch(micro, 0, 1)  # [2, SEQ] each
        (ref(x, y).loss / 2).backward()
        if micro % 2:
            opt.step()
            sched.step()
            opt.zero_grad()
    for (name, a), b in zip(module.model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


# ---- through the CLI (in process): the start-up line, an exact resume, init_from= --------------------------
def cli_args(corpus, runs, name, *extra):
    keys = dict(model="llama-tiny", kv_heads=1, d_ff=64, steps=6, threads=1, warmup=1)
    return ["train", "optim=muon", *tiny_run(corpus, runs, name, *extra, **keys)]


def test_muon_run_announces_its_groups_resumes_bit_identically_and_fine_tunes(capsys, corpus, tmp_path):
    import csv

    from conftest import run_main

    code, _, err = run_main(capsys, *cli_args(corpus, tmp_path, "straight"))
    assert code == 0, err[-3000:]
    line = next(x for x in err.splitlines() if "Muon (torch.optim.Muon" in x)
    # qkv, o, 3 MLP
    assert "parameters in 5 block matrices" in line and "AdamW (fused) for" in line, line
    code, _, err = run_main(capsys, *cli_args(corpus, tmp_path, "split", "trainer.stop_at_step=3"))
    assert code == 0, err[-3000:]
    ckpt = torch.load(tmp_path / "split/checkpoints/last.ckpt", weights_only=True)
    # Muon's state travels with the run
    assert "momentum_buffer" in ckpt["optimizer_states"][0]["state"][0]
    code, _, err = run_main(capsys, "train", f"resume={tmp_path / 'split'}")
    assert code == 0, err[-3000:]

    def rows(run):
        with open(tmp_path / run / "metrics.csv", newline="") as f:
            return [(r["step"], r["train/loss"], r["val/loss"]) for r in csv.DictReader(f)]

    # rows 1-6 as text: bit-identical
    assert len(rows("straight")) == 6 and rows("straight") == rows("split")
    # another optimizer cannot continue the run's state: one line
    code, _, err = run_main(capsys, "train", f"resume={tmp_path / 'split'}", "optim=adamw")
    assert code == 2 and err.strip().splitlines() == [
        f"error: resume={tmp_path / 'split'} continues a run trained with optim=muon; "
        f"for optim=adamw start a new run from its weights: init_from={tmp_path / 'split'}"
    ]
    # init_from= with Muon: a new run (fresh Muon and AdamW state) from the weights
    code, _, err = run_main(
        capsys,
        "train",
        f"init_from={tmp_path / 'straight'}",
        "optim=muon",
        "data=files",
        f"data.paths=[{corpus}]",
        "trainer.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_windows=4",
        "trainer.progress=false",
        "trainer.threads=1",
        f"runs_dir={tmp_path}",
        "name=ft",
    )
    assert code == 0, err[-3000:]
    assert torch.load(tmp_path / "ft/checkpoints/last.ckpt", weights_only=True)["global_step"] == 2


# ---- 2 processes (gloo) against one: DDP, and FSDP2 with Newton-Schulz on the gathered matrices ------------
def test_ddp_and_fsdp2_match_one_process(tmp_path):
    """2 gloo processes against one: FSDP2 (Newton-Schulz shared out by matrix) = FSDP2 (every matrix
    gathered on every rank) = DDP, bit for bit, in both dtypes; with optim.muon.ns_dtype=float32 they are one
    process's weights to 1e-6 after 3 steps."""

    import muon_distributed as w
    from conftest import run_two_ranks

    run_two_ranks("muon_distributed.py", tmp_path)
    for ns_dtype in w.NS_DTYPES:
        # one process, the whole batch
        model, opt = w.model_and_optimizer(fsdp=False, ns_dtype=ns_dtype)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        for x, y in w.batches():
            model(x, y).loss.backward()
            opt.step()
            opt.zero_grad()
        want = model.state_dict()
        ddp, fsdp, gathered = (
            torch.load(tmp_path / f"{run}-{ns_dtype}.pt", weights_only=True)
            for run in ("ddp", "fsdp", "fsdp-gathered")
        )
        for k, v in want.items():
            assert torch.equal(fsdp[k], gathered[k]), (ns_dtype, k)
            assert torch.equal(fsdp[k], ddp[k]), (ns_dtype, k)
            # every tensor moved
            assert (v - start[k]).abs().max() > 1e-3, k
            if ns_dtype == "float32":
                # the gradients differ in the last bits (2 half-batch means vs one mean); float32
                # Newton-Schulz keeps that difference small (bfloat16 rounds it up to ~1e-2 of the update)
                torch.testing.assert_close(ddp[k], v, rtol=0, atol=1e-6, msg=k)


# ---- gptkit bench optim: one lr grid for every optimizer, the best of each on every seed, side by side ----
def test_bench_optim_sweeps_one_grid_and_compares_the_best_of_each_seed_by_seed(tmp_path, monkeypatch):
    """Every optimizer is swept over the same lrs (seed 1; the optimizers of an lr queued together, side by
    side with parallel=2), then each at its own best lr on the other seeds; steps to the baseline's median
    final val loss are interpolated between validations; wall and CPU seconds at equal steps are compared
    with the baseline run of the same seed."""
    import json

    from gptkit.bench import optim as bench

    # a run folder as `gptkit train` leaves it: 4 steps of 10 tokens, val every 2
    def fake_run(args, log):
        opts = dict(a.split("=", 1) for a in args)
        # continues an interrupted run: its own arguments are in its folder
        if "resume" in opts:
            order.append(f"resume {Path(opts['resume']).name}")
            opts = saved[Path(opts["resume"]).name]
        else:
            saved[opts["name"]] = opts
            order.append(opts["name"])
        run = tmp_path / "runs" / opts["name"]
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run / "checkpoints/last.ckpt").write_bytes(b"")
        (run / "config.yaml").write_text("trainer: {max_steps: 4, max_tokens: null}\n")
        muon, seed, lr = opts["optim"] == "muon", int(opts["seed"]), float(opts["optim.lr"])
        # seconds per step: AdamW 2 x seed, Muon 3 x seed; CPU seconds: AdamW 1, Muon 1.25 per step
        tokens_per_s, per_cpu_s = 10 / (seed * (3 if muon else 2)), 10 / (1.25 if muon else 1)
        # AdamW is best at lr 1, Muon at lr 4; Muon's final loss 0.6 lower at its best
        best = 4.0 if muon else 1.0
        final = 1.8 - 0.6 * muon + abs(lr - best) + 0.01 * seed
        losses = {2: final + 0.4, 4: final}
        rows = ["step,perf/tokens,perf/tokens_per_s,perf/tokens_per_cpu_s,val/loss"]
        # row s: step s (s steps done)
        rows += [f"{s},{10 * s},{tokens_per_s},{per_cpu_s}," for s in range(1, 5)]
        rows += [f"{s},,,,{loss}" for s, loss in losses.items()]
        (run / "metrics.csv").write_text("\n".join(rows) + "\n")

    order, saved = [], {}
    monkeypatch.setattr(bench, "run_one", fake_run)
    cfg = OmegaConf.create(
        dict(
            recipes={"r": []},
            optimizers={"adamw": ["optim=adamw"], "muon": ["optim=muon"]},
            lrs=[1.0, 4.0],
            baseline="adamw",
            common=[],
            seeds=[1, 2],
            parallel=1,
            runs_dir=str(tmp_path / "runs"),
            out=str(tmp_path / "out.json"),
        )
    )
    assert bench.run(cfg) == 0
    assert order == [
        "r-adamw-lr1-seed1",
        "r-muon-lr1-seed1",
        "r-adamw-lr4-seed1",
        "r-muon-lr4-seed1",
        "r-adamw-lr1-seed2",
        "r-muon-lr4-seed2",
    ]
    r = json.loads((tmp_path / "out.json").read_text())["results"]["r"]
    assert r["best_lr"] == {"adamw": 1.0, "muon": 4.0} and r["target_val_loss"] == pytest.approx(1.815)
    adamw, muon = r["optimizers"]["adamw"], r["optimizers"]["muon"]
    # AdamW (2.21 at step 2, 1.81 at 4) reaches 1.815 between its validations of seed 1 and not on seed 2
    # (1.82); Muon (1.61, 1.62 at step 2) at its first: half the 4 steps AdamW took to its median final loss
    assert adamw["steps_to_target"][0] == pytest.approx(3.975) and adamw["steps_to_target"][1] is None
    assert muon["steps_to_target"] == [2.0, 2.0] and muon["steps_ratio"] == 0.5 and adamw["steps_ratio"] == 1
    # seed by seed, whatever the load: 1.5x the wall seconds, 1.25x the CPU seconds
    assert muon["wall_ratio"] == {"median": 1.5, "min": 1.5, "max": 1.5}
    assert muon["cpu_ratio"]["median"] == pytest.approx(1.25) and muon["train_cpu_seconds"]["median"] == 5.0
    # finished runs are read, not rerun
    assert bench.run(cfg) == 0 and len(order) == 6
    # a run killed after a checkpoint (its last validation before max_steps) is continued, not taken as done
    metrics = tmp_path / "runs" / "r-muon-lr4-seed2" / "metrics.csv"
    # no val after step 4
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:-1]) + "\n")
    assert bench.run(cfg) == 0 and order[6:] == ["resume r-muon-lr4-seed2"]


def test_muon_orthogonalizes_a_tensor_parallel_qkv_as_the_one_fused_matrix():
    """trainer.tensor_parallel splits qkv_proj into q, k, v (training/tensor_parallel.py): Muon stacks their
    updates and orthogonalizes the whole matrix, with its lr adjustment, as one process's fused qkv_proj;
    orthogonalizing each part alone (what it did before qkv_parts) gives another step."""
    from gptkit.training.optim import MuonWithAdamW, qkv_parts

    torch.manual_seed(0)
    sizes = [16, 8, 8]
    whole = torch.nn.Parameter(torch.randn(32, 16))
    parts = [torch.nn.Parameter(rows.clone()) for rows in torch.split(whole.detach(), sizes)]
    named = [(f"blocks.0.attn.qkv_proj.{p}.weight", t) for p, t in zip("qkv", parts)]
    assert sorted(qkv_parts(named).values()) == [("blocks.0.attn.qkv_proj", i) for i in range(3)]

    def step(params, fused):
        muon = torch.optim.Muon(params, lr=0.1, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        opt = MuonWithAdamW(muon, None, ns_dtype=torch.float32, fused=fused)
        for i in range(2):
            grad = torch.randn(32, 16, generator=torch.Generator().manual_seed(i))
            for p, g in zip(params, torch.split(grad, [p.shape[0] for p in params])):
                p.grad = g.clone()
            opt.step()
        return torch.cat([p.detach() for p in params])

    alone = [torch.nn.Parameter(rows.clone()) for rows in torch.split(whole.detach(), sizes)]
    one = step([whole], {})
    assert torch.allclose(step(parts, qkv_parts(named)), one, atol=1e-6)
    assert not torch.allclose(step(alone, {}), one, atol=1e-3)
