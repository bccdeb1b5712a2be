"""Expert parallelism (trainer.expert_parallel=k, with trainer=fsdp): each MoE layer's experts are split over
groups of k ranks, and every token is sent to the rank that holds its experts and back (all-to-all).

    ranks        the run's mesh (training/mesh.py): an expert group is the mesh's ep view, k ranks of
                 dp_shard x cp of one tensor-parallel coordinate (k consecutive ranks without tensor or
                 context parallelism; its other ranks, ep_replicas, hold the same experts: under
                 trainer.tensor_parallel the ranks of every tensor-parallel coordinate, which route their
                 own slices of the sequence: training/moe_tensor_parallel.py); rank r of a group holds experts
                 r*E/k .. (r+1)*E/k - 1 of every MoE layer
                 (and of the multi-token prediction blocks' mixtures, model.mtp: moe_experts)
                 (each expert stack [E, out, in] a DTensor sharded by experts, Shard(0), over the group)
    forward      the MoE layer routes its own tokens as on one process (gptkit/model/moe.py) and sorts its
                 (token, expert) rows by expert; here the rows for each rank's experts are sent to it
                 (all_to_all_single, uneven splits: each rank's rows only), sorted there by local expert,
                 run through the local experts (one grouped matmul per weight), and sent back in the order
                 they came: the layer then combines them as before
    backward     the all-to-alls' gradients travel the other way; an expert's weight gradient sums the
                 contributions of every rank of its group; it is then summed over the replicas and divided
                 by the data ranks (W without tensor parallelism), so that it is the mean over them, as FSDP2
                 makes every other gradient
    the rest     attention, norms, embeddings, routers, the dense layers and the shared experts: FSDP2 over
                 dp_shard x cp (training/distributed.parallelize), the experts left out of it (ignored_params)

The checkpoints need nothing of their own: the expert stacks are DTensors of their full shape, so a sharded
checkpoint holds each rank's experts at their offsets and any world size (one process included) reads it,
and a gathered one holds them whole. Muon orthogonalizes each expert's matrix on the rank that holds it
(training/optim.py: a stack sharded by whole experts is FSDP2's layout too). The routing, the balance and
z-losses, the router figures and the expert bias are computed on each rank from its own tokens, as without
expert parallelism (training/moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gptkit.errors import ConfigError
from gptkit.model import GPT, ModelConfig
from gptkit.model.moe import BIASES

WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """rows [M, d] -> rows [M', d]: the first send[0] rows to rank 0 of the group, the next send[1] to rank 1
    ...; receives recv[j] rows from rank j, in rank order. The gradient goes back the same way reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.shape[1])  # [M', d]
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), grad.shape[1])  # [M, d]
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class _MeanOverRanks(torch.autograd.Function):
    """The identity forward; backward: the gradient summed over the replica group (None: no replicas) and
    divided by the data ranks of one tensor-parallel coordinate (`world`: dp_cp)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, replicas, world: int) -> torch.Tensor:
        ctx.replicas, ctx.world = replicas, world
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.replicas is not None:
            dist.all_reduce(grad, group=ctx.replicas)
        return grad / ctx.world, None, None


class ExpertGroup:
    """This rank's place among the expert groups: its group (k ranks sharing out the experts: a 1-D
    DeviceMesh), the replicas of its experts in the other groups (a 1-D DeviceMesh, or None: no other
    group), the ranks a gradient is the mean over (`world`) and the dtype the experts compute in (FSDP2's
    param_dtype)."""

    def __init__(self, mesh, replicas, world: int, param_dtype: torch.dtype | None) -> None:
        self.mesh = mesh
        self.group = self.mesh.get_group()
        self.size = self.mesh.size()
        self.rank = self.mesh.get_local_rank()
        self.replicas = replicas.get_group() if replicas is not None and replicas.size() > 1 else None
        self.world = world
        self.param_dtype = param_dtype

    @classmethod
    def of(cls, mesh, param_dtype: torch.dtype | None) -> "ExpertGroup":
        """From the run's mesh (training/mesh.py): its ep and ep_replicas views; the mean over the data ranks
        of one tensor-parallel coordinate (dp_cp), as FSDP2's."""
        return cls(mesh["ep"], mesh["ep_replicas"], mesh.dims.dp_cp, param_dtype)


def moe_experts(model: GPT) -> list[nn.Module]:
    """Every mixture's Experts of `model`: its MoE layers', then those of its multi-token prediction blocks
    (model.mtp: each a block like the last layer's, MoE when that layer is)."""
    found = [model.blocks[i].mlp.experts for i in model.cfg.moe_layers]
    for layer in model.mtp.layers if model.mtp is not None else ():
        experts = getattr(layer.block.mlp, "experts", None)
        if experts is not None:
            found.append(experts)
    return found


