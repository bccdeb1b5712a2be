"""`hf:owner/name[@revision]` in data.paths (and data.val_paths) of the templated kinds (data=chat,
data=preference, data=prompts, data=unpaired): a Hugging Face Hub dataset's files of one split, downloaded
into the Hugging Face cache by huggingface_hub and then read by the same record reader as local files
(gptkit/data/records.py: jsonl, json and parquet), so a hub dataset and its files on disk make the same rows.

    data.paths=[hf:HuggingFaceH4/ultrachat_200k]  data.hf.split=train_sft  data.hf.subset=null
    data.hf.columns={messages: conversation}      gptkit's field <- the dataset's column
    data.hf.files=['data/train-*.parquet']        the repository's files to read (globs), not the split's

Which files are a split's: <split>.<ext>, <split>-*.<ext> and <split>/*.<ext> (ext: parquet, jsonl, json), at
the top of the repository or under data/ (with data.hf.subset: under <subset>/ or data/<subset>/, as the Hub's
parquet conversion lays a subset out). What was read (the repository, the revision asked for, the commit,
the split, the files) goes into the prepared folder's manifest (source.hub) and so into every run's.

Offline (HF_HUB_OFFLINE=1) only the Hugging Face cache is read; an unreachable hub fails in seconds; both, and
every other hub problem, in one line.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from gptkit import hub
from gptkit.data.files import expand_paths
from gptkit.errors import GptkitError

PREFIX = "hf:"
EXTENSIONS = ("parquet", "jsonl", "json")
# owner/name[@revision]
SPEC = re.compile(r"(?P<repo>[\w-][\w.-]*/[\w-][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
LOCAL = "without network use local files: data.paths=[train.jsonl]"


@dataclass
class HubFiles:
    """The files of one `hf:` path: where they are on this machine and where they came from."""

    repo: str
    # as asked (None: the main branch) and as resolved (the snapshot's commit)
    revision: str | None
    commit: str
    split: str
    subset: str | None
    # the files' paths in the repository, and on this machine (the same order)
    names: list[str]
    files: list[Path]

    def record(self) -> dict[str, Any]:
        """The manifest's entry (source.hub)."""
        return {
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "split": self.split,
            "subset": self.subset,
            "files": self.names,
        }

    def describe(self) -> str:
        return f"hf:{self.repo}@{self.commit} ({self.split}: {', '.join(self.names)})"


def is_hub(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def any_hub(*paths: Any) -> bool:
    """Whether a data.paths / data.val_paths value names a hub dataset."""
    for p in paths:
        items = [p] if p is None or isinstance(p, str) else list(p)
        if any(is_hub(x) for x in items):
            return True
    return False


def split_patterns(split: str, subset: str | None) -> list[str]:
    """The repository paths (fnmatch globs, `*` crossing folders) of a split's files."""
    tops = [f"{subset}/", f"data/{subset}/"] if subset else ["", "data/"]
    return [
        pat
        for top in tops
        for ext in EXTENSIONS
        for pat in (f"{top}{split}.{ext}", f"{top}{split}-*.{ext}", f"{top}{split}/*.{ext}")
    ]


def parse(spec: str, what: str) -> tuple[str, str | None]:
    """hf:owner/name[@revision] -> (owner/name, revision or None); one line otherwise."""
    m = SPEC.fullmatch(spec[len(PREFIX) :])
    if m is None:
        raise GptkitError(
            f"{what}: {spec!r} is not a Hub dataset; write hf:owner/name or hf:owner/name@revision"
        )
    return m["repo"], m["revision"]


def resolve(spec: str, hf: dict[str, Any], split: str, what: str) -> HubFiles:
    """The files of split `split` of the hub dataset `spec`, downloaded (or, offline, found in the cache)."""
    repo, revision = parse(spec, what)
    subset = hf.get("subset")
    wanted = [str(p) for p in (hf.get("files") or [])]
    if isinstance(hf.get("files"), str):
        wanted = [hf["files"]]
    patterns = wanted or split_patterns(split, subset)
    folder = _snapshot(repo, revision, patterns)
    names = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and any(fnmatch(p.relative_to(folder).as_posix(), pat) for pat in patterns)
    )
    names = [n for n in names if n.rsplit(".", 1)[-1].lower() in EXTENSIONS]
    if not names:
        looked = ", ".join(patterns[:6]) + (", ..." if len(patterns) > 6 else "")
        which = (
            "data.hf.files" if wanted else f"split {split!r}" + (f" of subset {subset!r}" if subset else "")
        )
        raise GptkitError(
            f"{what}: hf:{repo} has no jsonl, json or parquet files of {which} (looked for {looked}); set "
            "data.hf.split, data.hf.subset or data.hf.files=['<path in the repository>']"
        )
    return HubFiles(repo, revision, folder.name, split, subset, names, [folder / n for n in names])


