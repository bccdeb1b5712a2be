"""One training run, end to end: config -> run plan -> data -> model -> Lightning fit -> run folder.

train(cfg) reads in this order: where it was started from (Hydra's run folder and command line, or a
Python caller's: `invocation`), resume= and init_from= (gptkit/training/start.py: where the weights come
from), the checks that need no data (check_config), the data (the tokenizer fixes the vocabulary), then the
run plan (gptkit/training/plan.py), which everything after it reads. What the run prints is in
gptkit/training/report.py. How one optimizer step runs, and which class owns each part of it, is written at
the top of gptkit/training/module.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig, OmegaConf

from gptkit.chat_templates import CHAT_FILE, NoChatTemplate
from gptkit.checkpoints import CHECKPOINT_DIR, LAST_CHECKPOINT, remove_stale, run_dir_of, verify_checkpoint
from gptkit.errors import GptkitError
from gptkit.fsio import atomic_write_bytes, atomic_write_text
from gptkit.model import ModelConfig
from gptkit.options import Option, check_options, parse_options
from gptkit.remote import fetch_staged, push_run_files
from gptkit.runs import (
    CONFIG_FILE,
    MANIFEST_FILE,
    PLAN_FILE,
    TOKENIZER_FILE,
    check_run_dir,
    check_run_location,
    claim_run_dir,
    find_run_checkpoint,
    is_rank_zero,
    read_config,
    record_plan,
    unused,
)
from gptkit.training.config_checks import check_values
from gptkit.training.elastic import watch_peers
from gptkit.training.report import announce, check_disk, interrupted, out_of_memory, source_losses, summary
from gptkit.training.start import (
    FROM_START,
    HF_PREFIX,
    check_frozen,
    check_resume_or_init,
    frozen_base,
    frozen_source,
    load_frozen,
    load_init_weights,
    resolve_frozen,
    resolve_init_from,
    resolve_resume,
    tokenizer_source,
)

if TYPE_CHECKING:
    from gptkit.training.plan import Checked, RunPlan

# Lightning, torch and the rest of training/ are imported inside the functions that need them:
# commands/train.py imports this module to rewrite and check the command line, and a mistyped option
# must stay a one-line error in ~0.3 s of CPU time, not the ~7 s that importing them first costs
# (measured on 2026-12-01 with `gptkit train +trainer.max_step=3`).


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    last_checkpoint: Path
    # "SIGINT" / "SIGTERM" when a signal stopped the run
    stopped_by: Optional[str]
    val_loss: Optional[float]
    tokens_per_s: Optional[float]
    is_global_zero: bool = True


@dataclass(frozen=True)
class Invocation:
    """Where a run was started from: Hydra's run folder and command line (gptkit train), or a Python
    caller's (gptkit.train(cfg)): the only place train() reads Hydra's global state."""

    run_dir: Path
    # the command line's key=value, parsed once (gptkit.options)
    overrides: list[Option]
    # one job of `gptkit train -m`: its folder is <runs_dir>/<name>/<job number>
    multirun_job: bool
    # "job 1: optim.lr=3e-3" for a multirun job
    job: Optional[str]


def invocation(
    cfg: DictConfig,
    run_dir: Optional[Path] = None,
    overrides: Optional[list[str]] = None,
    options: Optional[list[Option]] = None,
) -> Invocation:
    """Hydra's run folder and overrides when Hydra runs this process's app; else <runs_dir>/<name> (or
    `run_dir`) and the `overrides` given (which resume= treats as the command line's). options: the
    command line the CLI parsed (one run, not a multirun job): Hydra's overrides are these, not parsed
    again."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if run_dir is None and overrides is None and HydraConfig.initialized():
        hc = HydraConfig.get()
        task = list(hc.overrides.task)
        multirun = hc.mode == RunMode.MULTIRUN
        job = f"job {hc.job.num}: {' '.join(task) or '(no overrides)'}" if multirun else None
        parsed = options if options is not None and not multirun else parse_options(task, sweeps=True)
        return Invocation(Path(hc.runtime.output_dir), parsed, multirun, job)
    folder = Path(run_dir) if run_dir is not None else Path(str(cfg.runs_dir)) / str(cfg.name)
    return Invocation(folder, parse_options(list(overrides or [])), False, None)


def check_config(cfg: DictConfig, resumed: bool = False) -> Checked:
    """The settings that can be checked without data: one-line errors before any data is prepared and,
    from the CLI (commands/train.check), before Hydra creates the run folder. Returns what the checks
    derived (plan.Checked: precision, accelerator, devices, compile mode and, for a new model, its config and
    training window), which make_plan reads instead of deriving it again. resumed: cfg is a resumed run's
    (resolve_resume), whose saved init_from= records where its weights first came from (objective=dpo: its
    reference, checked here)."""
    check_run_location(cfg.get("runs_dir"), None)
    # the command line had one of them (prepare_args, resolve_resume); the saved config, both
    if resumed:
        resume, init_from = True, False
    else:
        resume, init_from = check_resume_or_init(cfg.get("resume"), cfg.get("init_from"))
    # the values first. resume= and init_from= (but hf:, imported at the start) bring their model:
    # model_from_source checks the overrides
    from_run = bool(init_from) and not str(cfg.init_from).startswith(HF_PREFIX)
    values = check_values(cfg, new_model=not resume and not from_run)
    # what needs torch and Lightning after the values: imported here, since importing them costs ~4 s of
    # CPU that a refused value does not pay (5.3 s -> 0.28 s for `train trainer.precision=fp9`, issue 47)
    from gptkit.training.expert_parallel import check_expert_model
    from gptkit.training.finetune import check_finetune, finetune_class
    from gptkit.training.objectives import check_objective, objective_class
    from gptkit.training.optim import check_muon_config
    from gptkit.training.plan import with_model
    from gptkit.training.trainer import check_trainer_config

    checked = check_trainer_config(cfg.trainer, values)
    # Muon's settings (its values: check_values)
    if cfg.optim.name == "muon":
        check_muon_config(cfg.optim)
    check_finetune(cfg, resume or init_from)
    check_objective(cfg)
    # the objective's frozen models of their own sources (frozen.<name>)
    check_frozen(cfg)
    # hf: is imported (and checked) at the start
    if from_run:
        ckpt = find_run_checkpoint(str(cfg.init_from), cfg.runs_dir)
        verify_checkpoint(ckpt)
        source_model = ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"])
        # a reward model (model.score_head) is no policy: one line before the run folder is made
        objective_class(cfg).model_config(source_model, f"init_from={cfg.init_from}")
        # a frozen base's fine-tune settings (lora: targets and rank) against the model init_from= brings
        finetune = finetune_class(cfg)
        if not finetune.trains_base:
            finetune.check_model(cfg, source_model)
    # a resumed run whose objective has a frozen model of the starting weights (full fine-tuning): where it
    # is loaded from
    elif (
        resume
        and any(
            frozen_source(cfg, n) == FROM_START
            for n in objective_class(cfg).frozen_models(objective_class(cfg).settings_of(cfg))
        )
        and not finetune_class(cfg).own_reference
        and not str(cfg.init_from).startswith(HF_PREFIX)
    ):
        verify_checkpoint(find_run_checkpoint(str(cfg.init_from), cfg.runs_dir))
    elif values.model is not None:
        checked = with_model(checked, cfg.trainer, values.model)
        k = int(cfg.trainer.get("expert_parallel") or 1)
        check_expert_model(k, values.model, str(cfg.get("finetune", "full")))
    return checked


def train(
    cfg: DictConfig,
    *,
    run_dir: Optional[Path] = None,
    overrides: Optional[list[str]] = None,
    checked: Optional[Checked] = None,
    options: Optional[list[Option]] = None,
) -> TrainResult:
    """One training run, into one run folder; returns where it ended: plan_run, then run_plan.

    cfg: a composed `train` config (Hydra's, or as_config's for gptkit.train from Python). From Python no
    Hydra state is needed: the run folder is `run_dir` or <runs_dir>/<name>, and `overrides` are what
    resume= treats as the command line. checked: what check_config derived from this config (the CLI runs it
    before Hydra makes the run folder); options: the command line's key=value, parsed by the CLI."""
    started = time.perf_counter()
    # under torchrun: a rank that stops with an error stops the others (not left waiting in a collective)
    with watch_peers():
        plan = plan_run(cfg, run_dir=run_dir, overrides=overrides, checked=checked, options=options)
        return run_plan(plan, started=started)


def plan_run(
    cfg: DictConfig,
    *,
    run_dir: Optional[Path] = None,
    overrides: Optional[list[str]] = None,
    checked: Optional[Checked] = None,
    options: Optional[list[Option]] = None,
) -> RunPlan:
    """The first half of train: the run folder (claimed), resume= / init_from=, the checks, the data (the
    tokenizer fixes the vocabulary), then the plan, which carries the prepared data to run_plan.
    gptkit.plan(cfg) from Python: look at the plan (steps, tokens, world size), then gptkit.train(plan)."""
    from gptkit.data import check_vocab
    from gptkit.training.distributed import check_run_name
    from gptkit.training.objectives import objective_class
    from gptkit.training.plan import make_plan

    _quiet_lightning()
    inv = invocation(cfg, run_dir, overrides, options)
    # torchrun/srun ranks must agree on the run folder
    check_run_name({o.key for o in inv.overrides})
    run_dir = inv.run_dir
    # one writer per run folder; a start that fails removes the folder it made (runs.py)
    if is_rank_zero():
        claim_run_dir(run_dir, remove_if_unused=unused(run_dir))
    check_run_dir(run_dir, cfg.runs_dir, job=inv.multirun_job)
    cfg, resume_ckpt, resume_step, saved_trainer = resolve_resume(cfg, inv.overrides)
    # a resumed run's config is the saved one, merged: check it
    if resume_ckpt is not None or checked is None:
        checked = check_config(cfg, resumed=resume_ckpt is not None)
    if resume_ckpt is None:
        _refuse_checkpoints(run_dir)
    init_ckpt = None
    # a resumed run's weights come from its own checkpoint
    if resume_ckpt is None:
        cfg, init_ckpt = resolve_init_from(cfg, run_dir, inv.overrides)
    _set_threads(cfg.trainer, checked)

    # a new run's model, built by check_config
    model_cfg = checked.model
    if resume_ckpt is not None or init_ckpt is not None or model_cfg is None:
        # the model resume= and init_from= bring (their source's): it fails here, before any data is prepared
        model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        # make_plan checks its window
        checked = dataclasses.replace(checked, model=None, seq_len=None)
    # the objective's model (objective=reward adds a score head; a reward model is no other's policy)
    source = f"resume={cfg.resume}" if resume_ckpt is not None else f"init_from={cfg.get('init_from')}"
    model_cfg = objective_class(cfg).model_config(model_cfg, source)
    # finetune=lora, qlora: the frozen weights
    lora_base = frozen_base(cfg, model_cfg, init_ckpt, resume_ckpt)

    # data=prepared from a bucket (data.dir= its staging folder): downloaded and checked on this machine
    if cfg.data.get("kind") == "prepared":
        fetch_staged(cfg.data.get("dir"))
    # data first: the tokenizer decides the vocabulary size
    try:
        prepared = _prepare_data(cfg, model_cfg)
    # data.template=auto looked next to the tokenizer init_from= copied here: name the run it came from
    except NoChatTemplate as exc:
        source = tokenizer_source(cfg, run_dir, init_ckpt)
        if source is None or exc.folder is None or exc.folder.resolve() != run_dir.resolve():
            raise
        raise NoChatTemplate(
            f"in init_from={source}, whose tokenizer this run uses",
            source,
            f"it has no {CHAT_FILE}: a base run, trained without a chat template",
        ) from None
    multiple = int(cfg.get("vocab_multiple", 1))
    vocab_size = multiple * math.ceil(prepared.vocab_size / multiple)
    # init_from= with tokens the chat template added: the source's vocabulary, grown
    init_vocab = None
    if cfg.get("vocab_from_tokenizer", True) and resume_ckpt is None and init_ckpt is None:
        model_cfg = _with_vocab(model_cfg, vocab_size)
    # init_from= with tokens the data added (a chat template's): the source's vocabulary, grown
    elif prepared.added_tokens and init_ckpt is not None and prepared.vocab_size > model_cfg.vocab_size:
        init_vocab = model_cfg.vocab_size
        model_cfg = _with_vocab(model_cfg, vocab_size)
        if lora_base is not None:
            raise GptkitError(
                f"finetune={cfg.finetune} freezes the embeddings, and the chat template adds "
                f"{prepared.vocab_size - init_vocab} token(s) to init_from={cfg.init_from}'s "
                f"vocabulary, which would stay untrained; use a template of its own tokens "
                f"or finetune=full"
            )
    check_vocab(prepared, model_cfg.vocab_size)
    cfg.model = OmegaConf.create(model_cfg.to_dict())

    # from here on, every fact of the run comes from the plan
    plan = make_plan(
        cfg,
        run_dir,
        model_cfg,
        checked=checked,
        resume=resume_ckpt,
        resume_step=resume_step,
        init_from=init_ckpt,
        saved_trainer=saved_trainer,
        job=inv.job,
        data=prepared,
        init_vocab=init_vocab,
        lora_base=lora_base,
    )
    return _with_frozen(plan)


def _with_frozen(plan: RunPlan) -> RunPlan:
    """The plan with its frozen models' own sources resolved (frozen.<name>: imported, their configs read,
    their vocabulary checked against the run's tokenizer), once its data and window are known; a frozen
    model's outputs precomputed in the data checked to be its own and given to the data's rows."""
    from gptkit.training.precompute import attach_precomputed

    if plan.frozen is not None:
        return plan
    frozen = resolve_frozen(plan.cfg, plan.data.tokenizer_path, plan.model, plan.seq_len)
    plan = dataclasses.replace(plan, frozen=frozen)
    attach_precomputed(plan)
    return plan


def _quiet_lightning() -> None:
    """No Lightning banner or tips, and no warning of torch's about its own internals."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def _refuse_checkpoints(run_dir: Path) -> None:
    """A new run in a folder that holds checkpoints is a one-line error (resume= continues it)."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    if ckpt_dir.is_dir() and any(ckpt_dir.glob("*.ckpt")):
        raise GptkitError(
            f"{run_dir} already holds checkpoints; continue it with resume={run_dir} or choose another name="
        )


def _set_threads(t: DictConfig, checked: Checked) -> None:
    """CPU threads per process: one warning now if the machine's load would oversubscribe them."""
    from gptkit.threads import set_threads

    cpu = checked.accelerator == "cpu"
    set_threads(t.get("threads"), "trainer.threads", checked.devices if cpu else 1, warn=cpu)


def _with_vocab(model_cfg, vocab_size: int):
    """The model config with another vocab_size (checked again by ModelConfig)."""
    return (
        model_cfg
        if model_cfg.vocab_size == vocab_size
        else dataclasses.replace(model_cfg, vocab_size=vocab_size)
    )


def _prepare_data(cfg: DictConfig, model_cfg):
    """The run's data, prepared (or read from the cache): data.bos=auto resolved for the model first (off
    for a GPT-2-style model with learned positions; the run's config says so). Shards are checked meanwhile
    (prepared.wait_checked before training). No row is longer than the model's context: a conversation (or a
    pair's answer) longer than that is measured, never encoded whole."""
    from gptkit.data import for_model, prepare

    cfg.data = OmegaConf.create(for_model(cfg.data, str(model_cfg.position or "learned")))
    return prepare(cfg.data, cfg.tokenizer, max_seq_len=model_cfg.max_seq_len)


def complete_plan(plan: RunPlan) -> RunPlan:
    """A plan made outside `train` (make_plan from Python, without data or run folder) made ready to run:
    its run folder (plan.run_dir, else <runs_dir>/<name>) claimed and checked, its data prepared with the
    plan's own model (the tokenizer's vocabulary must fit plan.model.vocab_size: one-line error otherwise).
    The config saved to config.yaml is plan.cfg with plan.model."""
    from gptkit.data import check_vocab

    if plan.data is not None and plan.run_dir is not None:
        return _with_frozen(plan)
    _quiet_lightning()
    cfg = plan.cfg.copy()
    run_dir = Path(plan.run_dir) if plan.run_dir is not None else Path(str(cfg.runs_dir)) / str(cfg.name)
    if is_rank_zero():
        claim_run_dir(run_dir, remove_if_unused=unused(run_dir))
    check_run_dir(run_dir, cfg.runs_dir)
    if plan.resume is None:
        _refuse_checkpoints(run_dir)
    checked = _checked_of(plan)
    _set_threads(cfg.trainer, checked)
    cfg.model = OmegaConf.create(plan.model.to_dict())
    prepared = plan.data if plan.data is not None else _prepare_data(cfg, plan.model)
    check_vocab(prepared, plan.model.vocab_size)
    return _with_frozen(dataclasses.replace(plan, cfg=cfg, run_dir=run_dir, data=prepared))


def _checked_of(plan: RunPlan) -> Checked:
    """The trainer's facts a plan already holds."""
    from gptkit.training.plan import Checked

    return Checked(
        precision=plan.precision,
        accelerator=plan.accelerator,
        devices=plan.devices,
        nodes=plan.nodes,
        compile=plan.compile,
        model=plan.model,
        seq_len=plan.seq_len,
    )


def run_plan(plan: RunPlan, *, started: Optional[float] = None) -> TrainResult:
    """The second half of train: the model, the Trainer, the run folder's files, trainer.fit, the summary;
    every setting from the plan. A plan without data or run folder (made outside train) is completed first
    (complete_plan)."""
    started = time.perf_counter() if started is None else started
    import lightning as L
    import torch

    from gptkit.data import TokenDataModule
    from gptkit.training.memory import check_host_memory, cpu_out_of_memory, is_cpu_out_of_memory
    from gptkit.training.module import LitGPT
    from gptkit.training.optim import describe_optimizer
    from gptkit.training.peak_memory import reset_peak_rss
    from gptkit.training.plots import plot_loss
    from gptkit.training.stopping import final_validation
    from gptkit.training.task_evals import TaskEvals, print_summary
    from gptkit.training.trainer import build_loggers, build_trainer

    plan = complete_plan(plan)
    cfg, run_dir, prepared, t = plan.cfg, plan.run_dir, plan.data, plan.trainer
    rank_zero = is_rank_zero()
    ckpt_dir = run_dir / CHECKPOINT_DIR
    resume_ckpt, resume_step = plan.resume, plan.resume_step
    # touches nothing: exit 0
    if resume_ckpt is not None and _nothing_to_do(run_dir, plan):
        return TrainResult(run_dir, int(resume_step), ckpt_dir / LAST_CHECKPOINT, None, None, None, rank_zero)
    # the count-params estimate against the host's memory, before the model (the RSS it leaves out: the
    # peak measured after the first steps is counted above it, training/peak_memory.py)
    rss_before = reset_peak_rss()
    if plan.accelerator == "cpu":
        check_host_memory(plan)

    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    module = LitGPT(plan)
    # under FSDP (several processes) rank 0's weights reach the other ranks in configure_model
    if plan.init_from is not None and not module.built_on_meta:
        load_init_weights(module.model, plan.init_from, plan.init_vocab)
    # a LoRA run resumed: its frozen weights (qlora materializes its own: built_on_meta)
    elif plan.lora_base is not None and not module.built_on_meta:
        load_init_weights(module.model, plan.lora_base)
    # the objective's frozen models (objective=dpo: the reference, by default the starting weights)
    load_frozen(module, cfg, plan.init_from, plan.frozen or {})
    datamodule = TokenDataModule(
        prepared,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        seed=int(cfg.seed),
        val_windows=t.val_windows,
        pack=cfg.data.get("pack"),
    )
    loggers = build_loggers(cfg.logger, run_dir, str(cfg.name), resume_step)
    trainer, checkpoints, metrics = build_trainer(plan, loggers, rss_before)
    if trainer.world_size != plan.world_size:
        raise GptkitError(
            f"Lightning set up {trainer.world_size} processes, the config asks for "
            f"{plan.world_size} (trainer.devices x trainer.num_nodes); make them agree"
        )
    # a corrupted shard is never trained on
    prepared.wait_checked()

    # start-up succeeded: the run folder gets its files (written atomically; leftovers of killed writes go)
    if rank_zero:
        _remove_leftovers(run_dir)
        atomic_write_text(run_dir / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))
        # the tokenizer (and a chat template, the one `gptkit chat` talks with)
        for name, source in prepared.run_files().items():
            atomic_write_bytes(run_dir / name, Path(source).read_bytes())
        atomic_write_text(run_dir / MANIFEST_FILE, json.dumps(prepared.manifest, indent=2))
        # how this invocation draws its batches (`gptkit trace`)
        record_plan(run_dir, draw_facts(plan), int(resume_step or 0) + 1)
    if rank_zero and plan.accelerator == "cpu" and plan.precision.name == "16-true":
        print(
            "note: trainer.precision=16-true on the CPU: fp16 has no fast CPU kernels and runs many times "
            "slower than 32-true (use 32-true, or bf16-mixed)",
            file=sys.stderr,
        )
    optimizer = describe_optimizer(plan.optim, module.model, plan.accelerator)
    announce(trainer, plan, prepared, optimizer, module.trainable)
    if trainer.is_global_zero:
        check_disk(
            ckpt_dir,
            plan.model,
            t,
            plan.max_steps,
            resume_step or 0,
            plan.precision,
            each_bytes=plan.finetune_class.checkpoint_bytes(plan, module.trainable),
        )

    try:
        trainer.fit(
            module,
            datamodule=datamodule,
            ckpt_path=str(resume_ckpt) if resume_ckpt else None,
            weights_only=True,
        )
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(plan) from exc
    # the CPU allocator's failure: one line with the same estimate
    except RuntimeError as exc:
        raise (cpu_out_of_memory(plan) if is_cpu_out_of_memory(exc) else exc) from exc
    except SystemExit:
        # a second Ctrl-C: Lightning stops at once and exits 1; say so, exit 130
        if checkpoints.interrupted:
            interrupted(run_dir, ckpt_dir / LAST_CHECKPOINT, trainer.is_global_zero)
        raise

    last = ckpt_dir / LAST_CHECKPOINT
    # the last step's validation, unless the loop ran it (or a signal stopped the run: the resume runs it);
    # Ctrl-C/SIGTERM during it: saved, stopped, 130/143
    if checkpoints.signal_name is None:
        final_validation(trainer, module, datamodule, checkpoints)
    # the final checkpoint, once the rows it covers (final validation too) are on disk
    checkpoints.publish(trainer)
    val = trainer.callback_metrics.get("val/loss")
    if trainer.is_global_zero:
        for lg in loggers:
            lg.finalize("success")
        if (run_dir / "metrics.csv").is_file():
            plot_loss(run_dir)
        # runs_dir=s3://...: the run's files as they end (the checkpoints went up as they were published)
        push_run_files(run_dir)
    # a run a signal stopped ends with the line that says where it was saved (commands/train.py), not with
    # the summary of a finished run
    if trainer.is_global_zero and checkpoints.signal_name is None:
        summary(
            run_dir,
            trainer.global_step,
            metrics,
            plan.flops_per_token,
            plan.peak_flops,
            trainer.world_size,
            time.perf_counter() - started,
            module.objective.summary(trainer.callback_metrics),
        )
        source_losses(trainer.callback_metrics)
        print_summary(
            next((c for c in trainer.callbacks if isinstance(c, TaskEvals)), None),
            time.perf_counter() - started,
        )
    return TrainResult(
        run_dir,
        trainer.global_step,
        last,
        checkpoints.signal_name,
        float(val) if val is not None else None,
        metrics.average_tokens_per_s,
        trainer.is_global_zero,
    )


