"""One training run, end to end: config -> run plan -> data -> model -> Lightning fit -> run folder.

train(cfg) reads in this order: where it was started from (Hydra's run folder and command line, or a
Python caller's: `invocation`), resume= and init_from= (resolve_resume, resolve_init_from), the checks
that need no data (check_config), the data (the tokenizer fixes the vocabulary), then the run plan
(gptkit/training/plan.py), which everything after it reads. How one optimizer step runs, and which class
owns each part of it, is written at the top of gptkit/training/module.py.
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
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from gptkit import adapters
from gptkit.chat_templates import CHAT_FILE
from gptkit.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    checked_model_state,
    checkpoint_step,
    load_checkpoint,
    lora_base,
    read_sharded_checkpoint,
    remove_stale,
    run_dir_of,
    verify_checkpoint,
)
from gptkit.conf_tree import conf_dir
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import atomic_write_bytes, atomic_write_text, human_bytes
from gptkit.model import ModelConfig
from gptkit.options import Option, check_options, parse_options
from gptkit.runs import (
    CONFIG_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    check_run_dir,
    check_run_location,
    claim_run_dir,
    find_run_checkpoint,
    is_rank_zero,
    read_config,
    saved_run_config,
    unused,
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


def _group_choices(overrides: list[Option]) -> list[Option]:
    """The options that choose a preset (trainer=ddp, logger=[csv,wandb]), not a single key."""
    return [o for o in overrides if o.kind == "group"]


def _names(o: Option, group: str) -> bool:
    """Whether option o sets the group `group` or one of its keys (model=..., model.n_layers=...)."""
    return o.key == group or o.key.startswith(group + ".")


def resolve_resume(
    cfg: DictConfig, overrides: list[Option]
) -> tuple[DictConfig, Optional[Path], Optional[int], Optional[DictConfig]]:
    """For resume=..., continue with the run's saved config; command-line overrides other than
    the model's apply on top (e.g. a longer trainer.max_steps). A different model is an error."""
    if cfg.resume in (None, ""):
        return cfg, None, None, None
    check_resume_or_init(cfg.resume, cfg.get("init_from"))
    ckpt = find_run_checkpoint(cfg.resume, cfg.runs_dir)
    if ckpt.suffix != ".ckpt":
        raise GptkitError(f"resume={cfg.resume} has no Lightning checkpoint (.ckpt) to continue from")
    # sharded (FSDP): read only the small non-tensor state here
    if ckpt.is_dir():
        state = read_sharded_checkpoint(ckpt, weights=False)
    else:
        # fail now, with one line, if it is truncated or not a checkpoint
        state = load_checkpoint(ckpt)
    # data, never resolved (the CLI checked it as a command line)
    saved = saved_run_config(ckpt, cfg)
    saved_optimizer = str(saved.optim.get("name", "adamw"))
    saved_lora = OmegaConf.create(OmegaConf.to_container(saved.lora) if "lora" in saved else {})
    overrides = [o for o in overrides if o.kind != "hydra" and o.key not in ("resume", "name", "runs_dir")]
    saved.model = OmegaConf.create(
        model_from_source(f"resume={cfg.resume}", saved.model, cfg.model, overrides)
    )
    saved_trainer = OmegaConf.create(OmegaConf.to_container(saved.trainer, resolve=True))
    merged = saved
    if "trainer" in merged and "stop_at_step" in merged.trainer:
        # an early stop belongs to the invocation that asked for it
        merged.trainer.stop_at_step = None
    # a preset chosen again on resume (trainer=ddp, optim=..., logger=[...])
    for o in _group_choices(overrides):
        group = o.key
        if o.op == "DEL" or group == "model":
            continue
        if group in ("data", "tokenizer"):
            raise GptkitError(
                f"resume={cfg.resume} cannot change {group}= (the run's batches come from its "
                f"own data); start a new run instead"
            )
        # the loggers of this invocation
        if group == "logger" and group in cfg:
            merged[group] = cfg[group]
        elif group in ("trainer", "optim"):
            # the preset's own settings over the run's (trainer=ddp: the strategy, not 600 steps)
            merged[group] = OmegaConf.merge(merged[group], preset_settings(group, str(o.value)))
    dotlist = [
        o.first.lstrip("+~")
        for o in overrides
        if o.kind == "key" and o.op != "DEL" and "." in o.key and not _names(o, "model")
    ]
    if dotlist:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotlist))
    # the checkpoint's optimizer state would not fit
    if str(merged.optim.name) != saved_optimizer:
        raise GptkitError(
            f"resume={cfg.resume} continues a run trained with optim={saved_optimizer}; "
            f"for optim={merged.optim.name} start a new run from its weights: "
            f"init_from={cfg.resume}"
        )
    # a top-level key, which the dotlist above leaves out
    for o in overrides:
        if o.kind == "key" and o.key == "finetune" and o.op != "DEL":
            merged.finetune = o.value
    check_resumed_finetune(cfg.resume, saved_lora, merged, adapters.CHECKPOINT_KEY in state)
    merged.resume = str(ckpt)
    return merged, ckpt, int(state.get("global_step", 0)), saved_trainer


