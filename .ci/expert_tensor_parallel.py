"""A mixture of experts under trainer.tensor_parallel, with and without trainer.expert_parallel
(gptkit/training/moe_tensor_parallel.py), on gloo CPU processes against one process: the same model (float64),
batches, AdamW steps and expert-bias updates, through training/distributed.parallelize (tensor parallelism,
then the experts split over groups of data ranks, then FSDP2). Per case: the largest difference over the steps
of the loss, of the auxiliary loss and of the router figures (RouterWatch.read: balance, max load, entropy),
and of the final weights (the expert bias included).

    python .ci/expert_tensor_parallel.py [STEPS] [WORLD] [CLI]   (default 4 steps, 4 processes: ep 2 x tp 2
                                                                 and tp 2 alone; WORLD=8: dp 2 x ep 2 x tp 2
                                                                 and ep 4 x tp 2)

Then through the CLI on CLI processes (default WORLD; 0: skipped): `gptkit train trainer=fsdp
trainer.devices=CLI trainer.expert_parallel=2 trainer.tensor_parallel=2` against one process (fp32: the logged
losses, gradient norms and router figures, and the final weights).
"""

import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import parallel_harness as h
import torch
import torch.distributed as dist

from gptkit.model.mha import fuse_qkv_state
from gptkit.training.moe import RouterWatch

MOE = dict(
    h.LLAMA,
    moe=dict(
        n_experts=4,
        top_k=2,
        d_expert=24,
        n_shared=1,
        bias_update_rate=0.01,
        z_loss_coef=0.001,
        aux_loss_coef=0.01,
        impl="loop",
    ),
)
# layer 0 dense, layer 1 MoE with router and expert biases, a gated shared expert, sigmoid scores
MIXED = dict(
    MOE,
    moe=dict(
        MOE["moe"],
        first_dense=1,
        router="sigmoid",
        router_bias=True,
        expert_biases=True,
        shared_expert_gate=True,
    ),
)
# (name, model, ep, tp, optimizer): data ranks = world / tp
CASES = {
    4: [
        ("moe + shared expert, ep 2 x tp 2", MOE, 2, 2, "adamw"),
        ("moe + shared expert, tp 2 (experts replicated)", MOE, 1, 2, "adamw"),
        ("dense + moe (biases, sigmoid, gate), ep 2 x tp 2", MIXED, 2, 2, "adamw"),
    ],
    8: [
        ("moe + shared expert, dp 2 x ep 2 x tp 2", MOE, 2, 2, "adamw"),
        ("moe + shared expert, ep 4 x tp 2, muon", MOE, 4, 2, "muon"),
    ],
}


class Reduce:
    """The strategy.reduce RouterWatch.read calls (a sum over every rank)."""

    def reduce(self, t, reduce_op="sum"):
        if dist.is_initialized():
            dist.all_reduce(t)
        return t


def optimizer(model, kind):
    # eps 1e-6: where a gradient is near 0, AdamW's step moves by lr / eps times its rounding (the norms,
    # router and cross-entropy compute in fp32: ~1e-7 relative, summed in another order over the ranks);
    # with eps 1e-8 one weight of the third case differed by 2.9e-5 after 3 steps
    adamw = dict(lr=1e-2, eps=1e-6, weight_decay=0.1, foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), **adamw)
    from gptkit.training.optim import MuonWithAdamW, muon_split, qkv_parts

    muon, rest = muon_split(model)
    matrices = [p for _, p in muon if p.ndim == 2]
    m = torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    # the expert stacks [E, out, in] join after the 2-D check (as optim.build_optimizer)
    m.param_groups[0]["params"] = [p for _, p in muon]
    a = torch.optim.AdamW([p for _, p in rest], **adamw)
    return MuonWithAdamW(m, a, ns_dtype=torch.float32, fused=qkv_parts(muon))


