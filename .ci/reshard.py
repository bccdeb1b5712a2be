"""Sharded and one-file checkpoints read back at another mesh shape (gptkit/training/reshard.py), on gloo
CPU processes: the fsdp strategy itself (its one mesh, training/mesh.py; distributed.parallelize: tensor
parallel, expert parallel, FSDP2 or HSDP; its save_checkpoint and load_checkpoint), fp32.

Each case: a run at the saved mesh, 6 steps, checkpoint at step 3 (sharded folder and one file); the step-3
checkpoint read at the new mesh; there
  - the weights and optimizer state, gathered whole and in the one-process layout (q, k, v fused), equal the
    saved ones bit for bit ("state");
  - steps 4-6 run from it; their losses against the uninterrupted run at the new mesh ("vs new": not bit
    for bit where the meshes differ, their first 3 steps added in another order) and against the saved
    mesh's own steps 4-6 ("vs saved"); at the same mesh both must be 0.

    python .ci/reshard.py            (prints one row per case and the seconds; exit 1 on a failure)
"""

import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gptkit.model import GPT
from gptkit.model.config import ModelConfig
from gptkit.model.mha import fuse_qkv_optim_state, fuse_qkv_state

LLAMA = dict(
    vocab_size=67, max_seq_len=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=48,
    position="rope", mlp="swiglu", norm="rmsnorm", bias=False, tie_embeddings=False, dropout=0.0,
    attention="sdpa",
)  # fmt: skip
MOE = dict(
    LLAMA,
    moe=dict(n_experts=4, top_k=2, d_expert=24, aux_loss_coef=0.0, impl="loop"),
)
B, T, STEPS, SAVE_AT = 4, 16, 6, 3
# the bound on loss differences where the meshes differ (reduction order; the loss is fp32); same mesh: 0
LOOSE = 1e-5


def batches(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (B, T + 1), generator=g) for _ in range(STEPS)]


