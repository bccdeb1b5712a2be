"""Downstream tasks through lm-eval (an optional dependency: `pip install "gptkit[eval]"`): which tasks a
`tasks=` value names, loading them (offline when their data is local), running them on a gptkit model
through GptkitLM (its results table and files: gptkit.evaluation.task_results).

A `tasks=` entry is a task or group name of lm-eval's registry (hellaswag, arc_easy, mmlu, ...), a task YAML
file, or a folder of task YAMLs. In a local YAML, relative `dataset_kwargs.data_files` (and a relative
`dataset_path` folder) are read relative to the YAML's own folder, so a folder of YAML + jsonl files runs
from anywhere, with no network.
"""

from __future__ import annotations

import difflib
import functools
import glob
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gptkit import hub
from gptkit.errors import ConfigError, GptkitError
from gptkit.extras import require

# lm-eval (optional: gptkit[eval]) and datasets are imported where tasks run.

# where a task named by its name comes from
REGISTRY = "lm-eval's registry"
OFFLINE_HINT = (
    "point the task at local files instead: a task YAML with dataset_path: json and "
    "dataset_kwargs.data_files next to it, then tasks=path/to/that/folder (docs/tasks.md)"
)


def require_lm_eval() -> None:
    """One line naming the install command when lm-eval cannot be imported (gptkit.extras)."""
    require("eval")


