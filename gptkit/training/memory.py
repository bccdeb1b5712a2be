"""Host memory for a run on the CPU: checked against the count-params estimate before the model is built,
and an allocation that fails anyway is one line with that estimate (as the GPU path's out_of_memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptkit.errors import GptkitError
from gptkit.fsio import human_bytes
from gptkit.parallel_plan import MESH_KEYS, check_mesh, memory_per_gpu
from gptkit.training.config_checks import checkpointing_mode
from gptkit.training.finetune import FINETUNES
from gptkit.training.objectives import OBJECTIVES


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable plus free swap, capped by the cgroup
    (container) limit left; None where neither can be read."""
    found = []
    try:
        info = {
            k: int(v.split()[0]) * 1024
            for k, v in (
                line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line
            )
        }
        if "MemAvailable" in info:
            found.append(info["MemAvailable"] + info.get("SwapFree", 0))
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


# What a training process adds on the host beyond the tensors count-params counts (measured 2026-12-01 on
# the CPU with gptkit's tiny models, batch 4 to 16,000: peak RSS against the RSS when the check runs):
# Lightning's trainer, the data loader, the first step's set-up (after the check)
RUNTIME_BYTES = 256 * 2**20
# glibc keeps freed blocks under its mmap threshold (<= 32 MiB): up to ~25% more
ALLOCATOR_SLACK = 0.25


def estimate(plan: Any) -> dict[str, float]:
    """The count-params training memory estimate of a run plan (training/plan.py), per process: the tensors
    (host_estimate adds what a CPU process needs beyond them), as the fine-tune keeps them (lora: the
    gradients and AdamW moments of the adapters only, their weights added; qlora: the base's projections
    in NF4). The objective's rows per item count (a DPO pair is two sequences, chosen and rejected), and
    with finetune=full a frozen reference is a second copy of the weights (with lora and qlora it is the
    model itself with its adapters off: nothing more). The optimizer state is the optimizer's (optim=muon:
    one momentum buffer for the block matrices, gptkit.accounting.training_memory)."""
    from gptkit import accounting as acc

    objective = OBJECTIVES[getattr(plan, "objective", "lm")]
    group = objective.settings_of(getattr(plan, "cfg", None))
    t = plan.trainer
    settings = dict(
        optimizer=optimizer_of(plan),
        checkpointing=checkpointing_mode(t),
        checkpointing_policy=getattr(t, "activation_checkpointing_policy", "ops"),
        checkpointing_every=getattr(t, "activation_checkpointing_every", 2),
    )
    # sequences through the model per micro-step
    rows = plan.batch_size * objective.rows(group)
    mesh = plan_mesh(plan)
    if mesh is None:
        mem = acc.training_memory(
            plan.model,
            plan.precision,
            plan.shards,
            rows,
            plan.seq_len,
            # (a plan-like object without it: no expert parallelism)
            expert_shards=getattr(plan, "expert_shards", None),
            **settings,
        )
    else:
        # trainer.tensor_parallel, trainer.context_parallel: the plan per mesh (gptkit/parallel_plan.py)
        mem = memory_per_gpu(
            plan.model, mesh, plan.precision, rows, plan.seq_len, fsdp=plan.shards > 1, **settings
        )
    if objective.chunked_logps:
        tokens = plan.batch_size * objective.rows(group) * (plan.seq_len or plan.model.max_seq_len)
        mem["logits"] = chunked_logits_bytes(tokens, plan.model) / (1 if mesh is None else mesh.tp * mesh.cp)
    # (a plan-like object without `finetune`: lora when it names adapters)
    finetune = FINETUNES[
        getattr(plan, "finetune", None) or ("lora" if getattr(plan, "lora", None) else "full")
    ]
    # each frozen model of its own: the starting weights' copy (with lora the reference is the model with its
    # adapters off: nothing more), or a source of its own of another size (frozen.<name>)
    sources = getattr(plan, "frozen", None) or {}
    for name in objective.frozen_models(group):
        if name in sources:
            mem[name] = acc.training_memory(sources[name].model, plan.precision, plan.shards)["weights"]
        elif not finetune.own_reference:
            mem[name] = mem["weights"]
    mem = finetune.memory(plan, mem)
    mem["total"] = sum(v for key, v in mem.items() if key != "total")
    return mem


