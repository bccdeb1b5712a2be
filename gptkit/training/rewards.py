"""Rewards of objective=grpo: built-in checkers of a completion against a field of its prompt's record, and
the user's own functions, several at once with weights.

    grpo.rewards=[exact]                                  the completion is the record's answer
    'grpo.rewards=[number,{kind: format, weight: 0.2}]'   several, weighted
    'grpo.rewards=[my_rewards.py:score]'                  a function of a file (or module:function)

An entry is a checker's name, `module:function` / `file.py:function`, or a mapping with `kind` (a checker)
or `function`, and optionally `weight` (1.0), `field` (the record's field a checker reads: answer),
`pattern` (regex, format) and `name` (what the logs call it: the checker's kind, the function's name).

    exact     1 when the completion, stripped, is the field's text, stripped
    contains  1 when the field's text occurs in the completion
    number    1 when the last number in the completion equals the field's (a number, or the last one in its
              text: "#### 42" gives 42); commas between digit groups are ignored
    regex     1 when the completion's first match of `pattern` (its first group, if it has one) is the field's
              text; with field: null, 1 when the pattern occurs at all
    format    1 when the whole completion matches `pattern` (default: <think>...</think> <answer>...</answer>)

A function is called as fn(prompt, completion, row): the prompt's text (its record's prompt field, else its
messages list), the completion's text (without the end-of-turn token) and the record (a dict); it returns a
number. Loading one runs its file's code: the start-up says which file, once per process. A function that
raises, or returns something that is not a finite number, stops the run in one line naming the reward and the
prompt's file and row.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptkit.errors import ConfigError, GptkitError
from gptkit.runs import is_rank_zero

# the last number of a text: optional sign, digits (with commas between groups), decimals, exponent
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?")
# the format check's default: DeepSeek-R1's reasoning, then the answer
R1_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
DEFAULT_FIELD = "answer"


def last_number(text: str) -> float | None:
    """The last number written in text (None: none), commas between digit groups ignored."""
    found = [m.group() for m in NUMBER.finditer(text) if any(c.isdigit() for c in m.group())]
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def field_text(row: dict, name: str, where: str, reward: str) -> str:
    """The record's field `name` as text; a record without it is a one-line error."""
    if name not in row or row[name] is None:
        raise GptkitError(
            f"{where}: reward {reward} reads the field {name!r}, which this record does not have (fields: "
            f"{', '.join(map(str, row)) or 'none'}); set its field: or add the field to every record"
        )
    return str(row[name])


def exact(completion: str, row: dict, r: "Reward", where: str) -> float:
    return float(completion.strip() == field_text(row, r.field, where, r.name).strip())


def contains(completion: str, row: dict, r: "Reward", where: str) -> float:
    return float(field_text(row, r.field, where, r.name).strip() in completion)


def number(completion: str, row: dict, r: "Reward", where: str) -> float:
    value = row.get(r.field)
    want = (
        float(value)
        if isinstance(value, numbers.Real)
        else last_number(field_text(row, r.field, where, r.name))
    )
    if want is None:
        raise GptkitError(f"{where}: reward {r.name}: the field {r.field!r} holds no number ({value!r})")
    got = last_number(completion)
    return float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9))


def regex(completion: str, row: dict, r: "Reward", where: str) -> float:
    m = r.compiled.search(completion)
    if r.field is None:
        return float(m is not None)
    if m is None:
        return 0.0
    found = m.group(1) if r.compiled.groups else m.group()
    return float(found.strip() == field_text(row, r.field, where, r.name).strip())


def format_check(completion: str, row: dict, r: "Reward", where: str) -> float:
    return float(r.compiled.fullmatch(completion) is not None)


# kind -> (check, needs a pattern, default pattern, reads a field by default)
CHECKERS: dict[str, tuple[Callable, bool, str | None, bool]] = {
    "exact": (exact, False, None, True),
    "contains": (contains, False, None, True),
    "number": (number, False, None, True),
    "regex": (regex, True, None, True),
    "format": (format_check, False, R1_FORMAT, False),
}
ENTRY_KEYS = ("kind", "function", "weight", "field", "pattern", "name")


@dataclass
class Reward:
    """One reward of grpo.rewards: a checker (kind) or a user's function, its weight and name."""

    name: str
    weight: float
    kind: str | None = None
    function: str | None = None
    field: str | None = None
    pattern: str | None = None
    # the user's function, once loaded
    fn: Callable | None = None
    compiled: Any = None
    # the file whose code runs (a user's function)
    file: str | None = None

    @property
    def checker(self) -> bool:
        """A built-in check: its reward is 0 or 1, its mean an accuracy."""
        return self.kind is not None

    def __call__(self, prompt: Any, completion: str, row: dict, where: str) -> float:
        """The reward of one completion; a user's function that raises or returns no finite number is a
        one-line GptkitError naming this reward and the prompt's file and row."""
        if self.kind is not None:
            return CHECKERS[self.kind][0](completion, row, self, where)
        try:
            value = self.fn(prompt, completion, row)
        except Exception as exc:  # noqa: BLE001 - the user's code may fail in any way
            raise GptkitError(
                f"reward {self.name} ({self.function}) raised {type(exc).__name__}: {str(exc)[:200]} on the "
                f"prompt of {where}"
            ) from None
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise GptkitError(
                f"reward {self.name} ({self.function}) returned {str(value)[:80]!r} "
                f"({type(value).__name__}) on the prompt of {where}; a reward is a finite number"
            )
        return float(value)


