"""Trains with Lightning; every run writes one folder, runs/<name>/ (config.yaml, tokenizer.json,
manifest.json, checkpoints/, metrics.csv, loss.png).

Examples:
  gptkit train                                        (gpt2-tiny on the built-in corpus, CPU-sized)
  gptkit train model=llama-tiny trainer.max_steps=500 name=my-run
  gptkit train experiment=shakespeare-char            (the reference recipe)
  gptkit train resume=runs/my-run trainer.max_steps=1000
  gptkit train init_from=runs/imported-gpt2 data=files data.paths=[my.txt]   (fine-tune: a new run)
  gptkit train init_from=runs/imported-llama finetune=lora lora.targets=[q,k,v,o] ...   (LoRA: docs/lora.md)
  gptkit train objective=distill teacher=runs/big model.n_layers=2   (distillation: docs/distillation.md)
  gptkit train -m optim.lr=1e-3,3e-3                  (one folder per job)
  gptkit train logger=[csv,tensorboard,wandb] trainer.precision=bf16-mixed
Ctrl-C or SIGTERM saves checkpoints/last.ckpt and stops; `resume=` continues exactly.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
# what check() derived from this process's config before Hydra (gptkit.training.plan.Checked) and the
# command line the CLI parsed (gptkit.options.Option): train() reads them instead of deriving them again.
# None for a multirun, whose jobs each have their own values.
_checked = None
_options = None


def prepare_args(args: list[str]) -> list[str]:
    """s3:// locations (gptkit/remote.py), before anything reads the command line: runs_dir= becomes its
    local staging folder (whose checkpoints are uploaded as they are published), resume= the run downloaded
    there (its newest complete checkpoint), data.dir= (data=prepared) the prepared folder downloaded and
    checked. Credentials and the bucket are checked here: one line, before any training."""
    from gptkit.remote import localize_args

    return localize_args(args, {"runs_dir": "runs_dir", "resume": "run", "data.dir": "folder"})


def prepare_options(args: list[str], options: list) -> list[str]:
    """Before Hydra creates the run folder: refuse a run folder outside runs_dir, resume into the run's own
    folder, and check that the runs folder is writable (one-line errors instead of Hydra's tracebacks).
    options: `args` as the CLI parsed them (gptkit.options); the few keys read here come from them."""
    from gptkit.checkpoints import run_dir_of
    from gptkit.errors import GptkitError
    from gptkit.runs import LATEST, check_run_location, check_saved_run, find_run_checkpoint
    from gptkit.training.elastic import elastic_resume
    from gptkit.training.start import check_resume_or_init

    kv = {
        o.key: None if o.value is None else str(o.value)
        for o in options
        if o.kind == "key" and not o.sweep and o.key in ("resume", "init_from", "name", "runs_dir")
    }
    check_resume_or_init(kv.get("resume"), kv.get("init_from"))
    args = _name_after_init_source(args, options, kv)
    # torchrun --max-restarts runs the same command again: it continues the run its first attempt started,
    # whose saved config is this command's; only what a resume may change (trainer., logger) is kept
    restart = elastic_resume(kv)
    if restart is not None:
        kept = [a for a in args if a.lstrip("+~").startswith(("trainer", "logger", "-"))]
        args, kv["resume"] = [f"resume={restart}", *kept], str(restart)
    # teacher=<source>: the short spelling of frozen.teacher=<source> (objective=distill, gkd), the key the
    # run records
    args = [f"frozen.{a}" if a.startswith("teacher=") else a for a in args]
    name = kv.get("name")
    check_run_location(kv.get("runs_dir", "runs"), None if name and "${" in name else name)
    if kv.get("resume") not in (None, "", "null"):
        ckpt = find_run_checkpoint(kv["resume"], kv.get("runs_dir", "runs"), need="training")
        run_dir = (run_dir_of(ckpt) if ckpt.suffix == ".ckpt" else ckpt.parent).resolve()
        # its config.yaml is checked as a command line is
        check_saved_run(ckpt, f"resume={kv['resume']}")
        # resolved once, here: train continues that very folder
        if kv["resume"] == LATEST:
            args = [f"resume={run_dir}" if a.startswith("resume=") else a for a in args]
        asked = Path(kv.get("runs_dir", run_dir.parent)).resolve() / kv.get("name", run_dir.name)
        if asked != run_dir and ("name" in kv or "runs_dir" in kv):
            print(
                f"note: resume= continues {run_dir} in its own folder, not in {asked} (to start a new run "
                f"from its weights elsewhere: init_from={kv['resume']})",
                file=sys.stderr,
            )
        args = [a for a in args if not a.startswith(("name=", "runs_dir=", "hydra.output_subdir="))]
        args += [
            f"name={run_dir.name}",
            f"runs_dir={run_dir.parent}",
            "hydra.output_subdir=null",
            # keep the original run's .hydra/ untouched
        ]
        kv["name"], kv["runs_dir"] = run_dir.name, str(run_dir.parent)
    runs_dir = Path(kv.get("runs_dir", "runs")).expanduser()
    probe = runs_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not _can_create_in(probe):
        raise GptkitError(
            f"cannot write the runs folder {runs_dir} ({probe} is not a writable folder); "
            f"pass runs_dir=<a writable folder>"
        )
    return args


def _name_after_init_source(args: list[str], options, kv: dict) -> list[str]:
    """init_from= trains the source's model: unless the command line names the run or the model, the model's
    name (which the default run folder name, ${model.name}-<time>, is built from) is the source's, so that the
    folder is not named after the default preset."""
    from gptkit.training.start import init_source_name

    if kv.get("init_from") in (None, "", "null") or "name" in kv:
        return args
    if any(o.key in ("model", "model.name") for o in options):
        # theirs (model= with init_from= is refused later, in one line)
        return args
    source = init_source_name(kv["init_from"], kv.get("runs_dir", "runs"))
    if source is None or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", source):
        return args
    return [*args, f"model.name={source}"]


def _can_create_in(folder) -> bool:
    """Whether a folder can be made in `folder`: tried (and removed), since permission bits do not tell
    for root or for filesystems such as /proc."""
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gptkit-probe-", dir=folder))
    except OSError:
        return False
    return True


def check(cfg, multirun: bool = False, options: list | None = None) -> None:
    """The composed config, before Hydra creates the run folder: trainer, optimizer, schedule, model and
    init_from settings fail here in one line, before any data is prepared or any file is written. Then, for
    a single run with an explicit name=, this process takes the run folder's lock, so that a second writer
    is refused before it writes anything (Hydra's .hydra/ included). (A multirun's name= is the sweep folder,
    which holds no run: each job locks its own folder, as resumes do, in `train`.)"""
    from omegaconf import OmegaConf

    from gptkit.runs import check_run_location, claim_run_dir, is_rank_zero, unused
    from gptkit.training.fit import check_config
    from gptkit.training.start import resumed_config

    global _checked, _options
    # a resume runs with its saved config (trainer=fsdp...), the command line merged in: that is checked
    resumed = not multirun and options is not None and cfg.get("resume") not in (None, "", "null")
    checked = check_config(resumed_config(cfg, options) if resumed else cfg, resumed=resumed)
    # a multirun's jobs each have their own values: train() checks each
    if not multirun:
        _checked, _options = checked, options
    # the default name holds the time
    if not multirun and not OmegaConf.is_interpolation(cfg, "name") and is_rank_zero():
        check_run_location(cfg.runs_dir, cfg.name)
        run_dir = Path(cfg.runs_dir) / str(cfg.name)
        claim_run_dir(run_dir, remove_if_unused=unused(run_dir))


def run(cfg) -> int:
    """Train (Hydra runs this with its composed config); the exit status says how the run ended."""
    from gptkit.training.launch import train

    result = train(cfg, checked=_checked, options=_options)
    if result.stopped_by:
        if result.is_global_zero:
            print(
                f"{result.stopped_by}: saved {result.last_checkpoint} at step {result.step}; "
                f"continue with: gptkit train resume={result.run_dir}",
                file=sys.stderr,
            )
        return EXIT_CODES.get(result.stopped_by, 1)
    return 0
