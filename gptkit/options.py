"""Checking the command line against the verb's config, before anything runs.

Hydra accepts `+key=value` for any key, so a typo (`+trainer.max_step=3`) or a key of a preset that is not
chosen (`+data.paths=x` without data=files) is added to the config and silently ignored; its own messages
for a missing key or a sweep without -m span several lines. Here every key=value is read with Hydra's
grammar and checked against the verb's config as the YAML defines it (conf/<verb>.yaml and the presets of
its groups): the key must exist (free-form maps excepted), a value must have the key's type (true/false
or a number), a required value (???) must be given. Each problem is one ConfigError line that names the
fix: the close key, or the preset that has the key.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gptkit.conf_tree import compose, conf_dir, presets
from gptkit.errors import ConfigError
from gptkit.fsio import check_local_path

# hydra's parser is imported on use: `gptkit --help` imports this module and needs no Hydra.

# Maps whose keys the user names (+bench.models.<name>.preset=...): the only places a new key may be added.
FREE_FORM = ("bench.models", "bench.model_overrides", "data.sources")
# data=tokens, data=preference, data=unpaired and data=prompts share data.paths with files and chat; a path
# is far more often text
NAMED_LAST = ("tokens", "preference", "unpaired", "prompts")
_PREFIX = {"CHANGE": "", "ADD": "+", "FORCE_ADD": "++", "DEL": "~"}
# The keys (by their last part) whose values are paths on this machine, in every verb and preset: a URL there
# is refused (fsio.check_local_path), never made a folder named `s3:`
PATH_KEYS = (
    "run",
    "out",
    "runs_dir",
    "init_from",
    "resume",
    "dir",
    "cache_dir",
    "paths",
    "val_paths",
    "path",
    "prompt_file",
    "hf",
    "data_path",
    "file",
    "tasks",
    "eval_tasks",
    "template",
)


def is_path_key(key: str) -> bool:
    # frozen.<name>: an objective's frozen model's source (training/start.py)
    return key.rsplit(".", 1)[-1] in PATH_KEYS or key.startswith("frozen.")


def check_paths(d: Any, prefix: str = "") -> None:
    """Every path key of a config (plain data: a composed config, a preset) holds local paths."""
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if is_path_key(key) and not isinstance(v, dict):
                check_local_path(key, v)
            else:
                check_paths(v, key + ".")


@dataclass
class Option:
    """One key=value of the command line, as Hydra's override grammar reads it."""

    # as given
    arg: str
    # a dotted key, or a group name for a preset choice (model=llama-tiny)
    key: str
    # "key" | "group" | "hydra"
    kind: str
    # CHANGE (key=v), ADD (+key=v), FORCE_ADD (++key=v), DEL (~key)
    op: str
    # the parsed value; a sweep's choices as a list (None for a range sweep)
    value: Any
    sweep: bool
    # the arg with a sweep replaced by its first choice
    first: str

    @property
    def raw(self) -> str:
        return self.arg.split("=", 1)[1] if "=" in self.arg else "..."

    @property
    def free_form(self) -> bool:
        return any(self.key == f or self.key.startswith(f + ".") for f in FREE_FORM)


