"""A checkpoint read into the fsdp strategy's sharded module at this run's mesh, whatever mesh wrote it.

    written by                          read at                          how
    a sharded folder, same q/k/v layout any dp, tp, cp, ep               torch.distributed.checkpoint: each
                                                                         rank reads its shards' rows from
                                                                         the saved DTensors (load_sharded)
    a sharded folder, other layout      tp 1 <-> tp k                    rank 0 reads it whole, converts,
                                                                         sends each rank its shards
    one file (one process, DDP, fsdp    any                              rank 0's tensors, each rank its
    sharded_checkpoint=false)                                            shards (load_full)

The layout: a tensor-parallel run (trainer.tensor_parallel=k > 1) has each fused qkv_proj as three parameters
q, k, v (training/tensor_parallel.py); its sharded checkpoints keep them apart, at any k (each part a DTensor
of its full shape, so k -> k' needs nothing). A one-file checkpoint is always in the one-process layout (the
strategy's writer fuses a tensor-parallel run's weights and optimizer state); a reader of the other layout
fuses or splits the weights (gptkit.model.mha.fuse_qkv_state, tensor_parallel.split_qkv_state) and the
optimizer's per-parameter state by the same rows (fuse_qkv_optim_state, split_qkv_optim_state: AdamW's
moments, Muon's momentum; the step count is q's). The readers without a process group (a one-process or
DDP resume, consolidate: gptkit.checkpoints.read_sharded_checkpoint) fuse both too. Every value is copied,
never recomputed: the state read back is the saved one bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gptkit.checkpoints import (
    EXTRA_STATE,
    STATE_PREFIX,
    read_sharded_checkpoint,
    safe_planner,
    safe_reader,
    sharded_refusal,
    verify_checkpoint,
)
from gptkit.errors import GptkitError
from gptkit.model.mha import (
    QKV_PARTS,
    fuse_qkv_names,
    fuse_qkv_optim_state,
    fuse_qkv_state,
    split_qkv_names,
    split_qkv_optim_state,
)
from gptkit.training.tensor_parallel import is_tensor_parallel, split_qkv_state


def qkv_sizes(model) -> list[int]:
    """The rows of q, k, v in a fused qkv_proj of `model` (a GPT)."""
    cfg = model.cfg
    return [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]


def saved_split(path: Path) -> bool:
    """Whether the sharded checkpoint at `path` holds q, k, v apart (a tensor-parallel run wrote it)."""
    keys = safe_reader(path).read_metadata().state_dict_metadata
    return any(f".qkv_proj.{QKV_PARTS[0]}." in k for k in keys)


def load_sharded(module, optimizers, path: Path) -> dict[str, Any]:
    """Load a sharded checkpoint into a sharded module and its optimizers (collective: every rank
    calls it); returns the non-tensor state (step, loops, callbacks, schedulers). Written in the other q/k/v
    layout (tp 1 <-> tp k): read whole on rank 0 and sent as load_full sends a file's tensors."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    _verify_together(path)
    if saved_split(path) != is_tensor_parallel(module.model):
        # rank 0 reads it (fused: the one-process layout); the others take their shards of its tensors
        load_whole(module, optimizers, read_sharded_checkpoint(path) if dist.get_rank() == 0 else None, path)
        return torch.load(path / EXTRA_STATE, map_location="cpu", weights_only=True)
    finetune = module.finetune
    # what the run's checkpoints hold (lora, qlora: the adapters only)
    model_state = {"state_dict": finetune.checkpoint_state(get_model_state_dict(module), STATE_PREFIX)}
    _dcp_load(model_state, path)
    strict = finetune.saves_every_weight
    _, unexpected = module.load_state_dict(model_state["state_dict"], strict=strict)
    # (an adapter the checkpoint lacks fails in dcp.load already)
    if not strict and unexpected:
        raise GptkitError(f"{path} does not hold this run's adapters")
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        _dcp_load(optim_state, path)
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
        )
    return torch.load(path / EXTRA_STATE, map_location="cpu", weights_only=True)


def load_full(module, optimizers, path: Path) -> dict[str, Any]:
    """Load a one-file checkpoint (a one-process or DDP run's, or a consolidated one) into a sharded module
    and its optimizers (collective: every rank calls it; each maps the file, rank 0's tensors are sent:
    load_whole). Returns the rest of the checkpoint (step, loops, schedulers)."""
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    load_whole(module, optimizers, checkpoint if dist.get_rank() == 0 else None, path)
    return {k: v for k, v in checkpoint.items() if k != "state_dict"}


