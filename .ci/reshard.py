"""Sharded and one-file checkpoints read back at another mesh shape (gptkit/training/reshard.py), on gloo CPU
processes, float64: the fsdp strategy's own writer and reader (_FSDP2Strategy.save_checkpoint, load_checkpoint)
around a model sharded as distributed.parallelize shards it (tensor parallel, then expert parallel, then FSDP2).

Each case: a run at the saved mesh, 6 steps, checkpoint at step 3 (sharded folder and one file); the step-3
checkpoint read at the new mesh; there
  - the weights and optimizer state, gathered whole and in the one-process layout (q, k, v fused), equal the
    saved ones bit for bit ("state");
  - steps 4-6 run from it, their losses against the uninterrupted run at the new mesh ("vs new": not bit
    for bit where the meshes differ, their first 3 steps added in another order) and against the saved
    mesh's own steps 4-6 ("vs saved"); at the same mesh both must be 0.

    python .ci/reshard.py            (prints one row per case and the seconds; exit 1 on a failure)
"""

import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

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
# the bound on float64 loss differences where the meshes differ (reduction order); same mesh: 0
LOOSE = 1e-12


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


def strategy(world, tp, ep, sharded):
    from gptkit.training.checkpoint_io import SafeAtomicCheckpointIO
    from gptkit.training.distributed import _fsdp2_strategy_class, fsdp_options

    class Strategy(_fsdp2_strategy_class()):
        global_rank = property(lambda self: dist.get_rank())
        world_size = property(lambda self: dist.get_world_size())

    options = dict(fsdp_options({}), sharded_checkpoint=sharded)
    s = Strategy(options, "32-true", world, timedelta(seconds=600), tp)
    s.expert_parallel = ep
    s.checkpoint_io = SafeAtomicCheckpointIO()
    return s


def build(cfg, init, world, tp, ep, kind):
    """The model sharded as distributed.parallelize does (no mixed precision: float64), its optimizer."""
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gptkit.training.expert_parallel import ExpertGroup, expert_grid, shard_experts
    from gptkit.training.optim import build_optimizer
    from gptkit.training.tensor_parallel import apply_tensor_parallel

    model = GPT.from_state(ModelConfig.from_dict(cfg), {k: v.clone() for k, v in init.items()}).train()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    if tp > 1:
        apply_tensor_parallel(model, mesh["tensor_parallel"])
    experts = None
    if ep > 1:
        experts = shard_experts(model, ExpertGroup(expert_grid("cpu", world, ep), world, None))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"], ignored_params=experts)
    fully_shard(model, mesh=mesh["data_parallel"], ignored_params=experts)
    optim = OmegaConf.create(
        dict(
            name=kind, lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, decay_embeddings=False,
            decay_norms_and_biases=False, fused=False,
            muon=dict(momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="float32", adjust_lr="match_rms_adamw"),
        )
    )  # fmt: skip
    holder = Holder(model)
    return holder, build_optimizer(model, optim), mesh.get_local_rank("data_parallel"), world // tp


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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["RESHARD_PORT"])
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    for job in jobs:
        name, cfg, kind, tp, ep = job["name"], job["cfg"], job["kind"], job["tp"], job["ep"]
        init = torch.load(os.path.join(tmp, f"init-{job['model']}.pt"))
        data = batches(cfg["vocab_size"])
        holder, opt, dp_rank, dp = build(cfg, init, world, tp, ep, kind)
        out = {}
        if job["load"] is None:
            # the uninterrupted run (saving its step-3 checkpoint both ways when asked)
            out["losses"] = steps(holder, opt, data, 0, SAVE_AT, dp_rank, dp)
            for sharded in (True, False) if job["save"] else ():
                s = strategy(world, tp, ep, sharded)
                s.model, s._lightning_module = holder, holder
                checkpoint = {
                    "state_dict": s.lightning_module_state_dict(),
                    "optimizer_states": [s.optimizer_state(opt)],
                    "global_step": SAVE_AT,
                }
                s.save_checkpoint(checkpoint, os.path.join(tmp, f"{name}-{'sharded' if sharded else 'file'}"))
            saved = whole(holder, opt)
            out["losses"] += steps(holder, opt, data, SAVE_AT, STEPS, dp_rank, dp)
        else:
            s = strategy(world, tp, ep, True)
            s.model, s._lightning_module, s.optimizers = holder, holder, [opt]
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
    from omegaconf import OmegaConf

    from gptkit.checkpoints import load_checkpoint, model_state_dict
    from gptkit.training.optim import build_optimizer

    ckpt = load_checkpoint(os.path.join(tmp, load))
    model = GPT.from_state(ModelConfig.from_dict(cfg), model_state_dict(ckpt)).train()
    optim = OmegaConf.create(
        dict(
            name=kind, lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, decay_embeddings=False,
            decay_norms_and_biases=False, fused=False,
            muon=dict(momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="float32", adjust_lr="match_rms_adamw"),
        )
    )  # fmt: skip
    opt = build_optimizer(model, optim)
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
    mp.spawn(worker, args=(world, jobs, tmp), nprocs=world)


