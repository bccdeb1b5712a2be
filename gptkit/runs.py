"""Run folders: what `train` writes and what `sample`, `eval`, `export` and `resume` read.

    runs/<name>/
      config.yaml          the resolved config of the run (the `model` section builds the model)
      tokenizer.json       the exact tokenizer used for training (HF `tokenizers` format)
      manifest.json        the data manifest (when trained by gptkit)
      plan.json            how each invocation drew its batches (world size, accumulation, batch, window,
                           seed, steps): what `gptkit trace` reads
      checkpoints/         last.ckpt and periodic step-NNNNNN.ckpt (see gptkit.checkpoints)
      metrics.csv, loss.png, ...
      imported_from.json   (an imported run: where its weights came from; it has no training state)
      merge.json           (a merge of step checkpoints, `gptkit merge`: its sources; no optimizer state)
      .lock                held (fcntl) by the one process that trains into the folder; holds its PID

`run=latest` means the run folder under ./runs whose config.yaml was written last. A run folder is a
direct child of runs_dir (a multirun job's: of runs_dir/<name>), never runs_dir itself or outside it.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptkit.checkpoints import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    STATE_PREFIX,
    atomic_torch_save,
    checked_model_state,
    find_checkpoint,
    load_checkpoint,
    run_dir_of,
)
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import atomic_write_text, links_leaving, lock_file
from gptkit.precision import torch_dtype

# torch, tokenizers, yaml and the model are imported inside the functions: the CLI imports this module
# to check a command line before any of them is needed (docs/layout.md).

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.csv"
PLAN_FILE = "plan.json"
IMPORTED_FILE = "imported_from.json"
# a folder `gptkit merge` wrote: its sources (gptkit/merge.py); weights only, nothing to resume
MERGE_FILE = "merge.json"
LOCK_FILE = ".lock"
# a process whose run folder's lock is held by this PID, its job's own driver (trainer.launcher=ray: the
# `gptkit train` that started Ray Train's workers holds it for the whole job), writes it as the holder would
LOCK_HOLDER_ENV = "GPTKIT_RUN_LOCK_HOLDER"
# Hydra's copy of the composed config, written when the run starts
HYDRA_DIR = ".hydra"


# ---- where a run folder may be, and who writes it ----------------------------------------------------
def check_run_location(runs_dir: Any, name: Any) -> None:
    """runs_dir= and name= as given: the run folder is runs_dir/name, a new folder inside runs_dir. One-line
    ConfigError for an empty runs_dir or a name that is empty, absolute, `.`/`..` or has a path separator."""
    if runs_dir is not None and str(runs_dir).strip() in ("", "null", "None"):
        raise ConfigError("runs_dir= is empty; give the folder that holds the run folders (default: runs)")
    if name is None:
        return
    n = str(name)
    if (
        n.strip() in ("", ".", "..", "null", "None")
        or n.startswith(("/", "~"))
        or "/" in n
        or "\\" in n
        or ".." in Path(n).parts
    ):
        raise ConfigError(
            f"name={n!r} is not a run name: give a plain folder name (no '/', '..' or absolute "
            f"path); the run folder is <runs_dir>/<name>"
        )


def check_run_dir(run_dir: Path | str, runs_dir: Path | str, job: bool = False) -> None:
    """The run folder Hydra made must be a child of runs_dir (a multirun job's: a grandchild)."""
    run_dir, root = Path(run_dir).resolve(), Path(runs_dir).resolve()
    parent = run_dir.parent.parent if job else run_dir.parent
    if parent != root:
        raise ConfigError(
            f"the run folder {run_dir} is not a folder of runs_dir={runs_dir}; give a plain "
            f"name= (the run folder is <runs_dir>/<name>)"
        )


def is_run_folder(path: Path | str) -> bool:
    p = Path(path)
    return (p / CONFIG_FILE).is_file() or (p / CHECKPOINT_DIR).is_dir()


def check_not_source(out: Path | str, source: Path | str) -> None:
    """A command that writes a folder (export out=) never touches the run it reads or any other run: out must
    not be, contain or lie inside the source run folder, and must not be a run folder (force or not)."""
    o, src = Path(out).expanduser().resolve(), Path(source).resolve()
    if o == src or src in o.parents or o in src.parents:
        raise ConfigError(
            f"out={out} is, contains or lies inside the run folder {src} being read; "
            f"choose a folder outside it"
        )
    if is_run_folder(o):
        raise ConfigError(
            f"out={out} is a run folder; it is never replaced (force=true or not): choose another out="
        )


def check_import_out(out: Path | str, source: Path | str | None, force: bool) -> None:
    """`import out=` never destroys what it reads or a run: out must not be, contain or lie inside the source
    folder (when known), and a run folder is replaced only when it is an earlier import (no training in it),
    with force=true, and while no process holds its lock (the lock is then held by this process until it
    ends)."""
    o = Path(out).expanduser().resolve()
    src = Path(source).resolve() if source is not None else None
    if src is not None and (o == src or src in o.parents or o in src.parents):
        raise ConfigError(
            f"out={out} is, contains or lies inside the folder {src} being imported; "
            f"choose a folder outside it"
        )
    if not o.is_dir():
        return
    imported = (o / IMPORTED_FILE).is_file() and not (o / METRICS_FILE).exists()
    if is_run_folder(o) and not imported:
        raise ConfigError(
            f"out={out} is a run folder with training in it; import never replaces it "
            f"(force=true or not): choose another out="
        )
    if force and (is_run_folder(o) or (o / LOCK_FILE).exists()):
        # a live process's lock: one line, its PID
        claim_run_dir(o, remove_if_unused=False, instead="out=")


def is_rank_zero() -> bool:
    """True unless a launcher (Lightning, torchrun, SLURM, MPI) started this process as another rank."""
    return all(
        int(os.environ.get(k) or 0) == 0
        for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
    )


def unused(run_dir: Path | str) -> bool:
    """Nothing of a run in the folder (absent, or only Hydra's .hydra/ and a lock file): a start that
    failed."""
    p = Path(run_dir)
    return not p.exists() or (p.is_dir() and {f.name for f in p.iterdir()} <= {HYDRA_DIR, LOCK_FILE})


_claimed: dict[Path, int] = {}


def claim_run_dir(run_dir: Path | str, remove_if_unused: bool, instead: str = "name=") -> None:
    """Make this process the one writer of run_dir (created if needed): an exclusive fcntl lock on its .lock
    file, held until the process ends (the OS releases it then, kill -9 included, so no lock goes stale).
    Another holder is a one-line GptkitError naming its PID. With remove_if_unused (this invocation made the
    folder), the folder is removed at exit if no run began in it (no config.yaml): a start-up failure leaves
    nothing behind. Idempotent."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _claimed:
        return
    check_links(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = lock_file(run_dir / LOCK_FILE)
    if fd is None:
        try:
            pid = (run_dir / LOCK_FILE).read_text().strip() or "unknown"
        except OSError:
            pid = "unknown"
        if pid == os.environ.get(LOCK_HOLDER_ENV):
            return
        raise GptkitError(
            f"{run_dir} is being written by another gptkit process (PID {pid}); wait for it to "
            f"end or stop it, or choose another {instead}"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _claimed[run_dir] = fd
    if remove_if_unused:
        atexit.register(_remove_if_no_run, run_dir)


def check_links(run_dir: Path | str) -> None:
    """A run folder whose files are symbolic links that leave it is refused (one line): gptkit would read
    or write the link's target through it."""
    found = links_leaving(run_dir) if Path(run_dir).is_dir() else []
    if found:
        link, target = found[0]
        raise GptkitError(
            f"{link} is a symbolic link to {target}, outside the run folder "
            f"{Path(run_dir).resolve()}; "
            f"a run folder's files stay inside it: replace the link with a copy of the file"
        )


def _remove_if_no_run(run_dir: Path) -> None:
    ckdir = run_dir / CHECKPOINT_DIR
    if not (run_dir / CONFIG_FILE).exists() and not (ckdir.is_dir() and any(ckdir.iterdir())):
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- finding and reading run folders ---------------------------------------------------------------
# run=latest: the most recently written run folder under ./runs
LATEST = "latest"


def resolve_latest(path: Path | str, runs_dir: Path | str = "runs", need: str = "checkpoint") -> Path:
    """`latest` means the newest run folder under runs_dir (by its config.yaml; multirun job folders included)
    that is usable for the verb (`need`, see usable_for): a failed start, a sweep's folder or an import is
    skipped where it has nothing for the verb, with a note naming the newer folders skipped. Any other path is
    returned as it is."""
    if str(path) != LATEST:
        return Path(path).expanduser()
    root = Path(runs_dir)
    configs = [
        f
        for pattern in (f"*/{CONFIG_FILE}", f"*/*/{CONFIG_FILE}")
        for f in root.glob(pattern)
        if not any(part.startswith(".") for part in f.relative_to(root).parts)
        # not Hydra's .hydra/
    ]
    if not configs:
        raise GptkitError(f"`latest` found no run folder under {runs_dir}/; train first or give a run folder")
    newest = [f.parent for f in sorted(configs, key=lambda f: f.stat().st_mtime, reverse=True)]
    found = next((i for i, d in enumerate(newest) if usable_for(d, need)), None)
    if found is None:
        raise GptkitError(
            f"`latest` found no run folder under {runs_dir}/ with {NEEDS[need]} (newest: "
            f"{newest[0]}); "
            f"train first or give a run folder"
        )
    if found and is_rank_zero():
        import sys

        print(
            f"note: latest is {newest[found]}; newer folders without {NEEDS[need]} skipped: "
            f"{', '.join(str(d) for d in newest[:found][:3])}{' ...' if found > 3 else ''}",
            file=sys.stderr,
        )
    return newest[found]


NEEDS = {
    "checkpoint": "a checkpoint",
    "training": "training to resume (a .ckpt, not an import)",
    "metrics": "a metrics.csv",
    "sharded": "a sharded checkpoint",
}


def usable_for(run_dir: Path, need: str = "checkpoint") -> bool:
    """Whether a run folder has what a verb needs: a checkpoint (sample, eval, export, init_from), training
    to resume (a .ckpt of a run that is not an import), a metrics.csv (plot) or a sharded checkpoint
    (consolidate)."""
    if need == "metrics":
        return (run_dir / METRICS_FILE).is_file()
    try:
        ckpt = find_checkpoint(run_dir)
    except GptkitError:
        return False
    if need == "training":
        trained = (run_dir / METRICS_FILE).exists() or not (
            (run_dir / IMPORTED_FILE).exists() or (run_dir / MERGE_FILE).exists()
        )
        return ckpt.suffix == ".ckpt" and trained
    return ckpt.is_dir() if need == "sharded" else True


def find_run_checkpoint(path: Path | str, runs_dir: Path | str = "runs", need: str = "checkpoint") -> Path:
    """The checkpoint a `run=` / `resume=` / `init_from=` value names: a run folder, a checkpoint file or
    sharded folder, or `latest` (the newest run folder usable for `need`, see resolve_latest)."""
    return find_checkpoint(resolve_latest(path, runs_dir, need))


def record_plan(run_dir: Path | str, facts: dict[str, Any], from_step: int) -> None:
    """Add one invocation's facts (how its batches are drawn: world_size, accumulation, batch_size,
    rows_per_item, seq_len, seed, max_steps) to the run's plan.json, for the optimizer steps from `from_step`
    on; what an earlier invocation recorded for those steps (a resume from an earlier checkpoint) goes."""
    f = Path(run_dir) / PLAN_FILE
    segments = [s for s in read_plan(run_dir) if s["from_step"] < from_step]
    segments.append({"from_step": int(from_step), **facts})
    atomic_write_text(f, json.dumps({"invocations": segments}, indent=1))


# plan.json's fields of an invocation and their least values (seed: any integer)
PLAN_FIELDS = {
    "from_step": 1,
    "world_size": 1,
    "accumulation": 1,
    "batch_size": 1,
    "rows_per_item": 1,
    "seq_len": 1,
    "seed": None,
    "max_steps": 1,
}


def plan_problem(data: Any) -> str | None:
    """What is wrong with plan.json's content (parsed JSON), in a few words naming the field, or None: an
    object whose "invocations" is a list of objects, each with PLAN_FIELDS as integers (at least their least
    values), from_step rising from one invocation to the next."""
    invocations = data.get("invocations") if isinstance(data, dict) else None
    if not isinstance(invocations, list):
        return 'it needs {"invocations": [...]} (a list, one object per training invocation)'
    last = 0
    for i, inv in enumerate(invocations):
        if not isinstance(inv, dict):
            return f"invocations[{i}] is {inv!r}, not an object"
        for field, least in PLAN_FIELDS.items():
            v = inv.get(field)
            if isinstance(v, bool) or not isinstance(v, int) or (least is not None and v < least):
                want = "an integer" + (f" >= {least}" if least is not None else "")
                have = "missing" if field not in inv else f"{v!r}"
                return f"invocations[{i}].{field} is {have}; it must be {want}"
        if inv["from_step"] <= last:
            return (
                f"invocations[{i}].from_step={inv['from_step']} does not follow "
                f"invocations[{i - 1}].from_step={last} (each invocation starts after the one before)"
            )
        last = inv["from_step"]
    return None


def read_plan(run_dir: Path | str, check: bool = False) -> list[dict[str, Any]]:
    """The invocations plan.json records, oldest first ([]: none, or a run from before it was written). A
    file that is not what record_plan writes (hand-edited, cut short) is [] (training writes it anew), or with
    `check` (gptkit trace reads it as the truth) a one-line GptkitError naming the file and the field."""
    f = Path(run_dir) / PLAN_FILE
    if not f.is_file():
        return []
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        problem: str | None = f"not readable JSON ({str(exc).splitlines()[0][:120]})"
    else:
        problem = plan_problem(data)
    if problem is None:
        return list(data["invocations"])
    if check:
        raise GptkitError(f"{f}: {problem}; fix it, or remove the file (trace then plans from config.yaml)")
    return []


def read_config(run_dir: Path) -> dict[str, Any]:
    import yaml

    f = Path(run_dir) / CONFIG_FILE
    if not f.is_file():
        if (Path(run_dir) / "config.json").is_file():
            raise GptkitError(
                f"{run_dir} is a transformers folder, not a run folder; make it one first: "
                f"gptkit import hf={run_dir} out=runs/<name>"
            )
        raise GptkitError(f"{f} is missing; a run folder needs the {CONFIG_FILE} that `gptkit train` writes")
    try:
        cfg = yaml.safe_load(f.read_text())
    except yaml.YAMLError as exc:
        raise GptkitError(f"{f} is not valid YAML ({str(exc).splitlines()[0]})") from exc
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise GptkitError(f"{f} has no `model` section")
    _no_interpolation(cfg, f)
    return cfg


def _no_interpolation(node: Any, where: Path, key: str = "") -> None:
    """A run's saved config is data: a `${...}` in it (which OmegaConf would resolve, ${oc.env:...} included)
    is refused, naming the key."""
    if isinstance(node, dict):
        for k, v in node.items():
            _no_interpolation(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _no_interpolation(v, where, f"{key}[{i}]")
    elif isinstance(node, str) and "${" in node:
        raise ConfigError(
            f"{where}: {key}: {node!r} is an interpolation; a run's saved config is data and "
            f"is never resolved: write the value itself"
        )


def check_saved_run(ckpt: Path | str, source: str) -> None:
    """Before `train resume=` starts: the run has training to continue (an imported model has none:
    init_from=), its config.yaml passes check_saved_config, its model section builds, and a single-file
    checkpoint's weights have the shapes it names. One-line errors name <run>/config.yaml."""
    from gptkit.model import ModelConfig
    from gptkit.options import check_saved_config

    ckpt = Path(ckpt)
    if ckpt.is_file():
        # a truncated or foreign file: one line before its folder is looked at
        load_checkpoint(ckpt)
    run_dir = run_dir_of(ckpt)
    where = run_dir / CONFIG_FILE
    check_links(run_dir)
    raw = read_config(run_dir)
    if (run_dir / IMPORTED_FILE).is_file() and not (run_dir / METRICS_FILE).exists():
        raise GptkitError(
            f"{source}: {run_dir} is an imported model ({IMPORTED_FILE}), with no training "
            "state to "
            f"continue; start a new run from its weights: gptkit train init_from={run_dir}"
        )
    if (run_dir / MERGE_FILE).is_file() and not (run_dir / METRICS_FILE).exists():
        raise GptkitError(
            f"{source}: {run_dir} is a merge of step checkpoints ({MERGE_FILE}), whose optimizer state is "
            f"not carried, so there is no training to continue; start a new run from its weights: "
            f"gptkit train init_from={run_dir}"
        )
    missing = [s for s in ("trainer", "optim") if not isinstance(raw.get(s), dict)]
    if missing:
        raise GptkitError(
            f"{source}: {where} has no {missing[0]} section, so it holds no training to "
            f"continue; start a new run from its weights: gptkit train init_from={run_dir}"
        )
    fields = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig))
    check_saved_config("train", raw, str(where), fields)
    try:
        model_cfg = ModelConfig.from_dict(raw["model"])
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    # its shapes (mmap); a sharded folder's when loaded
    if ckpt.suffix == ".ckpt" and ckpt.is_file():
        checked_model_state(ckpt, model_cfg)


