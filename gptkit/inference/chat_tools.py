"""`gptkit chat tools=`: the tools a chat offers the model, and how its calls are answered.

    tools=tools.json             a JSON list of OpenAI tool specs ({"type": "function", "function": {name,
                                 description, parameters}}): each call is shown, and the user types its
                                 result
    tools=my_tools.py            a Python file (or tools=package.module): its TOOLS list when it has one
    tools=my_tools.py:obj        (functions, or specs next to functions of their names), else its public
                                 functions; `obj` names one function or a list of them. Each function is a
                                 tool, its schema from its signature (annotations: str, int, float, bool,
                                 list, dict; a default makes a parameter optional) and its docstring's first
                                 paragraph; the model's calls run it, and what it returns (text, or JSON) is
                                 the tool's result; a tool that raises: its error's text is the result

A Python module is the user's code: which file runs is said on stderr before any of it runs, as
objective=grpo says of a reward module (gptkit/training/rewards.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from gptkit.chat_formats.tools import check_tools
from gptkit.errors import ConfigError, GptkitError
from gptkit.user_code import import_user_code

_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class ChatTools:
    # the specs the template renders
    specs: list[dict[str, Any]]
    # name -> the function that answers it (None: the user types each result)
    functions: Optional[dict[str, Callable]]
    # what was loaded (a file or a module)
    source: str


def load_tools(spec: str, announce: bool = True) -> ChatTools:
    """tools= as ChatTools (ConfigError for a value that names nothing usable)."""
    spec = str(spec)
    if spec.endswith(".json"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"tools={spec}: no such file")
        try:
            specs = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(f"tools={spec} is not JSON ({exc})") from None
        return ChatTools(_checked(specs, spec), None, str(path))
    module, _, obj = spec.partition(":") if not _is_windows_drive(spec) else (spec, "", "")
    if module.endswith(".py") or "/" in module:
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"tools={spec}: {path} is not a file")
        where = str(path)
    else:
        if not all(p.isidentifier() for p in module.split(".")):
            raise ConfigError(f"tools={spec} is neither a .json file, a .py file nor a module name")
        path = None
        try:
            found = importlib.util.find_spec(module.split(".")[0])
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"tools={spec}: no module {module.split('.')[0]!r} can be found")
        where = found.origin if "." not in module and found.origin else module
    if obj and not obj.isidentifier():
        raise ConfigError(f"tools={spec}: {obj!r} is not a name (module:function or file.py:TOOLS)")
    if announce:
        # said before any of its code runs
        print(f"chat tools= runs {where} ({spec}): use only tool code you trust", file=sys.stderr, flush=True)
    mod = import_user_code(path, module, "gptkit_tools_", f"tools={spec}: importing {where}")
    if obj:
        if not hasattr(mod, obj):
            raise ConfigError(f"tools={spec}: {where} has no {obj}")
        found_obj = getattr(mod, obj)
        items = found_obj if isinstance(found_obj, (list, tuple)) else [found_obj]
    elif isinstance(getattr(mod, "TOOLS", None), (list, tuple)):
        items = list(mod.TOOLS)
    else:
        items = [
            f
            for name, f in vars(mod).items()
            if inspect.isfunction(f) and not name.startswith("_") and f.__module__ == mod.__name__
        ]
    specs, functions = [], {}
    for item in items:
        if callable(item):
            specs.append(schema_of(item))
            functions[item.__name__] = item
        elif isinstance(item, dict):
            name = (item.get("function") or {}).get("name")
            fn = getattr(mod, str(name), None)
            if not callable(fn):
                raise ConfigError(f"tools={spec}: the tool {name!r} has no function of its name in {where}")
            specs.append(item)
            functions[name] = fn
        else:
            raise ConfigError(f"tools={spec}: {item!r} is neither a function nor a tool spec")
    if not specs:
        raise ConfigError(f"tools={spec}: {where} has no tools (no public functions, no TOOLS list)")
    return ChatTools(_checked(specs, spec), functions, where)


def _is_windows_drive(spec: str) -> bool:
    return len(spec) > 2 and spec[1] == ":" and spec[2] in "\\/"


def _checked(specs: Any, spec: str) -> list[dict[str, Any]]:
    try:
        checked = check_tools(specs, f"tools={spec}")
    except GptkitError as exc:
        raise ConfigError(str(exc)) from None
    if not checked:
        raise ConfigError(f"tools={spec} holds no tools")
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"tools={spec} names {', '.join(twice)} more than once")
    return checked


def schema_of(fn: Callable) -> dict[str, Any]:
    """An OpenAI tool spec for a function: its parameters from its signature, its description from the
    first paragraph of its docstring."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        if isinstance(ann, str):
            ann = {t.__name__: t for t in _TYPES}.get(ann, ann)
        props[p.name] = {"type": _TYPES[ann]} if ann in _TYPES else {}
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    out: dict[str, Any] = {"name": fn.__name__}
    if doc:
        out["description"] = doc.split("\n\n")[0].replace("\n", " ")
    out["parameters"] = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": out}


def run_call(fn: Callable, arguments: dict[str, Any]) -> str:
    """A call run: what it returns as text (a string as it is, anything else as JSON), or its error's."""
    try:
        result = fn(**arguments)
    except Exception as exc:  # noqa: BLE001 - a tool's failure is its result, which the model reads
        return f"error: {type(exc).__name__}: {exc}"
    return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
