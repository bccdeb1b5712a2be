"""Build the Lightning Trainer (and its loggers and callbacks) from the `trainer` and `logger` groups."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from gptkit.checkpoints import CHECKPOINT_DIR
from gptkit.errors import ConfigError, GptkitError
from gptkit.precision import precision
from gptkit.training.callbacks import RunCheckpoints, ThroughputMonitor
from gptkit.training.checkpoint_io import SafeAtomicCheckpointIO
from gptkit.training.distributed import build_strategy, check_distributed, fail_fast_callback, world_size
from gptkit.training.metrics_csv import LearningRates, MetricsCSV


def build_loggers(logger_cfg: Any, run_dir: Path, run_name: str, resume_step: int | None = None) -> list:
    loggers = []
    for kind, opts in (logger_cfg or {}).items():
        if not (opts or {}).get("enabled", True):  # logger.<kind>.enabled=false switches one off
            continue
        try:
            loggers.append(_logger(kind, opts, run_dir, run_name, resume_step))
        except ModuleNotFoundError as exc:  # logger=[tensorboard] or [wandb] without the package
            raise GptkitError(f"logger={kind} needs the {kind} package, which is not installed: pip install {kind} "
                              f"(or leave {kind} out of logger=)") from exc
    return loggers


def _logger(kind: str, opts: Any, run_dir: Path, run_name: str, resume_step: int | None):
    if kind == "csv":
        return MetricsCSV(run_dir, resume_step)  # a resume keeps the rows its checkpoint covers
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)
    if kind == "wandb":
        return _wandb_logger(opts, run_dir, run_name)
    raise ConfigError(f"unknown logger {kind!r}; use logger=[csv,tensorboard,wandb]")


def _wandb_logger(opts: Any, run_dir: Path, run_name: str):
    mode = os.environ.get("WANDB_MODE") or opts.get("mode", "offline")
    if mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.wandb.mode={mode!r} must be offline, online or disabled")
    if mode == "online" and not _wandb_has_key():
        raise GptkitError("logger.wandb.mode=online needs a W&B API key (set WANDB_API_KEY or run `wandb login`); "
                          "or use logger.wandb.mode=offline and `wandb sync` later")
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=opts.get("project", "gptkit"), entity=opts.get("entity"), name=run_name,
                       save_dir=str(run_dir), mode=mode, settings=_wandb_settings())


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def _wandb_settings():
    import wandb

    return wandb.Settings(init_timeout=30, x_disable_stats=True)


def check_trainer_config(t: Any) -> None:
    """Fail in one line, before any data is prepared, on trainer values Lightning would reject late."""
    precision(t.precision)
    for key in ("batch_size", "accumulate_grad_batches", "val_every", "checkpoint_every", "log_every", "num_nodes"):
        if not isinstance(t[key], int) or int(t[key]) < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be an integer >= 1")
    if t.max_tokens is None and (not isinstance(t.max_steps, int) or t.max_steps < 1):
        raise ConfigError(f"trainer.max_steps={t.max_steps} must be an integer >= 1 (or set trainer.max_tokens)")
    if t.val_windows is not None and int(t.val_windows) < 1:
        raise ConfigError(f"trainer.val_windows={t.val_windows} must be >= 1 (or null for every window)")
    keep = t.get("keep_checkpoints", 3)
    if keep is not None and (not isinstance(keep, int) or keep < 0):
        raise ConfigError(f"trainer.keep_checkpoints={keep} must be an integer >= 0 (or null to keep every one)")
    if t.gradient_clip_val is not None and float(t.gradient_clip_val) <= 0:
        raise ConfigError(f"trainer.gradient_clip_val={t.gradient_clip_val} must be > 0 (or null for no clipping)")
    check_distributed(t)  # devices, strategy, launcher: one line now rather than a hang later


def build_trainer(cfg: Any, run_dir: Path, flops_per_token: float, tokens_per_step: int, max_steps: int,
                  peak_flops: float | None, loggers: list) -> tuple[L.Trainer, RunCheckpoints, ThroughputMonitor]:
    t = cfg.trainer  # checked by check_trainer_config before any data was prepared
    metrics = next((lg for lg in loggers if isinstance(lg, MetricsCSV)), None)
    checkpoints = RunCheckpoints(str(run_dir / CHECKPOINT_DIR), int(t.checkpoint_every), t.get("stop_at_step"),
                                 sync_every=int(t.log_every), keep=t.get("keep_checkpoints", 3), metrics=metrics)
    throughput = ThroughputMonitor(flops_per_token, tokens_per_step, peak_flops, int(t.log_every))
    callbacks = [
        throughput,
        checkpoints,
    ]
    if loggers:
        callbacks.append(LearningRates())  # on the loss's row
    if t.progress:
        callbacks.append(RichProgressBar(leave=True))
    if world_size(t) > 1:
        callbacks.append(fail_fast_callback())
    trainer = L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(t),
        precision=t.precision,
        max_steps=max_steps,
        max_epochs=-1,
        accumulate_grad_batches=int(t.accumulate_grad_batches),
        gradient_clip_val=t.gradient_clip_val,
        val_check_interval=int(t.val_every) * int(t.accumulate_grad_batches),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=int(t.log_every),
        logger=loggers or False,
        callbacks=callbacks,
        enable_progress_bar=bool(t.progress),
        enable_model_summary=False,
        deterministic=bool(t.deterministic),
        default_root_dir=str(run_dir),
        enable_checkpointing=False,  # RunCheckpoints writes them (Lightning would add a ModelCheckpoint)
        plugins=[SafeAtomicCheckpointIO()],
        use_distributed_sampler=True,
    )
    return trainer, checkpoints, throughput