class Holder(torch.nn.Module):
    """What the fsdp strategy loads into: a LightningModule's `model` and `finetune` (full)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        from gptkit.training.finetune.full import Full

        self.finetune = Full(None)


def optim_cfg(kind):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        dict(
            name=kind, lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, decay_embeddings=False,
            decay_norms_and_biases=False, fused=False,
            muon=dict(
                momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="float32", adjust_lr="match_rms_adamw"
            ),
        )
    )  # fmt: skip


def build(cfg, init, dims, kind):
    """The fsdp strategy (its one mesh: training/mesh.py) and the model it shards (distributed.parallelize:
    tensor parallel, expert parallel, FSDP2 or HSDP), its optimizer; (module, optimizer, data rank, data
    ranks, strategy)."""
    from gptkit.training.checkpoint_io import SafeAtomicCheckpointIO
    from gptkit.training.distributed import _fsdp2_strategy_class, fsdp_options, parallelize
    from gptkit.training.mesh import build_mesh
    from gptkit.training.optim import build_optimizer

    class Strategy(_fsdp2_strategy_class()):
        global_rank = property(lambda self: dist.get_rank())
        world_size = property(lambda self: dist.get_world_size())

    s = Strategy(fsdp_options({}), "32-true", dims, timedelta(seconds=600))
    s.checkpoint_io = SafeAtomicCheckpointIO()
    s.mesh = build_mesh("cpu", dims)
    model = GPT.from_state(ModelConfig.from_dict(cfg), {k: v.clone() for k, v in init.items()}).train()
    assert parallelize(model, s)
    holder = Holder(model)
    opt = build_optimizer(model, optim_cfg(kind))
    s.model, s._lightning_module, s.optimizers = holder, holder, [opt]
    rank, size = s.mesh.data_ranks()
    return holder, opt, rank, size, s


def steps(holder, opt, data, first, last, dp_rank, dp):
    from gptkit.training.tensor_parallel import loss_context

    losses, rows = [], B // dp
    for seq in data[first:last]:
        x, y = seq[dp_rank * rows : (dp_rank + 1) * rows, :-1], seq[dp_rank * rows : (dp_rank + 1) * rows, 1:]
        with loss_context(holder.model):
            loss = holder.model(x, y).loss
            loss.backward()
        loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().clone()
        # the tensor-parallel ranks of a group hold the same loss: the sum over all / world = the dp mean
        dist.all_reduce(loss)
        losses.append(float(loss / dist.get_world_size()))
        opt.step()
        opt.zero_grad()
    return losses


def whole(holder, opt):
    """The weights and optimizer state gathered, in the one-process layout, keyed by name (rank 0's)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(holder, options=options)
    osd = get_optimizer_state_dict(holder, opt, options=options)
    if dist.get_rank() != 0:
        return None
    osd = fuse_qkv_optim_state(osd)
    flat = {f"model/{k}": v for k, v in fuse_qkv_state(model).items()}
    for name, s in osd["state"].items():
        flat.update({f"optim/{name}/{k}": v for k, v in s.items()})
    # a copy: with one rank per shard a "gathered" tensor is the parameter's own storage, which trains on
    return {k: v.detach().clone() for k, v in flat.items()}


def worker(rank, world, jobs, tmp):
    from gptkit.training.mesh import MeshDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["RESHARD_PORT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    for job in jobs:
        name, cfg = job["name"], job["cfg"]
        init = torch.load(os.path.join(tmp, f"init-{job['model']}.pt"))
        data = batches(cfg["vocab_size"])
        dims = MeshDims(world=world, dp_replicate=job["replicate"], tp=job["tp"], ep=job["ep"])
        holder, opt, dp_rank, dp, s = build(cfg, init, dims, job["kind"])
        out = {}
        if job["load"] is None:
            # the uninterrupted run (saving its step-3 checkpoint both ways when asked)
            out["losses"] = steps(holder, opt, data, 0, SAVE_AT, dp_rank, dp)
            for sharded in (True, False) if job["save"] else ():
                s._save_distributed_checkpoint = sharded
                checkpoint = {
                    "state_dict": s.lightning_module_state_dict(),
                    "optimizer_states": [s.optimizer_state(opt)],
                    "global_step": SAVE_AT,
                }
                s.save_checkpoint(checkpoint, os.path.join(tmp, f"{name}-{'sharded' if sharded else 'file'}"))
            saved = whole(holder, opt)
            out["losses"] += steps(holder, opt, data, SAVE_AT, STEPS, dp_rank, dp)
        else:
            rest = s.load_checkpoint(os.path.join(tmp, job["load"]))
            assert rest["global_step"] == SAVE_AT, rest.keys()
            saved = whole(holder, opt)
            out["losses"] = steps(holder, opt, data, SAVE_AT, STEPS, dp_rank, dp)
        if rank == 0:
            out["state"] = saved
            torch.save(out, os.path.join(tmp, f"out-{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()


def one_process_plain(tmp, load, cfg, kind):
    """Lightning's one-process resume (trainer.strategy=auto): gptkit.checkpoints.load_checkpoint (what
    SafeAtomicCheckpointIO reads) into a plain model and its optimizer's load_state_dict, then steps 4-6."""
    from gptkit.checkpoints import load_checkpoint, model_state_dict
    from gptkit.training.optim import build_optimizer

    ckpt = load_checkpoint(os.path.join(tmp, load))
    model = GPT.from_state(ModelConfig.from_dict(cfg), model_state_dict(ckpt)).train()
    opt = build_optimizer(model, optim_cfg(kind))
    opt.load_state_dict(ckpt["optimizer_states"][0])
    names = {id(p): n for n, p in model.named_parameters()}
    flat = {f"model/model.{k}": v.clone() for k, v in model.state_dict().items()}
    for p, s in opt.state.items():
        flat.update({f"optim/model.{names[id(p)]}/{k}": v.clone() for k, v in s.items()})
    data = batches(cfg["vocab_size"])
    losses = []
    for seq in data[SAVE_AT:]:
        loss = model(seq[:, :-1], seq[:, 1:]).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {"state": flat, "losses": losses}


def spawn(world, jobs, tmp):
    os.environ["RESHARD_PORT"] = str(29600 + (os.getpid() + world) % 900)
    from parallel_harness import end_rank

    mp.spawn(end_rank, args=(worker, world, jobs, tmp), nprocs=world)


def job(name, model, kind, tp=1, ep=1, replicate=1, load=None, save=False):
    cfg = {"llama": LLAMA, "moe": MOE}[model]
    return dict(
        name=name, model=model, cfg=cfg, kind=kind, tp=tp, ep=ep, replicate=replicate, load=load, save=save
    )


def compare(tmp, name, saved_run, new_run, same_mesh):
    """(max |state diff| vs the saved state, max |loss diff| vs the new mesh's uninterrupted run, vs the
    saved mesh's steps 4-6)."""
    got = torch.load(os.path.join(tmp, f"out-{name}.pt"))
    saved = torch.load(os.path.join(tmp, f"out-{saved_run}.pt"))
    if set(got["state"]) != set(saved["state"]):
        return float("inf"), float("inf"), float("inf"), sorted(set(got["state"]) ^ set(saved["state"]))[:4]
    dstate, where = max(
        ((got["state"][k].double() - saved["state"][k].double()).abs().max().item(), k)
        for k in saved["state"]
    )
    new = torch.load(os.path.join(tmp, f"out-{new_run}.pt"))["losses"][SAVE_AT:]
    vs_new = max(abs(a - b) for a, b in zip(got["losses"], new))
    vs_saved = max(abs(a - b) for a, b in zip(got["losses"], saved["losses"][SAVE_AT:]))
    return dstate, vs_new, vs_saved, where if dstate else None


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    ok = True
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, cfg in (("llama", LLAMA), ("moe", MOE)):
            torch.manual_seed(0)
            torch.save(GPT(ModelConfig.from_dict(cfg)).state_dict(), os.path.join(tmp, f"init-{model}.pt"))
        # (case name, saved run, the new mesh's uninterrupted run, same mesh)
        cases = []

        def resume(name, saved, new, fmt, same=False, **mesh):
            cases.append((f"{name}-{fmt}", saved, new, same))
            model = "moe" if saved.startswith("ep") else "llama"
            kind = "muon" if saved.endswith("muon") else "adamw"
            return job(f"{name}-{fmt}", model, kind, load=f"{saved}-{fmt}", **mesh)

        four = [
            job("dp2tp2", "llama", "adamw", tp=2, save=True),
            job("hsdp", "llama", "adamw", replicate=2, save=True),
            job("tp4", "llama", "adamw", tp=4),
            job("dp4", "llama", "adamw"),
        ]
        for fmt in ("sharded", "file"):
            four += [
                resume("dp2tp2>dp2tp2", "dp2tp2", "dp2tp2", fmt, same=True, tp=2),
                resume("dp2tp2>tp4", "dp2tp2", "tp4", fmt, tp=4),
            ]
        four += [
            resume("dp2tp2>dp4", "dp2tp2", "dp4", "sharded"),
            resume("hsdp>dp4", "hsdp", "dp4", "sharded"),
            resume("hsdp>hsdp", "hsdp", "hsdp", "sharded", same=True, replicate=2),
        ]
        t0 = time.perf_counter()
        spawn(4, four, tmp)
        t4 = time.perf_counter() - t0
        two = [
            job("tp2", "llama", "adamw", tp=2, save=True),
            job("dp2", "llama", "adamw", save=True),
            job("tp2-muon", "llama", "muon", tp=2, save=True),
            job("dp2-muon", "llama", "muon"),
            job("ep2", "moe", "adamw", ep=2, save=True),
            job("ep1", "moe", "adamw", save=True),
            resume("dp2tp2>dp2", "dp2tp2", "dp2", "sharded"),
            resume("dp2>tp2", "dp2", "tp2", "sharded", tp=2),
            resume("tp2-muon>dp2", "tp2-muon", "dp2-muon", "sharded"),
            resume("ep1>ep2", "ep1", "ep2", "sharded", ep=2),
            resume("ep2>ep2", "ep2", "ep2", "sharded", same=True, ep=2),
        ]
        for fmt in ("sharded", "file"):
            two += [resume("tp2>dp2", "tp2", "dp2", fmt), resume("ep2>ep1", "ep2", "ep1", fmt)]
        t0 = time.perf_counter()
        spawn(2, two, tmp)
        t2 = time.perf_counter() - t0
        one = [
            job("one", "llama", "adamw"),
            resume("dp2tp2>1", "dp2tp2", "one", "sharded"),
            resume("dp2tp2>1", "dp2tp2", "one", "file"),
            resume("tp2>1", "tp2", "one", "sharded"),
        ]
        t0 = time.perf_counter()
        spawn(1, one, tmp)
        # one process without FSDP (trainer.strategy=auto): Lightning's own load
        for src, fmt in (("dp2tp2", "sharded"), ("dp2tp2", "file"), ("tp2", "file")):
            name = f"{src}>plain-{fmt}"
            out = one_process_plain(tmp, f"{src}-{fmt}", LLAMA, "adamw")
            torch.save(out, os.path.join(tmp, f"out-{name}.pt"))
            cases.append((name, src, "one", False))
        t1 = time.perf_counter() - t0
        for name, saved_run, new_run, same in cases:
            dstate, vs_new, vs_saved, diff = compare(tmp, name, saved_run, new_run, same)
            good = dstate == 0 and (vs_new == vs_saved == 0 if same else max(vs_new, vs_saved) <= LOOSE)
            ok &= good
            rows.append(
                f"{name:24s} state {dstate:.1e}  losses vs new mesh {vs_new:.1e}, vs saved mesh "
                f"{vs_saved:.1e}  {'ok' if good else 'FAILED'}{' ' + str(diff) if diff else ''}"
            )
    print("\n".join(rows))
    print(
        f"== .ci/reshard.py: {'ok' if ok else 'FAILED'} (state: 0 bit for bit; losses 0 at the same mesh, "
        f"<= {LOOSE:.0e} across meshes); 4 processes {t4:.0f} s, 2 processes {t2:.0f} s, 1 process "
        f"{t1:.0f} s, {time.perf_counter() - started:.0f} s in all"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