def expand(paths: Any, what: str, hf: dict[str, Any], split: str) -> tuple[list[Path], list[HubFiles]]:
    """data.paths (or data.val_paths) as files, in order: local paths and globs as gptkit.data.files'
    expand_paths makes them, each hf: path as its split's files; and the hub datasets read."""
    items = [] if paths is None else [paths] if isinstance(paths, str) else list(paths)
    if not any(is_hub(p) for p in items):
        return expand_paths(paths, what), []
    files: list[Path] = []
    read: list[HubFiles] = []
    for p in items:
        if is_hub(p):
            got = resolve(str(p), hf, split, what)
            read.append(got)
            files += got.files
        else:
            files += expand_paths([p], what, quiet=True)
    return list(dict.fromkeys(files)), read


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    """The snapshot folder of the dataset (named by its commit) holding the files of `patterns`."""
    offline = hub.offline("HF_DATASETS_OFFLINE")
    if not offline:
        hub.check_hub_reachable(hub.TIMEOUT_S, LOCAL)
    from huggingface_hub import constants, errors, snapshot_download

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return Path(
            snapshot_download(
                repo,
                repo_type="dataset",
                revision=revision,
                allow_patterns=patterns,
                local_files_only=offline,
            )
        )
    except errors.GatedRepoError:
        raise GptkitError(
            f"hf:{repo} is a gated dataset: accept its conditions on its Hub page and log in "
            "(`hf auth login` or HF_TOKEN), then try again"
        ) from None
    except errors.RepositoryNotFoundError:
        raise GptkitError(
            f"hf:{repo} is not a dataset on the Hugging Face Hub (check the name; a private dataset needs "
            "`hf auth login` or HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise GptkitError(
            f"hf:{repo} has no revision {revision!r}; give a branch, tag or commit it has: "
            f"hf:{repo}@<revision>"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise GptkitError(
            f"hf:{repo} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
            f"forbids downloading it; unset HF_HUB_OFFLINE to download it, or {LOCAL}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the network or the hub failed part-way: one line
        raise GptkitError(
            f"cannot download hf:{repo} from the Hugging Face Hub ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0][:160]}); try again, or {LOCAL}"
        ) from None
    finally:
        hub_log.setLevel(level)


def columns(hf: dict[str, Any] | None) -> dict[str, str]:
    """data.hf.columns: {gptkit's field: the dataset's column}, checked (one line otherwise)."""
    got = (hf or {}).get("columns") or {}
    if not isinstance(got, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in got.items()
    ):
        raise GptkitError(
            f"data.hf.columns={got!r} must map gptkit's fields to the dataset's columns, e.g. "
            "data.hf.columns={messages: conversation}"
        )
    return dict(got)


def renamed(rec: Any, mapping: dict[str, str]) -> Any:
    """A record with the dataset's columns under gptkit's field names (data.hf.columns); the record as it is
    when it is not an object (the reader says so) or nothing is mapped."""
    if not mapping or not isinstance(rec, dict):
        return rec
    out = {k: v for k, v in rec.items() if k not in mapping.values()}
    out.update({field: rec[col] for field, col in mapping.items() if col in rec})
    return out
