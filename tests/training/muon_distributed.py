"""One rank of tests/training/test_muon.py's 2-process check (gloo, CPU): MuonWithAdamW under DDP and
under FSDP2.

    python tests/training/muon_distributed.py RANK WORLD INIT_FILE OUT_DIR

For Newton-Schulz in bfloat16 and in float32 (optim.muon.ns_dtype), three runs start from the weights of
torch.manual_seed(0) and take 3 steps on the batches of `batches` (each rank its slice of the global batch):
DDP, FSDP2 with the Newton-Schulz work shared out by matrix (the default) and FSDP2 with every matrix gathered
on every rank. Rank 0 saves the full weights to OUT_DIR/{ddp,fsdp,fsdp-gathered}-{dtype}.pt. Under FSDP2 the
optimizer state also goes through get/set_optimizer_state_dict (what a sharded checkpoint saves and loads)
into a second sharded model and optimizer after step 2, which must then take step 3 identically.
"""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from gptkit.model import GPT, ModelConfig
from gptkit.training.optim import build_optimizer

MODEL = dict(
    vocab_size=64,
    max_seq_len=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_model=32,
    # odd: FSDP2 shards the MLP matrices' rows unevenly (32 + 31)
    d_ff=63,
    position="rope",
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    tie_embeddings=False,
)
OPTIM = dict(
    name="muon",
    lr=3e-3,
    betas=[0.9, 0.95],
    eps=1e-8,
    weight_decay=0.1,
    decay_embeddings=False,
    decay_norms_and_biases=False,
    fused="auto",
    muon=dict(momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="bfloat16", adjust_lr="match_rms_adamw"),
)
STEPS, BATCH = 3, 4
NS_DTYPES = ("bfloat16", "float32")


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(0, 64, (BATCH, 16), generator=g)  # [BATCH, T]
        yield x, torch.roll(x, -1, 1)


def model_and_optimizer(fsdp: bool, ns_dtype: str = "bfloat16", sharded_ns: bool = True):
    torch.manual_seed(0)
    model = GPT(ModelConfig(**MODEL))
    if fsdp:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    cfg = OmegaConf.create(OPTIM)
    cfg.muon.ns_dtype = ns_dtype
    opt = build_optimizer(model, cfg)
    opt.sharded_ns = sharded_ns
    return model, opt


def full(model) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
        for k, v in model.state_dict().items()
    }


def main(rank: int, world: int, init_file: str, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for ns_dtype in NS_DTYPES:
        # DDP: plain tensors, gradients all-reduced; every rank steps the whole matrices
        model, opt = model_and_optimizer(fsdp=False, ns_dtype=ns_dtype)
        ddp = DistributedDataParallel(model)
        for x, y in batches():
            ddp(x[part], y[part]).loss.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            torch.save(full(model), out / f"ddp-{ns_dtype}.pt")
        # FSDP2: row-sharded DTensors; after step 2 the state moves into a second model and optimizer
        model, opt = model_and_optimizer(fsdp=True, ns_dtype=ns_dtype)
        twin, twin_opt = model_and_optimizer(fsdp=True, ns_dtype=ns_dtype)
        for step, (x, y) in enumerate(batches()):
            if step == STEPS - 1:
                # a copy, as from a checkpoint file:
                set_model_state_dict(twin, get_model_state_dict(model))
                # (its tensors are opt's own)
                saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
                set_optimizer_state_dict(twin, twin_opt, saved)
                twin(x[part], y[part]).loss.backward()
                twin_opt.step()
            model(x[part], y[part]).loss.backward()
            opt.step()
            opt.zero_grad()
        weights, twin_weights = full(model), full(twin)
        if rank == 0:
            same = all(torch.equal(weights[k], twin_weights[k]) for k in weights)
            assert same, "the state did not carry over"
            torch.save(weights, out / f"fsdp-{ns_dtype}.pt")
        # FSDP2, every rank gathering and orthogonalizing every matrix
        model, opt = model_and_optimizer(fsdp=True, ns_dtype=ns_dtype, sharded_ns=False)
        for x, y in batches():
            model(x[part], y[part]).loss.backward()
            opt.step()
            opt.zero_grad()
        weights = full(model)
        if rank == 0:
            torch.save(weights, out / f"fsdp-gathered-{ns_dtype}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    # the gloo group outlives destroy_process_group (DTensor's caches keep its mesh): the rank ends
    # without the interpreter's teardown of its threads (which aborted spawned ranks in CI:
    # .ci/parallel_harness.py, end_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