def plan_mesh(plan: Any) -> Any:
    """The run's Mesh (gptkit/parallel_plan.py) when trainer.tensor_parallel or trainer.context_parallel is
    above 1 (else None), checked: one line naming the dimension that does not divide."""
    t = plan.trainer
    tp = getattr(t, "tensor_parallel", None) or 1
    cp = getattr(t, "context_parallel", None) or 1
    if tp == 1 and cp == 1:
        return None
    return check_mesh(
        plan.model,
        plan.world_size,
        tp,
        cp,
        getattr(plan, "expert_shards", None),
        plan.seq_len,
        keys=MESH_KEYS,
    )


def chunked_logits_bytes(tokens: int, model: Any) -> float:
    """What per-token log-probs computed chunk by chunk hold (target_logps: DPO, KTO, GRPO; distill's
    linear_distill, whose chunks are a quarter the rows, below this at the bench's sizes) in place of whole
    logits: two chunks of fp32-sized logits (the chunk, and its half-precision matmul output or the
    gradient's copy) and four fp32 values per token (log-probs, log-sum-exp, their gradient, the mask)."""
    from gptkit_kernels.linear_ce import chunk_rows

    return 2 * chunk_rows(tokens, model.vocab_size) * model.vocab_size * 4 + 4 * tokens * 4


def optimizer_of(plan: Any) -> str:
    """The plan's optimizer (optim.name; a plan-like object without one: adamw)."""
    return str(getattr(getattr(plan, "optim", None), "name", "adamw"))


def host_estimate(plan: Any) -> dict[str, float]:
    """The host memory a CPU training process adds from the check on, an upper-ish bound: the count-params
    tensors, the C allocator's slack on the activations and logits, and the framework's own set-up."""
    mem = dict(estimate(plan))
    mem["runtime"] = ALLOCATOR_SLACK * (mem["activations"] + mem["logits"]) + RUNTIME_BYTES
    mem["total"] = sum(v for k, v in mem.items() if k != "total")
    return mem


def _breakdown(mem: dict[str, float], plan: Any) -> str:
    runtime = f", runtime {human_bytes(mem['runtime'])}" if "runtime" in mem else ""
    objective = OBJECTIVES[getattr(plan, "objective", "lm")]
    names = objective.frozen_models(objective.settings_of(getattr(plan, "cfg", None)))
    reference = "".join(
        f", the {plan.objective.upper()} {name} {human_bytes(mem[name])}" for name in names if name in mem
    )
    return (
        f"weights {human_bytes(mem['weights'])}{reference}, gradients {human_bytes(mem['gradients'])}, "
        f"optimizer {human_bytes(mem['optimizer'])}, activations {human_bytes(mem['activations'])} and "
        f"logits {human_bytes(mem['logits'])} at trainer.batch_size={plan.batch_size}{runtime}"
    )


ADVICE = (
    "lower trainer.batch_size (raise trainer.accumulate_grad_batches to keep the batch), set "
    "trainer.activation_checkpointing=true, or choose a smaller model"
)


def check_host_memory(plan: Any) -> None:
    """On the CPU, before the model is built: a run whose estimate (x the processes on this machine) exceeds
    the memory available is a one-line GptkitError instead of the allocator's error minutes later."""
    available = available_memory()
    if available is None:
        return
    mem = host_estimate(plan)
    # every process of this machine holds its own replica (or shard)
    processes = plan.devices
    need = mem["total"] * processes
    if need > available:
        each = f" ({processes} processes x {human_bytes(mem['total'])})" if processes > 1 else ""
        raise GptkitError(
            "not enough memory for this run on the CPU: count-params estimates "
            f"{human_bytes(need)}"
            f"{each} ({_breakdown(mem, plan)}), {human_bytes(available)} is available; {ADVICE}"
        )


def is_cpu_out_of_memory(exc: BaseException) -> bool:
    """torch's CPU allocator failing (a RuntimeError, not torch.OutOfMemoryError)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def cpu_out_of_memory(plan: Any) -> GptkitError:
    """A failed host allocation during training as one line, with the estimate and what to change."""
    mem = host_estimate(plan)
    free = available_memory()
    return GptkitError(
        f"out of memory on the CPU: count-params estimates {human_bytes(mem['total'])} per "
        f"process ({_breakdown(mem, plan)})"
        + (f", {human_bytes(free)} is available now" if free else "")
        + f"; {ADVICE}"
    )
