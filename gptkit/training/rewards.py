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
    model     a reward model's score ({kind: model, path: <run>}: a run of objective=reward, same tokenizer):
              the prompt's tokens and the completion's (its stop token included) through the model, batched:
              one forward for every completion of a micro-batch, the score head at each one's last token

A function is called as fn(prompt, completion, row): the prompt's text (its record's prompt field, else its
messages list), the completion's text (without the end-of-turn token) and the record (a dict); it returns a
number. Loading one runs its file's code: the start-up says which file, once per process, before any of it
runs (a module's packages are found without importing them). A function that raises (SystemExit and a
KeyboardInterrupt of its own included), returns something that is not a finite number, or runs longer than
grpo.reward_timeout seconds stops the run in one line naming the reward and the prompt's file and row; so does
a completion whose total (sum of weight x reward) is not finite. A real Ctrl-C during a reward is a Ctrl-C
(the training's handler decides: the first one finishes the step and saves, a second one stops at once).

The time limit (call_limited): in the main thread of a process (one process, or each DDP / FSDP rank) a
SIGALRM timer (signal.setitimer) interrupts the function wherever it is in Python code, even in a loop that
never returns, and is disarmed (its previous handler and timer restored) after each call; elsewhere (a
thread, a platform without SIGALRM) the function runs in a daemon thread that is abandoned when the limit
passes. A function that catches every stop and carries on ends the process with the error line (ALARM_TRIES);
one stuck inside C code that never returns to Python is not interrupted in the main thread.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import numbers
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gptkit.errors import ConfigError, GptkitError
from gptkit.runs import is_rank_zero
from gptkit.user_code import import_user_code

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


class RewardTimeout(BaseException):
    """Raised in a reward that ran past grpo.reward_timeout (a BaseException: `except Exception` in the
    reward's code does not swallow it)."""


# after the first alarm, it fires again every this many seconds (a reward that swallowed it is stopped
# again), at most this many times more; then the reward's code has caught every stop (a bare `except:` in a
# loop) and the process ends with the error line (os._exit(2): no exception can leave such a loop)
ALARM_REPEAT_S = 0.5
ALARM_TRIES = 4


class Guard:
    """The signal handlers of reward calls in the main thread, installed once for many calls (`with
    Guard():` around a batch's scoring; call_limited makes one per call outside such a block): SIGINT's
    wraps the handler before it (which still decides what a Ctrl-C does) and notes that a real one came;
    SIGALRM's raises RewardTimeout inside a call that ran past its limit. On exit the handlers and the
    ITIMER_REAL timer before it are restored."""

    active: "Guard | None" = None

    def __init__(self) -> None:
        self.inside, self.alarm, self.sigint, self.stuck = False, 0, False, ""
        self.saved: tuple | None = None

    @staticmethod
    def usable() -> bool:
        return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()

    def _on_sigint(self, signum, frame) -> None:
        self.sigint = True
        previous = self.saved[0]
        if previous == signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    def _on_alarm(self, signum, frame) -> None:
        if not self.inside:
            return
        self.alarm += 1
        if self.alarm > ALARM_TRIES:
            print(
                f"error: {self.stuck or 'a reward ran past grpo.reward_timeout'}", file=sys.stderr, flush=True
            )
            os._exit(2)
        raise RewardTimeout

    def __enter__(self) -> "Guard":
        if Guard.active is None and self.usable():
            timer = signal.setitimer(signal.ITIMER_REAL, 0)
            self.saved = (
                signal.getsignal(signal.SIGINT),
                signal.getsignal(signal.SIGALRM),
                timer,
                time.monotonic(),
            )
            signal.signal(signal.SIGINT, self._on_sigint)
            signal.signal(signal.SIGALRM, self._on_alarm)
            Guard.active = self
        return self

    def __exit__(self, *exc) -> None:
        if Guard.active is not self:
            return
        Guard.active = None
        previous_int, previous_alarm, timer, start = self.saved
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_alarm)
        signal.signal(signal.SIGINT, previous_int)
        if timer[0] > 0:
            left = timer[0] - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), timer[1])

    def call(self, fn: Callable, args: tuple, timeout: float | None, stuck: str) -> Any:
        self.inside, self.alarm, self.sigint, self.stuck = True, 0, False, stuck
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, float(timeout), ALARM_REPEAT_S)
        try:
            value = fn(*args)
        except KeyboardInterrupt as exc:
            if self.sigint:
                exc.gptkit_sigint = True
            raise
        finally:
            self.inside = False
            if timeout:
                signal.setitimer(signal.ITIMER_REAL, 0)
        if self.alarm:
            # the alarm fired and the reward's code caught it
            raise RewardTimeout
        return value