def check_resumed_finetune(resume: Any, saved_lora: Any, merged: DictConfig, lora_ckpt: bool) -> None:
    """resume= continues the run's own finetune= (its checkpoint holds every weight, or the adapters only)
    and, for lora, its adapters' rank, alpha and targets (lora.dropout may change)."""
    asked = str(merged.get("finetune", "full"))
    have = "lora" if lora_ckpt else "full"
    if asked != have:
        other = (
            f"init_from={resume} finetune=lora"
            if asked == "lora"
            else f"init_from={resume} (its base with the adapters merged) finetune=full"
        )
        held = "the adapters only" if have == "lora" else "every weight"
        raise GptkitError(
            f"resume={resume} continues a finetune={have} run (its checkpoint holds {held}); "
            f"for finetune={asked} start a new run: {other}"
        )
    if have == "lora":
        for key in ("rank", "alpha", "targets"):
            was, now = saved_lora.get(key), merged.lora.get(key)
            was, now = (f"[{', '.join(map(str, v))}]" if OmegaConf.is_list(v) else v for v in (was, now))
            if was != now:
                raise GptkitError(
                    f"resume={resume} continues adapters with lora.{key}={was}; "
                    f"lora.{key}={now} would not fit them (start a new run for other adapters)"
                )


def preset_settings(group: str, name: str) -> DictConfig:
    """The keys conf/<group>/<name>.yaml sets itself (not those it inherits through its defaults list)."""
    path = conf_dir() / group / f"{name}.yaml"
    if not path.is_file():
        raise GptkitError(
            f"{group}={name} is not a preset; known: {', '.join(p.stem for p in path.parent.glob('*.yaml'))}"
        )
    own = OmegaConf.load(path)
    own.pop("defaults", None)
    return own


# Model settings that change no tensor shape: they may differ from those of the run that resume= continues
# or init_from= starts from. Every other model setting is fixed by the weights.
FREE_MODEL_KEYS = ("name", "dropout", "attention", "kernels", "position_reset")


def model_from_source(
    source: str, saved_model: Any, asked_model: Any, overrides: list[Option]
) -> dict[str, Any]:
    """The model config of a run whose weights come from `source` (resume= or init_from=): the source's own,
    with the command line's model.<FREE_MODEL_KEYS> overrides applied. model= or any other model.<key> that
    differs from the source's is a one-line error."""
    saved = (
        OmegaConf.to_container(saved_model, resolve=True)
        if isinstance(saved_model, DictConfig)
        else dict(saved_model)
    )
    asked = OmegaConf.to_container(asked_model, resolve=True)
    keys = [o.key for o in overrides if _names(o, "model")]
    if "model" in keys:
        raise GptkitError(f"{source} brings its own model ({saved.get('name')}); drop model=")
    for key in (k.split(".", 1)[1] for k in keys if "." in k):
        if key in FREE_MODEL_KEYS:
            saved[key] = asked.get(key)
        elif asked.get(key) != saved.get(key):
            raise GptkitError(
                f"{source} fixes model.{key}={saved.get(key)!r} (its weights' shape); only "
                f"model.{', model.'.join(FREE_MODEL_KEYS)} may change"
            )
    return saved


