"""Test environment: offline hubs, offline wandb, the Triton interpreter, a private cache.

TRITON_INTERPRET must be set before the kernel module is imported, so it is set here, first.
"""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU the kernels launch one pinned configuration each instead of autotuning (kernels/_tuning.py):
# the compiled kernel tests stay within a minute; the autotuner runs in training and `gptkit bench`.
os.environ.setdefault("GPTKIT_KERNELS_AUTOTUNE", "0")
# pytest -n 2 runs two workers on two cores: one thread each (and in their subprocesses) avoids
# oversubscription, which makes small CPU kernels several times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
if "GPTKIT_CACHE" not in os.environ:  # a private cache, removed when the test session ends
    import atexit
    import shutil

    os.environ["GPTKIT_CACHE"] = tempfile.mkdtemp(prefix="gptkit-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GPTKIT_CACHE"], True)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def shakespeare(n_chars: int | None = None, start: int = 0) -> str:
    """Text of the built-in corpus (data=shakespeare): what the product ships, nothing from outside the repo."""
    from gptkit.data.sources import shakespeare_text

    text = shakespeare_text()
    return text[start:] if n_chars is None else text[start:start + n_chars]


def run_cli(*args, env=None, cwd=None, timeout=300):
    """Run `python -m gptkit ...` as a subprocess (the way a user runs it); return CompletedProcess."""
    import subprocess

    e = dict(os.environ)
    e.pop("GPTKIT_VERB", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gptkit", *args], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def run_main(capsys, *args) -> tuple[int, str, str]:
    """gptkit.cli.main(args) in process -> (exit code, stdout, stderr) of that call alone."""
    from gptkit.cli import main

    capsys.readouterr()  # what earlier calls printed is not this call's
    try:
        code = main(list(args))
    except SystemExit as exc:  # an error: main prints one line and exits
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