def reward_timeout(limit: Any) -> float | None:
    """grpo.reward_timeout as seconds (None: no limit, for 0 or null), or a one-line ConfigError."""
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= float(limit) < math.inf
    ):
        raise ConfigError(
            f"grpo.reward_timeout={limit!r} must be a number of seconds >= 0 (0 or null: no limit): how "
            "long one reward call may take"
        )
    return float(limit or 0.0) or None


def call_limited(fn: Callable, args: tuple, timeout: float | None, stuck: str = "") -> Any:
    """fn(*args), stopped with RewardTimeout after `timeout` seconds (None or 0: no limit). A
    KeyboardInterrupt that a real SIGINT raised during the call comes out with gptkit_sigint = True (one the
    code raised itself does not). Module docstring: SIGALRM in the main thread (the Guard of the batch, or
    one for this call), else a daemon thread. `stuck`: the error line printed before the process ends when
    fn catches every RewardTimeout (ALARM_TRIES)."""
    if not Guard.usable():
        return _call_in_thread(fn, args, timeout) if timeout else fn(*args)
    if Guard.active is not None:
        return Guard.active.call(fn, args, timeout, stuck)
    with Guard() as guard:
        return guard.call(fn, args, timeout, stuck)


def _call_in_thread(fn: Callable, args: tuple, timeout: float) -> Any:
    """fn(*args) in a daemon thread, waited for `timeout` seconds: RewardTimeout when it is still running
    (it is abandoned), else its value or its exception."""
    out: dict[str, Any] = {}

    def target():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=target, name="gptkit-reward", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RewardTimeout
    if "error" in out:
        raise out["error"]
    return out["value"]


# kind -> (check, needs a pattern, default pattern, reads a field by default)
CHECKERS: dict[str, tuple[Callable, bool, str | None, bool]] = {
    "exact": (exact, False, None, True),
    "contains": (contains, False, None, True),
    "number": (number, False, None, True),
    "regex": (regex, True, None, True),
    "format": (format_check, False, R1_FORMAT, False),
}


def _regex_answer(completion: str, r: "Reward") -> str | None:
    m = r.compiled.search(completion)
    if m is None:
        return None
    return (m.group(1) if r.compiled.groups else m.group()).strip() or None


# kind -> the answer a checker compares with the record's field (the vote of maj@k in grpo.val_samples; a
# checker without one, contains and format, gives no maj@k); the checker's reward is a function of it
ANSWERS: dict[str, Callable[[str, "Reward"], Any]] = {
    "exact": lambda completion, r: completion.strip() or None,
    "number": lambda completion, r: last_number(completion),
    "regex": _regex_answer,
}
ENTRY_KEYS = ("kind", "function", "weight", "field", "pattern", "name", "path")
# a reward model's kind: scored batched (RewardModel), not one completion at a time
MODEL_KIND = "model"