def resolve_init_from(
    cfg: DictConfig, run_dir: Path, overrides: list[Option]
) -> tuple[DictConfig, Optional[Path]]:
    """For init_from=<run folder | checkpoint | latest>: a new run (fresh optimizer, schedule and step
    count) whose model starts from that run's weights. The model config is the source's (see
    model_from_source) and so is the
    tokenizer: its tokenizer.json is copied into the new run folder, which the run's config then names
    (resume= keeps working if the source goes away), unless the command line chooses a tokenizer itself.

    init_from=hf:<Hub model id or transformers folder> first imports it (as `gptkit import` does) into the run
    folder <runs_dir>/<name>-imported, reused by later runs while it holds the same files; the new run's
    config records the exact source (hf:owner/name@commit or hf:<folder>)."""
    if cfg.get("init_from") in (None, ""):
        return cfg, None
    source, pinned = str(cfg.init_from), None
    if source.startswith(HF_PREFIX):
        source, pinned = _import_init_source(source[len(HF_PREFIX) :], Path(cfg.runs_dir))
    ckpt = find_run_checkpoint(source, cfg.runs_dir)
    src_dir = run_dir_of(ckpt)
    src = read_config(src_dir)
    cfg.model = OmegaConf.create(
        model_from_source(f"init_from={cfg.init_from}", src["model"], cfg.model, overrides)
    )
    if not any(_names(o, "tokenizer") for o in overrides):
        tok_file = src_dir / TOKENIZER_FILE
        if not tok_file.is_file():
            raise GptkitError(
                f"init_from={cfg.init_from}: {src_dir} has no {TOKENIZER_FILE}; choose the "
                f"tokenizer its vocabulary was built with (tokenizer=file tokenizer.path=...)"
            )
        own = run_dir / TOKENIZER_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        # each rank its own temp file, then one rename
        atomic_write_bytes(own, tok_file.read_bytes())
        # its chat template, for data=chat data.template=auto
        if (src_dir / CHAT_FILE).is_file():
            atomic_write_bytes(run_dir / CHAT_FILE, (src_dir / CHAT_FILE).read_bytes())
        eos = (src.get("tokenizer") or {}).get("eos_token")
        cfg.tokenizer = OmegaConf.create({"kind": "file", "path": str(own.resolve()), "eos_token": eos})
    cfg.init_from = pinned or str(ckpt)
    return cfg, ckpt


# init_from=hf:<owner/name[@revision] or transformers folder>
HF_PREFIX = "hf:"


def init_source_name(init_from: str, runs_dir: Path | str) -> str | None:
    """The name of the model an init_from= run trains (its source's model.name, or for hf: the folder's or
    repository's name, as the import names it), read before Hydra names the run folder after it. None when
    the source cannot be read (its one-line error comes later, where init_from= is resolved)."""
    if init_from.startswith(HF_PREFIX):
        # ~3 s of imports after this module's: only for an hf: source
        from gptkit import hf

        return hf.source_name(init_from[len(HF_PREFIX) :]) or None
    try:
        name = read_config(run_dir_of(find_run_checkpoint(init_from, runs_dir)))["model"].get("name")
    except (GptkitError, OSError):
        return None
    return str(name) if name not in (None, "") else None