def saved_run_config(ckpt: Path | str, composed: Any):
    """The saved config of the run a resume= checkpoint belongs to, as an OmegaConf config: data (read_config
    refuses an interpolation), with the trainer/optim keys it lacks (an older gptkit's run, or an edited file)
    taken from `composed` (this invocation's config: the defaults and the command line), said once. The
    command line checks the file itself first (gptkit.options.check_saved_run)."""
    from omegaconf import OmegaConf

    run_dir = run_dir_of(Path(ckpt))
    saved = OmegaConf.create(read_config(run_dir))
    filled = []
    for section in ("trainer", "optim"):
        if section not in saved or section not in composed:
            continue
        defaults = OmegaConf.to_container(composed[section], resolve=False)
        for key, value in defaults.items():
            if key not in saved[section]:
                saved[section][key] = value
                filled.append(f"{section}.{key}")
    if filled and is_rank_zero():
        print(
            f"note: {run_dir / CONFIG_FILE} has no {', '.join(filled)} (an older gptkit's run, or an "
            "edited file): "
            f"{'their defaults are' if len(filled) > 1 else 'its default is'} used",
            file=sys.stderr,
        )
    return saved


@dataclass
class Run:
    dir: Path
    checkpoint: Path
    # the resolved run config (plain dict)
    config: dict[str, Any]
    # ModelConfig
    model_cfg: Any
    # GPT, eval mode, on the requested device and dtype
    model: Any
    # tokenizers.Tokenizer
    tokenizer: Any


