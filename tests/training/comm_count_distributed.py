"""One rank of tests/training/test_comm_count.py's gloo runs: the bytes each rank sends by kind in one
training micro-step (comm_count.py beside it), for parallel_plan.communication to be checked against.

    python tests/training/comm_count_distributed.py RANK WORLD INIT_FILE OUT_DIR CASE[,CASE...]
    python tests/training/comm_count_distributed.py table [CASE...]   (every case, or these: the ranks
                                                  started here, then formula vs measured as a markdown table)

CASE (CASES): the mesh and model. The model is sharded as a run shards it (distributed.parallelize with
the fsdp strategy's mesh [data_parallel, tensor_parallel]; trainer.context_parallel's ContextParallel; the
expert groups of trainer.expert_parallel), then one micro-step runs as LitGPT's does: the forward and the
loss under loss_parallel (tp), the backward, TokenMean's finish, the gradient norm and AdamW's step. Each
rank writes OUT_DIR/CASE.RANK.json: {"step": {kind: bytes}, "optimizer": {kind: bytes}, "calls": [...]}
("step": forward + backward; "optimizer": TokenMean, the norm and the optimizer step).
"""

import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from gptkit.model import GPT, ModelConfig

LLAMA = dict(
    vocab_size=64,
    max_seq_len=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_model=32,
    d_ff=64,
    position="rope",
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    tie_embeddings=False,
    dropout=0.0,
    attention="eager",
)
# top_k = n_experts: every token goes to every expert, so the all-to-alls are exactly even
MOE = dict(LLAMA, moe=dict(n_experts=2, top_k=2, aux_loss_coef=0.0))
# rows per data-parallel rank, tokens per row
ROWS, T = 2, 32
# name: (model, world, tp, cp, ep, strategy, trainer.activation_checkpointing[, trainer.precision])
CASES = {
    "tp2": (LLAMA, 2, 2, 1, 1, "fsdp", None),
    "cp2": (LLAMA, 2, 1, 2, 1, "fsdp", None),
    "fsdp2": (LLAMA, 2, 1, 1, 1, "fsdp", None),
    "ep2": (MOE, 2, 1, 1, 2, "fsdp", None),
    "ddp2": (LLAMA, 2, 1, 1, 1, "ddp", None),
    "tp2_full": (LLAMA, 2, 2, 1, 1, "fsdp", "full"),
    "cp2_full": (LLAMA, 2, 1, 2, 1, "fsdp", "full"),
    "tp2_ops": (LLAMA, 2, 2, 1, 1, "fsdp", "selective"),
    "tp2_mqa": (dict(LLAMA, n_kv_heads=1), 2, 2, 1, 1, "fsdp", None),
    "tp2_bf16": (LLAMA, 2, 2, 1, 1, "fsdp", None, "bf16-mixed"),
    "cp2_bf16": (LLAMA, 2, 1, 2, 1, "fsdp", None, "bf16-mixed"),
    "ep2_bf16": (MOE, 2, 1, 1, 2, "fsdp", None, "bf16-mixed"),
    "dp2_tp2": (LLAMA, 4, 2, 1, 1, "fsdp", None),
    # the ring on tensor-parallel-local heads
    "cp2_tp2": (LLAMA, 4, 2, 2, 1, "fsdp", None),
}


def sharding(world: int, tp: int, cp: int, ep: int, precision: str):
    """(what distributed.parallelize reads of gptkit's fsdp strategy, its (group, kind) pairs, the ring's
    group or None, this rank's data-parallel rank): the one mesh of training/mesh.py, as a run builds it."""
    from gptkit.training.distributed import fsdp_options
    from gptkit.training.mesh import MeshDims, build_mesh

    common = dict(
        fsdp_options=fsdp_options({}),
        fsdp_precision=precision,
        expert_parallel=ep,
        context_parallel=cp,
        root_device=torch.device("cpu"),
    )
    mesh = build_mesh("cpu", MeshDims(world=world, cp=cp, tp=tp, ep=ep))
    kinds = [(mesh["tp"].get_group(), "tp"), (mesh.fsdp.get_group(), "fsdp")]
    ring = mesh["cp"].get_group() if cp > 1 else None
    return SimpleNamespace(mesh=mesh, **common), kinds, ring, mesh.data_ranks()[0]


