"""Where a run's weights come from: a fresh init, the run that resume= continues, the weights init_from= (or
hf:) starts from, the frozen base of a LoRA or QLoRA run, the frozen models of an objective (frozen.<name>:
its reference, a teacher), each from the starting weights or a source of its own.

resolve_resume and resolve_init_from rewrite the config before anything else reads it (a resumed run's
config is the saved one, merged with the command line; an init_from= run takes its source's model and
tokenizer); the loaders put the weights into the built model (memory-mapped, names and shapes checked).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from gptkit import adapters
from gptkit.chat_templates import CHAT_FILE
from gptkit.checkpoints import (
    checked_model_state,
    checkpoint_step,
    load_checkpoint,
    read_sharded_checkpoint,
    run_dir_of,
    verify_checkpoint,
)
from gptkit.conf_files import conf_dir
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import atomic_write_bytes, check_local_path
from gptkit.model import ModelConfig
from gptkit.options import Option
from gptkit.runs import (
    TOKENIZER_FILE,
    check_links,
    find_run_checkpoint,
    load_tokenizer,
    read_config,
    saved_run_config,
)

# Lightning and torch (and training/finetune/, which imports torch) are imported inside the functions that
# need them: commands/train.py imports this module to check the command line (see fit.py).


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
    ckpt = _resume_checkpoint(cfg)
    # sharded (FSDP): read only the small non-tensor state here
    if ckpt.is_dir():
        state = read_sharded_checkpoint(ckpt, weights=False)
    else:
        # fail now, with one line, if it is truncated or not a checkpoint
        state = load_checkpoint(ckpt)
    from gptkit.training.finetune import check_resumed_finetune

    merged, saved_trainer, saved_finetune = _merge_resumed(cfg, ckpt, overrides)
    check_resumed_finetune(cfg.resume, saved_finetune, merged, state)
    merged.resume = str(ckpt)
    return merged, ckpt, int(state.get("global_step", 0)), saved_trainer


def resumed_config(cfg: DictConfig, overrides: list[Option]) -> DictConfig:
    """The config resume= runs with: the run's saved config with the command line merged in, as
    resolve_resume makes it, without reading the checkpoint's state. What train's early check (before Hydra
    makes anything) sees of a resume: the run's own trainer (trainer=fsdp), not the command line's default."""
    ckpt = _resume_checkpoint(cfg)
    merged = _merge_resumed(cfg, ckpt, overrides)[0]
    merged.resume = str(ckpt)
    return merged


def _resume_checkpoint(cfg: DictConfig) -> Path:
    """The Lightning checkpoint resume= continues from."""
    check_resume_or_init(cfg.resume, cfg.get("init_from"))
    ckpt = find_run_checkpoint(cfg.resume, cfg.runs_dir)
    if ckpt.suffix != ".ckpt":
        raise GptkitError(f"resume={cfg.resume} has no Lightning checkpoint (.ckpt) to continue from")
    return ckpt


def _merge_resumed(
    cfg: DictConfig, ckpt: Path, overrides: list[Option]
) -> tuple[DictConfig, DictConfig, DictConfig]:
    """(the saved config of the run of `ckpt` with the command line's overrides merged in, its trainer as
    saved, what its fine-tune fixes as saved)."""
    # data, never resolved (the CLI checked it as a command line)
    saved = saved_run_config(ckpt, cfg)
    saved_optimizer = str(saved.optim.get("name", "adamw"))
    # what the run's fine-tune fixes (lora: the adapters' shape), before the command line merges in
    saved_finetune = OmegaConf.create(
        {k: OmegaConf.to_container(saved[k]) for k in ("lora", "qlora") if k in saved}
    )
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
    return merged, saved_trainer, saved_finetune


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
        source, pinned = import_init_source(source[len(HF_PREFIX) :], Path(cfg.runs_dir))
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


def tokenizer_source(cfg: DictConfig, run_dir: Path, init_ckpt: Optional[Path]) -> Optional[Path]:
    """The run whose tokenizer.json (and chat.json) resolve_init_from copied into run_dir; None when the
    run's tokenizer is not such a copy (no init_from=, or the command line chose a tokenizer)."""
    path = (cfg.get("tokenizer") or {}).get("path")
    if init_ckpt is None or not path or Path(str(path)) != (run_dir / TOKENIZER_FILE).resolve():
        return None
    return run_dir_of(init_ckpt)


# init_from=hf:<owner/name[@revision] or transformers folder>
HF_PREFIX = "hf:"


