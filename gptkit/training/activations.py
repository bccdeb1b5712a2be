"""What a training step keeps for its backward pass: activation checkpointing
(trainer.activation_checkpointing) and activation offloading (trainer.activation_offload), applied to the
model's blocks from outside the model (each block's forward wrapped as an instance attribute: parameter
names and checkpoints unchanged; evaluation and decoding untouched), and the memory of one step measured
(step_memory: what `gptkit bench memory` reports).

    false           every activation kept
    true | full     each block recomputed in the backward pass: only its input stays
    selective       trainer.activation_checkpointing_policy:
        ops         torchtitan's op-level policy (torchtitan/models/llama3/infra/parallelize.py, _save_list):
                    inside each block the outputs of the matmuls and of the attention core are kept, every
                    trainer.activation_checkpointing_every-th matmul (2: torchtitan's) and every other op
                    (norms, activations, RoPE, residual adds) recomputed
        attention   only the attention core's outputs kept (its O(T^2) work is never done twice), the rest
                    of the block recomputed
        layers      every trainer.activation_checkpointing_every-th block recomputed whole, the others
                    kept (torchtitan's layer-level selective AC, selective_ac_option=k)

trainer.activation_offload: the tensors a block keeps for the backward (its activations; not the weights)
copied to host memory (pinned, asynchronous) in the forward and back to the device in the backward
(torch.autograd.graph.save_on_cpu, without the weights). On the CPU the activations are on the host already:
there it moves nothing and saves nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as recompute

from gptkit.training.config_checks import checkpointing_mode

_aten = torch.ops.aten
# the matmuls torchtitan's policy counts (a linear with a bias is an addmm)
MATMULS = {_aten.mm.default, _aten.addmm.default}
# the attention core: scaled_dot_product_attention's kernels
ATTENTION = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
}


def op_policy(policy: str, every: int) -> Callable[[], Any]:
    """A context_fn for torch.utils.checkpoint: the selective contexts of `policy` (module docstring), with
    the matmuls counted per checkpointed call, the forward and its recomputation apart (as torchtitan)."""

    def context_fn():
        counts: dict[str, int] = defaultdict(int)

        def decide(ctx, func, *args, **kwargs):
            if func in ATTENTION:
                return CheckpointPolicy.MUST_SAVE
            if policy == "ops" and func in MATMULS:
                key = "recompute" if ctx.is_recompute else "forward"
                counts[key] += 1
                if counts[key] % every:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(decide)

    return context_fn


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (the transposed weight a matmul keeps)."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


class Offload(torch.autograd.graph.saved_tensors_hooks):
    """The activations autograd keeps, on the host: a device tensor copied to pinned host memory when
    saved and back when the backward needs it; weights and host tensors stay where they are. `moved`
    counts the bytes copied; `on_host` the activations' bytes that were on the host already (the CPU: what
    the same step on a GPU would move). counts: a dict the two are added to as well (apply's). A tensor
    saved twice in one context (a block's input, read by q, k and v) is copied once: the copies are keyed by
    the tensor's storage and view, its device tensor held until the context ends so that no other takes its
    place."""

    def __init__(self, counts: dict | None = None) -> None:
        self.moved = self.on_host = 0
        counts = counts if counts is not None else {}
        self.copies: dict = {}

        def pack(t: torch.Tensor):
            if _is_weight(t):
                return t
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in self.copies:
                return self.copies[key][1]
            if t.device.type == "cpu":
                self.copies[key] = (t, t)
                self.on_host += t.numel() * t.element_size()
                counts["on_host"] = counts.get("on_host", 0) + t.numel() * t.element_size()
                return t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self.moved += t.numel() * t.element_size()
            counts["moved"] = counts.get("moved", 0) + t.numel() * t.element_size()
            self.copies[key] = (t, (t.device, host))
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        self.copies.clear()
        return super().__exit__(*exc)


def apply(
    model: Any, mode: str | None, policy: str = "ops", every: int = 2, offload: bool = False
) -> dict[str, int]:
    """Wrap each block's forward (mode, policy, every, offload: the module docstring) while it trains with
    gradients. Returns the offload's byte counts, added to as the blocks run (Offload: moved, on_host)."""
    counts: dict[str, int] = {"moved": 0, "on_host": 0}
    if mode is None and not offload:
        return counts
    selective = op_policy(policy, every) if mode == "selective" and policy != "layers" else None

    def wrapped(block, forward, checkpointed: bool):
        def run(*args, **kwargs):
            if not (block.training and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            with Offload(counts) if offload else _nothing():
                if not checkpointed:
                    return forward(*args, **kwargs)
                if selective is not None:
                    return recompute(forward, *args, use_reentrant=False, context_fn=selective, **kwargs)
                return recompute(forward, *args, use_reentrant=False, **kwargs)

        return run

    for i, block in enumerate(model.blocks):
        checkpointed = mode is not None and not (mode == "selective" and policy == "layers" and i % every)
        block.forward = wrapped(block, block.forward, checkpointed)
    return counts


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def apply_from_config(model: Any, t: Any) -> None:
    """apply() with the `trainer` group's settings."""
    apply(
        model,
        checkpointing_mode(t),
        str(t.get("activation_checkpointing_policy", "ops")),
        int(t.get("activation_checkpointing_every", 2)),
        bool(t.get("activation_offload", False)),
    )


def step_memory(forward: Callable[[], torch.Tensor]) -> dict[str, float]:
    """Run `forward` (returning the loss) and its backward under torch.profiler's memory recording (every
    allocation and free of the CPU allocator, in order): {"kept": bytes allocated by the forward and still
    alive when it returns (the activations kept for the backward, the logits and loss), "peak": the most
    bytes alive at any time of the forward and backward above what was alive before it (a block's
    recomputation and the gradients included), "loss"}. The CPU's tensors only: on a GPU read
    torch.cuda.max_memory_allocated."""
    from torch.profiler import ProfilerActivity, profile

    def net(prof) -> tuple[int, int]:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        now = top = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            now += e.nbytes()
            top = max(top, now)
        return now, top

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()
    kept, forward_peak = net(prof)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    _, backward_peak = net(prof)
    return {
        "kept": float(kept),
        "peak": float(max(forward_peak, kept + backward_peak)),
        "loss": float(loss.detach()),
    }
