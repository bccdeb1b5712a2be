"""The optional packages: which extra of pyproject.toml installs each, and the one-line error when one is
missing. Every place that imports an optional package asks here first (`require`), so that a missing one
is the same line everywhere, naming the pip command that fixes it, and the CLI's exit status 2:

    error: gptkit serve needs starlette, which cannot be imported (No module named 'starlette'):
    pip install 'gptkit[serve]'

EXTRAS is the one table (tests/front/test_cli.py checks it against pyproject.toml's extras). wandb is a
dependency of gptkit itself and transformers is the test extra's; a row each gives them the same line.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from gptkit.errors import GptkitError


@dataclass(frozen=True)
class Extra:
    # the import names, each needed
    modules: tuple[str, ...]
    # the command that installs them
    pip: str
    # who needs them, as the error starts: "<needs> <module>, which ..."
    needs: str


# the version the `quant` extra pins (pyproject.toml)
TORCHAO_PIN = "0.18.0"

EXTRAS: dict[str, Extra] = {
    "serve": Extra(("starlette", "uvicorn"), "pip install 'gptkit[serve]'", "gptkit serve needs"),
    # a JSON Schema checked, a tool call's arguments validated (serve's tools, `gptkit chat tools=`)
    "tools": Extra(("jsonschema",), "pip install 'gptkit[serve]'", "tools (their JSON Schemas) need"),
    "eval": Extra(("lm_eval",), "pip install 'gptkit[eval]'", "tasks= (lm-eval tasks) needs"),
    "quant": Extra(
        ("torchao",),
        f"pip install 'gptkit[quant]' (torchao=={TORCHAO_PIN})",
        "quantized weights (finetune=qlora, quantize=) need",
    ),
    "s3": Extra(("s3fs",), "pip install 'gptkit[s3]'", "an s3:// location needs"),
    "gguf": Extra(("gguf",), "pip install 'gptkit[gguf]'", "export format=gguf needs"),
    "gguf-check": Extra(
        ("llama_cpp",),
        "pip install 'gptkit[gguf-check]' (compiles llama.cpp)",
        "the GGUF check (.ci/gguf) needs",
    ),
    "tensorboard": Extra(("tensorboard",), "pip install 'gptkit[tensorboard]'", "logger=tensorboard needs"),
    "triton": Extra(("triton",), "pip install 'gptkit[triton]'", "the Triton kernels need"),
    "ray": Extra(("ray",), "pip install 'gptkit[ray]'", "trainer.launcher=ray needs"),
    "wandb": Extra(("wandb",), "pip install wandb", "logger=wandb needs"),
    "transformers": Extra(
        ("transformers",), "pip install transformers", "the comparison with transformers needs"
    ),
}


class MissingExtra(GptkitError):
    """An optional package that is not installed (or cannot be imported): one line with its pip command."""


def pip(extra: str) -> str:
    """The command that installs an extra: pip install 'gptkit[serve]'."""
    return EXTRAS[extra].pip


def require(extra: str, needs: str | None = None, *, load: bool = True) -> None:
    """Each package of `extra` can be imported, else MissingExtra: "<needs> <module>, which cannot be
    imported (<why>): <pip command>". needs: who needs it with its verb, when not the table's words
    ("bench.hf=true needs"). load=False only looks the packages up (importlib.util.find_spec), for one whose
    import is slow (torchao: ~3 s) and comes later anyway."""
    row = EXTRAS[extra]
    for module in row.modules:
        why = _missing(module, load)
        if why is not None:
            raise MissingExtra(f"{needs or row.needs} {module}, which {why}: {row.pip}")


def available(extra: str) -> bool:
    """Whether every package of `extra` is installed (looked up, not imported)."""
    return all(_missing(m, load=False) is None for m in EXTRAS[extra].modules)


def _missing(module: str, load: bool) -> str | None:
    """None when `module` is there; else the reason, as the error says it."""
    if not load:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else "is not installed"
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    return None


def missing_extra(exc: BaseException, needs: str) -> MissingExtra | None:
    """An ImportError of an optional package that no `require` caught first (an import at the top of a
    module) as its one line, or None for any other error. needs: who needed it ("gptkit bench evals
    needs")."""
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    top = str(name).split(".")[0] if name else None
    row = next((row for row in EXTRAS.values() if top in row.modules), None)
    if row is None:
        return None
    return MissingExtra(f"{needs} {top}, which cannot be imported ({exc}): {row.pip}")
