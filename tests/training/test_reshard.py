"""Checkpoints read at another mesh shape (gptkit/training/reshard.py): the q/k/v layout of the weights and of
the optimizer state (fused <-> split) by the same rows, a tensor-parallel run's checkpoint (sharded and one
file) read back bit for bit by a run without tensor parallelism and the other way round, on one gloo rank;
a resume at a mesh the model cannot take refused in one line. Long: `gptkit train` at dp 2 x tp 2 and
dp 2 x cp 2 (4 processes) stopped and resumed, bit for bit, and resumed at tp 1 / cp 1. The multi-process
matrix (dp x tp -> tp, dp, one process; HSDP; ep 2 <-> 1; sharded and one file) is .ci/reshard's."""

import os
import re
import shutil
from datetime import timedelta

import pytest
import torch
from conftest import module_corpus, rows_by_step, run_group, run_main, tiny_run

from gptkit.model import GPT, ModelConfig
from gptkit.model.mha import (
    fuse_qkv_names,
    fuse_qkv_optim_state,
    fuse_qkv_state,
    split_qkv_names,
    split_qkv_optim_state,
)

CFG = dict(
    vocab_size=37, max_seq_len=8, n_layers=1, n_heads=4, n_kv_heads=2, d_model=16, d_ff=24,
    position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False, dropout=0.0,
)  # fmt: skip
# q: 4 heads x 4, k and v: 2 x 4 rows each
SIZES = [16, 8, 8]


def test_optimizer_state_fuses_and_splits_by_the_rows_the_weights_do():
    """AdamW's moments and Muon's momentum of q, k, v concatenate into the fused qkv_proj's (its rows in q,
    k, v order, as fuse_qkv_state fuses the weights); the step is q's; the names keep their places; split
    inverts fuse bit for bit."""
    g = torch.Generator().manual_seed(0)
    parts = {p: n for p, n in zip("qkv", SIZES)}
    names = ["model.tok_emb.weight", *[f"model.blocks.0.attn.qkv_proj.{p}.weight" for p in "qkv"], "model.o"]
    state = {}
    for name in names:
        rows = parts[name.split(".")[-2]] if ".qkv_proj." in name else 5
        state[name] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(rows, 16, generator=g),
            "exp_avg_sq": torch.rand(rows, 16, generator=g),
            "momentum_buffer": torch.randn(rows, 16, generator=g),
        }
    osd = {
        "state": state,
        "param_groups": [{"params": names[:4], "lr": 0.1}, {"params": names[4:], "lr": 0.2}],
    }
    fused = fuse_qkv_optim_state(osd)
    qkv = "model.blocks.0.attn.qkv_proj.weight"
    assert [g["params"] for g in fused["param_groups"]] == [["model.tok_emb.weight", qkv], ["model.o"]]
    assert [g["lr"] for g in fused["param_groups"]] == [0.1, 0.2]
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        want = torch.cat([state[f"model.blocks.0.attn.qkv_proj.{p}.weight"][key] for p in "qkv"])
        assert torch.equal(fused["state"][qkv][key], want)
    assert fused["state"][qkv]["step"] == 3
    # the weights the same way
    weights = {n: s["exp_avg"] for n, s in state.items()}
    assert torch.equal(fuse_qkv_state(weights)[qkv], fused["state"][qkv]["exp_avg"])
    back = split_qkv_optim_state(fused, SIZES)
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in osd["param_groups"]]
    assert back["state"].keys() == state.keys()
    assert all(torch.equal(back["state"][n][k], state[n][k]) for n in state for k in state[n])
    assert split_qkv_names(fuse_qkv_names(names)) == names
    # a state without parts is returned as it is
    assert fuse_qkv_optim_state(fused) is fused


def _adamw():
    from omegaconf import OmegaConf

    return OmegaConf.create(
        dict(
            name="adamw", lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, decay_embeddings=False,
            decay_norms_and_biases=False, fused=False,
        )
    )  # fmt: skip


class _Module(torch.nn.Module):
    """What the fsdp strategy reads into: a LightningModule's `model` and `finetune`."""

    def __init__(self, model):
        super().__init__()
        from gptkit.training.finetune.full import Full

        self.model, self.finetune = model, Full(None)


def _run(state, tensor_parallel):
    """A GPT of CFG from `state` on the fsdp strategy's 1-rank mesh (the tensor-parallel layout or not: q, k,
    v apart), FSDP2 over it, its AdamW; the strategy around them."""
    from torch.distributed.fsdp import fully_shard

    from gptkit.training.distributed import _fsdp2_strategy_class, fsdp_options
    from gptkit.training.mesh import MeshDims, build_mesh
    from gptkit.training.optim import build_optimizer
    from gptkit.training.tensor_parallel import apply_tensor_parallel

    model = GPT.from_state(ModelConfig.from_dict(CFG), {k: v.clone() for k, v in state.items()}).train()
    dims = MeshDims(world=1)
    strategy = _fsdp2_strategy_class()(fsdp_options({}), "32-true", dims, timedelta(seconds=60))
    mesh = build_mesh("cpu", dims)
    if tensor_parallel:
        # (parallelize applies it from tp 2 on: here the layout alone)
        apply_tensor_parallel(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh.fsdp)
    fully_shard(model, mesh=mesh.fsdp)
    module, opt = _Module(model), build_optimizer(model, _adamw())
    strategy.model, strategy._lightning_module, strategy.optimizers = module, module, [opt]
    return module, opt, strategy


