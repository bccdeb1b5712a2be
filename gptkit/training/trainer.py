"""Build the Lightning Trainer (and its loggers and callbacks) from the `trainer` and `logger` groups."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from gptkit.checkpoints import CHECKPOINT_DIR
from gptkit.errors import ConfigError, GptkitError
from gptkit.runs import TOKENIZER_FILE
from gptkit.training.checkpoint_io import SafeAtomicCheckpointIO
from gptkit.training.config_checks import Values, check_trainer_values
from gptkit.training.distributed import (
    build_strategy,
    check_distributed,
    fail_fast_callback,
    launcher_plugins,
)
from gptkit.training.metrics import StepMetrics, check_spikes
from gptkit.training.metrics_csv import MetricsCSV
from gptkit.training.peak_memory import MeasuredMemory
from gptkit.training.plan import Checked, RunPlan, check_trainer
from gptkit.training.profile import ProfileSteps, check_profile
from gptkit.training.progress import ProgressReporter
from gptkit.training.run_checkpoints import RunCheckpoints
from gptkit.training.task_evals import check_task_evals, task_evals_callback
from gptkit.training.watch import ValidationWatch

# wandb and the tensorboard logger are imported on use: optional packages (config_checks.check_loggers
# says which).


def build_loggers(logger_cfg: Any, run_dir: Path, run_name: str, resume_step: int | None = None) -> list:
    """The loggers the `logger` group switches on (csv, tensorboard, wandb), each writing into run_dir."""
    loggers = []
    for kind, opts in (logger_cfg or {}).items():
        # logger.<kind>.enabled=false switches one off
        if not (opts or {}).get("enabled", True):
            continue
        # packages: check_loggers
        loggers.append(_logger(kind, opts, run_dir, run_name, resume_step))
    return loggers


def _logger(kind: str, opts: Any, run_dir: Path, run_name: str, resume_step: int | None):
    if kind == "csv":
        # a resume keeps the rows its checkpoint covers
        return MetricsCSV(run_dir, resume_step)
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(
            save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False
        )
    if kind == "wandb":
        return _wandb_logger(opts, run_dir, run_name)
    raise ConfigError(f"unknown logger {kind!r}; use logger=[csv,tensorboard,wandb]")


def _wandb_logger(opts: Any, run_dir: Path, run_name: str):
    mode = os.environ.get("WANDB_MODE") or opts.get("mode", "offline")
    if mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={mode!r} must be offline, online or disabled")
    if mode == "online" and not _wandb_has_key():
        raise GptkitError(
            "logger.wandb.mode=online needs a W&B API key (set WANDB_API_KEY or run `wandb "
            "login`); or use logger.wandb.mode=offline and `wandb sync` later"
        )

    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(
        project=opts.get("project", "gptkit"),
        entity=opts.get("entity"),
        name=run_name,
        save_dir=str(run_dir),
        mode=mode,
        settings=_wandb_settings(),
    )


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _wandb_settings():
    import wandb

    return wandb.Settings(init_timeout=30, x_disable_stats=True)


class ClippingMixedPrecision(MixedPrecision):
    """Lightning's mixed precision, with gradient clipping for optimizers that take the loss scale into their
    own step (fused AdamW), which Lightning refuses ("does not allow for gradient clipping because it performs
    unscaling of gradients internally").

    16-mixed: the gradients are unscaled before clipping for every optimizer; torch's GradScaler then sees
    them unscaled and steps a fused optimizer with no scale (and skips the step on inf/NaN, as always).
    bf16-mixed has no scaler, so there is nothing to unscale and clipping is plain clipping. The clipping
    itself is LitGPT.configure_gradient_clipping (called from _after_closure), which also keeps the norm.
    """

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Closure (forward, backward), unscale (16-mixed), clip, then the scaler's optimizer step."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # backward skipped by the step
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            # on the device: no host sync
            self.scaler.unscale_(optimizer)
        # on_before_optimizer_step hooks, then clipping
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out


def precision_plugin(plan: RunPlan):
    """The precision plugin for plan.precision: ClippingMixedPrecision for the mixed precisions (on CUDA
    and on the CPU alike: 16-mixed keeps fp16 and its GradScaler on the CPU, where Lightning would silently
    switch to bf16), else None (Lightning's own plugin for the "true" precisions)."""
    if not plan.precision.mixed:
        return None
    return ClippingMixedPrecision(plan.precision.name, plan.accelerator)


def check_trainer_config(t: Any, values: Values | None = None) -> Checked:
    """Fail in one line, before any data is prepared, on trainer values Lightning would reject late; returns
    the facts derived on the way (precision, accelerator, devices, compile mode), for make_plan. values: what
    config_checks.check_trainer_values derived from `t` (fit.check_config checks them before importing
    torch); None checks them here."""
    values = values or check_trainer_values(t)
    check_spikes(t)
    # a range beyond trainer.max_steps, before any data is prepared (make_plan checks it against the plan)
    if t.max_tokens is None:
        check_profile(t.get("profile"), int(t.max_steps))
    # trainer.eval_tasks: lm-eval importable, local task files there
    check_task_evals(t)
    checked = check_trainer(t, values)
    # devices, strategy, launcher: one line now rather than a hang later
    check_distributed(t, checked)
    p, device = checked.precision, checked.accelerator
    if device == "cuda" and p.compute == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"trainer.precision={p.name}: this GPU ({torch.cuda.get_device_name()}) has no "
            f"bf16; use trainer.precision=16-mixed (or 32-true)"
        )
    if checked.compile:
        check_compile(device, str(t.get("compile_backend") or "inductor"))
    return checked


def check_compile(device: str, backend: str) -> None:
    """trainer.compile=true where torch cannot compile is one line, before any data is prepared."""
    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            f"trainer.compile=true: torch.compile does not support this Python/platform "
            f"(torch {torch.__version__}); use trainer.compile=false"
        )
    if (
        backend == "inductor"
        and device == "cpu"
        and not any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    ):
        raise ConfigError(
            "trainer.compile=true on the CPU needs a C++ compiler for torch's inductor backend "
            "(install g++), or use trainer.compile=false"
        )