def as_config(cfg: DictConfig | dict | list[str]) -> DictConfig:
    """gptkit.train's argument as a composed `train` config: a DictConfig as it is, a dict made one, a
    list of key=value overrides composed and checked as the CLI checks them (one-line ConfigErrors)."""
    if isinstance(cfg, DictConfig):
        return cfg
    if isinstance(cfg, dict):
        return OmegaConf.create(cfg)

    composed = check_options("train", parse_options([str(a) for a in cfg]))
    if composed is None:
        raise GptkitError("gptkit.train() runs one job: a sweep (a,b) needs `gptkit train -m`")
    return composed


def draw_facts(plan: RunPlan) -> dict:
    """What the batches of a run's steps are drawn by, besides its data (plan.json: `gptkit trace`)."""
    return {
        "world_size": plan.world_size,
        "accumulation": plan.accumulation,
        "batch_size": plan.batch_size,
        "rows_per_item": plan.rows // plan.batch_size,
        "seq_len": plan.seq_len,
        "seed": int(plan.cfg.seed),
        "max_steps": plan.max_steps,
    }


def _nothing_to_do(run_dir: Path, plan: RunPlan) -> bool:
    """resume= with trainer.max_steps at or below the checkpoint's step (and that step's validation done, or
    nothing a resume would still run): one line saying so; nothing in the run folder changes."""
    from gptkit.training.metrics_csv import read_rows

    step = int(plan.resume_step or 0)
    if plan.max_steps > step:
        return False
    if plan.max_steps == step and "val/loss" not in read_rows(run_dir / "metrics.csv")[1].get(step, {}):
        if (run_dir / "metrics.csv").is_file():
            # stopped during the final validation: the resume runs it
            return False
    if is_rank_zero():
        print(
            f"nothing to do: {run_dir} is at step {step} and trainer.max_steps={plan.max_steps}; raise "
            f"trainer.max_steps (or trainer.max_tokens) to train further",
            file=sys.stderr,
        )
    return True


def _remove_leftovers(run_dir: Path) -> None:
    """Temporary files of writes that a kill interrupted (this process holds the run's lock: they are no
    one else's): checkpoints/.*.tmp|.pending|.old and the run folder's own .<file>.*.tmp."""
    remove_stale(run_dir / CHECKPOINT_DIR)
    for name in (CONFIG_FILE, TOKENIZER_FILE, CHAT_FILE, MANIFEST_FILE, PLAN_FILE, "metrics.csv", "loss.png"):
        for tmp in run_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