def load_tokenizer(run_dir: Path):
    from tokenizers import Tokenizer

    f = Path(run_dir) / TOKENIZER_FILE
    if not f.is_file():
        raise GptkitError(f"{f} is missing; the run folder must hold the training tokenizer")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:
        raise GptkitError(f"{f} is not a valid tokenizer.json ({str(exc)[:160]})") from exc


def load_run(
    path: Path | str,
    device: str = "cpu",
    dtype: str | None = None,
    attention: str | None = None,
    quantize: str | None = None,
    policy: bool = False,
) -> Run:
    """Load config, tokenizer and weights of a run folder (or of the run a checkpoint belongs to); quantize,
    policy: see load_model."""
    run_dir, ckpt_path, cfg, model_cfg, model = load_model(path, device, dtype, attention, quantize, policy)
    tokenizer = load_tokenizer(run_dir)
    check_tokenizer_fits(run_dir, tokenizer.get_vocab_size(), model_cfg.vocab_size)
    return Run(run_dir, ckpt_path, cfg, model_cfg, model, tokenizer)


def check_tokenizer_fits(run_dir: Path, tokenizer_size: int, vocab_size: int) -> None:
    """The run's tokenizer must give only ids the model has (the model's vocabulary may be larger: padded)."""
    if tokenizer_size > vocab_size:
        raise GptkitError(
            f"{Path(run_dir) / TOKENIZER_FILE} has {tokenizer_size:,} tokens but the model has "
            f"{vocab_size:,} (model.vocab_size in {Path(run_dir) / CONFIG_FILE}): it is not "
            f"the tokenizer the run was trained with; put that one back"
        )