def main(rank: int, world: int, init_file: str, out: Path, cases: str) -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    for case in cases.split(","):
        run = convention if case == "convention" else run_case
        run(rank, world, f"{init_file}.{case}", out, case)
        # a DeviceMesh equals another of the same shape and names whatever its process groups, so DTensor's
        # sharding-propagation cache would hand the next case this case's meshes, their groups destroyed
        # (dp2_tp2's then cp2_tp2's 2 x 2 [dp_shard_cp, tp]: "Could not resolve the process group"); a run
        # builds one mesh per process
        _clear_sharding_prop_cache()


def convention(rank: int, world: int, init_file: str, out: Path, case: str) -> None:
    """One call of each collective on the world group (counted as kind "world"): the bytes sent per call."""
    from comm_count import CommCounter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.ones(4, 6)
    families = {}
    with CommCounter([(dist.group.WORLD, "world"), (mesh.get_group(), "world")]) as c:
        dist.all_gather_into_tensor(torch.empty(8, 6), x)
        dist.reduce_scatter_tensor(torch.empty(2, 6), x)
        dist.all_reduce(x)
        # rank 0 keeps 1 row and sends 3, rank 1 keeps 3 and sends 1
        send = [[1, 3], [1, 3]][rank]
        recv = [[1, 1], [3, 3]][rank]
        dist.all_to_all_single(torch.empty(sum(recv), 6), x, recv, send)
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(torch.empty(4, 6), 0)
        d = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
        mark = len(c.calls)
        d.redistribute(mesh, [Replicate()]).to_local()
    for i, call in enumerate(c.calls):
        name = "redistribute" if i >= mark else call.family
        families[name] = families.get(name, 0) + call.sent
    result = {"families": families, "step": c.sent(), "optimizer": {}}
    (out / f"{case}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_case(rank: int, world: int, init_file: str, out: Path, case: str) -> None:
    from comm_count import CommCounter

    from gptkit.training import activations
    from gptkit.training.distributed import clip_gradients, parallelize
    from gptkit.training.tensor_parallel import local_loss, loss_context
    from gptkit.training.token_mean import TokenMean, loss_tokens

    cfg_dict, w, tp, cp, ep, how, checkpointing, *rest = CASES[case]
    precision = rest[0] if rest else "32-true"
    assert w == world, (case, world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(ModelConfig.from_dict(cfg_dict)).train()
    # before the sharding, as LitGPT applies trainer.activation_checkpointing (selective: the ops policy)
    activations.apply(model, checkpointing)
    s, kinds, ring_group, dp_rank = sharding(world, tp, cp, ep, precision)
    if how == "ddp":
        kinds = [(dist.group.WORLD, "dp")]
        run = torch.nn.parallel.DistributedDataParallel(model)
    else:
        parallelize(model, s)
        run = model
    ring = None
    if cp > 1:
        from gptkit.training.context_parallel import ContextParallel

        ring = ContextParallel(model, ring_group)
        kinds.append((ring_group, "cp"))
    if ep > 1:
        stack = model.blocks[model.cfg.moe_layers[0]].mlp.experts.gate_proj
        kinds.append((stack.device_mesh.get_group(), "ep"))
    # the rows of this data-parallel rank (a tensor- or context-parallel group reads the same rows)
    g = torch.Generator().manual_seed(dp_rank)
    x = torch.randint(0, 64, (ROWS, T), generator=g)
    y = torch.randint(0, 64, (ROWS, T), generator=g)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    tm = TokenMean(1, world // (tp * cp), ROWS * T)
    # the forward under bf16 autocast for a mixed precision (Lightning's MixedPrecision plugin), the weights
    # cast by FSDP2's param_dtype
    mixed = torch.autocast("cpu", torch.bfloat16) if "mixed" in precision else contextlib.nullcontext()
    with CommCounter(kinds) as step:
        with loss_context(model):
            with mixed:
                if ring is None:
                    loss = local_loss(run(x, y).loss)
                    n = loss_tokens(y)
                else:
                    xs, ys = ring.enter((x, y))
                    loss, n = model(xs, ys).loss, loss_tokens(ys)
                loss = tm.micro_batch(loss, n)
            # the ring stays on through the backward, whose recomputation (activation checkpointing) runs
            # the blocks' forwards again (LitGPT.training_step leaves it before: see test_comm_count.py)
            loss.backward()
            if ring is not None:
                ring.exit()
    with CommCounter(kinds) as rest:
        tm.finish(params)
        clip_gradients([p for p in params if p.grad is not None], 1.0)
        opt.step()
    calls = [[c.kind, c.family, c.op, c.group_size, c.sent] for c in step.calls]
    result = {"step": step.sent(), "optimizer": rest.sent(), "calls": calls, "loss": float(loss.detach())}
    (out / f"{case}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(cases: list[str], world: int, out: Path, timeout: float = 600) -> dict[str, list[dict]]:
    """Run `cases` (each of `world` ranks) as `world` processes, one thread each: {case: its results}."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__]
    ranks = [
        subprocess.Popen(
            [*argv, str(r), str(world), str(out / "init"), str(out), ",".join(cases)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    if any(p.returncode for p in ranks):
        raise RuntimeError("\n".join(e[-3000:] for e in errors))
    return {c: [json.loads((out / f"{c}.{r}.json").read_text()) for r in range(world)] for c in cases}


def planned(case: str) -> dict[str, float]:
    """parallel_plan.communication for the case's model, mesh and micro-step, by the counter's kinds (fsdp:
    its gathers and reduce-scatters together)."""
    from gptkit.parallel_plan import check_mesh, communication, recomputed_layers

    cfg_dict, world, tp, cp, ep, how, checkpointing, *rest = CASES[case]
    model = ModelConfig.from_dict(cfg_dict)
    mesh = check_mesh(model, world, tp, cp, ep if ep > 1 else None, T)
    recomputed = recomputed_layers(model, checkpointing)
    precision = rest[0] if rest else "32-true"
    comm = communication(model, mesh, precision, ROWS, T, fsdp=how == "fsdp", recomputed=recomputed)
    out: dict[str, float] = {}
    for key, value in comm.items():
        kind = {"fsdp_all_gather": "fsdp", "fsdp_reduce_scatter": "fsdp", "dp_all_reduce": "dp"}.get(key, key)
        if key != "total" and kind != "ep_gradients":
            out[kind] = out.get(kind, 0) + value
    return out


def table(cases: list[str]) -> None:
    """Every case's formula and measured bytes per kind (every rank's figure where they differ)."""
    import tempfile
    import time

    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({CASES[c][1] for c in cases}):
            got = launch([c for c in cases if CASES[c][1] == world], world, Path(tmp))
            for case, ranks in got.items():
                want = planned(case)
                for kind in sorted(set(want) | set(ranks[0]["step"])):
                    measured = sorted({r["step"].get(kind, 0) for r in ranks})
                    rows.append((case, kind, want.get(kind, 0), measured, ranks[0]["optimizer"]))
    print("| case | kind | formula | measured (every rank) | optimizer step, all kinds |")
    print("| --- | --- | --- | --- | --- |")
    for case, kind, want, measured, opt in rows:
        print(f"| {case} | {kind} | {want:,.0f} | {' / '.join(f'{m:,}' for m in measured)} | {opt} |")
    print(f"{time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    if sys.argv[1] == "table":
        table(sys.argv[2:] or list(CASES))
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5])
        # the gloo group outlives destroy_process_group (DTensor's caches keep its mesh): the rank ends
        # without the interpreter's teardown of its threads (which aborted spawned ranks in CI:
        # .ci/parallel_harness.py, end_rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
