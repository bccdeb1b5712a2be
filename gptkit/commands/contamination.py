"""Test-set contamination of a training corpus: which items of lm-eval tasks occur in the run's (or a
prepared folder's) train split, by word n-gram overlap, and the training documents that hold them: file
and place, through the documents file a build keeps beside its shards (as `gptkit trace` reads them).

Examples:
  gptkit contamination run=runs/my-run tasks=hellaswag,arc_easy
  gptkit contamination data=prepared data.dir=~/.cache/gptkit/data/files-bpe-1a2b3c tasks=my_tasks n=8 --json
  gptkit contamination run=runs/my-run data=files 'data.paths=[more/*.jsonl]' tasks=arc_easy
  gptkit eval run=runs/my-run tasks=arc_easy decontaminate=runs/my-run/contamination.json

The report (JSON, out=) names for each contaminated item its task, its index among the task's evaluated
documents and the training documents it occurs in; per task the share of its items that are contaminated.
`gptkit eval ... decontaminate=<report>` scores the tasks without the items it flags. docs/contamination.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# gptkit's rooms are imported inside the functions: cli.py imports every command module (for `gptkit
# --help` too), which must not pay for torch, Lightning or datasets (figures in docs/layout.md).


def prepare_args(args: list[str]) -> list[str]:
    """tasks=a,b is one value (a list of tasks), not a Hydra sweep."""
    from gptkit.conf_tree import verbatim

    return verbatim(args, ("tasks",))


def corpus(cfg):
    """(the prepared corpus, the default report path): data=prepared data.dir=<folder> as it is; another
    data= tokenized with the run's tokenizer; else the run's own training data."""
    from omegaconf import OmegaConf

    from gptkit.commands.trace import run_folder
    from gptkit.data import load_prepared, prepare
    from gptkit.errors import ConfigError
    from gptkit.runs import TOKENIZER_FILE, read_config

    data = cfg.get("data")
    if data is not None and data.get("kind") == "prepared" and cfg.run is None:
        folder = Path(str(data.dir)).expanduser()
        if not folder.is_dir():
            raise ConfigError(
                f"data.dir={data.dir}: no such folder (`gptkit prepare` prints the one it wrote)"
            )
        return load_prepared(folder), Path("contamination.json")
    if cfg.run is None:
        raise ConfigError(
            "give run=<run folder> (its training data), data=prepared data.dir=<prepared folder>, or run= "
            "with data=... (a corpus tokenized with the run's tokenizer)"
        )
    run_dir = run_folder(cfg.run, cfg.runs_dir)
    saved = OmegaConf.create(read_config(run_dir))
    if data is not None:
        tok = {
            "kind": "file",
            "path": str(run_dir / TOKENIZER_FILE),
            "eos_token": saved.tokenizer.get("eos_token"),
        }
        p = prepare(data, tok, progress=False)
    else:
        p = prepare(saved.data, saved.tokenizer, progress=False, max_seq_len=int(saved.model.max_seq_len))
    p.wait_checked()
    return p, run_dir / "contamination.json"


def run(cfg) -> int:
    from gptkit.errors import ConfigError
    from gptkit.evaluation import contamination as C
    from gptkit.evaluation import tasks as T
    from gptkit.fsio import atomic_write_text

    if cfg.format not in ("table", "json"):
        raise ConfigError(f"format={cfg.format!r} must be table or json")
    n = C.check_n(cfg.n)
    norm = C.check_normalize(cfg.normalize)
    T.require_lm_eval()
    entries = T.parse_tasks(cfg.tasks)
    for line in T.code_notices(entries):
        print(line, file=sys.stderr)
    specs = T.find_tasks(entries)
    prepared, default_out = corpus(cfg)
    out = Path(str(cfg.out)).expanduser() if cfg.out is not None else default_out
    if not out.parent.is_dir():
        raise ConfigError(f"out={out}: its folder {out.parent} does not exist")
    T.check_hub(specs)
    T.quiet_lm_eval(progress=bool(cfg.progress))
    manager = T.task_manager(specs)
    T.check_names(specs.names, manager)
    tasks = T.leaf_tasks(T.load_tasks(specs, manager))
    grams = C.task_ngrams(tasks, n, norm)
    figures = C.scan(prepared, grams)
    rep = C.report(grams, figures, [str(p.dir) for p in C.shard_parts(prepared)], str(cfg.normalize))
    atomic_write_text(out, json.dumps(rep, indent=1, ensure_ascii=False) + "\n")
    if cfg.format == "json":
        print(json.dumps(rep, indent=1, ensure_ascii=False))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(
        title=f"contamination: {n}-grams ({cfg.normalize}) of the task items in {escape(rep['data'][0])}"
    )
    for name, justify in (
        ("task", "left"),
        ("items", "right"),
        ("too short", "right"),
        ("contaminated", "right"),
        ("share", "right"),
    ):
        t.add_column(name, justify=justify)
    for name, s in rep["tasks"].items():
        t.add_row(
            escape(name),
            f"{s['items']:,}",
            f"{s['too_short']:,}",
            f"{s['contaminated']:,}",
            f"{100 * s['share']:.1f}%",
        )
    Console().print(t)
    for item in rep["items"][:10]:
        d = item["documents"][0]
        where = "  ".join(str(x) for x in (d["file"], d["where"]) if x)
        print(
            f"  {item['task']} item {item['doc_id']}: document {d['document']}  {where}"
            + (f" (and {len(item['documents']) - 1} more)" if len(item["documents"]) > 1 else "")
        )
    if len(rep["items"]) > 10:
        print(f"  ... {len(rep['items']) - 10} more contaminated items in the report")
    print(
        f"{rep['documents_scanned']:,} documents ({rep['tokens_scanned']:,} tokens) scanned in "
        f"{rep['seconds']:.1f} s; report: {out}",
        file=sys.stderr,
    )
    return 0