def load_whole(module, optimizers, checkpoint: dict[str, Any] | None, path: Path) -> None:
    """Load a whole checkpoint dict (rank 0's; None on the others) into a sharded module and its optimizers:
    every rank takes its shards of rank 0's full tensors. Its optimizer state is keyed by the parameter's
    index across the optimizer's param groups (torch.optim's format), which gptkit orders by group (decayed
    weights first; Muon's matrices, then AdamW's), not as module.named_parameters() lists them: Lightning's
    re-keying assumes the latter and put one parameter's moments on another's shard. The weights and the
    optimizer state are put in this run's q/k/v layout first (the module docstring). Collective."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # lora, qlora: the adapters only
    strict = module.finetune.saves_every_weight
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    model, optim_states, problem = {}, [{} for _ in optimizers], None
    if dist.get_rank() == 0:
        try:
            model, optim_states = _in_layout(module, optimizers, checkpoint, path)
        except GptkitError as exc:
            problem = str(exc)
    # a refusal on rank 0 is every rank's (none waits in a collective)
    told = [problem]
    dist.broadcast_object_list(told, src=0)
    if told[0]:
        raise GptkitError(told[0])
    set_model_state_dict(module, model, options=options)
    for optimizer, osd in zip(optimizers, optim_states):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=osd, options=options)


def _in_layout(module, optimizers, checkpoint: dict[str, Any], path: Path) -> tuple[dict, list]:
    """Rank 0: the checkpoint's weights and its optimizer states (keyed by name) in this run's layout."""
    state = checkpoint["state_dict"]
    # an older tensor-parallel run's one file held q, k, v apart (its optimizer state too)
    was_split = any(f".qkv_proj.{QKV_PARTS[0]}." in k for k in state)
    split = is_tensor_parallel(module.model)
    state = fuse_qkv_state(state)
    if split:
        state = split_qkv_state(state, module.model)
    names = {id(p): n for n, p in module.named_parameters()}
    saved = checkpoint.get("optimizer_states", [])
    if len(saved) != len(optimizers):
        raise GptkitError(f"{path} holds {len(saved)} optimizer state(s) for this run's {len(optimizers)}")
    out = []
    for optimizer, osd in zip(optimizers, saved):
        # the parameters' names in the saved optimizer's order: this run's, in the saved layout
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        fused = fuse_qkv_names(order) if split else order
        saved_order = split_qkv_names(fused) if was_split else fused
        if len(saved_order) != sum(len(g["params"]) for g in osd["param_groups"]):
            raise GptkitError(
                f"{path}: its optimizer state does not fit this run's parameters (another "
                f"model or optimizer); resume with the settings it was trained with"
            )
        by_name = {
            "state": {saved_order[i]: s for i, s in osd["state"].items()},
            "param_groups": [
                dict(g, params=[saved_order[i] for i in g["params"]]) for g in osd["param_groups"]
            ],
        }
        by_name = fuse_qkv_optim_state(by_name)
        if split:
            by_name = split_qkv_optim_state(by_name, qkv_sizes(module.model))
            # each group's names in this optimizer's own order
            rank = {n: i for i, n in enumerate(order)}
            for g in by_name["param_groups"]:
                g["params"] = sorted(g["params"], key=rank.__getitem__)
        out.append(by_name)
    return state, out


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """dcp.load through the safe reader and planner; its CheckpointException (a BaseException) as one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # a bad index: one line on every rank, not torch's logged traceback
    safe_reader(path).read_metadata()
    try:
        dcp.load(state, storage_reader=safe_reader(path), planner=safe_planner(distributed=True))
    except CheckpointException as exc:
        raise sharded_refusal(path, exc) from None


def _verify_together(path: Path) -> None:
    """Every rank checks its share of a sharded checkpoint's files; any mismatch fails every rank with the
    same one-line error (no rank is left waiting in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        verify_checkpoint(path, (rank, world))
        problem = None
    except GptkitError as exc:
        problem = str(exc)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, problem)
    first = next((p for p in every if p), None)
    if first:
        raise GptkitError(first)
