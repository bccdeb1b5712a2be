"""`gptkit <verb> [hydra overrides...]`: pick the verb, compose its config, run it.

VERBS below is the whole wiring: each verb names its module in gptkit/commands/ (which defines
run(cfg), prepare_args(args) when it rewrites its arguments first, and check(cfg) when a Hydra app
validates its composed config before Hydra creates the run folder), its primary config in conf/,
and its one-line help. Command modules keep heavy imports inside run(), so `gptkit --help` stays fast.
tests/test_cli.py checks that VERBS and gptkit/commands/ agree.

The verb is also stored in the environment (GPTKIT_VERB): Lightning relaunches DDP children
with this process's sys.argv, from which the verb has been removed.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

VERB_ENV = "GPTKIT_VERB"


@dataclass(frozen=True)
class Verb:
    module: str  # gptkit.commands.<module>
    config: str  # conf/<config>.yaml
    help: str
    hydra_app: bool = False  # needs Hydra's run folder and multirun (-m), as `train` does
    positional: str | None = None  # a first bare argument is this option: `gptkit bench data` -> bench=data
    verbatim: tuple[str, ...] = ()  # options whose values are taken literally (prompt text)


VERBS: dict[str, Verb] = {
    "train": Verb("train", "train", "train a model with Lightning; one run folder per run under runs/ "
                  "(resume=, init_from=, -m multirun)", hydra_app=True),
    "sample": Verb("sample", "sample", "generate text from a trained run (KV cache; greedy/temperature/top-k/"
                   "top-p; --json)", verbatim=("prompt",)),
    "eval": Verb("eval", "eval", "loss, perplexity and bits per byte/char of a run on its val split or a "
                 "held-out corpus (--json)"),
    "attention": Verb("attention", "attention", "write a PNG grid of attention maps (layers x heads) for a text "
                      "into the run folder", verbatim=("text",)),
    "count-params": Verb("count_params", "count_params", "parameters by component, FLOPs per token, and "
                         "compute/memory estimates for a planned run"),
    "prepare": Verb("prepare", "prepare", "tokenize a corpus into cached token shards + manifest + tokenizer.json"),
    "export": Verb("export", "export", "write a run as a transformers folder (Llama or GPT-2) that "
                   "AutoModelForCausalLM loads"),
    "import": Verb("import_hf", "import", "read a local transformers Llama or GPT-2 folder into a gptkit run "
                   "folder"),
    "plot": Verb("plot", "plot", "draw <run>/loss.png (train and val loss) from the run's metrics.csv"),
    "preflight": Verb("preflight", "preflight", "check a distributed set-up before a long job: ranks, backend, "
                      "an all-reduce, memory vs estimate"),
    "consolidate": Verb("consolidate", "consolidate", "merge a sharded (FSDP) checkpoint folder into one "
                        "checkpoint file", positional="run"),
    "bench": Verb("bench", "bench", "speed and memory benchmarks: gptkit bench attention|data|train|sample "
                  "[key=value ...]", positional="bench"),
}

# Hydra's own flags, for the verb that runs as a Hydra app
HYDRA_FLAGS = ("-m", "--multirun", "--cfg", "-c", "--resolve", "--info", "-i", "--package", "-p")


def command(verb: str) -> ModuleType:
    return importlib.import_module(f"gptkit.commands.{VERBS[verb].module}")


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: gptkit <verb> [key=value ...] [--help]", "", "verbs:"]
    lines += [f"  {name:<{width}}  {v.help}" for name, v in VERBS.items()]
    lines += ["", "Overrides are Hydra's: model=llama-tiny model.n_layers=2 optim.lr=3e-4 ...",
              "`gptkit <verb> --help` shows the verb's config and the presets of each group.",
              "GPTKIT_DEBUG=1 shows tracebacks for errors."]
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
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from gptkit.config import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name=config_name):
        return hydra_compose(config_name=config_name, overrides=overrides)


def _show_help(verb: str, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from gptkit.config import conf_dir, presets

    v = VERBS[verb]
    cfg = compose(v.config, overrides)
    print(f"gptkit {verb}: {v.help}\n")
    doc = command(verb).__doc__
    if doc:
        print(doc.strip() + "\n")
    groups = [g for g in cfg if (conf_dir() / str(g)).is_dir()]
    groups += [g for g in _optional_groups(v.config) if g not in groups]  # e.g. experiment (default: none)
    if groups:
        print("config groups (choose with group=name):")
        for g in groups:
            print(f"  {g}: {', '.join(presets(str(g)))}")
        print()
    print("config (override any field with key=value):\n")
    print(OmegaConf.to_yaml(cfg))


def _optional_groups(config_name: str) -> list[str]:
    """Groups the verb's defaults list leaves unchosen (`optional <group>: null` or `<group>: null`):
    absent from the composed config until chosen, but worth listing in --help."""
    import yaml

    from gptkit.config import conf_dir

    defaults = yaml.safe_load((conf_dir() / f"{config_name}.yaml").read_text()).get("defaults") or []
    found = []
    for entry in defaults:
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
    if isinstance(exc, BrokenPipeError):  # `gptkit ... | head`: the reader left; nothing to report
        return 0
    from gptkit.fsio import disk_full_error, is_disk_full

    if is_disk_full(exc) and not isinstance(exc, GptkitError):  # a write no one anticipated: still one line
        exc = disk_full_error(getattr(exc, "filename", None) or Path.cwd(), None, exc)
    if isinstance(exc, GptkitError) or _is_config_error(exc):
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(f"error: {type(exc).__name__}: {_one_line(exc)} (GPTKIT_DEBUG=1 shows the traceback)", file=sys.stderr)
    return 1


def _guarded(fn, *args):
    """Run fn; an error becomes one line on stderr and the exit status of _report."""
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        sys.exit(_report(exc))


def _plain_overrides(args: list[str]) -> bool:
    """True when args are only key=value overrides that the compose API accepts."""
    for a in args:
        if a.startswith("-") or a.startswith("hydra.") or a.startswith("hydra/") or a.startswith("+hydra"):
            return False
        if "=" in a and ("," in a.split("=", 1)[1] and not a.split("=", 1)[1].startswith(("[", "'", '"'))):
            return False  # a sweep: only valid with -m
    return True


def _run_hydra_app(verb: str, args: list[str]) -> None:
    import hydra

    from gptkit.config import conf_dir

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
    for i, a in enumerate(args):
        if not a.startswith("-") or a.split("=", 1)[0] in allowed:
            continue
        name, eq, value = a.lstrip("-").partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        raise ConfigError(f"options are key=value, not {a}: did you mean {_spelling(verb, name)}={value or '...'}?")


def _spelling(verb: str, name: str) -> str:
    """The config key a flag name most likely means: the key itself, or the one key ending in .name."""
    from omegaconf import OmegaConf

    name = name.replace("-", "_")
    try:
        keys = _flat_keys(OmegaConf.to_container(compose(VERBS[verb].config, []), resolve=False))
    except Exception:  # noqa: BLE001 - a suggestion is best effort
        return name
    if name in keys:
        return name
    ends = [k for k in keys if k.endswith("." + name)]
    return ends[0] if len(ends) == 1 else name


def _flat_keys(d, prefix: str = "") -> list[str]:
    out = []
    for k, v in (d.items() if isinstance(d, dict) else ()):
        out.append(prefix + str(k))
        out += _flat_keys(v, f"{prefix}{k}.")
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help", "help"):
            print(_usage())
            return 0 if args else 2
        if args[0] in VERBS:
            verb = args.pop(0)
        elif os.environ.get(VERB_ENV) in VERBS:  # a Lightning/torchrun child relaunched without the verb
            verb = os.environ[VERB_ENV]
        else:
            print(f"error: unknown verb {args[0]!r}; verbs: {', '.join(VERBS)} (gptkit --help)", file=sys.stderr)
            return 2
        os.environ[VERB_ENV] = verb
        v = VERBS[verb]
        if v.positional and args and "=" not in args[0] and not args[0].startswith("-"):
            args[0] = f"{v.positional}={args[0]}"  # `gptkit bench data` -> bench=data
        args = ["format=json" if a == "--json" else a for a in args]  # --json: machine-readable output
        if "--help" in args or "-h" in args:
            _show_help(verb, [a for a in args if a not in ("--help", "-h")])
            return 0
        _guarded(_check_flags, verb, args)
        if v.verbatim:
            from gptkit.config import verbatim

            args = verbatim(args, v.verbatim)
        mod = command(verb)
        if hasattr(mod, "prepare_args"):
            args = _guarded(mod.prepare_args, args)
        if not v.hydra_app or _plain_overrides(args):
            cfg = compose(v.config, args)  # composition errors surface here, as one line
            if v.hydra_app and hasattr(mod, "check"):
                _guarded(mod.check, cfg)  # before Hydra makes the run folder
        if v.hydra_app:
            _run_hydra_app(verb, args)
        else:
            rc = _guarded(mod.run, cfg)
            return int(rc or 0)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
        return _report(exc)


def _is_config_error(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(exc, (HydraException, OmegaConfBaseException))


if __name__ == "__main__":
    sys.exit(main())