def shard_experts(model: GPT, grid: ExpertGroup) -> set[nn.Parameter]:
    """Split every MoE layer's expert stacks (the MTP blocks' too: moe_experts) over the group (each rank
    keeps its experts, a DTensor of the full shape) and route its rows through the all-to-all; returns the
    expert parameters (FSDP2 leaves them alone). Collective-free: a rank slices the tensors it has (rank 0's
    weights arrive later, with the rest: distributed.broadcast_weights)."""
    from torch.distributed.tensor import DTensor, Shard

    experts_params: set[nn.Parameter] = set()
    for experts in moe_experts(model):
        n = experts.gate_proj.shape[0] // grid.size
        for name in WEIGHTS + (BIASES if experts.biased else ()):
            full = getattr(experts, name)
            mine = full.detach()[grid.rank * n : (grid.rank + 1) * n]  # [E / k, out, in]
            local = DTensor.from_local(
                mine.clone(), grid.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            param = nn.Parameter(local, requires_grad=full.requires_grad)
            setattr(experts, name, param)
            experts_params.add(param)
        # instance attributes: the parameter names, and so the checkpoints, stay as they are
        experts.weight = _local_weight(experts, grid)
        experts.forward = _dispatching(experts, grid)
    return experts_params


def _local_weight(experts: nn.Module, grid: ExpertGroup):
    """Experts.weight under expert parallelism: this rank's experts of a stack, [E / k, out, in], in the
    compute dtype, whose gradient becomes the mean over the job's data ranks."""

    def weight(name: str) -> torch.Tensor:
        w = _MeanOverRanks.apply(getattr(experts, name).to_local(), grid.replicas, grid.world)
        return w if grid.param_dtype is None else w.to(grid.param_dtype)

    return weight


def _dispatching(experts: nn.Module, grid: ExpertGroup):
    """The forward of `experts` (gptkit/model/moe.Experts) under expert parallelism: rows sorted by (global)
    expert in, the same rows' outputs out (see the module docstring)."""
    k = grid.size

    def forward(x: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # x [M, d] sorted by expert; counts [E]: rows per expert of this rank's tokens
        E = counts.numel()
        n = E // k
        # [k * n]: how many rows each rank sends to each of my experts, rank by rank
        mine = torch.empty_like(counts)
        dist.all_to_all_single(mine, counts, group=grid.group)
        mine = mine.view(k, n)  # [source rank, local expert]
        send = counts.view(k, n).sum(1).tolist()
        recv = mine.sum(1).tolist()
        rows = _AllToAll.apply(x, send, recv, grid.group)  # [R, d]: by source rank, then local expert
        # sort by local expert (stable: within an expert, by source rank)
        expert_of_row = torch.repeat_interleave(
            torch.arange(n, device=x.device).repeat(k), mine.flatten()
        )  # [R]
        order = torch.argsort(expert_of_row, stable=True)
        local_counts = mine.sum(0)  # [n]
        local_offsets = torch.cumsum(local_counts, 0).to(torch.int32)
        # the plain forward over the local experts (their weights: _local_weight)
        out = type(experts).forward(experts, rows[order], local_offsets, local_counts)  # [R, d]
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return _AllToAll.apply(out[back], recv, send, grid.group)  # [M, d]

    return forward


def check_expert_parallel(t: Any, world: int) -> int:
    """trainer.expert_parallel against the trainer group (one-line errors); returns it."""
    k = t.get("expert_parallel", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"trainer.expert_parallel={k} must be an integer >= 1 (1: no expert parallelism)")
    if k == 1:
        return k
    if str(t.strategy) != "fsdp":
        raise ConfigError(
            f"trainer.expert_parallel={k} shards the experts beside FSDP2: it needs trainer=fsdp "
            f"(trainer.strategy={t.strategy})"
        )
    if world % k:
        raise ConfigError(
            f"trainer.expert_parallel={k} must divide the job's {world} process(es) (trainer.devices x "
            f"trainer.num_nodes); pass trainer.expert_parallel=1 or a divisor of {world}"
        )
    return k


def check_expert_model(k: int, model: ModelConfig, finetune: str) -> None:
    """trainer.expert_parallel=k against the model and the fine-tuning (one-line errors)."""
    if k == 1:
        return
    if model.moe is None:
        raise ConfigError(
            f"trainer.expert_parallel={k} splits a mixture's experts, and this model has none (model.moe "
            f"is null); pass trainer.expert_parallel=1"
        )
    if model.moe.n_experts % k:
        raise ConfigError(
            f"trainer.expert_parallel={k} must divide model.moe.n_experts={model.moe.n_experts} (each rank "
            f"of a group holds the same number of experts)"
        )
    if finetune != "full":
        raise ConfigError(
            f"trainer.expert_parallel={k} trains every weight of the experts; finetune={finetune} is not "
            f"supported with it (pass trainer.expert_parallel=1)"
        )