def load_model(
    path: Path | str,
    device: str = "cpu",
    dtype: str | None = None,
    attention: str | None = None,
    quantize: str | None = None,
    policy: bool = False,
):
    """load_run without the tokenizer: (run_dir, checkpoint, config, model_cfg, model), the model in eval
    mode on `device` (auto: cuda when a GPU is present; resolve_device). The checkpoint's tensors are
    memory-mapped and copied once, into the model on `device`.
    quantize: int8 | w8a8 | int4 | nf4, the block projections' weights quantized (gptkit.quant: torchao, or
    torch's own int8 kernels on the CPU) after the cast to `dtype`; what cannot run on this model, device or
    dtype is one line before any weight is read. policy: the model is to generate (sample, chat, serve,
    eval): a reward model (model.score_head) is one line before any weight is read."""
    from gptkit import quant
    from gptkit.model.config import ModelConfig

    path = resolve_latest(path)
    ckpt_path = find_checkpoint(path)
    # a checkpoint given
    run_dir = run_dir_of(ckpt_path) if ckpt_path == path else path
    if is_run_folder(run_dir):
        check_links(run_dir)
    cfg = read_config(run_dir)
    mdict = dict(cfg["model"])
    if attention:
        mdict["attention"] = attention
    try:
        model_cfg = ModelConfig.from_dict(mdict)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{run_dir / CONFIG_FILE}: {exc}") from None
    if policy and model_cfg.score_head:
        raise GptkitError(
            f"{run_dir} is a reward model (objective=reward, model.score_head): it scores sequences and "
            "generates nothing; export it (gptkit export) or use it as a GRPO reward "
            "(grpo.rewards=[{kind: model, path: <run>}])"
        )
    # torch (the device, the model) once the run is found and its config read: a run= that is not one is one
    # line without it (3.3 s -> 0.24 s of CPU for `sample run=runs/none`, issue 47 item 12)
    from gptkit.model import GPT

    device = resolve_device(device)
    if quantize is not None:
        quant.check_quantize(quantize, model_cfg, str(device), str(dtype or "fp32"))
    model = GPT.from_state(model_cfg, checked_model_state(ckpt_path, model_cfg), device)
    if dtype:
        model = model.to(dtype=torch_dtype(dtype))
    if quantize is not None:
        quant.quantize_model(model, quantize)
    return run_dir, ckpt_path, cfg, model_cfg, model