def job(name, model, kind, tp=1, ep=1, load=None, save=False):
    cfg = {"llama": LLAMA, "moe": MOE}[model]
    return dict(name=name, model=model, cfg=cfg, kind=kind, tp=tp, ep=ep, load=load, save=save)


def compare(tmp, name, saved_run, new_run, same_mesh):
    """(max |state diff| vs the saved state, max |loss diff| vs the new mesh's uninterrupted run, vs the
    saved mesh's steps 4-6)."""
    got = torch.load(os.path.join(tmp, f"out-{name}.pt"))
    saved = torch.load(os.path.join(tmp, f"out-{saved_run}.pt"))
    if set(got["state"]) != set(saved["state"]):
        return float("inf"), float("inf"), float("inf"), sorted(set(got["state"]) ^ set(saved["state"]))[:4]
    dstate = max(
        (got["state"][k].double() - saved["state"][k].double()).abs().max().item() for k in saved["state"]
    )
    new = torch.load(os.path.join(tmp, f"out-{new_run}.pt"))["losses"][SAVE_AT:]
    vs_new = max(abs(a - b) for a, b in zip(got["losses"], new))
    vs_saved = max(abs(a - b) for a, b in zip(got["losses"], saved["losses"][SAVE_AT:]))
    return dstate, vs_new, vs_saved, None