class RewardModel:
    """A reward run (objective=reward: a model with model.score_head) that scores token sequences, batched;
    its weights are loaded on first use, on the policy's device, frozen and in eval mode."""

    def __init__(self, path: str, spec: str) -> None:
        self.path, self.spec = path, spec
        self.model: Any = None

    def check(self) -> None:
        """The run is there and is a reward model: one-line errors before anything is written."""
        from gptkit.checkpoints import run_dir_of
        from gptkit.runs import find_run_checkpoint, read_config

        try:
            model = read_config(run_dir_of(find_run_checkpoint(self.path)))["model"]
        except GptkitError as exc:
            raise ConfigError(f"grpo.rewards {self.spec}: {exc}") from None
        if not model.get("score_head"):
            raise ConfigError(
                f"grpo.rewards {self.spec}: {self.path} is not a reward model (no model.score_head); train "
                "one with objective=reward (docs/reward-models.md)"
            )

    def load(self, device: Any, tokenizer: Any) -> Any:
        """The model on `device` (loaded once); a reward run of another vocabulary is a one-line error."""
        if self.model is None:
            from gptkit.runs import load_run

            run = load_run(self.path, device=str(device))
            if tokenizer is not None and run.tokenizer.get_vocab() != tokenizer.get_vocab():
                raise GptkitError(
                    f"grpo.rewards {self.spec}: {run.dir}'s tokenizer is not the policy's; a reward model "
                    "reads the policy's token ids, so it must share its tokenizer"
                )
            run.model.requires_grad_(False)
            self.model = run.model.eval()
        return self.model

    def scores(self, seqs: list[list[int]], device: Any, tokenizer: Any = None) -> list[float]:
        """The reward of each token sequence: one forward of them all, padded on the right, the score head
        at each one's last token."""
        import torch

        model = self.load(device, tokenizer)
        longest = max(len(q) for q in seqs)
        if longest > model.cfg.max_seq_len:
            raise GptkitError(
                f"grpo.rewards {self.spec}: a prompt with its completion is {longest} tokens, more than the "
                f"reward model's model.max_seq_len={model.cfg.max_seq_len}; lower grpo.max_new_tokens or "
                "trainer.seq_len"
            )
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, : len(q)] = torch.tensor(q, dtype=torch.long)
        last = torch.tensor([len(q) - 1 for q in seqs], dtype=torch.long)
        with torch.no_grad():
            out = model(ids.to(device), score_at=last.to(device)).scores  # [N] fp32
        return [float(v) for v in out.float().cpu()]


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
    # kind: model, the reward run (RewardModel)
    model: RewardModel | None = None

    @property
    def checker(self) -> bool:
        """A built-in check: its reward is 0 or 1, its mean an accuracy."""
        return self.kind is not None and self.kind in CHECKERS

    @property
    def answers(self) -> bool:
        """A checker that compares an answer it extracts (exact, number, regex with a field): maj@k votes."""
        return self.checker and self.kind in ANSWERS and not (self.kind == "regex" and self.field is None)

    def answer(self, completion: str) -> Any:
        """The answer this checker extracts from a completion (None: none)."""
        return ANSWERS[self.kind](completion, self)

    @property
    def batched(self) -> bool:
        """A reward model: scored for a micro-batch's completions at once (Rewards.model_scores)."""
        return self.model is not None

    @property
    def spec(self) -> str:
        """How errors name it: the name, and the function or kind."""
        return f"{self.name} ({self.function or self.kind}{' ' + self.model.path if self.model else ''})"

    def __call__(
        self, prompt: Any, completion: str, row: dict, where: str, timeout: float | None = None
    ) -> float:
        """The reward of one completion, within timeout seconds (None: no limit); a reward that raises (any
        exception, SystemExit and its own KeyboardInterrupt included), runs past the limit or returns no
        finite number is a one-line GptkitError naming this reward and the prompt's file and row. A real
        Ctrl-C during the call is left to the process's SIGINT handler (module docstring)."""
        if self.kind is not None:
            fn, args = CHECKERS[self.kind][0], (completion, row, self, where)
        else:
            fn, args = self.fn, (prompt, completion, row)
        late = (
            f"reward {self.spec} did not return within grpo.reward_timeout={timeout:g} s on the prompt of "
            f"{where}; make it faster, or raise grpo.reward_timeout (0: no limit)"
            if timeout
            else ""
        )
        try:
            value = call_limited(fn, args, timeout, late)
        except GptkitError:
            if self.kind is not None:
                # a checker's own one-line error (a record without its field)
                raise
            exc = sys.exc_info()[1]
            raise GptkitError(
                f"reward {self.spec} raised {type(exc).__name__}: {str(exc)[:200]} on the prompt of {where}"
            ) from None
        except RewardTimeout:
            raise GptkitError(late) from None
        except SystemExit as exc:
            raise GptkitError(
                f"reward {self.spec} called sys.exit({exc.code!r}) on the prompt of {where}; a reward "
                "returns a number, it does not end the run"
            ) from None
        except BaseException as exc:  # noqa: BLE001 - the user's code may fail in any way
            if isinstance(exc, KeyboardInterrupt) and getattr(exc, "gptkit_sigint", False):
                # a real Ctrl-C (the handler of the run raised it): the run stops as on any Ctrl-C
                raise
            text = str(exc)[:200]
            raise GptkitError(
                f"reward {self.spec} raised {type(exc).__name__}{': ' + text if text else ''} on the prompt "
                f"of {where}"
            ) from None
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise GptkitError(
                f"reward {self.spec} returned {str(value)[:80]!r} ({type(value).__name__}) on the prompt of "
                f"{where}; a reward is a finite number"
            )
        return float(value)


