"""A mixture-of-experts layer under tensor parallelism (trainer.tensor_parallel=k),
with or without expert parallelism (trainer.expert_parallel, training/expert_parallel.py).

Around an MoE layer the activations are sequence-parallel: each of the k ranks of a tensor-parallel group
holds its own slice of the sequence, [B, T/k, d]. The layer runs on that slice as a data rank of its own
would (torchtitan's choice for expert parallelism without expert tensor parallelism, ETP = 1): no gather
before it, no reduce-scatter after it, no expert split by columns.

    input, output  the sequence-sharded DTensor's local [B, T/k, d] in; this rank's [B, T/k, d] out, the
                   residual stream's local slice (as the dense layers' outputs)
    router,        replicated over the k ranks (DTensors, Replicate()); each rank computes them on its own
    shared experts tokens, so a weight's gradient is a partial sum over the ranks (Partial()), summed over
    and their gate them before FSDP2 reduces it over the data ranks
    experts        trainer.expert_parallel=1: replicated as the router (and sharded by FSDP2 over the data
                   ranks); trainer.expert_parallel=e: split over groups of e data ranks of the same
                   tensor-parallel rank (expert_parallel.expert_grid), the tokens sent by all-to-all; an
                   expert's gradient is summed over every rank that holds it and divided by the data ranks
    aux loss       the balance loss needs each sequence's whole share of tokens per expert (f_i) and mean
                   router probability (P_i): both are summed over the k ranks (one all-reduce per layer,
                   with the z-loss and the entropy). The gradient flows through this rank's part of P_i
                   and of the z-loss, so that the k ranks' parts add up to one process's loss; the value
                   each rank reports is the whole one (the log and the progress line show it)
    figures        tokens per expert: this rank's (RouterWatch sums them over every rank, for the expert
                   bias too); balance, z and entropy: the group's whole, as one process has them

.ci/expert_tensor_parallel.py checks dp 2 x ep 2 x tp 2 on 8 processes, ep 2 x tp 2 and tp 2 on 4, against
one process (docs/distributed.md).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gptkit.model.layers import LayerAux
from gptkit.model.moe import MoE, MoEStats


def _partial(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor parameter as this rank's plain tensor, whose gradient is a partial sum over the
    tensor-parallel ranks (each computed on its own tokens)."""
    from torch.distributed.tensor import Partial

    return t.to_local(grad_placements=[Partial()])


def _local_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward with its replicated weights (and bias) on this rank's tokens."""
    bias = None if linear.bias is None else _partial(linear.bias)
    return F.linear(x, _partial(linear.weight), bias)


def apply_moe_tensor_parallel(moe: MoE, mesh, expert_parallel: int) -> None:
    """`moe` (one layer's MoE) on this rank's tokens over the 1-D tensor-parallel `mesh` (the module
    docstring): its router, shared experts and gate (and, expert_parallel 1, its experts) replicated
    DTensors. expert_parallel > 1: the experts are left as they are, for expert_parallel.shard_experts."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for module in moe.modules():
        if expert_parallel > 1 and module is moe.experts:
            continue
        # (not distribute_module: it would replicate the expert bias buffer and the experts too)
        for key, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p, mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=p.requires_grad))

    def inputs(module, args):
        # [B, T/k, d]: the local slice of the sequence-sharded DTensor (its gradient goes back as Shard(1))
        return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)

    # its output: this rank's [B, T/k, d], as the residual stream holds it (the dense layers' outputs too)
    moe.register_forward_pre_hook(inputs)
    for module in moe.modules():
        if isinstance(module, nn.Linear):
            module.forward = functools.partial(_local_linear, module)
    if expert_parallel == 1:
        experts = moe.experts
        experts.weight = lambda name: _partial(getattr(experts, name))
    moe.aux = functools.partial(_group_aux, moe, mesh.get_group(), mesh.size())


def _group_aux(moe: MoE, group, k: int, logits, scores, chosen, counts, batch: int) -> LayerAux:
    """MoE.aux over the tensor-parallel group's tokens: this rank's `logits`, `scores`, `chosen` [N/k, ...]
    are its slice of each of the `batch` sequences (see the module docstring)."""
    E, top = moe.n_experts, moe.top_k
    probs = scores if moe.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)  # [N/k, E]
    groups = batch if moe.per_sequence else 1
    n = probs.shape[0] // groups * k  # tokens of a group over the k ranks
    picked = torch.zeros_like(probs).scatter_(-1, chosen, 1.0).view(groups, -1, E).sum(1)  # [G, E]
    mine = probs.view(groups, -1, E).sum(1) / n  # [G, E]: this rank's part of P_i
    z = torch.logsumexp(logits.float(), -1).square().sum() / (probs.shape[0] * k)  # this rank's part
    with torch.no_grad():
        entropy = -(probs * probs.clamp_min(1e-20).log()).sum() / (probs.shape[0] * k)
        whole = torch.cat([picked.flatten(), mine.flatten(), z.view(1), entropy.view(1)])
        dist.all_reduce(whole, group=group)
    share = whole[: groups * E].view(groups, E) / (n * top)  # f_i, each row sums to 1
    mean_prob = whole[groups * E : 2 * groups * E].view(groups, E)  # P_i
    z_all, entropy = whole[-2], whole[-1]
    balance = E * (share * mean_prob).sum(-1).mean()
    part = moe.aux_loss_coef * E * (share * mine).sum(-1).mean() + moe.z_loss_coef * z
    loss = part + (moe.aux_loss_coef * balance + moe.z_loss_coef * z_all - part).detach()
    return LayerAux(loss, MoEStats(balance, z_all, entropy, counts.detach().float()))