def build_trainer(
    plan: RunPlan, loggers: list, rss_before: int | None = None
) -> tuple[L.Trainer, RunCheckpoints, StepMetrics]:
    """The Lightning Trainer of the plan, with its callbacks: StepMetrics (throughput, MFU, the NaN window,
    one row per log step), MeasuredMemory (the peak memory against the estimate; rss_before: the process's RSS
    before the model was built) and RunCheckpoints (the one checkpoint writer); returns the trainer,
    the checkpoints and the metrics."""
    # checked by check_trainer_config before any data was prepared
    t = plan.trainer
    # rows on disk before a checkpoint
    csv = next((lg for lg in loggers if isinstance(lg, MetricsCSV)), None)
    checkpoints = RunCheckpoints(
        str(plan.run_dir / CHECKPOINT_DIR),
        int(t.checkpoint_every),
        t.get("stop_at_step"),
        sync_every=int(t.log_every),
        keep=t.get("keep_checkpoints", 3),
        metrics=csv,
        keep_best=bool(t.get("keep_best", False)),
        val_every=int(t.val_every),
    )
    reporter = ProgressReporter(t.progress)
    metrics = StepMetrics(
        plan.flops_per_token,
        plan.tokens_per_step,
        plan.peak_flops,
        int(t.log_every),
        reporter if reporter.mode != "off" else None,
        plan.causal_flops_per_token,
        spikes=check_spikes(t) if plan.objective_class.loss_spikes else None,
        run_dir=plan.run_dir,
    )
    watch = ValidationWatch(plan.run_dir, str(plan.run_dir / TOKENIZER_FILE), t.get("sample_every"), csv)
    # watch after checkpoints: best.ckpt before the plot; the memory measured on the row of its step
    callbacks = [metrics, MeasuredMemory(plan, rss_before), checkpoints, watch]
    # trainer.eval_tasks
    task_evals = task_evals_callback(plan.cfg, clock=metrics)
    if task_evals is not None:
        # scores step N before step N's checkpoint is written
        callbacks.insert(1, task_evals)
    # trainer.profile: first, so that its steps end before the metrics and checkpoint callbacks run
    if plan.profile is not None:
        callbacks.insert(0, ProfileSteps(plan.profile, plan.run_dir, plan.accumulation))
    # trainer.ema: the averages move before the step's checkpoint is written (training/ema.py)
    if t.get("ema") is not None:
        from gptkit.training.ema import EMA

        callbacks.insert(callbacks.index(checkpoints), EMA(float(t.ema)))
    if plan.world_size > 1:
        callbacks.append(fail_fast_callback())
    plugin = precision_plugin(plan)
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=plan.nodes,
        strategy=build_strategy(t),
        precision=None if plugin else plan.precision.name,
        max_steps=plan.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=plan.accumulation,
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=int(t.val_every) * plan.accumulation,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=int(t.log_every),
        logger=loggers or False,
        callbacks=callbacks,
        # ProgressReporter: on stderr, and it never reads a device tensor
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=bool(t.deterministic),
        default_root_dir=str(plan.run_dir),
        # RunCheckpoints writes them (Lightning would add a ModelCheckpoint)
        enable_checkpointing=False,
        plugins=[SafeAtomicCheckpointIO(), *launcher_plugins(t)] + ([plugin] if plugin else []),
        use_distributed_sampler=True,
    )
    return trainer, checkpoints, metrics