def write_run_folder(
    run_dir: Path | str, config: dict[str, Any], model, tokenizer=None, manifest: dict[str, Any] | None = None
) -> Path:
    """Write a minimal complete run folder (config, tokenizer, checkpoints/last.ckpt) for `model`.

    Used by `import` and by tests; `train` writes the same layout through Lightning.
    """
    import yaml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    config["model"] = model.cfg.to_dict()
    atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))
    if tokenizer is not None:
        atomic_write_text(run_dir / TOKENIZER_FILE, tokenizer.to_str())
    if manifest is not None:
        atomic_write_text(run_dir / MANIFEST_FILE, json.dumps(manifest, indent=2))
    state = {STATE_PREFIX + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    atomic_torch_save({"state_dict": state, "global_step": 0}, run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT)
    return run_dir


def resolve_device(device: str) -> str:
    """`auto` -> cuda when a GPU is present, else cpu; a GPU asked for but absent is a GptkitError."""
    import torch

    device = str(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GptkitError(f"device={device} but no CUDA GPU is visible; use device=cpu (or auto)")
    if device != "cpu" and not device.startswith(("cuda", "mps")):
        raise GptkitError(f"device={device!r} is not one of auto, cpu, cuda, cuda:<n>")
    return device


def load_for_inference(
    path: Path | str,
    device: str = "auto",
    dtype: str = "fp32",
    attention: str | None = None,
    quantize: str | None = None,
) -> Run:
    """load_run for sample/eval/chat/attention (and serve), with device `auto` allowed (RotaryEmbedding keeps
    its cos/sin tables in fp32 whatever dtype the model is cast to). quantize: None (the run's weights) or
    int8 | w8a8 | int4 | nf4 on the block projections (gptkit.quant; docs/qlora.md; w8a8: int8 activations
    too): a model, device or dtype that cannot run it is one line before the weights load."""
    return load_run(path, device, str(dtype), attention, quantize, policy=True)
