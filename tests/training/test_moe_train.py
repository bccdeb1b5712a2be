"""Training a mixture of experts (gptkit/training/moe.py): `model=moe-tiny` trains on the CPU with its aux
loss, the per-layer max load and router entropy in metrics.csv and on the progress line; the expert bias moves
every step, is in the checkpoint and resumes bit for bit; accumulation equals one big batch (the aux loss and
the bias update see the whole step); FLOPs count the active parameters, the memory estimate every one."""

import pytest
import torch
from conftest import module_corpus, run_group, run_main, tiny_run
from conftest import rows_by_step as rows

import gptkit
from gptkit import accounting as acc
from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.training.moe import RouterWatch, progress_parts

STEPS = 6


corpus = module_corpus(30_000)


# issue 49's blocks, so that every path below (1 process, DDP, FSDP2 with experts split over ranks, resume,
# LoRA, Muon) trains them: gpt-oss's (sinks, a window layer then a full one, router and expert biases, clamped
# SwiGLU), the output gate, a NoPE layer and partial RoPE (8 of each head's 16 features)
NEW_BLOCKS = [
    "model.attn_sinks=true",
    "model.attn_output_gate=true",
    "model.sliding_window=8",
    "model.layer_types=[local,global]",
    "model.nope_layers=[1]",
    "model.rotary_dim=8",
    "model.moe.router_bias=true",
    "model.moe.expert_biases=true",
    "model.moe.activation=clamped_swiglu",
]


def moe_args(corpus, runs, name, *extra):
    """moe-tiny shrunk: 2 layers of 4 experts (top-2) of width 24, d_model 32, the expert bias on, and
    NEW_BLOCKS."""
    keys = dict(model="moe-tiny", layers=2, val_fraction=0.1, steps=STEPS, accelerator="cpu")
    experts = [
        "model.moe.n_experts=4",
        "model.moe.d_expert=24",
        "model.moe.bias_update_rate=0.01",
        "model.moe.z_loss_coef=0.001",
        *NEW_BLOCKS,
    ]
    return tiny_run(corpus, runs, name, *experts, *extra, **keys)


def biases(run, name="last.ckpt"):
    state = torch.load(run / "checkpoints" / name, weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.endswith("expert_bias")}


ROUTER_KEYS = ["train/aux_loss", "moe/balance"] + [
    f"moe/{k}/{i}" for i in (0, 1) for k in ("max_load", "entropy")
]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    gptkit.train(moe_args(corpus, runs, "straight", "trainer.progress=lines"))
    return runs / "straight"


def test_moe_tiny_trains_and_logs_the_router(straight):
    got = rows(straight)
    train = {s: r for s, r in got.items() if r.get("train/loss")}
    assert sorted(train) == list(range(1, STEPS + 1))
    for r in train.values():
        # the balance figure is 1 when balanced and E / k = 2 when collapsed (a little under 1 when the expert
        # bias, not the scores, picks a less probable expert); the entropy at most log 4
        assert 0.95 <= float(r["moe/balance"]) < 2.0
        for i in (0, 1):
            assert 1.0 <= float(r[f"moe/max_load/{i}"]) <= 2.0
            assert 0.0 < float(r[f"moe/entropy/{i}"]) <= float(torch.log(torch.tensor(4.0))) + 1e-6
        # 0.01 * balance + 0.001 * z per layer, over 2 layers: at least the balance terms
        assert float(r["train/aux_loss"]) >= 2 * 0.01
    assert float(train[STEPS]["train/loss"]) < float(train[1]["train/loss"])
    # the bias moved (a step of 0.01 per expert per step, centred) and sums to 0 in every layer
    # (a router near uniform may swing a bias up and down, back to 0 at an even step: steps 3 or 6)
    b, at3 = biases(straight), biases(straight, "step-000003.ckpt")
    assert sorted(b) == ["model.blocks.0.mlp.expert_bias", "model.blocks.1.mlp.expert_bias"]
    for k, v in b.items():
        assert max(v.abs().max(), at3[k].abs().max()) > 0 and abs(float(v.sum())) < 1e-6


def test_the_progress_line_shows_the_aux_loss_the_worst_load_and_the_lowest_entropy():
    metrics = {
        "train/aux_loss": 0.0213,
        "moe/max_load/0": 1.2,
        "moe/max_load/3": 1.9,
        "moe/entropy/0": 1.1,
        "moe/entropy/3": 1.3,
    }
    assert progress_parts(metrics) == ["aux 0.0213", "max load 1.90 (L3)", "router H 1.10 (L0)"]
    # a dense run: nothing
    assert progress_parts({"train/loss": 2.0}) == []


