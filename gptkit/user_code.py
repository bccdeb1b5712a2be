"""The user's own Python code, imported where a verb names it (grpo.rewards' reward functions, `gptkit chat
tools=`'s tools): the caller announces it first; whatever it raises while importing (sys.exit included) is
one line."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Optional

from gptkit.errors import GptkitError


def import_user_code(path: Optional[Path], module: str, prefix: str, what: str) -> ModuleType:
    """The file `path` as the module <prefix><its stem>, or (path None) the importable `module`; a failure
    inside it: GptkitError('<what> failed: <type>: <message>')."""
    try:
        if path is not None:
            spec = importlib.util.spec_from_file_location(f"{prefix}{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        return importlib.import_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module may fail (or exit)
        raise GptkitError(f"{what} failed: {type(exc).__name__}: {str(exc)[:200]}") from None
