"""Tensor and sequence parallelism (trainer.tensor_parallel=k, with trainer=fsdp): torch.distributed's own
DTensor plan (parallelize_module: ColwiseParallel, RowwiseParallel, SequenceParallel; loss_parallel), as
torchtitan's parallelize_llama, applied to the GPT before FSDP2 shards it over the data-parallel ranks.

The job's ranks form a mesh [data_parallel, tensor_parallel] (Lightning's ModelParallelStrategy builds it:
training/distributed.py); a tensor-parallel group is k consecutive ranks, and they read the same batch.

    module                          style (k ranks)                       activations between
    tok_emb                         RowwiseParallel: vocabulary rows      tokens replicated -> [B, T/k, d]
    pos_emb (GPT-2)                 replicated                            -> this rank's [T/k, d]
    attn_norm, mlp_norm, final_norm SequenceParallel (weights replicated) [B, T/k, d] -> [B, T/k, d]
    attn.qkv_proj                   split into q, k, v (QKVParallel),     all-gather -> [B, T, d] ->
                                    each ColwiseParallel: heads           local heads
                                    (k, v replicated where n_kv_heads
                                    < k: each rank its group's head)
    attn.q_norm, k_norm ("head")    SequenceParallel over the heads      local heads
    attn.o_proj                     RowwiseParallel                       -> reduce-scatter [B, T/k, d]
    mlp.gate_proj, up_proj          ColwiseParallel: d_ff columns         all-gather -> [B, T, d_ff/k]
    mlp.down_proj                   RowwiseParallel: d_ff rows            -> reduce-scatter [B, T/k, d]
    lm_head                         ColwiseParallel: vocabulary rows      all-gather -> logits [B, T, V/k]
    the loss                        loss_parallel: cross-entropy over the vocabulary shards; the logits are
                                    never gathered (LitGPT runs the objective and the backward under it)

A tied head shares tok_emb's vocabulary-sharded weight (one parameter). Dropout and the residual adds run on
the sequence-sharded [B, T/k, d] DTensors (sequence parallelism). The fused q/k/v projection becomes three
Linear modules (q, k, v) so that each rank holds whole heads; the state dict of a tensor-parallel run names
them attn.qkv_proj.{q,k,v}.weight (gptkit.model.mha.fuse_qkv_state fuses them back wherever a checkpoint is
read: `gptkit sample`, export, consolidation), and optim=muon orthogonalizes the three together as the one
fused matrix a one-process run has (optim.qkv_parts, muon_step).

Covered: the multi-head attention kind (GQA and MQA) of GPT-2 and Llama-style blocks (pre-norm, LayerNorm or
RMSNorm, GELU, SwiGLU or GeGLU, learned positions or RoPE, tied or untied head); a mixture of experts' layer
on each rank's slice of the sequence (training/moe_tensor_parallel.py). Refused in one line before torch is
imported (training/config_checks.py): MLA, Gated DeltaNet, attention sinks and output gates, a "full"
QK-norm, multi-token prediction, a score head, the fused loss kernel, LoRA and QLoRA.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from gptkit.model.mha import QKV_PARTS
from gptkit.training.moe_tensor_parallel import apply_moe_tensor_parallel

TP_DIM = "tensor_parallel"


class QKVParallel(nn.Module):
    """The fused q/k/v projection as three Linear modules (q, k, v), each column-sharded over the
    tensor-parallel ranks so that a rank holds whole heads. kv_group: None when the K/V heads are sharded;
    with fewer K/V heads than ranks (k % n_kv_heads == 0) k and v are replicated and each rank keeps the
    head its query heads read (kv_group = that head's index)."""

    def __init__(self, fused: nn.Linear, sizes: list[int], kv_group: int | None, head_dim: int) -> None:
        super().__init__()
        self.kv_group, self.head_dim = kv_group, head_dim
        bias = fused.bias is not None
        for name, rows in zip(QKV_PARTS, torch.split(torch.arange(sum(sizes)), sizes)):
            part = nn.Linear(fused.in_features, len(rows), bias=bias, device=fused.weight.device)
            with torch.no_grad():
                if not fused.weight.is_meta:
                    part.weight.copy_(fused.weight[rows])
                    if bias:
                        part.bias.copy_(fused.bias[rows])
            setattr(self, name, part)

    def forward(self, x):
        """x [B, T, d_model] (a replicated DTensor: the all-gathered sequence) -> this rank's q, k, v
        features side by side [B, T, (local heads + 2 local K/V heads) x head_dim], a local tensor."""
        from torch.distributed.tensor import Partial

        q = self.q(x)
        if self.kv_group is None:
            return torch.cat([q, self.k(x), self.v(x)], dim=-1)
        # replicated K/V weights: every rank computes every K/V head and keeps its group's (its gradient a
        # partial sum over the ranks, reduced when the weights' gradients are)
        g = slice(self.kv_group * self.head_dim, (self.kv_group + 1) * self.head_dim)
        k = self.k(x).to_local(grad_placements=[Partial()])[..., g]
        v = self.v(x).to_local(grad_placements=[Partial()])[..., g]
        return torch.cat([q, k, v], dim=-1)


def kv_layout(n_heads: int, n_kv_heads: int, k: int, rank: int) -> tuple[int, int, int | None]:
    """(query heads, K/V heads, replicated K/V head or None) of tensor-parallel rank `rank` of k: the heads
    split evenly; K/V heads fewer than k are replicated, each rank keeping its query heads' group."""
    if n_kv_heads % k == 0:
        return n_heads // k, n_kv_heads // k, None
    per_group = k // n_kv_heads
    return n_heads // k, 1, rank // per_group


def apply_tensor_parallel(model, mesh, expert_parallel: int = 1) -> None:
    """Shard `model` (a GPT) over the 1-D tensor-parallel `mesh` in place (the table of the module
    docstring; an MoE layer: training/moe_tensor_parallel.py, its experts left to expert parallelism when
    expert_parallel > 1); its parameters become DTensors on that mesh. Call it before fully_shard."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torch.distributed.tensor.parallel import parallelize_module as parallelize

    def parallelize_module(module, mesh, plan):
        # no broadcast: each rank keeps its part of its own weights (a rank built on the meta device has
        # none; broadcast_weights then sends rank 0's)
        return parallelize(module, mesh, plan, src_data_rank=None)

    cfg = model.cfg
    k, rank = mesh.size(), mesh.get_local_rank()
    n_q, n_kv, group = kv_layout(cfg.n_heads, cfg.n_kv_heads, k, rank)
    replicated = _replicated_style()
    # the head first (a tied head's weight is tok_emb's: distributed once, by the head, then shared)
    parallelize_module(
        model,
        mesh,
        {
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
            "final_norm": SequenceParallel(),
        },
    )
    if cfg.tie_embeddings:
        model.tok_emb.weight = model.lm_head.weight
        # Rowwise's partition would distribute the (now DTensor) weight again: inputs and outputs only
        tok_emb = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        tok_emb._partition_embedding_fn = lambda name, module, mesh: None
        tok_emb._partition_linear_fn = lambda name, module, mesh: None
    else:
        tok_emb = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    parallelize_module(model, mesh, {"tok_emb": tok_emb})
    if model.pos_emb is not None:
        partition, inputs, _ = replicated
        distribute_module(model.pos_emb, mesh, partition, inputs, _sequence_shard)
    for i, block in enumerate(model.blocks):
        attn = block.attn
        moe = cfg.feed_forward(i) == "moe"
        sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
        attn.qkv_proj = QKVParallel(attn.qkv_proj, sizes, group, cfg.head_dim)
        kv = ColwiseParallel(input_layouts=Replicate()) if group is None else _ReplicatedLinear()
        plan = {
            "attn_norm": SequenceParallel(),
            "attn.qkv_proj": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            "attn.qkv_proj.q": ColwiseParallel(input_layouts=Replicate()),
            "attn.qkv_proj.k": kv,
            "attn.qkv_proj.v": kv,
            "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
        }
        if not moe:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
            plan["mlp.up_proj"] = ColwiseParallel(input_layouts=Replicate())
            plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
        if hasattr(block.mlp, "gate_proj"):
            plan["mlp.gate_proj"] = ColwiseParallel(input_layouts=Replicate())
        if attn.qk_norm == "head":
            # [B, T, local heads, head_dim]: the heads are the sharded dimension
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, mesh, plan)
        if moe:
            # on this rank's slice of the sequence, as a data rank of its own
            apply_moe_tensor_parallel(block.mlp, mesh, expert_parallel)
        attn.n_heads, attn.n_kv_heads = n_q, n_kv
    model._gptkit_tensor_parallel = k


def _replicated_style():
    """distribute_module's (partition_fn, input_fn, output_fn) for a module whose weights every rank holds
    whole (a replicated DTensor) and whose inputs are the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    def partition(name, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            dt = distribute_tensor(p, mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=p.requires_grad))

    def inputs(module, args, mesh):
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False) if isinstance(a, torch.Tensor) else a
            for a in args
        )

    return partition, inputs, None


