"""One rank of tests/training/test_token_mean.py's 2-process check (gloo, CPU): TokenMean under DDP and FSDP2.

    python tests/training/token_mean_distributed.py RANK WORLD INIT_FILE OUT_DIR

Each rank takes its half of every micro-batch of `micro_batches()` (2 micro-batches per step, whose halves
carry very different numbers of loss tokens), backpropagates what TokenMean.micro_batch returns divided by the
accumulation (as Lightning does), and TokenMean.finish scales the gradients; rank 0 saves the full gradients
to OUT_DIR/{ddp,fsdp}.pt. One process over all the rows at once must give the same gradients.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from gptkit.model import GPT, ModelConfig
from gptkit.training.token_mean import TokenMean, loss_tokens

MODEL = dict(
    vocab_size=64,
    max_seq_len=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    d_model=32,
    d_ff=64,
    position="rope",
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    tie_embeddings=False,
    attention="eager",
)
# rows of one micro-batch, all ranks together
ROWS, T, ACCUMULATION = 4, 16, 2


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ACCUMULATION (x, y) pairs of [ROWS, T]; row r of micro-batch i keeps its last `keep[i][r]` targets
    (as an assistant-only loss would), the others are -100."""
    g = torch.Generator().manual_seed(1)
    # rank 0 holds rows 0-1, rank 1 rows 2-3
    keep = [[1, 2, 16, 12], [5, 1, 3, 16]]
    out = []
    for i in range(ACCUMULATION):
        x = torch.randint(0, 64, (ROWS, T), generator=g)  # [ROWS, T]
        y = torch.randint(0, 64, (ROWS, T), generator=g)  # [ROWS, T]
        for r, k in enumerate(keep[i]):
            y[r, : T - k] = -100
        out.append((x, y))
    return out


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(**MODEL))


def reference_grads() -> dict[str, torch.Tensor]:
    """One process, every row of every micro-batch in one batch: the mean over all loss tokens."""
    m = model()
    x, y = (torch.cat(t) for t in zip(*micro_batches()))  # [ACCUMULATION * ROWS, T]
    m(x, y).loss.backward()
    return {k: p.grad.clone() for k, p in m.named_parameters()}


def accumulate(m, params, rank: int, world: int) -> None:
    tm = TokenMean(ACCUMULATION, world, ROWS // world * T)
    part = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    for x, y in micro_batches():
        y = y[part]
        (tm.micro_batch(m(x[part], y).loss, loss_tokens(y)) / ACCUMULATION).backward()
    tm.finish(params)


def main(rank: int, world: int, init_file: str, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    plain = model()
    # DDP: mean of ranks
    accumulate(DistributedDataParallel(plain), list(plain.parameters()), rank, world)
    if rank == 0:
        torch.save({k: p.grad for k, p in plain.named_parameters()}, out / "ddp.pt")
    sharded = model()
    mesh = init_device_mesh("cpu", (world,))
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    # FSDP2: reduce-scatter, mean of ranks; DTensor gradients
    fully_shard(sharded, mesh=mesh)
    accumulate(sharded, list(sharded.parameters()), rank, world)
    grads = {
        k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for k, p in sharded.named_parameters()
    }
    if rank == 0:
        torch.save(grads, out / "fsdp.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    # the gloo group outlives destroy_process_group (DTensor's caches keep its mesh): the rank ends
    # without the interpreter's teardown of its threads (which aborted spawned ranks in CI:
    # .ci/parallel_harness.py, end_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
