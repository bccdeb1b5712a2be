"""What a training run prints: the start-up lines, the disk its checkpoints need, the one-line errors of
running out of memory or of a second Ctrl-C, and the run's last lines (the summary, each source's loss).

Everything goes to stderr; what comes from the user or the data (a path, a run name, a job's overrides)
is escaped, never read as markup.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptkit.checkpoints import checkpoint_step
from gptkit.errors import GptkitError
from gptkit.fsio import human_bytes

if TYPE_CHECKING:
    from gptkit.training.plan import RunPlan

# rich and the accounting are imported where a line is printed.


def check_disk(
    ckpt_dir: Path,
    model_cfg,
    t,
    max_steps: int,
    start_step: int,
    precision=None,
    each_bytes: int | None = None,
) -> None:
    """Say how much disk the run's checkpoints need (each_bytes: one checkpoint's, as the fine-tune says,
    e.g. lora's adapters and their AdamW moments in fp32; None: the count-params estimate) and warn when
    the filesystem has less free."""
    from rich.console import Console

    from gptkit import accounting as acc
    from gptkit.fsio import free_bytes, human_bytes

    # precision: the plan's
    each = acc.checkpoint_bytes(model_cfg, precision or str(t.precision))
    if each_bytes is not None:
        each = each_bytes
    periodic = max(0, max_steps // int(t.checkpoint_every) - start_step // int(t.checkpoint_every))
    keep = t.get("keep_checkpoints", 3)
    # + the one being written + last.ckpt
    at_once = (periodic if keep is None else min(int(keep), periodic)) + 2
    # best.ckpt and its pending replacement
    at_once += 2 if t.get("keep_best") else 0
    need, free = each * at_once, free_bytes(ckpt_dir)
    line = (
        f"  checkpoints: ~{human_bytes(each)} each, up to {at_once} at once "
        f"(trainer.keep_checkpoints={keep}) = ~{human_bytes(need)}; {human_bytes(free)} free"
    )
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(line)
    if need > free:
        console.print(
            f"[bold yellow]warning[/]: {ckpt_dir} lacks the space for the run's checkpoints "
            f"({human_bytes(need)} needed, {human_bytes(free)} free); free some or lower "
            f"trainer.keep_checkpoints"
        )


def interrupted(run_dir: Path, last: Path, rank_zero: bool) -> None:
    if rank_zero:
        try:
            saved = (
                f"{last} holds step {checkpoint_step(last)}; continue with: gptkit train resume={run_dir}"
                if last.exists()
                else "no checkpoint was saved yet: run the same command again to start over"
            )
        except GptkitError as exc:
            saved = str(exc)
        print(
            f"interrupted by a second Ctrl-C: stopped at once without saving this step; {saved}",
            file=sys.stderr,
        )
    raise SystemExit(130)


def out_of_memory(plan: RunPlan) -> GptkitError:
    """A CUDA out-of-memory error as one line: the count-params estimate of the plan (its optimizer, LoRA
    adapters and objective counted: training/memory.py) and what to change."""
    from gptkit.training.memory import estimate

    t = plan.trainer
    mem = estimate(plan)
    return GptkitError(
        f"out of GPU memory: count-params estimates {human_bytes(mem['total'])} per device (weights "
        f"{human_bytes(mem['weights'])}, optimizer {human_bytes(mem['optimizer'])}, activations "
        f"{human_bytes(mem['activations'])}, logits {human_bytes(mem['logits'])} at "
        f"trainer.batch_size={t.batch_size}); lower trainer.batch_size "
        "(and raise trainer.accumulate_grad_batches to keep the batch), set "
        f"trainer.activation_checkpointing=true, or shard with trainer=fsdp"
    )


def announce(
    trainer, plan: RunPlan, prepared, optimizer: str = "AdamW", trainable: int | None = None
) -> None:
    """The start-up lines: the run folder, the model, the data, the global batch and the plan's totals,
    precision, optimizer and clipping, where the weights come from, and what the objective says of itself."""
    if not trainer.is_global_zero:
        return
    from rich.console import Console
    from rich.markup import escape

    from gptkit import accounting as acc

    t, m = plan.trainer, plan.model
    counts = acc.count_params(m)
    n = counts.total
    trainable = n if trainable is None else trainable
    # a mixture of experts: FLOPs count the parameters a token goes through
    active = f" ({counts.active:,} active per token)" if counts.active != n else ""
    clip = f"clipping at {t.gradient_clip_val}" if t.gradient_clip_val else "no clipping"
    compiled = f", torch.compile={plan.compile}" if plan.compile else ""
    total = plan.total_tokens
    batch = plan.objective_class.batch_words(plan.batch_size, plan.objective_settings)
    finetune = plan.finetune_class
    convention = finetune.flops_convention
    lines = [f"[bold]{escape(plan.job)}[/]"] if plan.job else []
    # trainer.tensor_parallel=k: a group of k ranks reads one batch
    k = int(plan.cfg.trainer.get("tensor_parallel") or 1)
    tp = f" / {k} tensor-parallel" if k > 1 else ""
    lines += [
        f"[bold]gptkit train[/] -> {escape(str(plan.run_dir))}",
        f"  model {m.name}: {n:,} parameters{active}, vocab {m.vocab_size}, context {m.max_seq_len}, "
        f"attention {m.attention}{compiled}",
        f"  data: {escape(prepared.describe())}",
        f"  global batch: {plan.tokens_per_step:,} tokens/step = {batch} x {plan.seq_len} tokens x "
        f"{plan.accumulation} accumulation x {plan.devices} devices x {plan.nodes} nodes{tp} "
        f"({type(trainer.strategy).__name__}); {plan.max_steps} steps = {total:,} tokens, "
        f"{plan.flops_per_token * total:.3g} FLOPs ({convention})",
        f"  precision {plan.precision.name}, {escape(optimizer)}, {clip}",
    ]
    if plan.resume:
        lines.append(f"  resuming from {escape(str(plan.resume))}")
    if plan.replan:
        lines.append(f"  note: {plan.replan}")
    if plan.init_from:
        lines.append(f"  weights from {escape(str(plan.init_from))} (new optimizer and schedule)")
    tuned = finetune.describe(plan, trainable, n)
    if tuned:
        lines.append(f"  {escape(tuned)}")
    said = plan.objective_class.describe(plan)
    if said:
        lines.append(f"  {escape(said)}")
    if plan.weights_from_rank0:
        lines.append(
            f"  FSDP: rank 0 builds the weights; the other {plan.world_size - 1} rank(s) start on the "
            f"meta device and receive their shards"
        )
    if plan.strategy == "fsdp" and plan.world_size > 1:
        from gptkit.training.mesh import mesh_dims

        # the one device mesh (training/mesh.py): what each parallelism's group is carved from
        dims = mesh_dims(plan.cfg.trainer, plan.world_size)
        hsdp = f"; HSDP: {dims.dp_replicate} replicas" if dims.dp_replicate > 1 else ""
        lines.append(f"  mesh: {dims.describe()}; FSDP2 shards over dp_shard x cp = {dims.dp_shard_cp}{hsdp}")
    if plan.expert_shards:
        k, m = plan.expert_shards, plan.model.moe
        lines.append(
            f"  experts: each MoE layer's {m.n_experts} over groups of {k} ranks ({m.n_experts // k} per "
            f"rank, tokens sent to them and back by all-to-all, trainer.expert_parallel={k}); the rest FSDP2 "
            f"over dp_shard x cp"
        )
    Console(stderr=True, highlight=False, soft_wrap=True).print("\n".join(lines))


def source_losses(logged: dict[str, Any]) -> None:
    """data=mix: one line per source with its final val/loss/<source> (stderr, after the summary)."""
    for key, value in logged.items():
        if key.startswith("val/loss/"):
            loss = float(value)
            print(
                f"  val loss {key[len('val/loss/') :]}: {loss:.4f} (ppl {math.exp(min(loss, 50)):.2f})",
                file=sys.stderr,
            )


def summary(
    run_dir: Path,
    step: int,
    metrics,
    flops_per_token: float,
    peak: float | None,
    world: int,
    wall_s: float,
    val_text: str | None = None,
) -> None:
    """The run's result: the final validation as the objective says it (val_text: val loss and perplexity,
    or DPO's loss and reward accuracy), and this invocation's average throughput over all its training steps
    (not the last window) and total wall time."""
    from rich.console import Console
    from rich.markup import escape

    from gptkit import accounting as acc
    from gptkit.training.progress import clock

    parts = [f"step {step}"]
    if val_text:
        parts.append(val_text)
    tps = metrics.average_tokens_per_s
    if tps:
        fps = tps * flops_per_token
        rate = f"{fps / 1e12:.1f} TFLOP/s" if fps >= 1e12 else f"{fps / 1e9:.2f} GFLOP/s"
        mfu = f", MFU {acc.mfu(tps / world, flops_per_token, peak):.1%}" if peak else ""
        parts.append(
            f"{tps:,.0f} tokens/s on average over {metrics.steps_done:,} step"
            f"{'s' if metrics.steps_done != 1 else ''} ({rate}{mfu})"
        )
    parts.append(f"{clock(wall_s)} wall time")
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"[bold green]done[/]: {', '.join(parts)} -> {escape(str(run_dir))}"
    )
