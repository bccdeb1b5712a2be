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


class _Stored:
    """One storage's host copy, and its device copy once the backward has brought it back (shared by every
    view of it; freed with the last one autograd releases)."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device, self.back = host, device, None

    def restore(self) -> torch.UntypedStorage:
        if self.back is None:
            self.back = self.host.to(self.device, non_blocking=True).untyped_storage()
        return self.back


class Offload(torch.autograd.graph.saved_tensors_hooks):
    """The activations autograd keeps, on the host: each storage a saved tensor views copied once to
    (pinned) host memory when saved, and back once when the backward first needs it, every view of it
    rebuilt on the copy; weights stay where they are. On the CPU the activations are on the host already:
    they stay as they are unless copy_host (tests: the same copies and views as on a GPU). `moved` counts
    the bytes copied, `on_host` those already on the host (the CPU: what a GPU would move), each storage
    once; counts: a dict both are added to as well (apply's). The device tensors are held until the context
    ends, so that no other storage takes the address of one copied."""

    def __init__(self, counts: dict | None = None, copy_host: bool = False) -> None:
        self.moved = self.on_host = 0
        counts = counts if counts is not None else {}
        self.stored: dict[int, tuple[torch.Tensor, _Stored | None]] = {}

        def pack(t: torch.Tensor):
            if _is_weight(t):
                return t
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.stored:
                size = storage.nbytes()
                if t.device.type == "cpu" and not copy_host:
                    self.on_host += size
                    counts["on_host"] = counts.get("on_host", 0) + size
                    self.stored[key] = (t, None)
                else:
                    pin = t.device.type != "cpu" and torch.cuda.is_available()
                    host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                    host.untyped_storage().copy_(storage, non_blocking=pin)
                    self.moved += size
                    counts["moved"] = counts.get("moved", 0) + size
                    self.stored[key] = (t, _Stored(host, t.device))
            stored = self.stored[key][1]
            if stored is None:
                return t
            return (stored, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            stored, offset, shape, stride, dtype = packed
            view = torch.empty(0, dtype=dtype, device=stored.device)
            return view.set_(stored.restore(), offset, shape, stride)

        super().__init__(pack, unpack)

    def __exit__(self, *exc):
        self.stored.clear()
        return super().__exit__(*exc)


def apply(
    model: Any,
    mode: str | None,
    policy: str = "ops",
    every: int = 2,
    offload: bool = False,
    copy_host: bool = False,
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
            with Offload(counts, copy_host) if offload else _nothing():
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