def _import_init_source(spec: str, runs_dir: Path) -> tuple[str, str]:
    """init_from=hf:<spec> -> (the imported run folder, hf:<the exact source>), saying which on one line."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from gptkit import hf

    folder, src, reused = hf.import_cached(
        spec, runs_dir, f"gptkit train init_from={HF_PREFIX}/path/to/folder"
    )
    if rank_zero_only.rank == 0:
        import sys

        if src.note:
            print(f"note: {src.note}", file=sys.stderr)
        print(
            f"init_from={HF_PREFIX}{spec}: {'reusing' if reused else 'imported'} {src.spec} "
            f"{'from' if reused else 'into'} {folder} (kept for later runs)",
            file=sys.stderr,
        )
    return str(folder), HF_PREFIX + src.spec


def _load_init_weights(model, ckpt: Path, vocab_size: int | None = None) -> None:
    """Copy the weights of an init_from= checkpoint (memory-mapped, names and shapes checked) into the new
    run's model (a GPT), with no second model in memory. `vocab_size`: the checkpoint's, smaller than the new
    model's (a chat template's special tokens were added): the new rows start as the mean of the old ones."""
    from gptkit.model.gpt import grow_vocab

    cfg = model.cfg
    if vocab_size is None or vocab_size == cfg.vocab_size:
        state = checked_model_state(ckpt, cfg)
    else:
        state = checked_model_state(ckpt, dataclasses.replace(cfg, vocab_size=vocab_size))
        state = grow_vocab(state, cfg.vocab_size)
    # into the (tied) parameters
    missing, unexpected = model.load_state_dict(state, strict=False)
    # only LoRA's adapters start anew
    if unexpected or any(not adapters.is_adapter_key(k) for k in missing):
        raise GptkitError(
            f"{ckpt} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def _load_reference(module, cfg: DictConfig, init_ckpt: Optional[Path]) -> None:
    """objective=dpo: the starting weights into the frozen reference (module.dpo.reference; None with LoRA,
    whose reference is the base with adapters off). A new run copies the policy's (just loaded from
    init_from=); a resumed run reads them again from the checkpoint its config's init_from= names, whose
    step LitGPT checks against the one the run started from. FSDP: on the ranks that build weights only."""
    reference = module.dpo.reference
    if reference is None:
        return
    if init_ckpt is not None:
        module.reference_source = {"path": str(init_ckpt), "step": checkpoint_step(init_ckpt)}
        if not module.built_on_meta:
            reference.load_state_dict(module.model.state_dict())
        return
    source = str(cfg.init_from)
    if source.startswith(HF_PREFIX):
        source, _ = _import_init_source(source[len(HF_PREFIX) :], Path(cfg.runs_dir))
    ckpt = find_run_checkpoint(source, cfg.runs_dir)
    module.reference_source = {"path": str(ckpt), "step": checkpoint_step(ckpt)}
    if not module.built_on_meta:
        vocab = int(read_config(run_dir_of(ckpt))["model"]["vocab_size"])
        _load_init_weights(reference, ckpt, vocab)


def _lora_base(
    cfg: DictConfig, model_cfg: ModelConfig, init_ckpt: Optional[Path], resume_ckpt: Optional[Path]
) -> Optional[Path]:
    """finetune=lora: the checkpoint of the frozen weights (init_from='s, or the one the resumed run's
    checkpoint records, checked unchanged), after the lora settings are checked against the model."""
    if cfg.get("finetune", "full") != "lora":
        return None
    adapters.check_lora(adapters.settings(cfg.lora), model_cfg)
    if resume_ckpt is None:
        return init_ckpt
    state = (
        read_sharded_checkpoint(resume_ckpt, weights=False)
        if resume_ckpt.is_dir()
        else load_checkpoint(resume_ckpt)
    )
    return lora_base(state, resume_ckpt)


def check_resume_or_init(resume: Any, init_from: Any) -> tuple[bool, bool]:
    """(resume given, init_from given); both is a one-line error."""
    given = tuple(v not in (None, "", "null") for v in (resume, init_from))
    if all(given):
        raise GptkitError(
            "give resume= (continue a run) or init_from= (start a new run from its weights), not both"
        )
    return given


def check_finetune(cfg: DictConfig, has_weights: bool) -> None:
    """finetune= is full or lora; lora starts from weights (init_from=, or the run resume= continues), with
    either optimizer (optim=muon orthogonalizes each adapter factor: training/optim.py, muon_split)."""
    finetune = cfg.get("finetune", "full")
    if finetune not in ("full", "lora"):
        raise ConfigError(
            f"finetune={finetune} must be full (every weight trains) or lora (adapters on frozen weights)"
        )
    if finetune != "lora":
        return
    if not has_weights:
        raise ConfigError(
            "finetune=lora trains adapters on frozen weights, so it needs the weights to start "
            "from: init_from=<run folder | checkpoint | hf:owner/name>; without one the frozen "
            "model would be random (train it first with finetune=full)"
        )


def check_config(cfg: DictConfig, resumed: bool = False) -> Checked:
    """The settings that can be checked without data: one-line errors before any data is prepared and,
    from the CLI (commands/train.check), before Hydra creates the run folder. Returns what the checks
    derived (plan.Checked: precision, accelerator, devices, compile mode and, for a new model, its config and
    training window), which make_plan reads instead of deriving it again. resumed: cfg is a resumed run's
    (resolve_resume), whose saved init_from= records where its weights first came from (objective=dpo: its
    reference, checked here)."""
    from gptkit.training.dpo import check_objective
    from gptkit.training.optim import check_optim_config
    from gptkit.training.plan import with_model
    from gptkit.training.trainer import check_loggers, check_trainer_config

    check_run_location(cfg.get("runs_dir"), None)
    # the command line had one of them (prepare_args, resolve_resume); the saved config, both
    if resumed:
        resume, init_from = True, False
    else:
        resume, init_from = check_resume_or_init(cfg.get("resume"), cfg.get("init_from"))
    checked = check_trainer_config(cfg.trainer)
    check_optim_config(cfg.optim)
    check_loggers(cfg.logger)
    check_finetune(cfg, resume or init_from)
    check_objective(cfg)
    # hf: is imported (and checked) at the start
    if init_from and not str(cfg.init_from).startswith(HF_PREFIX):
        ckpt = find_run_checkpoint(str(cfg.init_from), cfg.runs_dir)
        verify_checkpoint(ckpt)
        # the targets and rank against the model init_from= brings
        if cfg.get("finetune") == "lora":
            model = ModelConfig.from_dict(read_config(run_dir_of(ckpt))["model"])
            adapters.check_lora(adapters.settings(cfg.lora), model)
    elif (
        resume
        and str(cfg.get("objective")) == "dpo"
        and cfg.get("finetune", "full") != "lora"
        and not str(cfg.init_from).startswith(HF_PREFIX)
        # a resumed full DPO run: its reference
    ):
        verify_checkpoint(find_run_checkpoint(str(cfg.init_from), cfg.runs_dir))
    # resume= and init_from= bring their model; model_from_source checks the overrides
    elif not resume:
        model_cfg = ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
        checked = with_model(checked, cfg.trainer, model_cfg)
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
    return run_plan(
        plan_run(cfg, run_dir=run_dir, overrides=overrides, checked=checked, options=options), started=started
    )


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
    # finetune=lora: the frozen weights
    lora_base = _lora_base(cfg, model_cfg, init_ckpt, resume_ckpt)

    # data first: the tokenizer decides the vocabulary size
    prepared = _prepare_data(cfg, model_cfg)
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
                f"finetune=lora freezes the embeddings, and the chat template adds "
                f"{prepared.vocab_size - init_vocab} token(s) to init_from={cfg.init_from}'s "
                f"vocabulary, which would stay untrained; use a template of its own tokens "
                f"or finetune=full"
            )
    check_vocab(prepared, model_cfg.vocab_size)
    cfg.model = OmegaConf.create(model_cfg.to_dict())

    # from here on, every fact of the run comes from the plan
    return make_plan(
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
    (prepared.wait_checked before training)."""
    from gptkit.data import for_model, prepare

    cfg.data = OmegaConf.create(for_model(cfg.data, str(model_cfg.position or "learned")))
    return prepare(cfg.data, cfg.tokenizer)


