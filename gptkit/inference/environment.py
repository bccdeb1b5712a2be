"""Environments of multi-turn GRPO (grpo.environment=): a Python class whose methods are the tools the model
may call, and which scores the finished episode.

    grpo.environment=my_env.py:Calculator        a class of a file (or package.module:Class)

The contract (docs/agentic.md):

    class Calculator:
        def __init__(self, record): ...           one instance per episode, given the prompt's record (a
                                                  constructor without a parameter is called bare)
        def add(self, a: int, b: int) -> int:     a tool: each public method (or the names of TOOLS, a class
            "Add two integers."                   attribute: method names or OpenAI tool specs), its schema
                                                  from its signature and docstring (gptkit/inference/
                                                  chat_tools.py's schema_of), its result text or JSON
        def score(self, messages) -> float:       required: the finished episode's reward, given the whole
                                                  conversation (the model's turns and the tools' results)
        def turn_reward(self, turn, message, results) -> float:
                                                  optional: a reward after each model turn (its message and
                                                  its calls' results), added to the episode's total

Loading runs the user's code: which file runs is said on stderr before any of it runs, as grpo.rewards' reward
functions are (gptkit/training/rewards.py). A spec that names nothing usable, a class without score, a tool
whose schema is not JSON Schema: a one-line ConfigError. A tool that raises during an episode ends the episode
with its error recorded (Environment.call returns it); the run goes on and counts it.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import numbers
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gptkit.chat_formats.tools import check_tools
from gptkit.errors import ConfigError, GptkitError
from gptkit.inference.chat_tools import schema_of
from gptkit.user_code import import_user_code

# methods of the contract that are no tools
RESERVED = ("score", "turn_reward", "reset")


@dataclass
class Environment:
    """A loaded environment class: its tools' specs (what the template renders) and how to run them."""

    cls: type
    # the tools' OpenAI specs, in order
    specs: list[dict[str, Any]]
    # what was loaded (a file or a module) and the spec as given
    source: str
    spec: str

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.specs]

    @property
    def has_turn_reward(self) -> bool:
        return callable(getattr(self.cls, "turn_reward", None))

    def new(self, record: dict) -> Any:
        """One episode's instance, given its prompt's record."""
        takes = _positional(self.cls.__init__) if self.cls.__init__ is not object.__init__ else 0
        return self.cls(record) if takes >= 1 else self.cls()

    def call(self, instance: Any, name: str, arguments: dict) -> tuple[str, Optional[str]]:
        """(the result's text, None), or ('error: <type>: <message>', the same) when the tool raised."""
        try:
            result = getattr(instance, name)(**arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's failure ends its episode, recorded
            error = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            return error, error
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        return text, None

    def score(self, instance: Any, messages: list[dict]) -> float:
        return self._number(instance.score(messages), "score")

    def turn_reward(self, instance: Any, turn: int, message: dict, results: list[str]) -> float:
        if not self.has_turn_reward:
            return 0.0
        return self._number(instance.turn_reward(turn, message, results), "turn_reward")

    def _number(self, value: Any, what: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise GptkitError(
                f"grpo.environment={self.spec}: {what} returned {str(value)[:40]!r}, not a finite number"
            )
        return float(value)


def _positional(fn) -> int:
    """How many parameters besides self a method takes positionally."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return 0
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _where(module: str, spec: str) -> tuple[Optional[Path], str]:
    """(the file, when a file is named; what is said to run)."""
    if module.endswith(".py") or "/" in module or "\\" in module:
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"grpo.environment={spec}: {path} is not a file")
        return path, str(path)
    if not all(p.isidentifier() for p in module.split(".")):
        raise ConfigError(f"grpo.environment={spec}: {module!r} is neither a .py file nor a module name")
    try:
        found = importlib.util.find_spec(module.split(".")[0])
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ConfigError(f"grpo.environment={spec}: no module {module.split('.')[0]!r} can be found")
    return None, (found.origin if "." not in module and found.origin else module)


def load_environment(spec: Any, announce: bool = True) -> Environment:
    """grpo.environment=module:Class (or file.py:Class) loaded and checked; ConfigError in one line."""
    spec = str(spec)
    module, _, name = spec.rpartition(":")
    if not module or not name.isidentifier():
        raise ConfigError(f"grpo.environment={spec} must be module:Class or file.py:Class")
    path, where = _where(module, spec)
    if announce:
        # said before any of its code runs
        print(
            f"grpo.environment runs {where} ({spec}): use only environment code you trust",
            file=sys.stderr,
            flush=True,
        )
    mod = import_user_code(path, module, "gptkit_env_", f"grpo.environment={spec}: importing {where}")
    cls = getattr(mod, name, None)
    if not inspect.isclass(cls):
        raise ConfigError(f"grpo.environment={spec}: {where} has no class {name}")
    if not callable(getattr(cls, "score", None)):
        raise ConfigError(
            f"grpo.environment={spec}: the class {name} has no score method "
            "(score(self, messages) -> number: the finished episode's reward)"
        )
    specs = _tool_specs(cls, spec)
    try:
        checked = check_tools(specs, f"grpo.environment={spec}")
    except GptkitError as exc:
        raise ConfigError(str(exc)) from None
    for t in checked or []:
        problem = _meta_schema_problem(t["function"].get("parameters"))
        if problem:
            raise ConfigError(
                f"grpo.environment={spec}: tool {t['function']['name']}: parameters is not JSON Schema: "
                f"{problem}"
            )
    if not checked:
        raise ConfigError(f"grpo.environment={spec}: the class {name} has no tools (no public methods)")
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"grpo.environment={spec} names the tool {', '.join(twice)} more than once")
    return Environment(cls, checked, where, spec)


def _tool_specs(cls: type, spec: str) -> Any:
    """The class's tools as OpenAI specs: its TOOLS (method names or specs), else its public methods."""
    listed = getattr(cls, "TOOLS", None)
    if listed is None:
        listed = [
            n
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_") and n not in RESERVED
        ]
    if not isinstance(listed, (list, tuple)):
        raise ConfigError(f"grpo.environment={spec}: TOOLS must be a list of method names or tool specs")
    out = []
    for item in listed:
        name = item if isinstance(item, str) else ((item or {}).get("function") or {}).get("name")
        fn = getattr(cls, str(name), None) if isinstance(item, (str, dict)) else None
        if not inspect.isfunction(fn) or str(name) in RESERVED or str(name).startswith("_"):
            raise ConfigError(
                f"grpo.environment={spec}: the tool {str(name)[:40]!r} is no public method of {cls.__name__}"
            )
        # the method bound to a placeholder: its signature without self
        out.append(item if isinstance(item, dict) else schema_of(types.MethodType(fn, object())))
    return out


def _meta_schema_problem(schema: Any) -> Optional[str]:
    """The parameters checked against JSON Schema's meta-schema when jsonschema is installed."""
    if not isinstance(schema, dict):
        return None
    try:
        import jsonschema  # noqa: F401 - optional (the serve extra)
    except ImportError:
        return None
    from gptkit.chat_formats.tool_syntax import check_schema

    return check_schema(schema)
