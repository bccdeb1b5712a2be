"""`gptkit merge`: the weighted average of a run's step checkpoints, written as a new run folder.

    <runs_dir>/<run>-merge-<steps>/      (or out=)
      config.yaml, tokenizer.json, manifest.json    copied from the source run (it evaluates, samples,
                                                    exports like any run)
      checkpoints/last.ckpt                         {"state_dict": the average, "global_step": the newest
                                                    source's step, "merged_from": the steps}
      merge.json                                    the sources: path, step, bytes, CRC-32, weight

Memory stays bounded whatever the model's size: the tensors are streamed one name at a time across the
sources (a single-file checkpoint memory-mapped, a sharded folder read tensor by tensor through its index,
only the chunks of that tensor), accumulated in fp32 as acc = w_0 * x_0, acc += w_i * x_i (the weights
normalized to sum to 1), cast back to the sources' dtype and written to a scratch file of its own; the
checkpoint is then saved from those memory-mapped scratch tensors through the one atomic writer
(gptkit.checkpoints.atomic_torch_save), and the folder is renamed into place whole. So at any moment
the process holds one tensor of each source and the accumulator. A floating tensor is averaged; any other
(an integer buffer) is the newest source's. The optimizer state is not carried: a merged run evaluates,
samples and exports, and `train init_from=` starts from it, but it does not resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from gptkit import adapters
from gptkit.checkpoints import (
    CHECKPOINT_DIR,
    CHECKSUMS,
    LAST_CHECKPOINT,
    SHARDED_INDEX,
    STATE_PREFIX,
    atomic_torch_save,
    checkpoint_step,
    find_checkpoint,
    is_sharded_checkpoint,
    load_checkpoint,
    read_sharded_checkpoint,
    safe_reader,
    sharded_refusal,
    verify_checkpoint,
)
from gptkit.errors import ConfigError, GptkitError
from gptkit.fsio import atomic_write_text, file_crc32
from gptkit.runs import CONFIG_FILE, MANIFEST_FILE, MERGE_FILE, TOKENIZER_FILE

# the checkpoint entry of trainer.ema's averages (gptkit.training.ema.STATE_KEY; training is a room above)
EMA_KEY = "EMA"
STEP_FILE = re.compile(r"step-(\d+)\.ckpt")
# what a merged folder copies from its source run (the run folder's facts a verb reads)
COPIED = (CONFIG_FILE, TOKENIZER_FILE, MANIFEST_FILE)


# ---- the options, checked without torch --------------------------------------------------------------
def parse_merge_options(steps: Any, last: Any, weights: Any, ema: bool = False) -> tuple[Any, Any, Any]:
    """(steps, last, weights) as given on the command line, checked: exactly one of steps=[...] and last=k,
    steps distinct non-negative integers, k >= 1, weights one finite number per checkpoint summing to more
    than 0 (ema=true: neither steps= nor last= is the run's last checkpoint). One-line ConfigError
    otherwise."""
    if steps is not None and last is not None or (steps is None and last is None and not ema):
        raise ConfigError(
            "merge needs exactly one of steps=[s1,s2,...] (the step checkpoints to average) and last=k "
            "(the newest k step checkpoints)"
        )
    if steps is not None:
        if isinstance(steps, (int, str)):
            steps = [steps]
        try:
            steps = [_int(s, "steps") for s in steps]
        except TypeError:
            raise ConfigError(f"steps={steps!r} is not a list of steps, e.g. steps=[400,500,600]") from None
        if not steps or min(steps) < 0:
            raise ConfigError(f"steps={steps} must be a non-empty list of step numbers >= 0")
        if len(set(steps)) != len(steps):
            raise ConfigError(f"steps={steps} names a step twice; each checkpoint is averaged once")
        steps = sorted(steps)
    if last is not None:
        last = _int(last, "last")
        if last < 1:
            raise ConfigError(f"last={last} must be at least 1 (the newest k step checkpoints)")
    if weights is not None:
        if isinstance(weights, (int, float, str)):
            weights = [weights]
        try:
            weights = [float(w) for w in weights]
        except (TypeError, ValueError):
            raise ConfigError(f"weights={weights!r} is not a list of numbers, e.g. weights=[1,2,3]") from None
        n = len(steps) if steps is not None else last if last is not None else 1
        if len(weights) != n:
            raise ConfigError(
                f"weights= has {len(weights)} numbers for {n} checkpoints; give one weight per checkpoint "
                f"(in step order) or leave weights out (uniform)"
            )
        if not all(math.isfinite(w) for w in weights) or not sum(weights) > 0:
            raise ConfigError(
                f"weights={weights} must be finite numbers whose sum is positive (they are divided by it)"
            )
    return steps, last, weights


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{key}={value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not an integer") from None


# ---- the sources -------------------------------------------------------------------------------------
def step_checkpoints(run_dir: Path) -> dict[int, Path]:
    """{step: checkpoints/step-NNNNNN.ckpt} of a run folder (files or sharded folders)."""
    ckdir = Path(run_dir) / CHECKPOINT_DIR
    found = {}
    for p in ckdir.glob("step-*.ckpt") if ckdir.is_dir() else []:
        m = STEP_FILE.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def choose_sources(run_dir: Path, steps: list[int] | None, last: int | None) -> list[tuple[int, Path]]:
    """The (step, checkpoint) pairs to merge, oldest first; a step the run has no checkpoint of, or more
    checkpoints asked for than it has, is one line naming the steps it has. Neither steps nor last: the run's
    last checkpoint alone (ema=true)."""
    if steps is None and last is None:
        ckpt = find_checkpoint(run_dir)
        return [(checkpoint_step(ckpt), ckpt)]
    have = step_checkpoints(run_dir)
    listed = ", ".join(str(s) for s in have) or "none"
    if last is not None:
        if last > len(have):
            raise GptkitError(
                f"last={last} but {run_dir} has {len(have)} step checkpoint(s) (steps: {listed}); "
                f"use a smaller last= (trainer.keep_checkpoints=null keeps every one)"
            )
        return list(have.items())[-last:]
    missing = [s for s in steps if s not in have]
    if missing:
        raise GptkitError(
            f"{run_dir} has no checkpoint of step(s) {missing} ({run_dir / CHECKPOINT_DIR}/step-*.ckpt: "
            f"steps {listed})"
        )
    return [(s, have[s]) for s in steps]


class _Source:
    """One checkpoint's GPT tensors, read one name at a time: `spec` {name: (shape, dtype)}, tensor(name)."""

    def __init__(self, path: Path, ema: bool = False) -> None:
        self.path = path
        self.sharded = is_sharded_checkpoint(path)
        if self.sharded and ema:
            raise GptkitError(f"{path} is a sharded checkpoint, which holds no EMA (trainer=fsdp refuses it)")
        if self.sharded:
            extra = read_sharded_checkpoint(path, weights=False)
            verify_checkpoint(path)
            self._reader = safe_reader(path)
            try:
                meta = self._reader.read_metadata()
            except GptkitError:
                raise
            except Exception as exc:
                raise sharded_refusal(path, exc) from None
            self.spec = {}
            for fqn, md in meta.state_dict_metadata.items():
                if fqn.startswith("state_dict." + STATE_PREFIX) and hasattr(md, "size"):
                    name = fqn[len("state_dict." + STATE_PREFIX) :]
                    self.spec[name] = (tuple(md.size), md.properties.dtype)
            self.step = int(extra.get("global_step", 0))
            self.lora = adapters.CHECKPOINT_KEY in extra
        else:
            ckpt = load_checkpoint(path)
            self._state = {
                k[len(STATE_PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(STATE_PREFIX)
            }
            self.spec = {k: (tuple(v.shape), v.dtype) for k, v in self._state.items()}
            if ema:
                self._state = self._with_ema(ckpt)
            self.step = int(ckpt.get("global_step", 0))
            self.lora = adapters.CHECKPOINT_KEY in ckpt
        if self.lora:
            raise GptkitError(
                f"{path} holds LoRA adapters, not a whole model; merge the step checkpoints of a full "
                f"training run (or export the LoRA run merged first)"
            )

    def _with_ema(self, ckpt: dict[str, Any]) -> dict[str, Any]:
        """The model's tensors with the EMA's (trainer.ema, in fp32) in place of each trained parameter."""
        record = (ckpt.get("callbacks") or {}).get(EMA_KEY)
        if not record or not record.get("ema"):
            raise GptkitError(
                f"{self.path} holds no EMA of the weights (the run trained without trainer.ema); "
                "drop ema=true"
            )
        averages = dict(record["ema"])
        for alias, first in (record.get("aliases") or {}).items():
            averages[alias] = averages[first]
        unknown = sorted(set(averages) - set(self._state))
        if unknown:
            raise GptkitError(f"{self.path}: its EMA names tensors the model does not have ({unknown[:3]})")
        return {**self._state, **averages}

    def tensor(self, name: str):
        if not self.sharded:
            return self._state[name]
        import torch
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        shape, dtype = self.spec[name]
        out = torch.empty(shape, dtype=dtype)
        # only this tensor's chunks are read (from whichever rank's file holds each)
        target = {"state_dict": {STATE_PREFIX + name: out}}
        try:
            _load_state_dict(target, storage_reader=self._reader, planner=DefaultLoadPlanner(), no_dist=True)
        except (Exception, CheckpointException) as exc:
            raise sharded_refusal(self.path, exc) from None
        return target["state_dict"][STATE_PREFIX + name]


def _fingerprint(path: Path) -> dict[str, Any]:
    """A source's size and CRC-32 (a sharded folder: its files' total size, the CRC-32 of checksums.json,
    which holds every shard's)."""
    if path.is_dir():
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        sums = path / CHECKSUMS if (path / CHECKSUMS).is_file() else path / SHARDED_INDEX
        return {"bytes": size, "crc32": file_crc32(sums), "crc32_of": sums.name}
    return {"bytes": path.stat().st_size, "crc32": file_crc32(path)}


def check_same_shapes(sources: list[_Source]) -> None:
    first = sources[0]
    for s in sources[1:]:
        if set(s.spec) != set(first.spec):
            extra = sorted(set(s.spec) ^ set(first.spec))[:3]
            raise GptkitError(
                f"checkpoints of different shapes in a merge: {s.path} and {first.path} hold different "
                f"tensors ({extra}); merge checkpoints of one model"
            )
        for name, (shape, dtype) in first.spec.items():
            if s.spec[name] != (shape, dtype):
                raise GptkitError(
                    f"checkpoints of different shapes in a merge: {name} is {tuple(s.spec[name][0])} "
                    f"{s.spec[name][1]} in {s.path} but {shape} {dtype} in {first.path}"
                )


# ---- the average -------------------------------------------------------------------------------------
def average_into(sources: list[_Source], weights: list[float], scratch: Path) -> dict[str, Any]:
    """{"model.<name>": the weighted average}, each tensor memory-mapped from its own file under `scratch`,
    computed one name at a time (see the module's docstring)."""
    import torch

    scratch.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    for i, (name, (shape, dtype)) in enumerate(sources[0].spec.items()):
        if dtype.is_floating_point:
            acc = sources[0].tensor(name).to(torch.float32) * weights[0]
            for w, s in zip(weights[1:], sources[1:]):
                acc += s.tensor(name).to(torch.float32) * w
            value = acc.to(dtype)
            del acc
        else:
            value = sources[-1].tensor(name)
        f = scratch / f"{i}.bin"
        nbytes = value.numel() * value.element_size()
        with open(f, "wb") as h:
            h.truncate(nbytes)
        mapped = torch.from_file(str(f), shared=True, size=value.numel(), dtype=dtype) if nbytes else None
        if mapped is None:
            out[STATE_PREFIX + name] = value.clone()
            continue
        mapped = mapped.view(shape)
        mapped.copy_(value)
        del value
        out[STATE_PREFIX + name] = mapped
    return out


def merge_run(
    run_dir: Path,
    out: Path,
    steps: list[int] | None,
    last: int | None,
    weights: list[float] | None,
    ema: bool = False,
) -> dict[str, Any]:
    """Average the chosen step checkpoints of `run_dir` into the new run folder `out` (absent: the caller
    checked); returns the merge record written as out/merge.json. ema: each checkpoint's EMA of the weights
    (trainer.ema) instead of its weights."""
    import torch

    chosen = choose_sources(run_dir, steps, last)
    given = weights or [1.0] * len(chosen)
    total = sum(given)
    norm = [w / total for w in given]
    sources = [_Source(p, ema) for _, p in chosen]
    check_same_shapes(sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.merge.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = average_into(sources, norm, tmp / ".scratch")
        step = max(s for s, _ in chosen)
        atomic_torch_save(
            {"state_dict": state, "global_step": step, "merged_from": [s for s, _ in chosen]},
            tmp / CHECKPOINT_DIR / LAST_CHECKPOINT,
        )
        del state
        shutil.rmtree(tmp / ".scratch")
        for name in COPIED:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
        record = {
            "run": str(run_dir.resolve()),
            "weights_of": "ema (trainer.ema)" if ema else "the checkpoints",
            "rule": "acc = w_0*x_0; acc += w_i*x_i in fp32 (weights normalized to sum 1), cast to the dtype",
            "optimizer_state": "not carried: the merged run evaluates, samples, exports; it does not resume",
            "torch": torch.__version__,
            "sources": [
                {"path": str(p.resolve()), "step": s, "weight": w, "given_weight": g, **_fingerprint(p)}
                for (s, p), w, g in zip(chosen, norm, given)
            ],
        }
        atomic_write_text(tmp / MERGE_FILE, json.dumps(record, indent=1))
        if out.exists():
            old = out.with_name(f".{out.name}.merge.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(
        f"merged steps {[s for s, _ in chosen]} of {run_dir} "
        f"(weights {[round(w, 6) for w in norm]}) -> {out}",
        file=sys.stderr,
    )
    return record