def complete_plan(plan: RunPlan) -> RunPlan:
    """A plan made outside `train` (make_plan from Python, without data or run folder) made ready to run:
    its run folder (plan.run_dir, else <runs_dir>/<name>) claimed and checked, its data prepared with the
    plan's own model (the tokenizer's vocabulary must fit plan.model.vocab_size: one-line error otherwise).
    The config saved to config.yaml is plan.cfg with plan.model."""
    from gptkit.data import check_vocab

    if plan.data is not None and plan.run_dir is not None:
        return plan
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
    return dataclasses.replace(plan, cfg=cfg, run_dir=run_dir, data=prepared)


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
    # the count-params estimate against the host's memory, before the model
    if plan.accelerator == "cpu":
        check_host_memory(plan)

    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    module = LitGPT(plan)
    # under FSDP (several processes) rank 0's weights reach the other ranks in configure_model
    if plan.init_from is not None and not module.built_on_meta:
        _load_init_weights(module.model, plan.init_from, plan.init_vocab)
    # a LoRA run resumed: its frozen weights
    elif plan.lora_base is not None and not module.built_on_meta:
        _load_init_weights(module.model, plan.lora_base)
    # objective=dpo: the reference holds the starting weights, frozen
    if module.dpo is not None:
        _load_reference(module, cfg, plan.init_from)
    datamodule = TokenDataModule(
        prepared,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        seed=int(cfg.seed),
        val_windows=t.val_windows,
        pack=cfg.data.get("pack"),
    )
    loggers = build_loggers(cfg.logger, run_dir, str(cfg.name), resume_step)
    trainer, checkpoints, metrics = build_trainer(plan, loggers)
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
    if rank_zero and plan.accelerator == "cpu" and plan.precision.name == "16-true":
        print(
            "note: trainer.precision=16-true on the CPU: fp16 has no fast CPU kernels and runs many times "
            "slower than 32-true (use 32-true, or bf16-mixed)",
            file=sys.stderr,
        )
    optimizer = describe_optimizer(plan.optim, module.model, plan.accelerator)
    _announce(trainer, plan, prepared, optimizer, getattr(module, "trainable", None))
    if trainer.is_global_zero:
        _check_disk(
            ckpt_dir,
            plan.model,
            t,
            plan.max_steps,
            resume_step or 0,
            plan.precision,
            lora_params=getattr(module, "trainable", None),
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
            _interrupted(run_dir, ckpt_dir / LAST_CHECKPOINT, trainer.is_global_zero)
        raise

    last = ckpt_dir / LAST_CHECKPOINT
    if checkpoints.signal_name is None:
        # Ctrl-C/SIGTERM here: saved, stopped, 130/143
        if trainer.global_step % int(t.val_every):
            final_validation(trainer, module, datamodule, checkpoints)
    # the final checkpoint, once the rows it covers (final validation too) are on disk
    checkpoints.publish(trainer)
    val = trainer.callback_metrics.get("val/loss")
    if trainer.is_global_zero:
        for lg in loggers:
            lg.finalize("success")
        if (run_dir / "metrics.csv").is_file():
            plot_loss(run_dir)
        _summary(
            run_dir,
            trainer.global_step,
            val,
            metrics,
            plan.flops_per_token,
            plan.peak_flops,
            trainer.world_size,
            time.perf_counter() - started,
            trainer.callback_metrics.get("val/rewards/accuracy") if plan.objective == "dpo" else None,
        )
        _source_losses(trainer.callback_metrics)
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
    for name in (CONFIG_FILE, TOKENIZER_FILE, CHAT_FILE, MANIFEST_FILE, "metrics.csv", "loss.png"):
        for tmp in run_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)


