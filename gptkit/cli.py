"""`gptkit <verb> [hydra overrides...]`: pick the verb, compose its config, run it.

VERBS below is the whole wiring: each verb names its module in gptkit/commands/ (which defines
run(cfg), prepare_args(args) when it rewrites its arguments before they are parsed, prepare_options(args,
options) when it rewrites them from their parsed values, and check(cfg, multirun, options) when a Hydra app
validates its composed config before Hydra creates the run folder), its primary config in conf/,
and its one-line help. Command modules keep heavy imports inside run(), so `gptkit --help` stays fast.
tests/front/test_cli.py checks that VERBS and gptkit/commands/ agree.

Before a verb runs (and before Hydra makes `train`'s run folder) every key=value is checked against the
verb's config by gptkit.options: an unknown key, a value of the wrong type, a sweep without -m or a
required value left unset is one line and exit status 2.

The verb is also stored in the environment (GPTKIT_VERB): Lightning relaunches DDP children
with this process's sys.argv, from which the verb has been removed.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from gptkit.extras import pip
from gptkit.hf.families import imported

VERB_ENV = "GPTKIT_VERB"


@dataclass(frozen=True)
class Verb:
    # gptkit.commands.<module>
    module: str
    # conf/<config>.yaml
    config: str
    help: str
    # needs Hydra's run folder and multirun (-m), as `train` does
    hydra_app: bool = False
    # a first bare argument is this option: `gptkit bench data` -> bench=data
    positional: str | None = None
    # options whose values are taken literally (prompt text)
    verbatim: tuple[str, ...] = ()


# the transformers families export and import map, as the helps name them: one per row of the family table
# (gptkit/hf/families.py imports no torch)
HF_FAMILIES = imported("or")

VERBS: dict[str, Verb] = {
    "train": Verb(
        "train",
        "train",
        "train a model with Lightning; one run folder per run under runs/ (resume=, init_from=, -m multirun)",
        hydra_app=True,
    ),
    "sample": Verb(
        "sample",
        "sample",
        "generate text from a trained run (KV cache; greedy/temperature/top-k/top-p; --json)",
        verbatim=("prompt",),
    ),
    "chat": Verb(
        "chat",
        "chat",
        "talk with a run turn by turn in its chat template (streaming; KV cache "
        "kept across turns; /reset, /exit; stdin lines without a terminal)",
        verbatim=("system",),
    ),
    "serve": Verb(
        "serve",
        "serve",
        "an OpenAI-compatible HTTP server for a run: chat and text completions, streaming, continuous "
        f"batching, a chat page (needs the serve extra: {pip('serve')})",
    ),
    "eval": Verb(
        "eval",
        "eval",
        "loss, perplexity and bits per byte/char of a run on its val split or a "
        "held-out corpus; lm-eval task accuracy with tasks=...; pass@k and maj@k with samples=n (--json)",
    ),
    "attention": Verb(
        "attention",
        "attention",
        "write a PNG grid of attention maps (layers x heads) for a text into the run folder",
        verbatim=("text",),
    ),
    "count-params": Verb(
        "count_params",
        "count_params",
        "parameters by component, FLOPs per token, and compute/memory estimates for a planned run",
    ),
    "prepare": Verb(
        "prepare", "prepare", "tokenize a corpus into cached token shards + manifest + tokenizer.json"
    ),
    "export": Verb(
        "export",
        "export",
        f"write a run as a transformers folder ({HF_FAMILIES}) that AutoModelForCausalLM loads",
    ),
    "import": Verb(
        "import_hf",
        "import",
        f"read a transformers model ({HF_FAMILIES}; a local folder or a Hub id) into a gptkit run folder",
    ),
    "plot": Verb("plot", "plot", "draw <run>/loss.png (train and val loss) from the run's metrics.csv"),
    "runs": Verb(
        "runs",
        "runs",
        "the runs under a folder: a table (model, parameters, tokens, steps, best val loss, evals, status, "
        "size); `gptkit runs serve`: a local page of them, curves overlaid, configs side by side, live",
        positional="action",
    ),
    "compare": Verb(
        "compare",
        "compare",
        "the curves of several runs overlaid in one PNG: gptkit compare runs=[a,b] out=compare.png",
    ),
    "preflight": Verb(
        "preflight",
        "preflight",
        "check a distributed set-up before a long job: ranks, backend, an all-reduce, memory vs estimate",
    ),
    "consolidate": Verb(
        "consolidate",
        "consolidate",
        "merge a sharded (FSDP) checkpoint folder into one checkpoint file",
        positional="run",
    ),
    "merge": Verb(
        "merge",
        "merge",
        "average step checkpoints of a run (steps=[...] or last=k, weights=) into a new run folder",
        positional="run",
    ),
    "verify": Verb(
        "verify",
        "verify",
        "rehearse a training config at tiny width on the CPU and check its invariants: 2 ranks = 1, "
        "accumulation, resume after a kill, packed = unpacked, export -> import",
    ),
    "trace": Verb(
        "trace",
        "trace",
        "which documents trained step N of a run: source, document, file and offset, text of every row, "
        "read from its prepared data (rank=, micro_batch=, --json)",
    ),
    "contamination": Verb(
        "contamination",
        "contamination",
        "which test items of lm-eval tasks occur in a run's training data (13-gram overlap): the share per "
        "task, the documents (file, offset) of each; `eval decontaminate=` scores without them",
    ),
    "example-data": Verb(
        "example_data",
        "example_data",
        "write the example data the docs use (train.jsonl, prompts.jsonl, pairs.jsonl) into a folder (out=.)",
    ),
    "bench": Verb(
        "bench",
        "bench",
        "speed and memory benchmarks: gptkit bench <name> [key=value ...] (gptkit bench --help names them)",
        positional="bench",
    ),
}

# Hydra's own flags, for the verb that runs as a Hydra app
HYDRA_FLAGS = ("-m", "--multirun", "--cfg", "-c", "--resolve", "--info", "-i", "--package", "-p")
# followed by a value: --cfg job
HYDRA_VALUE_FLAGS = ("--cfg", "-c", "--info", "-i", "--package", "-p")


def command(verb: str) -> ModuleType:
    return importlib.import_module(f"gptkit.commands.{VERBS[verb].module}")


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: gptkit <verb> [key=value ...] [--help]", "", "verbs:"]
    # wrapped at 100 columns, continued under the text
    for name, v in VERBS.items():
        wrapped = textwrap.wrap(v.help, 100 - width - 4)
        lines.append(f"  {name:<{width}}  {wrapped[0]}")
        lines += [" " * (width + 4) + more for more in wrapped[1:]]
    lines += [
        "",
        "Overrides are Hydra's: model=llama-tiny model.n_layers=2 optim.lr=3e-4 ...",
        "`gptkit <verb> --help` shows the verb's config and the presets of each group.",
        "GPTKIT_DEBUG=1 shows tracebacks for errors.",
    ]
    return "\n".join(lines)


def _one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines; keep their substance on one."""
    text = str(exc).split("Config search path")[0]
    lines = [p.strip() for p in text.replace("\t", " ").splitlines() if p.strip()]
    lines = [p for p in lines if not p.startswith(("full_key:", "object_type=", "reference_type="))]
    out: list[str] = []
    options: list[str] = []
    for line in lines:
        if line.lower().startswith("available options"):
            options = []
            out.append(line.rstrip(":").replace("Available options", "available") + ":")
        elif out and out[-1].endswith(":") and " " not in line:
            options.append(line)
        else:
            if options:
                out[-1] += " " + ", ".join(options)
                options = []
            out.append(line.rstrip("."))
    if options:
        out[-1] += " " + ", ".join(options)
    return "; ".join(out) if out else type(exc).__name__