def parse_options(args: list[str], sweeps: bool = False) -> list[Option]:
    """The key=value args (flags such as -m are skipped) as Options. A value Hydra cannot read, or a sweep
    (a,b) where `sweeps` is False, is a one-line ConfigError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for a in args:
        if a.startswith("-"):
            continue
        try:
            o = parser.parse_override(a)
        except HydraException:
            raise ConfigError(_unreadable(a)) from None
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            kind = "hydra"
        elif o.package is not None or "/" in key or ("." not in key and (conf_dir() / key).is_dir()):
            kind = "group"
        else:
            kind = "key"
        value, first, sweep = o.value(), a, o.is_sweep_override()
        if sweep:
            if not sweeps:
                raise ConfigError(_no_sweep(a, key))
            # a range or glob: unchecked
            value = list(value.list) if isinstance(value, ChoiceSweep) else None
            if value:
                first = f"{_PREFIX[o.type.name]}{o.get_key_element()}={next(o.sweep_string_iterator())}"
        if kind == "key" and is_path_key(key):
            check_local_path(key, value)
        out.append(Option(a, key, kind, o.type.name, value, sweep, first))
    return out


def _unreadable(arg: str) -> str:
    key, eq, value = arg.partition("=")
    if not eq:
        return f"{arg} has no value: write {arg}=<value> (options are key=value)"
    if not arg.isascii():
        return f"{arg}: Hydra reads only ASCII characters in an unquoted value; quote it: \"{key}='{value}'\""
    if value.startswith("[") and value.endswith("]"):
        # a list of items such as overrides (trainer.max_steps=100): quoting the whole value would make it one
        # string, so each item is quoted
        items = ",".join('"' + i.strip().strip("'\"") + '"' for i in value[1:-1].split(",") if i.strip())
        return (
            f"cannot read {arg} as key=value; quote each item of a list that holds = or other special "
            f"characters: '{key}=[{items}]'"
        )
    return (
        f"cannot read {arg} as key=value; quote a value that has spaces or special characters: "
        f"\"{key}='{value}'\""
    )


def _no_sweep(arg: str, key: str) -> str:
    value = arg.split("=", 1)[1]
    return (
        f"{arg}: a comma separates the values of a sweep, which only `gptkit train -m` runs; "
        f"write a list as {key}=[{value}] or quote text: \"{key}='{value}'\""
    )


def check_options(config_name: str, options: list[Option]) -> DictConfig | None:
    """Compose the verb's config with the options (a sweep at its first value) and check, in one-line
    ConfigErrors, what Hydra would accept silently or report in several lines: a key no code reads (with
    `+` or without; the suggestion names the close key, or the preset of a group that has it), a value
    of the wrong type (not a number, not true/false), a required value (???) left unset. Returns the
    composed config, or None for a sweep over presets or a range (train -m model=a,b: Hydra checks
    each job)."""
    from hydra.errors import HydraException

    for o in options:
        if o.kind == "group":
            _check_preset(o)
    if any(o.sweep and (o.kind == "group" or o.value is None) for o in options):
        # a sweep over presets, or a range(...): Hydra composes and checks each job
        return None
    groups = [o.first for o in options if o.kind == "group"]
    checked = [o for o in options if o.kind == "key" and not o.free_form]
    # Hydra would add a key no code reads
    if any(o.op in ("ADD", "FORCE_ADD") for o in checked):
        schema = compose(config_name, groups)
        for o in checked:
            _check_key(config_name, o, schema, options)
    try:
        cfg = compose(config_name, [o.first for o in options if o.kind != "hydra"])
    except (HydraException, OmegaConfBaseException):
        # a bad preset choice raises here, as Hydra says it
        schema = compose(config_name, groups)
        for o in checked:
            _check_key(config_name, o, schema, options)
        raise
    for o in checked:
        _check_type(config_name, o)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(_required(config_name, missing[0], options))
    # what presets (experiment=...) set, as the command line is checked
    check_paths(OmegaConf.to_container(cfg, resolve=False))
    return cfg


def _check_preset(o: Option) -> None:
    """Each preset a group option names (model=x, a list logger=[a,b], a sweep -m model=a,b) must exist: Hydra
    skips a missing preset of an optional group (experiment=) silently and reports others in many lines."""
    group = o.key.split("@")[0]
    if not (conf_dir() / group).is_dir() or o.op == "DEL":
        return
    known = presets(group)
    for name in o.value if isinstance(o.value, list) else [o.value]:
        if isinstance(name, str) and name not in known:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f": did you mean {group}={near[0]}?" if near else ""
            raise ConfigError(f"{group}={name} is not a preset{hint} ({group} presets: {', '.join(known)})")


def _has(cfg: DictConfig, key: str) -> bool:
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _check_key(config_name: str, o: Option, schema: DictConfig, options: list[Option]) -> None:
    exists = _has(schema, o.key)
    # ~key +key=...: replaced
    deleted = any(d.op == "DEL" and d.key == o.key for d in options)
    if exists and o.op == "ADD" and not deleted:
        raise ConfigError(f"{o.key} is an option already: write {o.key}={o.raw} (without the +)")
    if not exists:
        raise ConfigError(_unknown(config_name, o, schema, options))


def _unknown(config_name: str, o: Option, schema: DictConfig, options: list[Option]) -> str:
    """One line for a key the verb's config does not have: the preset that has it, or the closest key."""
    group = o.key.split(".")[0]
    in_group = "." in o.key and group in _groups(config_name, options)
    preset_keys = _group_keys(group) if in_group else {}

    def owners_of(key: str) -> list[str]:
        """The presets that have `key`, the simplest first (data.paths: files, then chat)."""
        return sorted(
            (p for p, keys in preset_keys.items() if key in keys),
            key=lambda p: (p in NAMED_LAST, len(preset_keys[p])),
        )

    owners = owners_of(o.key)
    if owners:
        return (
            f"{o.key} {_needs(config_name, group, owners, options)}: "
            f"{_fix(config_name, group, owners, options)} {o.key}={o.raw}"
        )
    known = flat_keys(OmegaConf.to_container(schema, resolve=False))
    near = suggest(o.key, known + sorted(set().union(*preset_keys.values())))
    hint = ""
    if near:
        owners = owners_of(near) if near not in known else []
        fix = f" (with {_fix(config_name, group, owners, options)})" if owners else ""
        hint = f": did you mean {near}{fix}?"
    return f"unknown option {o.key}{hint} (`gptkit {config_name.replace('_', '-')} --help` lists the options)"