def _check_disk(
    ckpt_dir: Path,
    model_cfg,
    t,
    max_steps: int,
    start_step: int,
    precision=None,
    lora_params: int | None = None,
) -> None:
    """Say how much disk the run's checkpoints need (the count-params estimate; finetune=lora: the
    adapters and their AdamW moments, in fp32) and warn when the filesystem has less free."""
    from rich.console import Console

    from gptkit import accounting as acc
    from gptkit.fsio import free_bytes, human_bytes

    # precision: the plan's
    each = acc.checkpoint_bytes(model_cfg, precision or str(t.precision))
    if lora_params is not None:
        each = 12 * lora_params
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


def _interrupted(run_dir: Path, last: Path, rank_zero: bool) -> None:
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
    """A CUDA out-of-memory error as one line: the count-params estimate and what to change."""
    from gptkit import accounting as acc

    t = plan.trainer
    mem = acc.training_memory(
        plan.model,
        plan.precision,
        plan.shards,
        plan.batch_size,
        plan.seq_len,
        bool(t.activation_checkpointing),
    )
    return GptkitError(
        f"out of GPU memory: count-params estimates {human_bytes(mem['total'])} per device (weights "
        f"{human_bytes(mem['weights'])}, optimizer {human_bytes(mem['optimizer'])}, activations "
        f"{human_bytes(mem['activations'])}, logits {human_bytes(mem['logits'])} at "
        f"trainer.batch_size={t.batch_size}); lower trainer.batch_size "
        "(and raise trainer.accumulate_grad_batches to keep the batch), set "
        f"trainer.activation_checkpointing=true, or shard with trainer=fsdp"
    )