def _step(module, opt, x):
    from gptkit.training.tensor_parallel import local_loss, loss_context

    with loss_context(module.model):
        local_loss(module.model(x, x).loss).backward()
    opt.step()
    opt.zero_grad()


def _loss(module, x) -> float:
    from gptkit.training.tensor_parallel import local_loss, loss_context

    with loss_context(module.model), torch.no_grad():
        return float(local_loss(module.model(x, x).loss))


def _whole(module, opt) -> dict:
    """Weights and optimizer state gathered, in the one-process layout, by name (copies)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    flat = {f"w/{k}": v for k, v in fuse_qkv_state(get_model_state_dict(module, options=options)).items()}
    osd = fuse_qkv_optim_state(get_optimizer_state_dict(module, opt, options=options))
    for name, s in osd["state"].items():
        flat.update({f"o/{name}/{k}": v for k, v in s.items()})
    return {k: v.detach().clone() for k, v in flat.items()}


def _save(strategy, module, opt, path, sharded):
    strategy._save_distributed_checkpoint = sharded
    from gptkit.training.checkpoint_io import SafeAtomicCheckpointIO

    strategy.checkpoint_io = SafeAtomicCheckpointIO()
    checkpoint = {
        "state_dict": strategy.lightning_module_state_dict(),
        "optimizer_states": [strategy.optimizer_state(opt)],
        "global_step": 2,
    }
    strategy.save_checkpoint(checkpoint, path)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "one-file"])
def test_a_tensor_parallel_checkpoint_reads_back_without_it_and_the_other_way(tmp_path, sharded):
    """On one gloo rank (the layouts, not the shards: .ci/reshard runs 1, 2 and 4 processes): a run in the
    tensor-parallel layout (q, k, v three parameters) steps twice and saves; read by the fsdp strategy into a
    run without tensor parallelism, and by a one-process resume (gptkit.checkpoints.load_checkpoint, then the
    optimizer's own load_state_dict, as Lightning does), its weights and AdamW state are the saved ones bit
    for bit, and a further step gives the loss the saving run's did (to 1e-5: the
    layouts' arithmetic differs in the last bit); then the reverse, a run without it read into the
    tensor-parallel layout. (Resuming at tp 1 failed: the optimizer state held q, k, v apart.)"""
    import torch.distributed as dist

    from gptkit.checkpoints import load_checkpoint, model_state_dict
    from gptkit.training.optim import build_optimizer

    torch.manual_seed(0)
    init = GPT(ModelConfig.from_dict(CFG)).state_dict()
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(1))
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for saved_tp in (True, False):
            path = str(tmp_path / f"tp{int(saved_tp)}.ckpt")
            module, opt, strategy = _run(init, saved_tp)
            _step(module, opt, x)
            _step(module, opt, x)
            _save(strategy, module, opt, path, sharded)
            want = _whole(module, opt)
            _step(module, opt, x)
            want_loss = _loss(module, x)
            # the other layout, through the fsdp strategy's reader
            module, opt, strategy = _run(init, not saved_tp)
            assert strategy.load_checkpoint(path)["global_step"] == 2
            got = _whole(module, opt)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            _step(module, opt, x)
            # the state is the same; the math not quite (loss_parallel's cross-entropy, q, k, v as 3 matmuls)
            assert abs(_loss(module, x) - want_loss) < 1e-5
            # one process, no FSDP: Lightning's own load of what gptkit's checkpoint IO reads
            ckpt = load_checkpoint(path)
            plain = GPT.from_state(ModelConfig.from_dict(CFG), model_state_dict(ckpt)).train()
            plain_opt = build_optimizer(plain, _adamw())
            plain_opt.load_state_dict(ckpt["optimizer_states"][0])
            names = {id(p): n for n, p in plain.named_parameters()}
            got = {f"w/model.{k}": v for k, v in plain.state_dict().items()}
            got.update(
                {f"o/model.{names[id(p)]}/{k}": v for p, s in plain_opt.state.items() for k, v in s.items()}
            )
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        if started:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A 2-step llama-tiny run (one process, 4 heads, 2 K/V heads)."""
    from conftest import shakespeare

    from gptkit.cli import main

    d = tmp_path_factory.mktemp("llama")
    (d / "corpus.txt").write_text(shakespeare(8_000))
    args = [
        "train", "model=llama-tiny", "model.n_layers=1", "model.d_model=32", "model.n_heads=4",
        "model.n_kv_heads=2", "model.d_ff=48", "model.max_seq_len=32", "tokenizer=char", "data=files",
        f"data.paths=[{d / 'corpus.txt'}]", "trainer.batch_size=2", "trainer.max_steps=2",
        "trainer.val_every=2", "trainer.val_windows=1", "trainer.progress=false", "trainer.accelerator=cpu",
        "trainer.precision=32-true", f"runs_dir={d / 'runs'}", "name=llama",
    ]  # fmt: skip
    assert main(args) == 0
    return d / "runs" / "llama"


def _listing(run):
    """Every file of a run folder with its size and time (the lock a command takes aside)."""
    return sorted(
        (str(p.relative_to(run)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in run.rglob("*")
        if p.name != ".lock"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.devices=3", "trainer.tensor_parallel=3"], "model.n_heads=4"),
        (["trainer.devices=2", "trainer.tensor_parallel=3"], "trainer.tensor_parallel=3"),
        (["trainer.devices=2", "trainer.expert_parallel=2"], "trainer.expert_parallel=2"),
    ],
)
def test_a_resume_at_a_mesh_the_model_cannot_take_is_refused_in_one_line(
    llama_run, tmp_path, capsys, monkeypatch, overrides, message
):
    """resume= of a tensor-parallel run at another mesh its shapes do not divide: one line naming the
    dimension, exit 2, the run folder as it was (nothing read, nothing written)."""
    from omegaconf import OmegaConf

    run = tmp_path / "llama"
    shutil.copytree(llama_run, run)
    saved = OmegaConf.load(run / "config.yaml")
    # as a dp 1 x tp 2 run on 2 processes saved it
    saved.trainer.strategy, saved.trainer.devices, saved.trainer.tensor_parallel = "fsdp", 2, 2
    OmegaConf.save(saved, run / "config.yaml")
    before = _listing(run)
    # a machine with the cores for 3 processes (this one may have 2): the model's check is what refuses
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    code, _, err = run_main(capsys, "train", f"resume={run}", *overrides)
    # (the data's cache line may come first: the model's heads are checked once the tokenizer gives the vocab)
    errors = [line for line in err.strip().splitlines() if not line.startswith("cache hit:")]
    assert code == 2 and len(errors) == 1 and re.search(re.escape(message), errors[0]), err
    assert _listing(run) == before


corpus = module_corpus(30_000)
LLAMA_TINY = (
    "model=llama-tiny", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.position=rope", "model.attention=eager",
)  # fmt: skip


def _train(*argv):
    r = run_group("-m", "gptkit", "train", *argv)
    assert r.returncode == 0, r.stderr[-3000:]


def _losses(run):
    return {
        step: float(row["train/loss"]) for step, row in rows_by_step(run).items() if row.get("train/loss")
    }


@pytest.mark.long
@pytest.mark.parametrize("dim", ["tensor_parallel", "context_parallel"])
def test_a_stopped_run_resumes_to_the_bit_at_its_mesh_and_at_another_within_reduction_order(
    corpus, tmp_path, monkeypatch, dim
):
    """`gptkit train trainer=fsdp trainer.devices=4 trainer.<dim>=2` (dp 2 x tp 2, dp 2 x cp 2; 4 gloo
    processes, fp32) stopped after step 3 and resumed: the train losses and the last checkpoint (weights,
    optimizer state) are the uninterrupted run's bit for bit. Its step-3 checkpoint resumed at <dim> 1 on 2
    processes (dp 2): the losses within 1e-5 of the uninterrupted run (another reduction order)."""
    from gptkit.checkpoints import read_sharded_checkpoint

    # 4 processes on a machine that may have 2 cores: every process of the runs sees 8 (gptkit refuses more
    # processes than cores); what runs is unchanged, only slower
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.cpu_count = lambda: 8\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    base = tiny_run(corpus, tmp_path, None, *LLAMA_TINY, layers=2, steps=6, val_every=3, batch_size=2)
    base += ["trainer.precision=32-true", "trainer.accelerator=cpu"]
    mesh = ("trainer=fsdp", "trainer.devices=4", f"trainer.{dim}=2")
    _train(*base, "name=whole", *mesh)
    _train(*base, "name=stopped", *mesh, "trainer.stop_at_step=3")
    shutil.copytree(tmp_path / "stopped", tmp_path / "other")
    _train(f"resume={tmp_path / 'stopped'}")
    want, got = _losses(tmp_path / "whole"), _losses(tmp_path / "stopped")
    assert sorted(want) == list(range(1, 7)) and got == want, (got, want)
    a = read_sharded_checkpoint(tmp_path / "whole/checkpoints/last.ckpt")
    b = read_sharded_checkpoint(tmp_path / "stopped/checkpoints/last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    # at another mesh: dp 2 on 2 processes, the same global batch
    _train(f"resume={tmp_path / 'other'}", "trainer.devices=2", f"trainer.{dim}=1")
    other = _losses(tmp_path / "other")
    assert sorted(other) == sorted(want) and all(abs(other[s] - want[s]) < 1e-5 for s in want), (other, want)