def _needs(config_name: str, group: str, owners: list[str], options: list[Option]) -> str:
    now = _choice(config_name, group, options)
    if isinstance(now, list):
        return f"needs the {owners[0]} {group}"
    now = f"{group} is {now} now" if now != "none" else f"no {group} is chosen"
    return f"needs {' or '.join(f'{group}={p}' for p in owners)} ({now})"


def _fix(config_name: str, group: str, owners: list[str], options: list[Option]) -> str:
    now = _choice(config_name, group, options)
    if isinstance(now, list):
        return f"{group}=[{','.join([*now, owners[0]])}]"
    return f"{group}={owners[0]}"


def _required(config_name: str, key: str, options: list[Option]) -> str:
    group = key.split(".")[0]
    comment = key_comments(config_name, [o.arg for o in options]).get(key)
    # what conf/ says the key is
    what = f" ({comment})" if comment else ""
    if "." in key and group in _groups(config_name, options):
        choice = _choice(config_name, group, options)
        return f"{key} is required with {group}={choice}: add {key}=<value>{what}"
    return f"{key} is required: add {key}=<value>{what}"


def suggest(name: str, keys: list[str]) -> str | None:
    """The key a misspelt or shortened option most likely means: the key itself, the one key ending in
    .name, or the closest key (whole, or by its last part)."""
    if name in keys:
        return name
    ends = [k for k in keys if k.endswith("." + name)]
    if len(ends) == 1:
        return ends[0]
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.8)
    if close:
        return close[0]
    leaf = name.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for k in keys:
        by_leaf.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if close:
        same_group = [k for k in by_leaf[close[0]] if k.split(".")[0] == name.split(".")[0]]
        return (same_group or by_leaf[close[0]])[0]
    return None