def _announce(
    trainer, plan: RunPlan, prepared, optimizer: str = "AdamW", trainable: int | None = None
) -> None:
    """The start-up lines: the run folder, the model, the data, the global batch and the plan's totals,
    precision, optimizer and clipping, and where the weights come from."""
    if not trainer.is_global_zero:
        return
    from rich.console import Console
    from rich.markup import escape

    from gptkit import accounting as acc

    t, m = plan.trainer, plan.model
    n = acc.count_params(m).total
    trainable = n if trainable is None else trainable
    clip = f"clipping at {t.gradient_clip_val}" if t.gradient_clip_val else "no clipping"
    compiled = f", torch.compile={plan.compile}" if plan.compile else ""
    total = plan.total_tokens
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        (f"[bold]{escape(plan.job)}[/]\n" if plan.job else "")
        + f"[bold]gptkit train[/] -> {escape(str(plan.run_dir))}\n"
        f"  model {m.name}: {n:,} parameters, vocab {m.vocab_size}, context {m.max_seq_len}, "
        f"attention {m.attention}{compiled}\n"
        f"  data: {escape(prepared.describe())}\n"
        f"  global batch: {plan.tokens_per_step:,} tokens/step = "
        + (
            f"{plan.batch_size} pairs x 2 answers"
            if plan.objective == "dpo"
            else f"{plan.batch_size} sequences"
        )
        + " x "
        f"{plan.seq_len} tokens x {plan.accumulation} accumulation x {plan.devices} devices x "
        f"{plan.nodes} nodes"
        f" ({type(trainer.strategy).__name__}); "
        f"{plan.max_steps} steps = {total:,} tokens, "
        f"{plan.flops_per_token * total:.3g} FLOPs ("
        + (
            "4N + 6·adapters + 12·L·T·d_attn: no weight gradient for the frozen weights"
            if plan.lora
            else "6N + 12·L·T·d_attn, as count-params"
        )
        + ")\n"
        f"  precision {plan.precision.name}, {escape(optimizer)}, {clip}"
        + (f"\n  resuming from {escape(str(plan.resume))}" if plan.resume else "")
        + (f"\n  note: {plan.replan}" if plan.replan else "")
        + (
            f"\n  weights from {escape(str(plan.init_from))} (new optimizer and schedule)"
            if plan.init_from
            else ""
        )
        + (
            f"\n  LoRA: rank {plan.lora['rank']}, alpha {plan.lora['alpha']}, dropout {plan.lora['dropout']} "
            f"on {', '.join(plan.lora['targets'])}: {trainable:,} trainable parameters "
            f"({trainable / n:.2%}), "
            f"the rest frozen from {escape(str(plan.lora_base))}; checkpoints hold the adapters only"
            if plan.lora
            else ""
        )
        + (
            f"\n  DPO: beta {plan.dpo.get('beta')}, {plan.dpo.get('loss')} loss; reference: "
            + (
                "the base with the adapters off (no second copy)"
                if plan.lora
                else "a frozen copy of the starting weights"
            )
            if plan.objective == "dpo"
            else ""
        )
        + (
            f"\n  FSDP: rank 0 builds the weights; the other {plan.world_size - 1} rank(s) start on the "
            f"meta device and receive their shards"
            if plan.weights_from_rank0
            else ""
        )
    )


def _source_losses(logged: dict[str, Any]) -> None:
    """data=mix: one line per source with its final val/loss/<source> (stderr, after the summary)."""
    for key, value in logged.items():
        if key.startswith("val/loss/"):
            loss = float(value)
            print(
                f"  val loss {key[len('val/loss/') :]}: {loss:.4f} (ppl {math.exp(min(loss, 50)):.2f})",
                file=sys.stderr,
            )


def _summary(
    run_dir: Path,
    step: int,
    val: Any,
    metrics,
    flops_per_token: float,
    peak: float | None,
    world: int,
    wall_s: float,
    reward_accuracy: Any = None,
) -> None:
    """The run's result: final val loss, and this invocation's average throughput over all its training
    steps (not the last window) and total wall time. objective=dpo: the val pairs' reward accuracy instead
    of a perplexity."""
    from rich.console import Console
    from rich.markup import escape

    from gptkit import accounting as acc
    from gptkit.training.progress import clock

    parts = [f"step {step}"]
    if val is not None and reward_accuracy is not None:
        parts.append(f"val DPO loss {float(val):.4f} (reward accuracy {float(reward_accuracy):.1%})")
    elif val is not None:
        parts.append(f"val loss {float(val):.4f} (ppl {math.exp(min(float(val), 50)):.2f})")
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