def train(model, data, kind, rank=0, dp=1, world=1, tensor_parallel=False):
    from gptkit.training.tensor_parallel import local_loss, loss_context

    watch = RouterWatch(model, world)
    opt = optimizer(model, kind)
    losses, figures = [], []
    rows = h.B // dp
    for seq in data:
        x, y = seq[rank * rows : (rank + 1) * rows, :-1], seq[rank * rows : (rank + 1) * rows, 1:]
        with loss_context(model) if tensor_parallel else torch.enable_grad():
            loss = local_loss(model(x, y).loss)
            (loss + watch.take()).backward()
        loss = loss.detach().clone()
        if world > 1:
            # the mean over the data ranks (a tensor-parallel group's ranks hold the same loss)
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
        watch.after_optimizer_step()
        figures.append(watch.read(Reduce()))
    return losses, figures


def worker(rank, world, port, cases, steps, tmp):
    h.start_rank(rank, world, port)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from gptkit.training import distributed
    from gptkit.training.mesh import MeshDims, build_mesh

    # float64 throughout: FSDP2 casts nothing (the trainer's precisions are fp32 and bf16 only)
    distributed.torch_dtype = lambda name, what: None
    for i, (_, cfg_dict, ep, tp, kind) in enumerate(cases):
        # the run's one mesh (training/mesh.py), as the fsdp strategy builds it
        mesh = build_mesh("cpu", MeshDims(world, tp=tp, ep=ep))
        strategy = SimpleNamespace(
            fsdp_options=dict(param_dtype="fp32", reduce_dtype="fp32", reshard_after_forward=True),
            fsdp_precision="32-true",
            mesh=mesh,
            root_device=torch.device("cpu"),
        )
        model = h.initial_model(cfg_dict, tmp, i)
        distributed.parallelize(model, strategy)
        dp_rank = mesh.data_ranks()[0]
        data = h.batches(steps, model.cfg.vocab_size)
        losses, figures = train(model, data, kind, dp_rank, world // tp, world, True)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if rank == 0:
            out = {"losses": losses, "figures": figures, "state": fuse_qkv_state(state)}
            torch.save(out, Path(tmp) / f"out{i}.pt")
    # every rank done with the store (rank 0 hosts it) before any rank ends (parallel_harness.end_rank)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    cases = CASES[world]
    h.float64_one_thread()
    started = time.perf_counter()
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        models = h.initial_models([c[1] for c in cases], tmp)
        ones = [train(m, h.batches(steps, m.cfg.vocab_size), c[4]) for m, c in zip(models, cases)]
        one_s = time.perf_counter() - started
        h.spawn(worker, world, cases, steps, tmp)
        for i, (name, *_) in enumerate(cases):
            got = torch.load(Path(tmp) / f"out{i}.pt")
            (losses, figures), ref = ones[i], models[i].state_dict()
            assert set(got["state"]) == set(ref), set(got["state"]) ^ set(ref)
            assert len(figures) == len(got["figures"]) == steps
            dloss = max(abs(a - b) for a, b in zip(losses, got["losses"]))
            dfig, which = max(
                (abs(a[k] - b[k]), k) for a, b in zip(figures, got["figures"]) for k in a.keys() | b.keys()
            )
            dw, where = max(((got["state"][k] - v).abs().max().item(), k) for k, v in ref.items())
            bias = max(
                (got["state"][k] - v).abs().max().item() for k, v in ref.items() if k.endswith("expert_bias")
            )
            moved = max(v.abs().max().item() for k, v in ref.items() if k.endswith("expert_bias"))
            worst = max(worst, dloss, dfig, dw)
            print(
                f"{name:50s} ({world} processes): {steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                f"max |diff| loss {dloss:.1e}, router figures {dfig:.1e} ({which}), weights {dw:.1e} "
                f"({where}), expert bias {bias:.1e} (moved to {moved:.3f})"
            )
    print(
        f"worst difference {worst:.1e} ({'ok' if worst <= 1e-5 else 'FAILED'}: bound 1e-5); one process "
        f"{one_s:.1f} s, {world} processes {time.perf_counter() - started - one_s:.1f} s"
    )
    # the CLI check on CLI processes (argument 3; default WORLD, 0: none): 4 ep 2 x tp 2, 8 dp 2 x ep 2 x tp 2
    cli_world = int(sys.argv[3]) if len(sys.argv) > 3 else world
    cli_ok = cli_check(steps, cli_world) if cli_world else True
    sys.exit(0 if worst <= 1e-5 and cli_ok else 1)


def cli_check(steps: int, world: int) -> bool:
    """gptkit train with trainer.expert_parallel=2 trainer.tensor_parallel=2 on `world` gloo processes
    against one process: the logged losses, gradient norms and router figures, and the final weights (a
    gathered one-file checkpoint: trainer.fsdp.sharded_checkpoint=false)."""
    env = h.cli_env(ETP_CLI="1")
    started = time.perf_counter()
    keys = ["train/loss", "train/grad_norm", "train/aux_loss", "moe/balance"] + [
        f"moe/{k}/{i}" for i in (0, 1) for k in ("max_load", "entropy")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(h.shakespeare(20_000))

        def train(name: str, *extra: str) -> tuple[list[dict], dict]:
            # this script as gptkit's entry point (CLI below): Lightning starts the other ranks with it too
            h.run_gptkit(
                [sys.executable, ".ci/expert_tensor_parallel.py", "gptkit",
                 *h.tiny_train("moe-tiny", steps, steps, tmp, name), "model.moe.n_experts=4",
                 "model.moe.d_expert=24", "model.moe.n_shared=1", "model.moe.bias_update_rate=0.01",
                 "model.moe.z_loss_coef=0.001", f"data.paths=[{corpus}]", "trainer.threads=1", *extra],
                env,
            )  # fmt: skip
            rows = [r for r in h.metrics(Path(tmp) / name) if r.get("train/loss")]
            ckpt = torch.load(Path(tmp) / name / "checkpoints" / "last.ckpt", weights_only=True)
            return rows, fuse_qkv_state(ckpt["state_dict"])

        one, one_state = train("one", "trainer.batch_size=4")
        many, state = train(
            f"etp{world}",
            "trainer=fsdp",
            f"trainer.devices={world}",
            # per data rank (world / tp): the same 4 sequences a step
            f"trainer.batch_size={4 // (world // 2)}",
            "trainer.expert_parallel=2",
            "trainer.tensor_parallel=2",
            "trainer.fsdp.sharded_checkpoint=false",
        )
    assert set(state) == set(one_state), set(state) ^ set(one_state)
    dlog, which = max((abs(float(a[k]) - float(b[k])), k) for a, b in zip(one, many) for k in keys)
    dw, where = max(((state[k].double() - v.double()).abs().max().item(), k) for k, v in one_state.items())
    ok = len(one) == len(many) == steps and dlog <= 1e-5 and dw <= 1e-5
    print(
        f"CLI: gptkit train trainer.expert_parallel=2 trainer.tensor_parallel=2 ({world} processes) vs one, "
        f"{steps} steps (fp32): max |diff| of the logged figures {dlog:.1e} ({which}), of the weights "
        f"{dw:.1e} ({where}) ({'ok' if ok else 'FAILED'}; {time.perf_counter() - started:.1f} s)"
    )
    return ok


def cli() -> None:
    """gptkit's CLI with this machine's cores not counted: the check runs more CPU processes than it has."""
    args = sys.argv[1:]
    sys.exit(h.gptkit_with_cores(args[1:] if args[:1] == ["gptkit"] else args, 64))


if __name__ == "__main__":
    # ETP_CLI: the CLI check's processes (Lightning starts the other ranks with this script and their own
    # arguments)
    cli() if os.environ.get("ETP_CLI") else main()