def test_the_expert_bias_resumes_bit_for_bit(corpus, straight):
    runs = straight.parent
    gptkit.train(moe_args(corpus, runs, "split", "trainer.stop_at_step=3"))
    at3 = biases(runs / "split")
    gptkit.train([f"resume={runs / 'split'}", f"runs_dir={runs}", "name=split"])
    # the checkpoint of step 3 holds the bias after step 3's update: what the straight run had then
    assert all(torch.equal(at3[k], v) for k, v in biases(straight, "step-000003.ckpt").items())
    a, b = rows(straight), rows(runs / "split")
    keys = ["train/loss", "train/grad_norm", "val/loss", *ROUTER_KEYS]
    assert [[r.get(k) for k in keys] for r in a.values()] == [[r.get(k) for k in keys] for r in b.values()]
    assert all(torch.equal(biases(runs / "split")[k], v) for k, v in biases(straight).items())


def test_the_bias_moves_by_the_loads_of_the_whole_step_over_its_micro_batches():
    """Two micro-batches of a step move the bias as one batch of both does (RouterWatch sums their loads
    before the update), and only training forwards count."""
    cfg = ModelConfig.from_dict(
        {
            **ModelConfig(vocab_size=48, max_seq_len=16, n_layers=2, n_heads=2, d_model=32).to_dict(),
            "mlp": "swiglu",
            "moe": {"n_experts": 4, "top_k": 2, "d_expert": 24, "bias_update_rate": 0.01},
        }
    )
    torch.manual_seed(0)
    idx = torch.randint(0, 48, (4, 16))
    ends = []
    for parts in ([idx], [idx[:2], idx[2:]]):
        torch.manual_seed(1)
        model = GPT(cfg).train()
        watch = RouterWatch(model, world_size=1)
        for _ in range(3):
            for part in parts:
                model(part)
                assert watch.take() is not None
            with torch.no_grad():
                model.eval()(idx)
            model.train()
            assert watch.take() is None
            watch.after_optimizer_step()
        ends.append(torch.stack([b.mlp.expert_bias for b in model.blocks]))
    assert ends[0].abs().max() > 0 and torch.equal(ends[0], ends[1])


def test_flops_count_the_active_parameters_and_memory_every_one(corpus, tmp_path):
    plan = gptkit.plan(moe_args(corpus, tmp_path, "plan"))
    c = acc.count_params(plan.model)
    assert c.active < c.total
    f = acc.flops_per_token(plan.model, plan.seq_len)
    assert plan.flops_per_token == f.train_dense
    # not matmul weights either: the sinks, and per layer the router's bias and the biases of a token's 2
    # experts (gate and up 24 each, down 32)
    biases = c.attn_sinks + 2 * (4 + 2 * (24 + 24 + 32))
    assert f.n_matmul == c.active - c.tok_emb - c.norms - c.final_norm - biases
    assert acc.training_memory(plan.model, "32-true")["optimizer"] == c.total * 8


@pytest.mark.parametrize(
    "extra, named",
    [
        (
            ["trainer.expert_parallel=2"],
            "trainer.expert_parallel=2 shards the experts beside FSDP2: it needs ",
        ),
        (["trainer=fsdp", "trainer.expert_parallel=2"], "must divide the job's 1 process(es)"),
        (
            ["trainer=fsdp", "trainer.devices=2", "trainer.expert_parallel=2", "model.moe.n_experts=3"],
            "trainer.expert_parallel=2 must divide model.moe.n_experts=3",
        ),
        (
            ["trainer=fsdp", "trainer.devices=2", "trainer.expert_parallel=2", "model.moe=null"],
            "this model has none (model.moe is null)",
        ),
        (["trainer.expert_parallel=0"], "trainer.expert_parallel=0 must be an integer >= 1"),
    ],
)
def test_bad_expert_parallel_settings_are_one_line_config_errors(corpus, tmp_path, extra, named):
    with pytest.raises(ConfigError) as e:
        gptkit.plan(moe_args(corpus, tmp_path, "bad", *extra))
    assert named in str(e.value) and "\n" not in str(e.value)