def _sequence_shard(module, out, mesh):
    """pos_emb's output, [T, d] or [B, T, d] replicated, as this rank's positions (the local [T/k, d] or
    [B, T/k, d] the sequence-sharded token embeddings are added to)."""
    from torch.distributed.tensor import Shard

    return out.redistribute(placements=[Shard(out.ndim - 2)]).to_local()


def _ReplicatedLinear():
    """A ParallelStyle: the Linear's weights replicated over the tensor-parallel ranks, its input the
    replicated DTensor it is given, its output a replicated DTensor (QKVParallel keeps a slice of it)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedLinear(ParallelStyle):
        def _apply(self, module, device_mesh):
            partition, _, _ = _replicated_style()
            return distribute_module(module, device_mesh, partition)

    return ReplicatedLinear()


def split_qkv_state(state: dict, model) -> dict:
    """A full state dict of `model`'s one-process layout (rank 0's weights) in the layout of its tensor-
    parallel form: each ...attn.qkv_proj.weight (bias) split into its q, k, v rows."""
    cfg = model.cfg
    sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    out = {}
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        if head.endswith(".attn.qkv_proj") and leaf in ("weight", "bias"):
            for part, rows in zip(QKV_PARTS, torch.split(value, sizes)):
                out[f"{head}.{part}.{leaf}"] = rows
        else:
            out[key] = value
    return out


def is_tensor_parallel(model) -> bool:
    """Whether apply_tensor_parallel sharded `model`."""
    return bool(getattr(model, "_gptkit_tensor_parallel", 0))


def loss_context(model):
    """loss_parallel() around a tensor-parallel model's loss and its backward (the cross-entropy over the
    vocabulary-sharded logits); a no-op otherwise."""
    if not is_tensor_parallel(model):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_loss(loss):
    """The objective's loss as a plain tensor: under loss_parallel it is a DTensor replicated over the
    tensor-parallel ranks (each rank backpropagates the same value into its shards)."""
    return loss.to_local() if hasattr(loss, "to_local") else loss


class LocalLoss:
    """A tensor-parallel GPT as the objectives call it: the loss of its output a plain tensor (local_loss),
    every other attribute the model's."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        return out if out.loss is None else out._replace(loss=local_loss(out.loss))

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def objective_model(model):
    """What the objective is given: the model, or (tensor-parallel) the model behind LocalLoss."""
    return LocalLoss(model) if is_tensor_parallel(model) else model
