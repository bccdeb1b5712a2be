"""A SLURM batch job's signal before its time limit, checked before any process group starts.

The checkpoint-and-requeue pattern (docs/examples/slurm-cpu.sbatch) asks SLURM for SIGTERM N seconds
before the job's time limit (`#SBATCH --signal=TERM@N`): every rank then saves checkpoints/last.ckpt and
stops (exit 143) and the job goes back in the queue. The signal counts back from the time limit, so a job
that asks for it without one (no `--time` on a partition without a default: TimeLimit=UNLIMITED) never
gets it, and one whose limit is not longer than N gets it at once. Both are refused in one line, before
the run starts.

SLURM puts neither the signal nor the time limit in the tasks' environment (22.05's sbatch exports
SLURM_JOB_ID, SLURM_NTASKS, ... but no --signal, and `scontrol show job` does not show it either), so both are
read from the controller: `scontrol write batch_script <job> -` (the submitted script: its #SBATCH lines) and
`scontrol show job -o <job>` (TimeLimit). An `SBATCH_SIGNAL` variable (sbatch's own spelling of --signal) in
the environment counts as the option. Outside a batch job, or where scontrol cannot say, nothing is checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping

from gptkit.errors import ConfigError

# the seconds before the time limit when --signal gives no @N (sbatch's default)
DEFAULT_SIGNAL_S = 60
SCONTROL_S = 10
# what SLURM shows for an infinite time limit after a requeue
INFINITE_DAYS = 365


def sbatch_options(script: str) -> dict[str, str]:
    """The long options of a batch script's #SBATCH lines (the ones sbatch reads: before the first command),
    by name: {'signal': 'TERM@60', 'time': '00:30:00', 'requeue': ''}. Short -t is 'time'."""
    options: dict[str, str] = {}
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if not stripped.startswith("#SBATCH"):
            continue
        try:
            words = shlex.split(stripped[len("#SBATCH") :], comments=True)
        except ValueError:
            continue
        for i, word in enumerate(words):
            if word.startswith("--"):
                name, eq, value = word[2:].partition("=")
                options[name] = value if eq else ""
            elif word == "-t" and i + 1 < len(words):
                options["time"] = words[i + 1]
            elif word.startswith("-t") and len(word) > 2:
                options["time"] = word[2:]
    return options


def signal_seconds(spec: str) -> int:
    """--signal=[{R|B}:]<sig>[@<seconds>] -> the seconds before the time limit."""
    _, at, when = spec.partition("@")
    return int(when) if at and when.strip().isdigit() else DEFAULT_SIGNAL_S


def time_limit_seconds(limit: str) -> int | None:
    """scontrol's TimeLimit ([days-]hh:mm:ss, mm:ss, UNLIMITED, Partition_Limit) -> seconds; None: none.
    365 days or more is none too: SLURM 22.05 shows an UNLIMITED job as 365-00:00:00 once it has been
    requeued twice (seen on .ci/slurm's cluster)."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", limit.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    if days >= INFINITE_DAYS:
        return None
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def signal_problem(job: str, spec: str, limit: str) -> str | None:
    """The one-line refusal for a job that asks for --signal=`spec` with TimeLimit=`limit`, or None."""
    before = signal_seconds(spec)
    seconds = time_limit_seconds(limit)
    if seconds is None:
        return (
            f"SLURM job {job} asks for --signal={spec} ({before} s before its time limit, to save a "
            f"checkpoint and requeue) but has no time limit (TimeLimit={limit}), so the signal never comes; "
            "add #SBATCH --time=HH:MM:SS (docs/examples/slurm-cpu.sbatch)"
        )
    if before >= seconds:
        return (
            f"SLURM job {job} asks for --signal={spec} ({before} s before its time limit) but its time "
            f"limit is {limit} ({seconds} s): the signal would come before the run starts; give --time more "
            f"than {before} s or the signal fewer"
        )
    return None


def _scontrol(*args: str) -> str | None:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SCONTROL_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def check_slurm_signal(
    env: Mapping[str, str] | None = None, scontrol: Callable[..., str | None] = _scontrol
) -> None:
    """Under a SLURM batch job: refuse a --signal without a time limit to count back from (module doc)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    # srun's own allocation (no batch script) and interactive shells: nothing submitted to read
    if not job or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    spec = env.get("SBATCH_SIGNAL")
    if not spec:
        script = scontrol("write", "batch_script", job, "-")
        if script is None:
            return
        spec = sbatch_options(script).get("signal")
    if not spec:
        return
    shown = scontrol("show", "job", "-o", job)
    m = re.search(r"\bTimeLimit=(\S+)", shown or "")
    if m is None:
        return
    problem = signal_problem(job, spec, m.group(1))
    if problem:
        raise ConfigError(problem)