def compose(config_name: str, overrides: list[str]):
    """gptkit.conf_tree.compose, imported on use so that `gptkit --help` imports no OmegaConf."""
    from gptkit.conf_tree import compose as compose_config

    return compose_config(config_name, overrides)


def _show_help(verb: str, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from gptkit.conf_tree import conf_dir, presets
    from gptkit.options import annotate_yaml, key_comments

    v = VERBS[verb]
    cfg = compose(v.config, overrides)
    print(f"gptkit {verb}: {v.help}\n")
    doc = command(verb).__doc__
    if doc:
        print(doc.strip() + "\n")
    groups = [g for g in cfg if (conf_dir() / str(g)).is_dir()]
    # e.g. experiment (default: none)
    groups += [g for g in _optional_groups(v.config) if g not in groups]
    if groups:
        print("config groups (choose with group=name):")
        for g in groups:
            print(f"  {g}: {', '.join(presets(str(g)))}")
        print()
    print("config (override any field with key=value; # what conf/ says of it):\n")
    print(annotate_yaml(OmegaConf.to_yaml(cfg), key_comments(v.config, overrides)))


def _optional_groups(config_name: str) -> list[str]:
    """Groups the verb's defaults list leaves unchosen (`optional <group>: null` or `<group>: null`):
    absent from the composed config until chosen, but worth listing in --help."""
    import yaml

    from gptkit.conf_tree import conf_dir

    defaults = yaml.safe_load((conf_dir() / f"{config_name}.yaml").read_text()).get("defaults") or []
    found = []
    for entry in defaults:
        # a config the verb's is built on (verify's `- train`): its groups too
        if isinstance(entry, str) and entry != "_self_" and (conf_dir() / f"{entry}.yaml").is_file():
            found += [g for g in _optional_groups(entry) if g not in found]
        if isinstance(entry, dict):
            for key, value in entry.items():
                name = str(key).removeprefix("optional ").strip()
                if value is None and (conf_dir() / name).is_dir():
                    found.append(name)
    return found


def _report(exc: Exception) -> int:
    """Print an error as one line; 2 for what the user can fix, 1 for anything else."""
    from gptkit.errors import GptkitError

    if os.environ.get("GPTKIT_DEBUG") == "1":
        raise exc
    # `gptkit ... | head`: the reader left; nothing to report
    if isinstance(exc, BrokenPipeError):
        return 0
    from gptkit.extras import missing_extra
    from gptkit.fsio import disk_full_error, human_bytes, is_disk_full

    # an optional package imported at the top of a module: the line that names its pip install
    exc = missing_extra(exc, f"gptkit {os.environ.get(VERB_ENV) or 'this command'} needs") or exc
    # a write no one anticipated: still one line
    if is_disk_full(exc) and not isinstance(exc, GptkitError):
        exc = disk_full_error(getattr(exc, "filename", None), None, exc)
    # outside training (sample, eval, export of a model too large for the host). Only torch's allocator
    # fails this way, so with torch not loaded there is nothing to look for: gptkit.training.memory imports
    # the fine-tunes, and with them torch (2.6 s of CPU measured on a refused config, issue 47 item 12)
    if "torch" in sys.modules:
        from gptkit.training.memory import available_memory, is_cpu_out_of_memory

        if is_cpu_out_of_memory(exc):
            asked = re.search(r"allocate (\d+) bytes", str(exc))
            exc = GptkitError(
                "out of memory on the "
                f"CPU{f' allocating {human_bytes(int(asked.group(1)))}' if asked else ''}"
                f" ({human_bytes(available_memory() or 0)} is available); use a smaller model or "
                f"batch, or a machine with more memory (count-params shows a model's memory)"
            )
    if isinstance(exc, GptkitError) or _is_config_error(exc):
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(
        f"error: {type(exc).__name__}: {_one_line(exc)} (GPTKIT_DEBUG=1 shows the traceback)", file=sys.stderr
    )
    return 1


def _guarded(fn, *args):
    """Run fn; an error becomes one line on stderr and the exit status of _report."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        sys.exit(_report(exc))


def _run_hydra_app(verb: str, args: list[str]) -> None:
    import hydra

    from gptkit.conf_tree import conf_dir

    sys.argv = [sys.argv[0]] + args
    run = command(verb).run

    @hydra.main(config_path=str(conf_dir()), config_name=VERBS[verb].config, version_base=None)
    def app(cfg):
        rc = _guarded(run, cfg)
        if rc:
            sys.exit(rc)

    app()


def _check_flags(verb: str, args: list[str]) -> None:
    """Options are key=value; a `--name value` flag (other than --help, --json and Hydra's own flags for
    `train`) is one line naming the key=value spelling."""
    from gptkit.errors import ConfigError

    allowed = ("--help", "-h") + (HYDRA_FLAGS if VERBS[verb].hydra_app else ())
    # `gptkit sample runs/x`: a bare path where the verb reads run=
    for i, a in enumerate(args):
        # --run runs/x: below
        flag_value = i and args[i - 1].startswith("-") and "=" not in args[i - 1]
        bare = "=" not in a and not a.startswith("-") and not flag_value
        if bare and ("/" in a or Path(a).exists()) and _has_run_option(verb):
            raise ConfigError(f"{a}: options are key=value: did you mean run={a}?")
    for i, a in enumerate(args):
        if not a.startswith("-") or a.split("=", 1)[0] in allowed:
            continue
        name, eq, value = a.lstrip("-").partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        raise ConfigError(
            f"options are key=value, not {a}: did you mean {_spelling(verb, name)}={value or '...'}?"
        )


def _has_run_option(verb: str) -> bool:
    import yaml

    from gptkit.conf_tree import conf_dir

    return "run" in (yaml.safe_load((conf_dir() / f"{VERBS[verb].config}.yaml").read_text()) or {})


def _spelling(verb: str, name: str) -> str:
    """The config key a flag name most likely means (gptkit.options.suggest over the verb's keys)."""
    from omegaconf import OmegaConf

    from gptkit.options import flat_keys, suggest

    name = name.replace("-", "_")
    try:
        keys = flat_keys(OmegaConf.to_container(compose(VERBS[verb].config, []), resolve=False))
    except Exception:  # noqa: BLE001 - a suggestion is best effort
        return name
    return suggest(name, keys) or name


def _skip_transformers_in_torchmetrics() -> None:
    """Lightning imports torchmetrics, whose BERTScore module imports `transformers` at import time when it is
    installed: about 1 s of start-up for a metric gptkit never uses. torchmetrics has no switch for it, so
    its own availability flag is set to false as its flags module loads (this process only; transformers
    itself stays importable). A no-op when torchmetrics or transformers is already imported."""
    import importlib.abc
    import importlib.machinery

    flags = "torchmetrics.utilities.imports"
    if (
        "torchmetrics" in sys.modules
        or "transformers" in sys.modules
        or any(getattr(f, "unflags", None) == flags for f in sys.meta_path)
    ):
        return

    class Finder(importlib.abc.MetaPathFinder):
        unflags = flags

        def find_spec(self, name, path, target=None):
            if name != flags:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_unflag(module):
                exec_module(module)
                flag = getattr(module, "_TRANSFORMERS_GREATER_EQUAL_4_4", None)
                # a lightning_utilities RequirementCache
                if flag is not None and hasattr(flag, "requirement"):
                    flag.available = False
                    flag.message = "transformers is not imported for torchmetrics by the gptkit CLI"

            spec.loader.exec_module = exec_and_unflag
            return spec

    sys.meta_path.insert(0, Finder())


def main(argv: list[str] | None = None) -> int:
    """The CLI. As the process's entry point (argv None: the `gptkit` script, python -m gptkit), a failure
    that printed its one line ends the process at once: the atexit handlers run (a run folder's lock and an
    unused folder are removed), then os._exit skips the interpreter's teardown of torch and Lightning,
    1.2 s of CPU after the line was printed (measured on a refused `train trainer.precision=`, issue 47)."""
    if argv is not None:
        return _main(list(argv))
    try:
        rc = _main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
    if rc in (1, 2):
        _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def _main(args: list[str]) -> int:
    try:
        if not args or args[0] in ("-h", "--help", "help"):
            print(_usage())
            return 0 if args else 2
        if args[0] in ("--version", "-V", "version"):
            from gptkit import __version__

            print(f"gptkit {__version__}")
            return 0
        if args[0] in VERBS:
            verb = args.pop(0)
        # a Lightning/torchrun child relaunched without the verb
        elif os.environ.get(VERB_ENV) in VERBS:
            verb = os.environ[VERB_ENV]
        else:
            import difflib

            near = difflib.get_close_matches(args[0], list(VERBS), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}? " if near else ""
            print(
                f"error: unknown verb {args[0]!r}; {hint}verbs: {', '.join(VERBS)} (gptkit --help)",
                file=sys.stderr,
            )
            return 2
        os.environ[VERB_ENV] = verb
        v = VERBS[verb]
        if v.positional and args and "=" not in args[0] and not args[0].startswith("-"):
            # `gptkit bench data` -> bench=data
            args[0] = f"{v.positional}={args[0]}"
        elif v.positional == v.config and not any(a.startswith(f"{v.positional}=") for a in args):
            # `gptkit bench` alone: the positional is a group to choose
            from gptkit.conf_tree import presets

            names = "|".join(presets(v.positional))
            if "--help" in args or "-h" in args:
                print(f"gptkit {verb}: {v.help}\n\n`gptkit {verb} <{names}> --help` shows that one's config")
                return 0
            print(
                f"error: name the {v.positional}: gptkit {verb} {names} [key=value ...] [--help]",
                file=sys.stderr,
            )
            return 2
        # --json: machine-readable output
        args = ["format=json" if a == "--json" else a for a in args]
        if "--help" in args or "-h" in args:
            _show_help(verb, [a for a in args if a not in ("--help", "-h")])
            return 0
        _guarded(_check_flags, verb, args)
        if v.verbatim:
            from gptkit.conf_tree import verbatim

            args = verbatim(args, v.verbatim)
        mod = command(verb)
        # rewrites of the text before it is parsed (bench, eval tasks=)
        if hasattr(mod, "prepare_args"):
            args = _guarded(mod.prepare_args, args)
        # every key=value parsed once, here
        options = _guarded(_parse_args, verb, args)
        # rewrites that read the parsed options (train: resume=)
        if hasattr(mod, "prepare_options"):
            rewritten = _guarded(mod.prepare_options, args, options)
            if rewritten != args:
                args, options = rewritten, _guarded(_parse_args, verb, rewritten)
        cfg = _guarded(_check_options, v.config, options)
        _skip_transformers_in_torchmetrics()
        # before Hydra makes the run folder
        if v.hydra_app and cfg is not None and hasattr(mod, "check"):
            _guarded(mod.check, cfg, _is_multirun(verb, args), options)
        if v.hydra_app:
            _run_hydra_app(verb, args)
            return 0
        return int(_guarded(mod.run, cfg) or 0)
    except KeyboardInterrupt as exc:
        from gptkit.errors import Interrupted

        # one line: the one that says what was kept (errors.Interrupted), else this one
        print(str(exc) if isinstance(exc, Interrupted) else "interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        return _report(exc)


def _is_multirun(verb: str, args: list[str]) -> bool:
    return VERBS[verb].hydra_app and any(a in ("-m", "--multirun") for a in args)


def _parse_args(verb: str, args: list[str]):
    """The key=value arguments as gptkit.options.Option (a value Hydra cannot read, or a sweep without -m,
    is one line). _check_options then composes the verb's config and checks each against it: unknown keys,
    wrong types and unset required values are one line each, before the verb or Hydra's run folder exist
    (for `train -m` over several presets the config is None: Hydra checks each job)."""
    from gptkit.options import parse_options

    options = [
        a
        # the value of a Hydra flag (--cfg job) is not an option
        for i, a in enumerate(args)
        if not (i and args[i - 1] in HYDRA_VALUE_FLAGS and "=" not in a and not a.startswith("-"))
    ]
    return parse_options(options, sweeps=_is_multirun(verb, args))


def _check_options(config_name: str, options):
    """gptkit.options.check_options, imported on use (`gptkit --help` imports no OmegaConf)."""
    from gptkit.options import check_options as check

    return check(config_name, options)


def _is_config_error(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(exc, (HydraException, OmegaConfBaseException))


if __name__ == "__main__":
    sys.exit(main())