@dataclass
class Rewards:
    """Every reward of a run and how they add up: total = sum of weight x reward."""

    rewards: list[Reward] = field(default_factory=list)
    # seconds one reward call may take (grpo.reward_timeout; None: no limit)
    timeout: float | None = None

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def guard(self) -> Guard:
        """`with rewards.guard():` around many calls: their signal handlers installed once (Guard)."""
        return Guard()

    def score(
        self, prompt: Any, completion: str, row: dict, where: str, given: dict[int, float] | None = None
    ) -> list[float]:
        """Each reward of one completion, in order; `given`: the batched ones' (model_scores), by index."""
        given = given or {}
        return [
            given[i] if i in given else r(prompt, completion, row, where, self.timeout)
            for i, r in enumerate(self.rewards)
        ]

    def model_scores(
        self, seqs: list[list[int]], device: Any, tokenizer: Any = None
    ) -> list[dict[int, float]]:
        """For each token sequence (a prompt with its completion), the reward models' scores by reward index:
        one batched forward per reward model ([{}] * len(seqs) when there is none)."""
        out: list[dict[int, float]] = [{} for _ in seqs]
        for i, r in enumerate(self.rewards):
            if r.batched and seqs:
                for d, v in zip(out, r.model.scores(seqs, device, tokenizer)):
                    d[i] = v
        return out

    def total(self, scores: list[float], where: str = "") -> float:
        """sum of weight x reward; one that is not finite (finite rewards whose sum overflows) is a one-line
        GptkitError naming each reward, its value and the prompt's file and row."""
        total = sum(r.weight * s for r, s in zip(self.rewards, scores))
        if not math.isfinite(total):
            terms = ", ".join(f"{r.weight:g} x {r.name} {s:g}" for r, s in zip(self.rewards, scores))
            raise GptkitError(
                f"the total reward is {total} ({terms}) on the prompt of {where or 'a completion'}: not a "
                "finite number; keep the rewards (and their weights) in a range whose sum is finite"
            )
        return total

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
        if d.get("kind") == MODEL_KIND:
            if not d.get("path"):
                raise ConfigError(
                    f"grpo.rewards[{i}]: kind: model needs path: <a reward run> (objective=reward)"
                )
            name = str(d.get("name") or MODEL_KIND)
            r = Reward(name, weight, kind=MODEL_KIND)
            r.model = RewardModel(str(d["path"]), f"{name} (model {d['path']})")
        elif "path" in d:
            raise ConfigError(f"grpo.rewards[{i}].path is for kind: model (a reward run) only")
        elif "kind" in d:
            kind = str(d["kind"])
            if kind not in CHECKERS:
                raise ConfigError(
                    f"grpo.rewards[{i}].kind={kind!r} is not one of {', '.join(CHECKERS)}, {MODEL_KIND}"
                )
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


def _module_file(module: str) -> tuple[Path | None, bool]:
    """(the file a module:function names, whether it is an importable module name), found without running
    any code: a dotted name's packages are looked up on their search paths, not imported (their __init__.py
    runs only after the start-up has said which file's code runs)."""
    if module.endswith(".py") or "/" in module or "\\" in module:
        return Path(module).expanduser().resolve(), False
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(
            f"reward module {module!r} is not a module name (or name its file: path/to/rewards.py:function)"
        )
    spec, search = None, None
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
        elif i == 0:
            try:
                # a top-level name: finding it imports nothing
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError) as exc:
                raise ConfigError(f"reward module {module!r} cannot be found: {exc}") from None
        else:
            spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            raise ConfigError(
                f"reward module {module!r} cannot be found (or name its file: path/to/rewards.py:function)"
            )
        search = (
            list(loaded.__path__)
            if loaded is not None and hasattr(loaded, "__path__")
            else spec.submodule_search_locations
        )
        if i < len(parts) - 1 and search is None:
            raise ConfigError(f"reward module {module!r} cannot be found: {name} is not a package")
    return (Path(spec.origin) if spec.origin and spec.has_location else None), True


def load_rewards(rewards: Rewards, announce: bool = True) -> Rewards:
    """Load each user function (once per process), saying first on stderr which file's code runs; check each
    reward model's run (its weights load on first use)."""
    for r in rewards.rewards:
        if r.model is not None:
            r.model.check()
        if r.function is None or r.fn is not None:
            continue
        key = (r.function, str(Path.cwd()))
        if key not in _LOADED:
            module, _, name = r.function.rpartition(":")
            path, importable = _module_file(module)
            if not importable and (path is None or not path.is_file()):
                raise ConfigError(f"grpo.rewards: {r.function}: {path} is not a file")
            if announce and is_rank_zero():
                # said before any of its code (a package's __init__.py included) runs
                print(
                    f"grpo.rewards runs {path or module} ({r.function}): use only reward code you trust",
                    file=sys.stderr,
                    flush=True,
                )
            mod = import_user_code(
                None if importable else path,
                module,
                "gptkit_reward_",
                f"grpo.rewards: importing {path or module}",
            )
            fn = getattr(mod, name, None)
            if not callable(fn):
                raise GptkitError(f"grpo.rewards: {path} has no function {name}")
            _LOADED[key] = (fn, str(path))
        r.fn, r.file = _LOADED[key]
    return rewards
