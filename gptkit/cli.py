"""`gptkit <verb> [hydra overrides...]`: pick the verb, compose its config, run it.

Each verb is a module in gptkit/commands/ that defines VERB, HELP (one line), CONFIG (the name
of its primary config in conf/), HYDRA_APP (True when the verb needs Hydra's run directory and
multirun, as `train` does) and run(cfg). Command modules keep heavy imports inside run(), so
`gptkit --help` stays fast.

The verb is also stored in the environment (GPTKIT_VERB): Lightning relaunches DDP children
with this process's sys.argv, from which the verb has been removed.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from types import ModuleType

VERB_ENV = "GPTKIT_VERB"


def _commands() -> dict[str, ModuleType]:
    import gptkit.commands as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"gptkit.commands.{info.name}")
        if hasattr(mod, "VERB"):
            found[mod.VERB] = mod
    return dict(sorted(found.items()))


def _usage(commands: dict[str, ModuleType]) -> str:
    width = max(len(v) for v in commands)
    lines = ["usage: gptkit <verb> [key=value ...] [--help]", "", "verbs:"]
    lines += [f"  {v:<{width}}  {m.HELP}" for v, m in commands.items()]
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


def _show_help(mod: ModuleType, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from gptkit.config import conf_dir, presets

    cfg = compose(mod.CONFIG, overrides)
    print(f"gptkit {mod.VERB}: {mod.HELP}\n")
    if mod.__doc__:
        print(mod.__doc__.strip() + "\n")
    groups = [g for g in cfg if (conf_dir() / str(g)).is_dir()]
    groups += [g for g in _optional_groups(mod.CONFIG) if g not in groups]  # e.g. experiment (default: none)
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


def _run_hydra_app(mod: ModuleType, args: list[str]) -> None:
    import hydra

    from gptkit.config import conf_dir

    sys.argv = [sys.argv[0]] + args

    @hydra.main(config_path=str(conf_dir()), config_name=mod.CONFIG, version_base=None)
    def app(cfg):
        rc = _guarded(mod.run, cfg)
        if rc:
            sys.exit(rc)

    app()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        commands = _commands()
        if not args or args[0] in ("-h", "--help", "help"):
            print(_usage(commands))
            return 0 if args else 2
        if args[0] in commands:
            verb = args.pop(0)
        elif os.environ.get(VERB_ENV) in commands:  # a Lightning/torchrun child relaunched without the verb
            verb = os.environ[VERB_ENV]
        else:
            print(f"error: unknown verb {args[0]!r}; verbs: {', '.join(commands)} (gptkit --help)", file=sys.stderr)
            return 2
        os.environ[VERB_ENV] = verb
        mod = commands[verb]
        positional = getattr(mod, "POSITIONAL", None)
        if positional and args and "=" not in args[0] and not args[0].startswith("-"):
            args[0] = f"{positional}={args[0]}"  # `gptkit bench data` -> bench=data
        args = ["format=json" if a == "--json" else a for a in args]  # --json: machine-readable output
        if hasattr(mod, "prepare_args"):
            args = _guarded(mod.prepare_args, args)
        if "--help" in args or "-h" in args:
            _show_help(mod, [a for a in args if a not in ("--help", "-h")])
            return 0
        if not mod.HYDRA_APP or _plain_overrides(args):
            cfg = compose(mod.CONFIG, args)  # composition errors surface here, as one line
        if mod.HYDRA_APP:
            _run_hydra_app(mod, args)
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