def parse_tasks(value: Any) -> list[str]:
    """tasks= as a list of entries: `a,b` (one string) or a YAML list [a, b]."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        value = str(value).strip()
        value = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    items = value if isinstance(value, (list, tuple)) else value.split(",")
    out = [str(t).strip() for t in items if str(t).strip()]
    if not out:
        raise ConfigError("tasks= names no task; give tasks=hellaswag,arc_easy or tasks=path/to/task_dir")
    return out


def quiet_lm_eval(progress: bool = False) -> None:
    """lm-eval and datasets log every step at INFO/WARNING: keep errors only. Without progress, their
    progress bars are off too (lm-eval's task module draws one per task as it builds the prompts).

    simple_evaluate also records the git commit of the current folder (`git describe`, which prints
    "fatal: not a git repository" outside one) and torch's environment report (a dozen subprocesses, seconds
    on a busy machine): neither describes a gptkit run, whose results files name the run, the checkpoint and
    the lm-eval version instead, so both are switched off."""
    import datasets
    import lm_eval.api.task
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.evaluator.add_env_info = lambda storage: None

    for name in ("lm_eval", "lm-eval", "datasets", "fsspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    datasets.logging.set_verbosity_error()
    if not progress:
        datasets.disable_progress_bars()
        lm_eval.api.task.tqdm = functools.partial(tqdm, disable=True)


# ---- finding the tasks --------------------------------------------------------------------------------
def _absolute(base: Path, value: Any, where: str | None) -> Any:
    """data_files (or data_dir) entries relative to the YAML's folder `base`, where such a file exists. With
    `where` (files of a local file builder: dataset_path json, csv, ...) always there, never in the current
    folder, where a file of the same name would be read instead, and a named path that does not exist is one
    line, `where` first (a glob or a URL is left to datasets). Without it (a Hub data set's files, relative
    to its repository) an entry with no such file next to the YAML is left as it is."""
    if isinstance(value, str):
        p = Path(value).expanduser()
        if "://" in value or p.is_absolute():
            return value
        if where is not None and not glob.has_magic(value) and not (base / p).exists():
            raise GptkitError(
                f"{where} names {value}, and {base / p} does not exist (relative data files are read from "
                f"the YAML's folder)"
            )
        return str((base / p).resolve()) if (base / p).exists() or where is not None else value
    if isinstance(value, list):
        return [_absolute(base, v, where) for v in value]
    if isinstance(value, dict):
        return {k: _absolute(base, v, where) for k, v in value.items()}
    return value


def local_task_config(path: Path) -> dict[str, Any] | None:
    """The task config of a local YAML (includes and !function resolved by lm-eval's loader), data paths
    made absolute; None for a YAML that defines no task (a group, or a template others include)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path)
    except Exception as exc:  # noqa: BLE001 - a bad YAML is the user's, said in one line
        raise GptkitError(
            f"{path} is not a task YAML lm-eval can read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if not isinstance(cfg.get("task"), str):
        return None
    base = path.resolve().parent
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    local_files = cfg.get("dataset_path") in _file_builders()
    for key in ("data_files", "data_dir"):
        if key in kwargs:
            where = f"{path}: dataset_kwargs.{key}" if local_files else None
            kwargs[key] = _absolute(base, kwargs[key], where)
    if kwargs:
        cfg["dataset_kwargs"] = kwargs
    dp = cfg.get("dataset_path")
    if isinstance(dp, str) and (base / dp).exists() and not Path(dp).is_absolute():
        cfg["dataset_path"] = str((base / dp).resolve())
    return cfg


@dataclass
class TaskSpecs:
    # registry names
    names: list[str] = field(default_factory=list)
    # configs from local YAMLs
    local: list[dict[str, Any]] = field(default_factory=list)
    # task name -> YAML path, for local tasks
    sources: dict[str, str] = field(default_factory=dict)


def _task_files(folder: Path) -> list[Path]:
    """The YAML files of a task folder, every one of which is loaded."""
    return sorted(f for f in folder.rglob("*.y*ml") if f.suffix in (".yaml", ".yml"))


def find_tasks(entries: list[str], option: str = "tasks") -> TaskSpecs:
    """Split tasks= entries into registry names and local task configs (folders: every YAML in them); an
    error names the `option` the entries came from (tasks, or trainer.eval_tasks).

    Loading a local YAML imports the Python its `!function` tags name: say code_notices() first."""
    specs = TaskSpecs()
    for entry in entries:
        p = Path(entry).expanduser()
        if p.is_dir():
            files = _task_files(p)
            found = [(f, local_task_config(f)) for f in files]
            found = [(f, c) for f, c in found if c is not None]
            if not found:
                raise ConfigError(
                    f"{option}={entry}: the folder holds no task YAML (a .yaml file with a `task:` name)"
                )
        elif p.suffix in (".yaml", ".yml"):
            if not p.is_file():
                raise ConfigError(f"{option}={entry}: no such file")
            cfg = local_task_config(p)
            if cfg is None:
                raise ConfigError(f"{option}={entry} defines no task (no `task:` name in it)")
            found = [(p, cfg)]
        elif "/" in entry or entry.startswith("."):
            raise ConfigError(f"{option}={entry}: no such folder or task YAML")
        else:
            specs.names.append(entry)
            continue
        for f, cfg in found:
            specs.local.append(cfg)
            specs.sources[cfg["task"]] = str(f)
    return specs


# ---- the Python a task folder runs --------------------------------------------------------------------
def _function_refs(path: Path, seen: set[Path]) -> list[tuple[Path, str]]:
    """(folder of the YAML, "module.name") for every `!function` tag of a YAML and of the YAMLs it includes,
    from the YAML text alone: nothing is imported."""
    import yaml

    path = path.expanduser().resolve()
    if path in seen or not path.is_file():
        return []
    seen.add(path)
    refs: list[tuple[Path, str]] = []

    class Reader(yaml.SafeLoader):
        pass

    def function(loader, node):
        if isinstance(node, yaml.ScalarNode):
            refs.append((path.parent, str(loader.construct_scalar(node))))
        return None

    Reader.add_constructor("!function", function)
    # any other tag: lm-eval's loader says what is wrong with it
    Reader.add_multi_constructor("", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=Reader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        # lm-eval's loader fails on it too, before it imports anything
        return refs
    includes = doc.get("include") if isinstance(doc, dict) else None
    for inc in includes if isinstance(includes, list) else [includes]:
        if isinstance(inc, str):
            refs += _function_refs(Path(inc) if Path(inc).is_absolute() else path.parent / inc, seen)
    return refs


def task_code(entry: str) -> tuple[Path, list[Path], list[str]]:
    """(the entry's folder, the Python files and the installed modules its YAMLs import through `!function`)
    for a local tasks= entry; lm-eval's rule: module.name is <the YAML's folder>/module.py when that file
    exists, else an importable module."""
    p = Path(entry).expanduser()
    if p.is_dir():
        folder, files = p, _task_files(p)
    elif p.suffix in (".yaml", ".yml") and p.is_file():
        folder, files = p.parent, [p]
    else:
        return p, [], []
    seen: set[Path] = set()
    local: dict[Path, None] = {}
    modules: dict[str, None] = {}
    for base, spec in (ref for f in files for ref in _function_refs(f, seen)):
        module = spec.rpartition(".")[0]
        if not module:
            continue
        py = (base / f"{module.replace('.', '/')}.py").resolve()
        if py.is_file():
            local[py] = None
        else:
            modules[module] = None
    return folder, list(local), list(modules)


def code_notices(entries: list[str], option: str = "tasks") -> list[str]:
    """One line per local tasks= entry whose YAMLs import Python (`!function module.name`), naming it; to be
    said before find_tasks() loads them, which runs that code."""
    lines = []
    for entry in entries:
        folder, files, modules = task_code(entry)
        if not files and not modules:
            continue
        where = folder.resolve()
        names = [str(f.relative_to(where)) if f.is_relative_to(where) else str(f) for f in files]
        what = f"{', '.join(names)} from {folder}" if names else ""
        if modules:
            what += f"{' and ' if what else ''}Python module(s) {', '.join(modules)}"
        lines.append(f"{option}={entry} runs {what}: use only task folders you trust")
    return lines


def task_manager(specs: TaskSpecs):
    """lm-eval's TaskManager: its whole registry only when a name needs it (indexing it takes a while)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=bool(specs.names))


def check_names(names: list[str], manager) -> None:
    """An unknown task name is one line, with the closest names of lm-eval's registry."""
    known = set(manager.all_tasks)
    for name in names:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown task {name!r}: not in lm-eval's registry ({len(known):,} tasks and "
            f"groups), nor a task YAML or folder{hint}"
        )


# ---- data sets on the Hub ---------------------------------------------------------------------------------
# datasets' builders of local files (json, csv, parquet, ...): a dataset_path that names none of them, nor a
# local path, is a data set of the Hugging Face Hub
_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml", "webdataset")


def _file_builders() -> set[str]:
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        return set(_PACKAGED_DATASETS_MODULES)
    except ImportError:
        return set(_FILE_BUILDERS)


def hub_tasks(specs: TaskSpecs) -> list[str]:
    """The tasks whose data set comes from the Hugging Face Hub: every registry name (their YAMLs name Hub
    data sets) and each local task whose dataset_path is neither a local path nor a file builder."""
    builders = _file_builders()
    local = [
        cfg["task"]
        for cfg in specs.local
        if isinstance(cfg.get("dataset_path"), str)
        and cfg["dataset_path"]
        and cfg["dataset_path"] not in builders
        and not Path(cfg["dataset_path"]).expanduser().exists()
    ]
    return [*specs.names, *local]


def _cached_hub_data() -> bool:
    """Whether the Hugging Face caches hold any data set of the Hub at all: huggingface_hub's datasets--*
    folders, or a folder of datasets' cache other than its file builders' (local json, csv... files)."""
    import datasets.config
    from huggingface_hub import constants

    hub_cache = Path(constants.HF_HUB_CACHE).expanduser()
    if hub_cache.is_dir() and any(d.name.startswith("datasets--") for d in hub_cache.iterdir()):
        return True
    data_cache = Path(datasets.config.HF_DATASETS_CACHE).expanduser()
    builders = _file_builders()
    return data_cache.is_dir() and any(d.is_dir() and d.name not in builders for d in data_cache.iterdir())


def check_hub(specs: TaskSpecs) -> None:
    """Before lm-eval is asked for any data set (and before its registry is indexed): tasks whose data sets
    are on the Hub fail in one line when the Hub is unreachable (a connect with a short timeout: no retries),
    or offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) when the caches hold no Hub data set at all. Offline
    with a cache, lm-eval reads it (a data set missing from it is one line in load_tasks)."""
    names = hub_tasks(specs)
    if not names:
        return
    where = ", ".join(f"{n} ({specs.sources.get(n, REGISTRY)})" for n in names)
    task = f"task{'s' if len(names) > 1 else ''} {where}"
    if not hub.offline("HF_DATASETS_OFFLINE"):
        hub.check_hub_reachable(
            hub.TIMEOUT_S,
            f"{task} read{'' if len(names) > 1 else 's'} data from it: set HF_HUB_OFFLINE=1 to read a copy "
            f"already in the Hugging Face cache, or {OFFLINE_HINT}",
        )
        return
    if not _cached_hub_data():
        import datasets.config
        from huggingface_hub import constants

        said = " and ".join(
            f"{v}={os.environ[v]!r}" for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if v in os.environ
        )
        raise GptkitError(
            f"{task} need{'' if len(names) > 1 else 's'} data from the Hugging Face Hub, {said} "
            f"forbids downloading, and the Hugging Face caches ({constants.HF_HUB_CACHE}, "
            f"{datasets.config.HF_DATASETS_CACHE}) hold no Hub data set; run once online to cache it, "
            f"or {OFFLINE_HINT}"
        )


def _is_offline_error(exc: BaseException) -> bool:
    seen: set[int] = set()
    e: BaseException | None = exc
    words = (
        "offline",
        "couldn't reach",
        "connection",
        "connect",
        "resolve",
        "network",
        "name or service",
        "not found on the hub",
        "localentrynotfound",
        "max retries",
    )
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__} {e}".lower()
        if any(w in text for w in words) or type(e).__name__ in (
            "DatasetNotFoundError",
            "OfflineModeIsEnabled",
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


class _Held(logging.Handler):
    """Keeps the records it is given (datasets' logs while a task loads)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def load_tasks(specs: TaskSpecs, manager) -> dict:
    """lm-eval's task dict for every spec; a hub data set that cannot be fetched is one line, and so is data
    that datasets cannot read: its log line that names the file and the fault (it raises only "An error
    occurred while generating the dataset") is held back while a task loads and said in that line (on
    success what was held is logged as it would have been)."""
    from lm_eval.tasks import get_task_dict

    out: dict = {}
    log = logging.getLogger("datasets")
    for spec in [*specs.names, *specs.local]:
        name = spec if isinstance(spec, str) else spec["task"]
        held, handlers, propagate = _Held(), log.handlers, log.propagate
        log.handlers, log.propagate = [held], False
        try:
            out.update(get_task_dict([spec], manager))
        except GptkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - lm-eval and datasets raise many kinds: each is one line
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            said = [r.getMessage() for r in held.records if r.levelno >= logging.ERROR and r.getMessage()]
            if said:
                first += f" ({said[-1].splitlines()[0][:300]})"
            if _is_offline_error(exc):
                where = specs.sources.get(name, REGISTRY)
                offline = os.environ.get("HF_DATASETS_OFFLINE", "")
                raise GptkitError(
                    f"task {name} ({where}) needs its data set from the Hugging Face Hub, "
                    f"which cannot be reached (HF_DATASETS_OFFLINE={offline!r}, or no network) "
                    f"and is not in the local cache; run it once online to cache it, or "
                    f"{OFFLINE_HINT}"
                ) from None
            raise GptkitError(f"task {name} could not be loaded: {type(exc).__name__}: {first}") from None
        finally:
            log.handlers, log.propagate = handlers, propagate
        for record in held.records:
            log.handle(record)
    return out


def leaf_tasks(task_dict: dict) -> dict[str, Any]:
    """name -> Task for every task of a (possibly nested, grouped) task dict."""
    out = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            out.update(leaf_tasks(value))
        else:
            out[key if isinstance(key, str) else key.task_name] = value
    return out


def check_fewshot(tasks: dict[str, Any], num_fewshot: int | None) -> None:
    """num_fewshot (or a task's own, when null) larger than the task's pool of examples is one line (lm-eval
    would fail deep inside)."""
    if num_fewshot is not None and (
        not isinstance(num_fewshot, int) or isinstance(num_fewshot, bool) or num_fewshot < 0
    ):
        raise ConfigError(f"num_fewshot={num_fewshot} must be an integer >= 0 (or null: each task's own)")
    for name, task in tasks.items():
        own = task.config.num_fewshot
        # lm-eval keeps an own 0
        n = num_fewshot if num_fewshot is not None and own != 0 else int(own or 0)
        if n == 0:
            continue
        pool = list(task.fewshot_docs() or [])
        split = _fewshot_split(task)
        need = n + (1 if split is not None and split == _eval_split(task) else 0)
        if len(pool) < need:
            same = " (drawn from the evaluated split, so one fewer than its size)" if need > n else ""
            given = f"num_fewshot={n}" if num_fewshot is not None else f"its num_fewshot: {n}"
            raise ConfigError(
                f"{given} but task {name} has {len(pool)} few-shot example(s){same}; use "
                f"num_fewshot<={max(0, len(pool) - (need - n))}"
            )


def unscorable(tasks: dict[str, Any], lm) -> dict[str, str]:
    """name -> why, for each task that needs a special token the run's tokenizer lacks (said before any
    scoring)."""
    out = {}
    for name, task in tasks.items():
        if task.config.output_type == "loglikelihood_rolling" and lm.bos_id is None and lm.eos_id is None:
            out[name] = (
                "scores whole texts (loglikelihood_rolling), which start with a BOS or end-of-text "
                "token, and the run's tokenizer has neither; train with tokenizer.eos_token set to "
                "score it"
            )
    return out


def skip_notice(name: str, why: str) -> str:
    """The line that says a task is skipped, and why."""
    return f"skipped task {name}: it {why}"


def nothing_to_score(skipped: dict[str, str]) -> GptkitError:
    """The one line when every task is skipped."""
    return GptkitError("; ".join(f"task {name} {why}" for name, why in skipped.items()))


def skip_tasks(specs: TaskSpecs, skipped: dict[str, str]) -> TaskSpecs:
    """The specs without the skipped tasks. One line instead when nothing would be left, or when a skipped
    task is part of a group (the group's scores would silently leave it out)."""
    if not skipped:
        return specs
    given = {*specs.names, *(cfg["task"] for cfg in specs.local)}
    for name, why in skipped.items():
        if name not in given:
            raise GptkitError(f"task {name} (in a group of tasks={', '.join(sorted(given))}) {why}")
    left = TaskSpecs(
        names=[n for n in specs.names if n not in skipped],
        local=[cfg for cfg in specs.local if cfg["task"] not in skipped],
        sources={k: v for k, v in specs.sources.items() if k not in skipped},
    )
    if not left.names and not left.local:
        raise nothing_to_score(skipped)
    return left


def _eval_split(task) -> str | None:
    c = task.config
    return c.test_split if c.test_split else c.validation_split


def _fewshot_split(task) -> str | None:
    c = task.config
    fs = getattr(c, "fewshot_config", None) or {}
    split = fs.get("split") if isinstance(fs, dict) else getattr(fs, "split", None)
    if split or c.fewshot_split:
        return split or c.fewshot_split
    if isinstance(fs, dict) and fs.get("samples") is not None:
        return None
    return c.training_split or c.validation_split or c.test_split


# ---- running them ---------------------------------------------------------------------------------------
def run_tasks(
    lm,
    specs: TaskSpecs,
    manager,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    bootstrap_iters: int = 100000,
    seed: int = 1234,
    log_samples: bool = False,
    samples: dict[str, list[int]] | None = None,
) -> dict:
    """lm-eval's simple_evaluate on the tasks as given (registry names, local configs) with the given LM
    (manager: the TaskManager that found them; without one lm-eval would index its whole registry again);
    lm-eval's results dict. load_tasks() before it has said any error in one line. samples: {task: the
    indices of its documents to evaluate} (instead of limit)."""
    from lm_eval import simple_evaluate

    # as given: a group (mmlu) is then aggregated over its tasks
    tasks = [*specs.names, *specs.local]
    return simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        samples=samples,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        task_manager=manager,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def check_limit(limit: Any) -> int | float | None:
    """limit= as lm-eval takes it: an integer >= 1 (examples per task) or a fraction in (0, 1)."""
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise ConfigError(
            f"limit={limit!r} must be a number: examples per task (>= 1) or a fraction (0 < limit < 1)"
        )
    if isinstance(limit, float) and 0 < limit < 1:
        return limit
    if limit >= 1 and float(limit).is_integer():
        return int(limit)
    raise ConfigError(
        f"limit={limit} must be an integer >= 1 (examples per task) or a fraction 0 < limit < 1"
    )


# ---- a fixed subset, scored again and again (trainer.eval_tasks) ----------------------------------------
class TaskSubset:
    """The first `limit` examples of a task (this rank's share of them: examples rank, rank + world_size,
    ...), with its requests (few-shot contexts included) built once, so every scoring sees the same prompts.

    score(lm) runs the requests as lm-eval's evaluator does (by request type, then the task's filters and
    process_results) and returns the per-example metric values; aggregate() turns values gathered from every
    rank into the task's metrics."""

    def __init__(self, name: str, task, limit: int | None, rank: int = 0, world_size: int = 1) -> None:
        self.name, self.task = name, task
        task.build_all_requests(limit=limit, rank=rank, world_size=world_size)
        self.docs = list(task.doc_iterator(rank=rank, limit=limit, world_size=world_size))
        self.instances = list(task.instances)
        self.requests = len(self.instances)

    def score(self, lm) -> dict[str, list]:
        """'metric,filter' -> one value per example of this share."""
        by_type = defaultdict(list)
        for inst in self.instances:
            inst.resps = []
            by_type[inst.request_type].append(inst)
        for reqtype, reqs in by_type.items():
            cloned = [r for r in reqs for _ in range(r.repeats)]
            for x, r in zip(getattr(lm, reqtype)(cloned), cloned):
                r.resps.append(x)
        # apply_filters works on the task's instances: make them ours
        self.task._instances = self.instances
        self.task.apply_filters()
        by_doc = defaultdict(list)
        for inst in self.instances:
            by_doc[inst.doc_id].append(inst)
        raw: dict[str, list] = defaultdict(list)
        for filter_key in self.instances[0].filtered_resps if self.instances else {}:
            for doc_id, doc in self.docs:
                insts = sorted(by_doc[doc_id], key=lambda i: i.idx)
                metrics = self.task.process_results(doc, [i.filtered_resps[filter_key] for i in insts])
                for metric, value in metrics.items():
                    raw[f"{metric},{filter_key}"].append(value)
        return dict(raw)

    def aggregate(self, raw: dict[str, list]) -> dict[str, float]:
        """'<task>/<metric>' (filter added unless `none`) -> the task's aggregation over every value."""
        agg = self.task.aggregation()
        out = {}
        for key, values in raw.items():
            metric, filter_key = key.split(",", 1)
            if metric in agg and values:
                name = metric if filter_key == "none" else f"{metric}_{filter_key}"
                out[f"{self.name}/{name}"] = float(agg[metric](values))
        return out


def merge_shares(shares: list[dict[str, list]]) -> dict[str, list]:
    """The per-example values of every rank's share, as one."""
    out: dict[str, list] = {}
    for share in shares:
        for key, values in share.items():
            out.setdefault(key, []).extend(values)
    return out


def kept_documents(
    tasks: dict[str, Any], flagged: dict[str, list[int]], limit: int | float | None, source: str
):
    """decontaminate=: {task: the indices of its evaluated documents that the report did not flag} (the first
    `limit` of them, as limit= counts), and {task: (dropped, of)}; a task the report does not cover, or whose
    documents are not the ones it scanned, is one line."""
    samples, dropped = {}, {}
    for name, task in tasks.items():
        if name not in flagged:
            raise ConfigError(
                f"decontaminate={source} has no task {name} (it covers {', '.join(flagged) or 'none'}); run "
                f"`gptkit contamination tasks={name}` for it"
            )
        total = len(task.eval_docs)
        bad = set(flagged[name])
        if bad and max(bad) >= total:
            raise ConfigError(
                f"decontaminate={source} flags document {max(bad)} of task {name}, which has {total}: the "
                f"report was made for other data of that task"
            )
        n = total if limit is None else min(total, int(limit if limit >= 1 else math.ceil(total * limit)))
        samples[name] = [i for i in range(n) if i not in bad]
        dropped[name] = (n - len(samples[name]), n)
        if not samples[name]:
            raise ConfigError(
                f"decontaminate={source} flags every evaluated item of task {name}: none is left to score"
            )
    return samples, dropped