def init_source_name(init_from: str, runs_dir: Path | str) -> str | None:
    """The name of the model an init_from= run trains (its source's model.name, or for hf: the folder's or
    repository's name, as the import names it), read before Hydra names the run folder after it. None when
    the source cannot be read (its one-line error comes later, where init_from= is resolved)."""
    if init_from.startswith(HF_PREFIX):
        # ~3 s of imports after this module's: only for an hf: source
        from gptkit.hf import folders

        return folders.source_name(init_from[len(HF_PREFIX) :]) or None
    try:
        name = read_config(run_dir_of(find_run_checkpoint(init_from, runs_dir)))["model"].get("name")
    except (GptkitError, OSError):
        return None
    return str(name) if name not in (None, "") else None


def import_init_source(spec: str, runs_dir: Path, key: str = "init_from") -> tuple[str, str]:
    """init_from=hf:<spec> (or frozen.<name>=hf:<spec>: `key`) -> (the imported run folder, hf:<the exact
    source>), saying which on one line."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from gptkit.hf import folders

    folder, src, reused = folders.import_cached(
        spec, runs_dir, f"gptkit train {key}={HF_PREFIX}/path/to/folder"
    )
    if rank_zero_only.rank == 0:
        import sys

        if src.note:
            print(f"note: {src.note}", file=sys.stderr)
        print(
            f"{key}={HF_PREFIX}{spec}: {'reusing' if reused else 'imported'} {src.spec} "
            f"{'from' if reused else 'into'} {folder} (kept for later runs)",
            file=sys.stderr,
        )
    return str(folder), HF_PREFIX + src.spec


# the tensors of a score head (model.score_head), which a policy's checkpoint lacks
SCORE_HEAD = ("score.weight",)


def load_init_weights(model, ckpt: Path, vocab_size: int | None = None) -> None:
    """Copy the weights of an init_from= checkpoint (memory-mapped, names and shapes checked) into the new
    run's model (a GPT), with no second model in memory. `vocab_size`: the checkpoint's, smaller than the new
    model's (a chat template's special tokens were added): the new rows start as the mean of the old ones."""
    from gptkit.model.gpt import grow_vocab

    cfg = model.cfg
    # a score head (objective=reward from a policy's weights) starts anew
    new = SCORE_HEAD if cfg.score_head else ()
    if vocab_size is None or vocab_size == cfg.vocab_size:
        state = checked_model_state(ckpt, cfg, new)
    else:
        state = checked_model_state(ckpt, dataclasses.replace(cfg, vocab_size=vocab_size), new)
        state = grow_vocab(state, cfg.vocab_size)
    # into the (tied) parameters
    missing, unexpected = model.load_state_dict(state, strict=False)
    # only the adapters (lora, qlora) and a new score head start anew
    if unexpected or any(not adapters.is_adapter_key(k) and k not in new for k in missing):
        raise GptkitError(
            f"{ckpt} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def load_frozen(module, cfg: DictConfig, init_ckpt: Optional[Path], sources: dict[str, FrozenSource]) -> None:
    """The weights of the objective's frozen models (module.frozen, by name): each from its own source
    (`sources`, resolve_frozen), else the starting weights (load_start_weights). FSDP: on the ranks that
    build weights only (the others receive rank 0's in configure_model)."""
    for name, frozen in module.frozen.items():
        if frozen.module is None:
            # LoRA, QLoRA: the base with its adapters off, nothing to load
            continue
        source = sources.get(name)
        if source is None:
            load_start_weights(module, frozen, cfg, init_ckpt)
            continue
        frozen.source = {"path": str(source.checkpoint), "step": checkpoint_step(source.checkpoint)}
        if not module.frozen_on_meta:
            load_init_weights(frozen.module, source.checkpoint)


def load_start_weights(module, frozen, cfg: DictConfig, init_ckpt: Optional[Path]) -> None:
    """The starting weights into a frozen model (the default reference). A new run copies the policy's (just
    loaded from init_from=); a resumed run reads them again from the checkpoint its config's init_from= names,
    whose step the FrozenModel checks against the one the run started from."""
    if init_ckpt is not None:
        frozen.source = {"path": str(init_ckpt), "step": checkpoint_step(init_ckpt)}
        if not module.frozen_on_meta:
            frozen.module.load_state_dict(module.model.state_dict())
        return
    source = str(cfg.init_from)
    if source.startswith(HF_PREFIX):
        source, _ = import_init_source(source[len(HF_PREFIX) :], Path(cfg.runs_dir))
    ckpt = find_run_checkpoint(source, cfg.runs_dir)
    frozen.source = {"path": str(ckpt), "step": checkpoint_step(ckpt)}
    if not module.frozen_on_meta:
        vocab = int(read_config(run_dir_of(ckpt))["model"]["vocab_size"])
        load_init_weights(frozen.module, ckpt, vocab)


# ---- frozen models: frozen.<name> -----------------------------------------------------------------
# frozen.<name>=start: the policy's starting weights (init_from=, kept in a resumed run's config)
FROM_START = "start"
# a frozen model's source when the config names none: the reference is the start (and a run saved before
# frozen: existed has no frozen block)
DEFAULT_SOURCES = {"reference": FROM_START}
FROZEN_SOURCES = "start, a run folder or checkpoint, latest, or hf:<owner/name | transformers folder>"


@dataclasses.dataclass(frozen=True)
class FrozenSource:
    """A frozen model's own source (frozen.<name> other than start), resolved: its checkpoint and run
    folder, its own ModelConfig (any size; the vocabulary is the policy's)."""

    name: str
    # as the run's config records it (hf: pinned to the import's exact source)
    given: str
    checkpoint: Path
    run_dir: Path
    model: ModelConfig

    def describe(self) -> str:
        m = self.model
        return f"frozen {self.given} ({m.n_layers} layers, d_model {m.d_model})"


def frozen_source(cfg: Any, name: str) -> Optional[str]:
    """frozen.<name> of a run's config: FROM_START, a path or hf:<spec>; None when it names none."""
    value = (cfg.get("frozen") or {}).get(name)
    if value is None or str(value).strip() in ("", "null", "None"):
        return DEFAULT_SOURCES.get(name)
    return str(value)


def _frozen_names(cfg: Any) -> tuple[str, ...]:
    from gptkit.training.objectives import objective_class

    objective = objective_class(cfg)
    group = objective.settings_of(cfg)
    # a frozen model whose outputs are precomputed is not built, but its source says whose they must be
    return (*objective.frozen_models(group), *objective.precomputed_models(group))


def check_frozen(cfg: Any) -> None:
    """frozen.<name> checked without data (before Hydra makes the run folder): each frozen model the
    objective reads names a source, a local one (no URL) that holds a checkpoint inside its run folder; a
    source the objective does not read is refused; hf: is imported at the start (resolve_frozen)."""
    from gptkit.training.objectives import objective_class

    names = _frozen_names(cfg)
    for name, value in (cfg.get("frozen") or {}).items():
        if name not in names and frozen_source(cfg, name) not in (None, DEFAULT_SOURCES.get(name)):
            reads = ", ".join(f"frozen.{n}" for n in names) or "no frozen model"
            raise ConfigError(
                f"frozen.{name}={value}: objective={objective_class(cfg).name} does not read it with these "
                f"settings (it reads {reads}); drop it"
            )
    for name in names:
        given = frozen_source(cfg, name)
        if given is None:
            raise ConfigError(f"objective={objective_class(cfg).name} needs frozen.{name}=<{FROZEN_SOURCES}>")
        check_local_path(f"frozen.{name}", given)
        if given == FROM_START and cfg.get("init_from") in (None, "", "null"):
            raise ConfigError(
                f"frozen.{name}=start is the starting weights, and without init_from= those are random: "
                f"give init_from= or frozen.{name}=<{FROZEN_SOURCES.split(', ', 1)[1]}>"
            )
        if given == FROM_START or given.startswith(HF_PREFIX):
            continue
        ckpt = _frozen_checkpoint(cfg, name, given)
        try:
            verify_checkpoint(ckpt)
        except GptkitError as exc:
            raise ConfigError(f"frozen.{name}={given}: {exc}") from None


def _frozen_checkpoint(cfg: Any, name: str, given: str) -> Path:
    """The checkpoint a frozen.<name> path names, inside a run folder whose files stay inside it."""
    try:
        ckpt = find_run_checkpoint(given, cfg.runs_dir)
        check_links(run_dir_of(ckpt))
    except GptkitError as exc:
        raise ConfigError(f"frozen.{name}={given}: {exc}") from None
    return ckpt


def resolve_frozen(
    cfg: DictConfig, tokenizer_path: Path, model: ModelConfig, seq_len: int
) -> dict[str, FrozenSource]:
    """The frozen models with a source of their own (frozen.<name> other than start), by name: hf: imported
    (as init_from=hf: is, into <runs_dir>/<name>-imported), each one's checkpoint and ModelConfig read. Any
    size, but the policy's vocabulary (the run's tokenizer `tokenizer_path`, model.vocab_size) and a context
    of at least seq_len: else one line naming both sources, before anything trains. cfg.frozen.<name> is
    rewritten to the checkpoint (hf: the pinned source), which config.yaml keeps for a resume."""
    out = {}
    for name in _frozen_names(cfg):
        given = frozen_source(cfg, name)
        if given is None or given == FROM_START:
            continue
        pinned = None
        if given.startswith(HF_PREFIX):
            folder, pinned = import_init_source(given[len(HF_PREFIX) :], Path(cfg.runs_dir), f"frozen.{name}")
            ckpt = _frozen_checkpoint(cfg, name, folder)
        else:
            ckpt = _frozen_checkpoint(cfg, name, given)
        src_dir = run_dir_of(ckpt)
        try:
            frozen_cfg = ModelConfig.from_dict(read_config(src_dir)["model"])
        except (GptkitError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"frozen.{name}={given}: {src_dir / 'config.yaml'}: {exc}") from None
        if frozen_cfg.score_head:
            raise ConfigError(
                f"frozen.{name}={given} is a reward model (model.score_head): its token log-probs come from "
                "an LM head it never trained; give a policy run (use a reward model as a GRPO reward)"
            )
        _check_same_vocabulary(cfg, name, given, src_dir, frozen_cfg, tokenizer_path, model)
        if frozen_cfg.max_seq_len < seq_len:
            raise ConfigError(
                f"frozen.{name}={given} reads at most {frozen_cfg.max_seq_len} tokens (model.max_seq_len), "
                f"the run's rows are {seq_len}: lower trainer.seq_len or give a model of a longer context"
            )
        if cfg.get("frozen") is None:
            cfg.frozen = OmegaConf.create({})
        cfg.frozen[name] = pinned or str(ckpt)
        out[name] = FrozenSource(name, pinned or str(ckpt), ckpt, src_dir, frozen_cfg)
    return out


def _check_same_vocabulary(
    cfg: Any,
    name: str,
    given: str,
    src_dir: Path,
    frozen_cfg: ModelConfig,
    tokenizer_path: Path,
    model: ModelConfig,
) -> None:
    """A frozen model's logits index the policy's tokens: the same tokenizer (every token at the same id)
    and the same model.vocab_size, else one ConfigError naming both sources."""
    from gptkit.tokenizer import load_tokenizer_file

    ours = load_tokenizer_file(tokenizer_path).get_vocab(with_added_tokens=True)
    theirs = load_tokenizer(src_dir).get_vocab(with_added_tokens=True)
    init_from = cfg.get("init_from")
    policy = (
        f"init_from={init_from}" if init_from not in (None, "") else f"tokenizer={cfg.tokenizer.get('kind')}"
    )
    if ours != theirs:
        moved = sum(1 for t, i in ours.items() if theirs.get(t) != i)
        raise ConfigError(
            f"frozen.{name}={given} has another vocabulary than the policy ({policy}): "
            f"{len(theirs):,} tokens in {src_dir / TOKENIZER_FILE}, {len(ours):,} in {tokenizer_path}, "
            f"{moved:,} of the policy's at another id or absent; a frozen model must share the policy's "
            "tokenizer"
        )
    if frozen_cfg.vocab_size != model.vocab_size:
        raise ConfigError(
            f"frozen.{name}={given} has model.vocab_size {frozen_cfg.vocab_size}, the policy ({policy}) "
            f"{model.vocab_size}: the same tokenizer, padded otherwise (vocab_multiple=); their logits must "
            "line up"
        )


def frozen_base(
    cfg: DictConfig, model_cfg: ModelConfig, init_ckpt: Optional[Path], resume_ckpt: Optional[Path]
) -> Optional[Path]:
    """finetune=lora, qlora: the checkpoint of the frozen weights (init_from='s, or the one the resumed run's
    checkpoint records, checked unchanged), after the fine-tune's settings are checked against the model;
    None when every weight trains."""
    from gptkit.training.finetune import finetune_class

    return finetune_class(cfg).base_checkpoint(cfg, model_cfg, init_ckpt, resume_ckpt)


def check_resume_or_init(resume: Any, init_from: Any) -> tuple[bool, bool]:
    """(resume given, init_from given); both is a one-line error."""
    given = tuple(v not in (None, "", "null") for v in (resume, init_from))
    if all(given):
        raise GptkitError(
            "give resume= (continue a run) or init_from= (start a new run from its weights), not both"
        )
    return given