def close_rows(got, want, keys, tol=1e-5):
    """The same logged steps, each figure within tol (fp32: 2 ranks reduce in another order than 1)."""
    train = sorted(s for s, r in want.items() if r.get("train/loss"))
    assert train == sorted(s for s, r in got.items() if r.get("train/loss")) == list(range(1, STEPS + 1))
    for s, r in want.items():
        for k in keys:
            if r.get(k):
                assert abs(float(got[s][k]) - float(r[k])) < tol, (s, k, got[s][k], r[k])


@pytest.mark.long
def test_ddp_and_fsdp2_with_expert_parallelism_on_2_processes_follow_one_process_bias_included(
    corpus, straight
):
    """Each rank half the step's sequences: the per-sequence balance loss, the token-weighted aux gradient and
    the all-reduced loads make 2 ranks train as 1 process; so does FSDP2 with each rank holding half the
    experts and the tokens sent to them by all-to-all (trainer.expert_parallel=2,
    training/expert_parallel.py), whose sharded checkpoints hold the bias and every expert and continue in 1
    process."""
    runs = straight.parent
    keys = ["train/loss", "train/grad_norm", "val/loss", *ROUTER_KEYS]
    two = ["trainer.devices=2", "trainer.batch_size=2"]
    r = run_group("-m", "gptkit", "train", *moe_args(corpus, runs, "ddp", "trainer=ddp", *two))
    assert r.returncode == 0, r.stderr[-3000:]
    close_rows(rows(runs / "ddp"), rows(straight), keys)
    # the loads are counts: the same expert biases exactly
    assert all(torch.equal(biases(runs / "ddp")[k], v) for k, v in biases(straight).items())
    fsdp = ["trainer=fsdp", "trainer.precision=32-true", "trainer.stop_at_step=3", *two]
    r = run_group(
        "-m", "gptkit", "train", *moe_args(corpus, runs, "fsdp", *fsdp, "trainer.expert_parallel=2")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "experts: each MoE layer's 4 over groups of 2 ranks (2 per rank" in r.stderr
    assert (runs / "fsdp/checkpoints/step-000003.ckpt/.metadata").is_file()
    # (a process of its own: FSDP2 over a world of 1 starts a process group)
    one = ["trainer.devices=1", "trainer.batch_size=4", "trainer.expert_parallel=1"]
    r = run_group("-m", "gptkit", "train", f"resume={runs / 'fsdp'}", *one)
    assert r.returncode == 0, r.stderr[-3000:]
    close_rows(rows(runs / "fsdp"), rows(straight), keys)


def mla_mtp_args(corpus, runs, name, *extra):
    """mla-tiny shrunk (2 layers, d_model 32) with moe_args' mixture in every layer and one multi-token
    prediction depth (its block an MoE block like the last layer's)."""
    keys = dict(model="mla-tiny", layers=2, val_fraction=0.1, steps=STEPS, accelerator="cpu")
    model = [
        "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
        "v_head_dim: 8}",
        "model.moe={n_experts: 4, top_k: 2, d_expert: 24, bias_update_rate: 0.01, z_loss_coef: 0.001}",
        "model.mtp={depth: 1, loss_scale: 0.3}",
    ]
    return tiny_run(corpus, runs, name, *model, *extra, **keys)


def test_expert_parallelism_splits_the_mtp_blocks_experts_too():
    """shard_experts splits every Experts of the model over the group, the multi-token prediction block's
    included (it walked model.cfg.moe_layers only): each is the dispatching forward over DTensor stacks. On a
    world of one the model computes what it did."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from gptkit.training.expert_parallel import ExpertGroup, moe_experts, shard_experts

    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=16,
        n_layers=2,
        n_heads=2,
        d_model=32,
        mlp="swiglu",
        norm="rmsnorm",
        moe=dict(n_experts=4, top_k=2, d_expert=24),
        mtp=dict(depth=1),
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 40, (2, 12))
    want = model(x, x, mtp=True)
    # a world of one (an earlier in-process run may have left its own world of one up)
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        one = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        params = shard_experts(model, ExpertGroup(one, None, 1, None))
        experts = moe_experts(model)
        assert experts[-1] is model.mtp.layers[0].block.mlp.experts and len(experts) == 3
        assert len(params) == 3 * 3 and all(isinstance(e.gate_proj, DTensor) for e in experts)
        assert all("forward" in vars(e) for e in experts)
        got = model(x, x, mtp=True)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.mtp_losses[0], want.mtp_losses[0], atol=1e-6, rtol=0)
    finally:
        if fresh:
            dist.destroy_process_group()


@pytest.mark.long
def test_mla_and_mtp_resume_bit_for_bit_and_fsdp2_with_expert_parallelism_follows_one_process(
    corpus, straight
):
    """MLA + MoE + MTP: 6 steps straight and 3 + resume 3 log the same rows and save the same weights; FSDP2
    on 2 processes with the experts split (the MTP block's too) logs one process's losses, MTP's included."""
    runs = straight.parent
    gptkit.train(mla_mtp_args(corpus, runs, "mla-mtp"))
    gptkit.train(mla_mtp_args(corpus, runs, "mla-mtp-halves", "trainer.stop_at_step=3"))
    gptkit.train([f"resume={runs / 'mla-mtp-halves'}", f"runs_dir={runs}", "name=mla-mtp-halves"])
    keys = ["train/loss", "train/mtp_loss_1", "train/grad_norm", "val/loss", *ROUTER_KEYS]
    want, again = rows(runs / "mla-mtp"), rows(runs / "mla-mtp-halves")
    assert [[r.get(k) for k in keys] for r in again.values()] == [
        [r.get(k) for k in keys] for r in want.values()
    ]
    assert want[STEPS]["train/mtp_loss_1"] and sorted(again) == sorted(want)
    weights = [
        torch.load(runs / r / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
        for r in ("mla-mtp", "mla-mtp-halves")
    ]
    assert "model.mtp.layers.0.block.mlp.experts.up_proj" in weights[0]
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())
    two = ["trainer=fsdp", "trainer.precision=32-true", "trainer.devices=2", "trainer.batch_size=2"]
    r = run_group(
        "-m",
        "gptkit",
        "train",
        *mla_mtp_args(corpus, runs, "mla-mtp-ep", *two, "trainer.expert_parallel=2"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    close_rows(rows(runs / "mla-mtp-ep"), want, keys)


def test_lora_on_attention_and_experts_trains_the_adapters_only_and_samples_merged(corpus, straight, capsys):
    runs = straight.parent
    gptkit.train(
        moe_args(
            corpus,
            runs,
            "lora",
            f"init_from={straight}",
            "finetune=lora",
            "lora.targets=[q,v,gate,up,down]",
            "lora.rank=4",
            "trainer.max_steps=3",
        )
    )
    state = torch.load(runs / "lora/checkpoints/last.ckpt", weights_only=True)["state_dict"]
    # the adapters alone (the expert bias is no adapter: it stays the base's, not moved by a LoRA run)
    assert sorted(k for k in state if "experts" in k) == [
        f"model.blocks.{i}.mlp.experts.lora_{t}_{ab}"
        for i in (0, 1)
        for t in ("down", "gate", "up")
        for ab in "AB"
    ]
    assert tuple(state["model.blocks.0.mlp.experts.lora_up_B"].shape) == (4, 24, 4)
    assert state["model.blocks.1.mlp.experts.lora_down_B"].abs().sum() > 0
    code, out, err = run_main(capsys, "sample", f"run={runs / 'lora'}", "prompt=the", "max_new_tokens=4")
    assert code == 0, err


@pytest.mark.long
def test_muon_trains_each_expert_as_a_matrix_and_fsdp2_follows_one_process(corpus, straight, capsys):
    """optim=muon: the expert stacks are Muon's (tests/training/test_muon.py: each expert as torch's Muon
    moves a matrix); under FSDP2 each rank orthogonalizes its own experts, and 2 ranks follow 1 process."""
    runs = straight.parent
    muon = ["optim=muon", "trainer.max_steps=4", "trainer.val_every=2", "trainer.checkpoint_every=2"]
    code, _, err = run_main(capsys, "train", *moe_args(corpus, runs, "muon", *muon))
    assert code == 0, err
    # per layer qkv, o, the output gate, the router and 3 x 4 experts; AdamW the sinks, the router's and
    # the experts' biases (training/test_optim.py: undecayed)
    assert "in 32 block matrices" in err
    two = ["trainer=fsdp", "trainer.devices=2", "trainer.batch_size=2", "trainer.precision=32-true"]
    r = run_group("-m", "gptkit", "train", *moe_args(corpus, runs, "muon-fsdp", *muon, *two))
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = rows(runs / "muon"), rows(runs / "muon-fsdp")
    assert sorted(s for s, r in got.items() if r.get("train/loss")) == [1, 2, 3, 4]
    for s, r in want.items():
        for k in ("train/loss", "val/loss", *ROUTER_KEYS):
            if r.get(k):
                assert abs(float(got[s][k]) - float(r[k])) < 1e-5, (s, k, got[s][k], r[k])
