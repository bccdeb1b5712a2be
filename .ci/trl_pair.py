"""The two sides of a `.ci/*_vs_trl.py` check: the script run by gptkit's python computes its own side and
compares; the same script run by TRL's python (`--side trl`, in a venv of its own: TRL is not a dependency of
gptkit) prints TRL's side as JSON. Each script calls `main(__file__, __doc__, trl_side, compare)`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any, Callable


def main(file: str, doc: str, trl_side: Callable[[], Any], compare: Callable[[Any], int]) -> int:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--side", choices=("trl", "gptkit"), default="gptkit")
    p.add_argument("--trl-python", help="the python of an environment with TRL installed")
    a = p.parse_args()
    if a.side == "trl":
        json.dump(trl_side(), sys.stdout)
        return 0
    if not a.trl_python:
        p.error("--trl-python is needed (TRL is not a dependency of gptkit)")
    r = subprocess.run([a.trl_python, file, "--side", "trl"], capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-3000:], file=sys.stderr)
        return r.returncode
    return compare(json.loads(r.stdout))