@dataclass
class Rewards:
    """Every reward of a run and how they add up: total = sum of weight x reward."""

    rewards: list[Reward] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def score(self, prompt: Any, completion: str, row: dict, where: str) -> list[float]:
        """Each reward of one completion, in order."""
        return [r(prompt, completion, row, where) for r in self.rewards]

    def total(self, scores: list[float]) -> float:
        return sum(r.weight * s for r, s in zip(self.rewards, scores))

    def describe(self) -> str:
        return ", ".join(f"{r.weight:g} x {r.name}" for r in self.rewards)


def _entry(raw: Any, i: int) -> dict[str, Any]:
    """Entry i of grpo.rewards as a mapping (a string names a checker or a function)."""
    if isinstance(raw, str):
        if raw in CHECKERS:
            return {"kind": raw}
        if ":" in raw:
            return {"function": raw}
        raise ConfigError(
            f"grpo.rewards[{i}]={raw!r} is neither a checker ({', '.join(CHECKERS)}) nor module:function "
            "(or file.py:function)"
        )
    if hasattr(raw, "items"):
        d = dict(raw.items())
        unknown = sorted(set(d) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(
                f"grpo.rewards[{i}] has unknown key(s) {', '.join(unknown)}; keys: {', '.join(ENTRY_KEYS)}"
            )
        if ("kind" in d) == ("function" in d):
            raise ConfigError(
                f"grpo.rewards[{i}] needs one of kind: (a checker) or function: (module:function)"
            )
        return d
    raise ConfigError(f"grpo.rewards[{i}] must be a checker name, module:function or a mapping, got {raw!r}")


def parse_rewards(raw: Any) -> Rewards:
    """grpo.rewards, checked (one-line ConfigErrors), the user's functions not yet loaded."""
    if raw is None or isinstance(raw, str) or not hasattr(raw, "__len__") or not len(raw):
        raise ConfigError(
            "objective=grpo needs rewards: grpo.rewards=[exact] (checkers: "
            f"{', '.join(CHECKERS)}; or module:function, file.py:function)"
        )
    out = []
    for i, item in enumerate(raw):
        d = _entry(item, i)
        try:
            weight = float(d.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ConfigError(f"grpo.rewards[{i}].weight={d.get('weight')!r} must be a number") from None
        if not math.isfinite(weight) or weight == 0:
            raise ConfigError(f"grpo.rewards[{i}].weight={d.get('weight')!r} must be a finite number, not 0")
        if "kind" in d:
            kind = str(d["kind"])
            if kind not in CHECKERS:
                raise ConfigError(f"grpo.rewards[{i}].kind={kind!r} is not one of {', '.join(CHECKERS)}")
            _, needs_pattern, default_pattern, reads = CHECKERS[kind]
            pattern = d.get("pattern", default_pattern)
            if needs_pattern and not pattern:
                raise ConfigError(f"grpo.rewards[{i}]: the {kind} checker needs a pattern: (a regex)")
            try:
                compiled = re.compile(str(pattern), re.DOTALL) if pattern else None
            except re.error as exc:
                raise ConfigError(f"grpo.rewards[{i}].pattern={pattern!r} is not a regex: {exc}") from None
            f = d.get("field", DEFAULT_FIELD if reads else None)
            r = Reward(
                str(d.get("name") or kind), weight, kind=kind, field=f, pattern=pattern, compiled=compiled
            )
        else:
            spec = str(d["function"])
            module, _, fn = spec.rpartition(":")
            if not module or not fn.isidentifier():
                raise ConfigError(
                    f"grpo.rewards[{i}].function={spec!r} must be module:function or file.py:function"
                )
            r = Reward(str(d.get("name") or fn), weight, function=spec)
        out.append(r)
    names = [r.name for r in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"grpo.rewards names {', '.join(twice)} more than once; give each its own name: (the logs' key)"
        )
    return Rewards(out)


# the functions this process loaded: (spec, cwd) -> (function, file)
_LOADED: dict[tuple[str, str], tuple[Callable, str]] = {}


def _module_file(module: str) -> tuple[Path | None, Any]:
    """(the file a module:function names, the import spec when it is an importable module name)."""
    if module.endswith(".py") or "/" in module or "\\" in module:
        return Path(module).expanduser().resolve(), None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"reward module {module!r} cannot be found: {exc}") from None
    if spec is None:
        raise ConfigError(
            f"reward module {module!r} cannot be found (or name its file: path/to/rewards.py:function)"
        )
    return (Path(spec.origin) if spec.origin else None), spec


def load_rewards(rewards: Rewards, announce: bool = True) -> Rewards:
    """Load each user function (once per process), saying first on stderr which file's code runs."""
    for r in rewards.rewards:
        if r.function is None or r.fn is not None:
            continue
        key = (r.function, str(Path.cwd()))
        if key not in _LOADED:
            module, _, name = r.function.rpartition(":")
            path, spec = _module_file(module)
            if spec is None and (path is None or not path.is_file()):
                raise ConfigError(f"grpo.rewards: {r.function}: {path} is not a file")
            if announce and is_rank_zero():
                print(
                    f"grpo.rewards runs {path} ({r.function}): use only reward code you trust",
                    file=sys.stderr,
                )
            try:
                if spec is None:
                    file_spec = importlib.util.spec_from_file_location(f"gptkit_reward_{path.stem}", path)
                    mod = importlib.util.module_from_spec(file_spec)
                    file_spec.loader.exec_module(mod)
                else:
                    mod = importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - the user's module may fail in any way
                raise GptkitError(
                    f"grpo.rewards: importing {path} failed: {type(exc).__name__}: {str(exc)[:200]}"
                ) from None
            fn = getattr(mod, name, None)
            if not callable(fn):
                raise GptkitError(f"grpo.rewards: {path} has no function {name}")
            _LOADED[key] = (fn, str(path))
        r.fn, r.file = _LOADED[key]
    return rewards