def flat_keys(d: Any, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items() if isinstance(d, dict) else ():
        out.append(prefix + str(k))
        out += flat_keys(v, f"{prefix}{k}.")
    return out


def _flat_values(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items() if isinstance(d, dict) else ():
        out[prefix + str(k)] = v
        out.update(_flat_values(v, f"{prefix}{k}."))
    return out


# ---- what the YAML says: the presets of each group, the verb's own keys ------------------------------
def _yaml(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(the `# @package` of a YAML file or None, its content)."""
    text = path.read_text()
    package = None
    for line in text.splitlines():
        if line.startswith("# @package"):
            package = line.split("@package", 1)[1].strip()
            break
    return package, yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}


@functools.cache
def _group_values(group: str) -> dict[str, dict[str, Any]]:
    """preset -> {dotted key: default} for every preset of a group (its `defaults` from the same group
    included; `# @package _global_` presets, which set other groups' keys, left out)."""
    out: dict[str, dict[str, Any]] = {}
    for preset in presets(group):
        package, d = _yaml(conf_dir() / group / f"{preset}.yaml")
        if package == "_global_":
            continue
        root = group if package in (None, "_group_") else package
        values: dict[str, Any] = {}
        for base in d.pop("defaults", None) or []:
            if isinstance(base, str) and base != "_self_" and (conf_dir() / group / f"{base}.yaml").is_file():
                values.update(_flat_values(_yaml(conf_dir() / group / f"{base}.yaml")[1], root + "."))
        values.update(_flat_values(d, root + "."))
        out[preset] = values
    return out


def _group_keys(group: str) -> dict[str, set[str]]:
    return {p: set(v) for p, v in _group_values(group).items()}


@functools.cache
def _verb_values(config_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """({dotted key: default} of the verb's own YAML (and the configs its defaults list names, as preflight
    names train), {group: its default choice})."""
    _, d = _yaml(conf_dir() / f"{config_name}.yaml")
    values: dict[str, Any] = {}
    choices: dict[str, Any] = {}
    for entry in d.pop("defaults", None) or []:
        if isinstance(entry, str) and entry != "_self_":
            base_values, base_choices = _verb_values(entry)
            values.update(base_values)
            choices.update(base_choices)
        elif isinstance(entry, dict):
            for k, v in entry.items():
                if not str(k).startswith("override "):
                    choices[str(k).removeprefix("optional ").strip()] = v
    d.pop("hydra", None)
    values.update(_flat_values(d))
    return values, choices


def _groups(config_name: str, options: list[Option]) -> set[str]:
    """The config groups of the verb: those its defaults list names and those the options choose."""
    return set(_verb_values(config_name)[1]) | {o.key for o in options if o.kind == "group"}


def _choice(config_name: str, group: str, options: list[Option]) -> Any:
    for o in options:
        if o.kind == "group" and o.key == group:
            return o.value
    return _verb_values(config_name)[1].get(group) or "none"


def _check_type(config_name: str, o: Option) -> None:
    """A value of the type the key has in the YAML (wherever it is set: the verb's config or any preset of
    its group): true/false, or a number (an int default may take a float: 5 seconds may be 2.5; the verb
    checks what must be whole). null and ${...} are always accepted."""
    if o.op == "DEL" or (o.sweep and o.value is None):
        return
    group = o.key.split(".")[0]
    seen = [_verb_values(config_name)[0].get(o.key)]
    if "." in o.key and (conf_dir() / group).is_dir():
        seen += [v.get(o.key) for v in _group_values(group).values()]
    types = {type(v) for v in seen if v is not None}
    if not types or not (types == {bool} or types <= {int, float}):
        return
    default = next(v for v in seen if v is not None)
    for v in o.value if o.sweep else [o.value]:
        if v is None or (isinstance(v, str) and "${" in v):
            continue
        if types == {bool} and not isinstance(v, bool):
            raise ConfigError(f"{o.key}={_raw(o, v)} must be true or false")
        if types != {bool} and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        ):
            raise ConfigError(f"{o.key}={_raw(o, v)} is not a number (the default is {o.key}={default})")


def _raw(o: Option, v: Any) -> str:
    return str(v) if o.sweep else o.raw


# ---- a run's saved config, checked as the command line is -------------------------------------------
def check_saved_config(
    config_name: str, saved: dict[str, Any], where: str, extra_keys: tuple[str, ...] = ()
) -> None:
    """A run's saved config (plain data read from `where`, e.g. runs/x/config.yaml) checked against the
    verb's config as a command line is: every key one that the verb's YAML or a preset of its groups has (a
    renamed key: the close one named), every value of its key's type (runs.read_config refuses an
    interpolation). Each problem is a one-line ConfigError that names `where`."""
    own, choices = _verb_values(config_name)
    known = set(own) | set(extra_keys)
    for group in choices:
        if (conf_dir() / group).is_dir():
            for keys in _group_keys(group).values():
                known |= keys
    # their sections
    known |= {k.rsplit(".", i)[0] for k in list(known) for i in range(1, k.count(".") + 1)}
    for key, value in _flat_values(saved).items():
        if isinstance(value, dict) and value:
            continue
        if key not in known and not any(key == f or key.startswith(f + ".") for f in FREE_FORM):
            same_section = sorted(k for k in known if k.split(".")[0] == key.split(".")[0])
            near = suggest(key, same_section or sorted(known))
            raise ConfigError(
                f"{where}: unknown key {key}"
                + (f" (did you mean {near}?)" if near else "")
                + "; fix or remove it"
            )
        try:
            arg = f"{key}={value}"
            _check_type(config_name, Option(arg, key, "key", "CHANGE", value, False, arg))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


# ---- what the YAML explains: each key's comment, for --help ------------------------------------------
def _split_comment(rest: str) -> tuple[str, str | None, int]:
    """A YAML line's text after `key:` -> (value, its `# comment` or None, the comment's column in rest)."""
    quote = None
    for i, c in enumerate(rest):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].rstrip(), rest[i + 1 :].strip(), i
    return rest.rstrip(), None, -1


def _continues(lines: list[str], i: int, key_indent: int) -> bool:
    """Whether comment line i, under a key's inline comment but not in its column, continues it: it stands
    deeper than both that key and the next key (a comment in the next key's column is that key's)."""
    col = len(lines[i]) - len(lines[i].lstrip())
    following = next((ln for ln in lines[i + 1 :] if ln.strip() and not ln.strip().startswith("#")), "")
    return col > key_indent and col > len(following) - len(following.lstrip())


def yaml_comments(text: str, root: str = "") -> dict[str, str]:
    """{dotted key: its comment} of a block-style YAML file: the comment on the key's line (with the comment
    lines under it that start in the same column: its continuation), else the comment lines just above it.
    The comment block a file starts with describes the file, not its first key; `hydra:` is left out."""
    out: dict[str, str] = {}
    # (indent, key) of the mapping keys enclosing the current line
    stack: list[tuple[int, str]] = []
    # comment lines waiting for the key below them
    above: list[str] = []
    # (dotted key, column of its inline comment, the key's indent) that may continue
    last: tuple[str, int, int] | None = None
    # still in the comment block at the top of the file
    header = True
    lines = text.splitlines()
    for i, line in enumerate(lines):
        body = line.strip()
        if not body:
            above, last, header = [], None, False
            continue
        if body.startswith("#"):
            col = len(line) - len(line.lstrip())
            if last is not None and (col == last[1] or _continues(lines, i, last[2])):
                out[last[0]] += " " + body[1:].strip()
            elif not header and not body.startswith("# @package"):
                above.append(body[1:].strip())
            continue
        header = False
        indent = len(line) - len(line.lstrip())
        key, sep, rest = body.partition(":")
        if body.startswith("-") or not sep or " " in key.strip() or key.startswith(("'", '"')):
            # a list item, a flow or quoted key: no comment of its own here
            above, last = [], None
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key.strip()))
        dotted = ".".join(k for _, k in stack)
        _, comment, col = _split_comment(rest)
        last = None
        if comment:
            out[dotted] = comment
            last = (dotted, indent + len(key) + 1 + col, indent)
        elif above:
            out[dotted] = " ".join(above)
        above = []
    return {
        f"{root}.{k}" if root else k: v
        for k, v in out.items()
        if k != "hydra" and not k.startswith("hydra.") and k != "defaults"
    }


def key_comments(config_name: str, overrides: list[str]) -> dict[str, str]:
    """{dotted key: the comment that explains it in conf/} for the verb's config as `overrides` compose it:
    the verb's YAML (and the configs its defaults list names), then each chosen preset of its groups."""
    options = parse_options([a for a in overrides if "=" in a], sweeps=True)
    out: dict[str, str] = {}

    def verb(name: str) -> None:
        path = conf_dir() / f"{name}.yaml"
        _, d = _yaml(path)
        for entry in d.get("defaults") or []:
            if isinstance(entry, str) and entry != "_self_" and (conf_dir() / f"{entry}.yaml").is_file():
                verb(entry)
        out.update(yaml_comments(path.read_text()))

    def preset(group: str, name: str) -> None:
        path = conf_dir() / group / f"{name}.yaml"
        if not path.is_file():
            return
        package, d = _yaml(path)
        for base in d.get("defaults") or []:
            if isinstance(base, str) and base != "_self_":
                preset(group, base)
        root = "" if package == "_global_" else group if package in (None, "_group_") else package
        out.update(yaml_comments(path.read_text(), root))

    def names(choice: Any) -> list[str]:
        return [
            str(n)
            for n in (choice if isinstance(choice, (list, tuple)) else [choice])
            if n not in (None, "none", "null")
        ]

    def is_global(group: str, name: str) -> bool:
        path = conf_dir() / group / f"{name}.yaml"
        return path.is_file() and _yaml(path)[0] == "_global_"

    choices = {g: _choice(config_name, g, options) for g in sorted(_groups(config_name, options))}
    on_line = {o.key for o in options if o.kind == "group"}
    # experiment=...: its `override /<group>: <preset>` choices
    for group, choice in list(choices.items()):
        for name in (n for n in names(choice) if is_global(group, n)):
            for entry in _yaml(conf_dir() / group / f"{name}.yaml")[1].get("defaults") or []:
                for key, value in entry.items() if isinstance(entry, dict) else ():
                    other = str(key).removeprefix("override").strip().lstrip("/")
                    if other in choices and other not in on_line:
                        choices[other] = value
    verb(config_name)
    # a _global_ preset (an experiment) last: its comments are the specific ones
    for last in (False, True):
        for group, choice in choices.items():
            for name in names(choice):
                if is_global(group, name) == last:
                    preset(group, name)
    return out


def annotate_yaml(text: str, comments: dict[str, str]) -> str:
    """OmegaConf.to_yaml output with each key's comment after it (`# ...`, in one column where it fits)."""
    lines = text.splitlines()
    keyed: list[tuple[str, str | None]] = []
    stack: list[tuple[int, str]] = []
    for line in lines:
        body = line.lstrip()
        indent = len(line) - len(body)
        key, sep, _ = body.partition(":")
        if not sep or body.startswith(("-", "'", '"')) or " " in key:
            keyed.append((line, None))
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        keyed.append((line, comments.get(".".join(k for _, k in stack))))
    col = min(max((len(ln) for ln, c in keyed if c), default=0) + 2, 48)
    out = []
    for line, comment in keyed:
        if comment:
            line = f"{line:<{col}}# {comment}" if len(line) < col else f"{line}  # {comment}"
        out.append(line)
    return "\n".join(out) + "\n"