def main() -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    started = time.perf_counter()
    ok = True
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, cfg in (("llama", LLAMA), ("moe", MOE)):
            torch.manual_seed(0)
            torch.save(GPT(ModelConfig.from_dict(cfg)).state_dict(), os.path.join(tmp, f"init-{model}.pt"))
        # (case name, saved run, the new mesh's uninterrupted run, same mesh)
        cases = []
        four = [
            job("dp2tp2", "llama", "adamw", tp=2, save=True),
            job("dp2tp2-muon", "llama", "muon", tp=2, save=True),
            job("tp4", "llama", "adamw", tp=4),
            job("dp4", "llama", "adamw"),
            job("dp4-muon", "llama", "muon"),
        ]
        for fmt in ("sharded", "file"):
            four += [
                job(f"dp2tp2>dp2tp2-{fmt}", "llama", "adamw", tp=2, load=f"dp2tp2-{fmt}"),
                job(f"dp2tp2>tp4-{fmt}", "llama", "adamw", tp=4, load=f"dp2tp2-{fmt}"),
                job(f"dp2tp2>dp4-{fmt}", "llama", "adamw", load=f"dp2tp2-{fmt}"),
                job(f"dp2tp2-muon>dp4-{fmt}", "llama", "muon", load=f"dp2tp2-muon-{fmt}"),
            ]
            cases += [
                (f"dp2tp2>dp2tp2-{fmt}", "dp2tp2", "dp2tp2", True),
                (f"dp2tp2>tp4-{fmt}", "dp2tp2", "tp4", False),
                (f"dp2tp2>dp4-{fmt}", "dp2tp2", "dp4", False),
                (f"dp2tp2-muon>dp4-{fmt}", "dp2tp2-muon", "dp4-muon", False),
            ]
        t0 = time.perf_counter()
        spawn(4, four, tmp)
        t4 = time.perf_counter() - t0
        two = [
            job("tp2", "llama", "adamw", tp=2, save=True),
            job("dp2", "llama", "adamw", save=True),
            job("ep2", "moe", "adamw", ep=2, save=True),
            job("ep1", "moe", "adamw", save=True),
        ]
        for fmt in ("sharded", "file"):
            two += [
                job(f"dp2tp2>dp2-{fmt}", "llama", "adamw", load=f"dp2tp2-{fmt}"),
                job(f"tp2>dp2-{fmt}", "llama", "adamw", load=f"tp2-{fmt}"),
                job(f"dp2>tp2-{fmt}", "llama", "adamw", tp=2, load=f"dp2-{fmt}"),
                job(f"ep2>ep1-{fmt}", "moe", "adamw", load=f"ep2-{fmt}"),
                job(f"ep1>ep2-{fmt}", "moe", "adamw", ep=2, load=f"ep1-{fmt}"),
                job(f"ep2>ep2-{fmt}", "moe", "adamw", ep=2, load=f"ep2-{fmt}"),
            ]
            cases += [
                (f"dp2tp2>dp2-{fmt}", "dp2tp2", "dp2", False),
                (f"tp2>dp2-{fmt}", "tp2", "dp2", False),
                (f"dp2>tp2-{fmt}", "dp2", "tp2", False),
                (f"ep2>ep1-{fmt}", "ep2", "ep1", False),
                (f"ep1>ep2-{fmt}", "ep1", "ep2", False),
                (f"ep2>ep2-{fmt}", "ep2", "ep2", True),
            ]
        t0 = time.perf_counter()
        spawn(2, two, tmp)
        t2 = time.perf_counter() - t0
        one = [job("one", "llama", "adamw")]
        for fmt in ("sharded", "file"):
            one += [
                job(f"dp2tp2>1-{fmt}", "llama", "adamw", load=f"dp2tp2-{fmt}"),
                job(f"tp2>1-{fmt}", "llama", "adamw", load=f"tp2-{fmt}"),
            ]
            cases += [(f"dp2tp2>1-{fmt}", "dp2tp2", "one", False), (f"tp2>1-{fmt}", "tp2", "one", False)]
        t0 = time.perf_counter()
        spawn(1, one, tmp)
        for fmt in ("sharded", "file"):
            for src in ("dp2tp2", "tp2"):
                name = f"{src}>plain-{fmt}"
                torch.save(
                    one_process_plain(tmp, f"{src}-{fmt}", LLAMA, "adamw"),
                    os.path.join(tmp, f"out-{name}.pt"),
                )
                cases.append((name, src, "one", False))
        t1 = time.perf_counter() - t0
        for name, saved_run, new_run, same in cases:
            dstate, vs_new, vs_saved, diff = compare(tmp, name, saved_run, new_run, same)
            good = dstate == 0 and (vs_new == vs_saved == 0 if same else max(vs_new, vs_saved) <= LOOSE)
            ok &= good
            rows.append(
                f"{name:28s} state {dstate:.1e}  losses vs new mesh {vs_new:.1e}, vs saved mesh {vs_saved:.1e}"
                f"  {'ok' if good else 'FAILED'}{' ' + str(diff) if diff else ''}"
            )
    print("\n".join(rows))
    print(
        f"== .ci/reshard.py: {'ok' if ok else 'FAILED'} (state: 0 bit for bit; losses 0 at the same mesh, "
        f"<= {LOOSE:.0e} across meshes); 4 processes {t4:.0f} s, 2 processes {t2:.0f} s, 1 process {t1:.0f} s, "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
