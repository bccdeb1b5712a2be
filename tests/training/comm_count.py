"""A measuring tool of the tests (comm_count_distributed.py's ranks import it; not part of gptkit): the bytes
each rank sends, by kind (tp, cp, fsdp, ep, ...), counted as the collectives and point-to-point calls run: a
TorchDispatchMode that sees every c10d op (torch.distributed's all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single, isend, batch_isend_irecv, broadcast, ... reach the dispatcher as
c10d::* ops) and every functional collective DTensor and FSDP issue (_c10d_functional*), the outermost call
only (a functional collective's inner c10d call is not counted twice). Each call is put under the kind of its
process group (`CommCounter([(group, "tp"), ...])`); a group not named counts as "other:<its name>". Where one
process group serves several kinds (a DeviceMesh dimension that spans the world is the default group: FSDP
over 2 ranks and a ring of 2 share it), the call goes to the kind whose code issued it, read from the Python
stack (ORIGINS: FSDP2's module, gptkit's context_parallel or expert_parallel, DTensor's).

The convention, the one parallel_plan.communication uses (docs/parallelism.md "The convention"): the bytes
one rank SENDS under the bandwidth-optimal ring algorithm, for a group of k ranks (nccl-tests' "bus bytes",
PERFORMANCE.md: algorithm bytes x the bus factor):

    all-gather        output N (each rank's input N/k)     (k-1)/k N   (its input, passed on k-1 times)
    reduce-scatter    input N                              (k-1)/k N
    all-reduce        N                                    2 (k-1)/k N (a reduce-scatter and an all-gather)
    all-to-all        input N                              the input rows bound for the other ranks
                                                           (exact with uneven splits; (k-1)/k N when even)
    send              N                                    N; recv 0
    broadcast, reduce N                                    N (bus factor 1); scatter: the root (k-1)/k N
    barrier                                                0 (counted as a call)

A group of one rank sends 0. What is counted is what the process hands to the process group, not what gloo
or NCCL put on the wire (headers, NCCL's tree all-reduce, gloo's own algorithms): the algorithm-independent
figure a formula can give.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# op name (namespace and trailing "_" off) -> its family
FAMILY = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "scatter": "scatter",
    "gather": "gather",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}
# (a path fragment of the calling code, its kind): which of a shared group's kinds issued a call
ORIGINS = (
    ("/torch/distributed/fsdp/", "fsdp"),
    ("/torch/nn/parallel/", "fsdp"),
    ("/gptkit/training/context_parallel.py", "cp"),
    ("/gptkit/training/expert_parallel.py", "ep"),
    ("/torch/distributed/tensor/", "tp"),
)
# wrappers that move nothing
IGNORED = {"wait_tensor", "_wrap_tensor_autograd"}


@dataclass
class Call:
    kind: str
    family: str
    op: str
    group_size: int
    sent: int  # bytes this rank sends (the module docstring's convention)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def group_name(group: Any) -> str:
    """The name of a ProcessGroup (or a DeviceMesh dimension's group), as the ops carry it."""
    return group if isinstance(group, str) else group.group_name


def sent_bytes(family: str, args: dict[str, Any], k: int, rank: int) -> int:
    """Bytes this rank (`rank` of a group of k) sends in one call of `family` with these arguments (by the
    op's schema names), by the module docstring's convention."""
    if k <= 1 and family not in ("send",):
        return 0
    inputs = args.get("input", args.get("inputs", args.get("input_tensor", args.get("input_tensors"))))
    if family == "all_reduce":
        n = _nbytes(args.get("tensors", args.get("input", args.get("inputs"))))
        return 2 * (k - 1) * n // k
    if family == "all_gather":
        # each rank's input is 1/k of the output: it is passed on k-1 times
        return (k - 1) * _nbytes(args.get("input_list", inputs))
    if family == "reduce_scatter":
        return (k - 1) * _nbytes(inputs) // k
    if family == "all_to_all":
        if "input_tensors" in args:  # alltoall_: a list, one tensor per rank
            return sum(_nbytes(t) for i, t in enumerate(args["input_tensors"]) if i != rank)
        x = args.get("input")
        n = _nbytes(x)
        splits = list(args.get("input_split_sizes") or [])
        if not splits:
            return (k - 1) * n // k
        row = n // max(1, x.shape[0])
        return n - int(splits[rank]) * row
    if family == "send":
        return _nbytes(args.get("tensors"))
    if family in ("broadcast", "reduce"):
        return _nbytes(args.get("tensors"))
    if family == "scatter":
        return (k - 1) * _nbytes(args.get("input_tensors")) // k if rank == args.get("root_rank") else 0
    if family == "gather":
        return _nbytes(args.get("input_tensors")) if rank != args.get("root_rank") else 0
    return 0  # recv, barrier


def _origin(kinds: list[str]) -> str:
    """Which of `kinds` issued the current call: the innermost caller ORIGINS names ("+".join(kinds) if
    none)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for fragment, kind in ORIGINS:
            if fragment in path and kind in kinds:
                return kind
        frame = frame.f_back
    return "+".join(kinds)


class CommCounter(TorchDispatchMode):
    """`with CommCounter(kinds) as c: ...` -> c.calls (one Call per collective or point-to-point call),
    c.sent() {kind: bytes this rank sent}. kinds: (ProcessGroup or its name, kind) pairs (a group may come
    with several kinds: the module docstring)."""

    def __init__(self, kinds: list[tuple[Any, str]] = ()) -> None:
        super().__init__()
        self.kinds: dict[str, list[str]] = defaultdict(list)
        for g, kind in kinds:
            if kind not in self.kinds[group_name(g)]:
                self.kinds[group_name(g)].append(kind)
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func.namespace not in NAMESPACES and any(issubclass(t, DTensor) for t in types):
            # let DTensor run first (modes come before subclasses), so that the collectives it issues
            # inside an op (loss_parallel's reductions, implicit redistributions) reach this mode too
            # (torch.distributed.tensor.debug.CommDebugMode does the same)
            return NotImplemented
        if func.namespace in NAMESPACES:
            name = func._schema.name.split("::")[-1]
            family = FAMILY.get(name.rstrip("_") if name not in FAMILY else name)
            if family is None and name not in IGNORED:
                raise NotImplementedError(f"comm_count: no rule for {func} (add it to FAMILY)")
            if family is not None:
                self._count(func, name, family, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, name: str, family: str, args, kwargs) -> None:
        from torch.distributed import ProcessGroup
        from torch.distributed.distributed_c10d import _resolve_process_group

        bound = {a.name: v for a, v in zip(func._schema.arguments, args)}
        bound.update(kwargs)
        pg = bound.get("process_group")
        gname = bound.get("group_name")
        if pg is None:
            pg = _resolve_process_group(gname)
        elif not isinstance(pg, ProcessGroup):
            pg = ProcessGroup.unbox(pg)  # the c10d ops carry it as a ScriptObject
        gname = pg.group_name
        k, rank = pg.size(), pg.rank()
        kinds = self.kinds.get(gname) or [f"other:{gname}"]
        kind = kinds[0] if len(kinds) == 1 else _origin(kinds)
        self.calls.append(Call(kind, family, name, k, sent_bytes(family, bound, k, rank)))

    def sent(self) -> dict[str, int]:
        """{kind: bytes this rank sent}, over the calls counted."""
        out: dict[str, int] = defaultdict(int)
        for c in self.calls:
            out[c.kind] += c.sent
        return dict(out)

    def table(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(kind, family): (calls, bytes sent)}."""
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for c in self.calls:
            out[(c.kind, c.family)][0] += 1
            out[(c.kind, c.family)][1] += c.sent
        return {key: (n, b) for key, (n, b) in out.items()}
