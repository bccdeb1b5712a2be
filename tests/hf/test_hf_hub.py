"""`gptkit import hf=<owner/name>` and `gptkit train init_from=hf:<owner/name>`: Hugging Face Hub ids.

Nothing can be downloaded here. The offline failures run the real CLI with the real huggingface_hub (an empty
cache, HF_HUB_OFFLINE=1 or an unreachable endpoint). The download path runs in process, with
huggingface_hub.snapshot_download replaced by FakeHub: a repository whose files are a transformers folder that
gptkit's own `export` wrote, copied into a cache laid out as huggingface_hub lays out its own.
"""

import json
import os
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import yaml
from conftest import char_tokenizer, make_run, one_line_error, random_gpt, run_main, shakespeare, write_jsonl

from gptkit.cli import main as gptkit_main
from gptkit.errors import GptkitError
from gptkit.hf import folders
from gptkit.hub import check_hub_reachable as REAL_CHECK
from gptkit.runs import load_model, write_run_folder

REPO_ID = "tiny-org/tiny-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NO_PROXY = {
    v: "" for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")
}


def exported(tmp_path: Path, name: str = "repo"):
    """A transformers folder written by `gptkit export` (a tiny random GPT-2 and a char tokenizer), plus a
    pytorch_model.bin that nothing may download while safetensors exist, and the model itself."""
    tok = char_tokenizer()
    model = random_gpt("gpt2-tied", vocab_size=tok.get_vocab_size())
    write_run_folder(tmp_path / f"{name}-run", {}, model, tok)
    assert gptkit_main(["export", f"run={tmp_path / f'{name}-run'}", f"out={tmp_path / name}"]) == 0
    (tmp_path / name / "pytorch_model.bin").write_bytes(b"not to be downloaded")
    return tmp_path / name, model


class FakeHub:
    """huggingface_hub.snapshot_download for one repository whose files are those of `files`: it copies what
    allow_patterns allows into <cache>/models--owner--name/snapshots/<commit>/ and returns that folder. With
    local_files_only it only looks there, raising LocalEntryNotFoundError for a missing file, as the real one
    does."""

    def __init__(self, files: Path, cache: Path, error: Exception | None = None):
        self.files, self.cache, self.error, self.calls = files, cache, error, []

    def __call__(self, repo_id, *, revision=None, allow_patterns=None, local_files_only=False, **kwargs):
        from huggingface_hub import errors

        self.calls.append(
            {
                "repo_id": repo_id,
                "revision": revision,
                "allow_patterns": list(allow_patterns),
                "local_files_only": local_files_only,
            }
        )
        if self.error is not None:
            raise self.error
        snapshot = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        wanted = [f for f in sorted(self.files.iterdir()) if any(fnmatch(f.name, p) for p in allow_patterns)]
        for f in wanted:
            if local_files_only and not (snapshot / f.name).is_file():
                raise errors.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
            snapshot.mkdir(parents=True, exist_ok=True)
            (snapshot / f.name).write_bytes(f.read_bytes())
        return str(snapshot)

    def fetched(self) -> list[list[str]]:
        return [c["allow_patterns"] for c in self.calls]


def http_error(cls_name: str, status: int):
    import httpx2
    from huggingface_hub import errors

    response = httpx2.Response(
        status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO_ID}")
    )
    return getattr(errors, cls_name)(f"{status} Client Error", response=response)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Online, with FakeHub serving REPO_ID from a gptkit export: (fake, the exported model)."""
    files, model = exported(tmp_path)
    fake = FakeHub(files, tmp_path / "hf-cache")
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("gptkit.hub.check_hub_reachable", lambda timeout, instead="": None)
    # main() sets it; restored afterwards
    monkeypatch.delenv("GPTKIT_VERB", raising=False)
    return fake, model


def assert_same_weights(run_dir: Path, model) -> None:
    _, _, _, cfg, imported = load_model(run_dir)
    assert cfg.vocab_size == model.cfg.vocab_size and cfg.n_layers == model.cfg.n_layers
    for k, v in model.state_dict().items():
        assert torch.equal(imported.state_dict()[k], v), k


# ---- import hf=<owner/name> ------------------------------------------------------------------------
def test_import_hub_id_downloads_config_and_tokenizer_then_safetensors_only(tmp_path, hub, capsys):
    fake, model = hub
    code, out, err = run_main(capsys, "import", f"hf={REPO_ID}", f"out={tmp_path / 'run'}")
    assert code == 0, err
    # config.json first: an unsupported model stops there
    assert fake.fetched() == [folders.HUB_FIRST, folders.HUB_WEIGHTS]
    # then exactly the commit the config came from
    assert [c["revision"] for c in fake.calls] == [None, COMMIT]
    assert not any(c["local_files_only"] for c in fake.calls)
    snapshot = tmp_path / "hf-cache" / "models--tiny-org--tiny-gpt2" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        # the chat template
    ]
    assert_same_weights(tmp_path / "run", model)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["name"] == "tiny-gpt2"
    provenance = json.loads((tmp_path / "run" / "imported_from.json").read_text())
    assert provenance["source"] == f"{REPO_ID}@{COMMIT}"
    assert f"imported {REPO_ID}@{COMMIT} (gpt2, " in out


def test_import_hub_model_without_safetensors_reads_pytorch_bin_safely(tmp_path, hub, capsys):
    from safetensors.torch import load_file

    fake, model = hub
    state = load_file(fake.files / "model.safetensors")
    (fake.files / "model.safetensors").unlink()
    torch.save(state, fake.files / "pytorch_model.bin")
    code, _, err = run_main(capsys, "import", f"hf={REPO_ID}@v1.0", f"out={tmp_path / 'run'}")
    assert code == 0, err
    assert fake.fetched() == [folders.HUB_FIRST, folders.HUB_WEIGHTS, folders.HUB_PICKLES]
    assert fake.calls[0]["revision"] == "v1.0"
    assert_same_weights(tmp_path / "run", model)


@pytest.mark.parametrize(
    "case, needles",
    [
        ("unknown", ["neither a local folder nor a model on the Hugging Face Hub", "HF_TOKEN"]),
        ("gated", ["is a gated model", "hf auth login"]),
        ("revision", ["has no revision 'v9'", f"{REPO_ID}@<revision>"]),
        ("no config.json", ["has no config.json", "not a transformers model"]),
        ("phi", ["model_type='phi'", "Llama", "GPT-2", "Phi-3"]),
    ],
)
def test_import_hub_errors_are_one_line(tmp_path, hub, capsys, case, needles):
    fake, _ = hub
    fake.error = {
        "unknown": http_error("RepositoryNotFoundError", 404),
        "gated": http_error("GatedRepoError", 403),
        "revision": http_error("RevisionNotFoundError", 404),
    }.get(case)
    if case == "no config.json":
        (fake.files / "config.json").unlink()
    if case == "phi":
        (fake.files / "config.json").write_text(
            json.dumps({"model_type": "phi", "architectures": ["PhiForCausalLM"]})
        )
    code, out, err = run_main(capsys, "import", f"hf={REPO_ID}@v9", f"out={tmp_path / 'run'}")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    # no weights downloaded for a model that cannot be imported
    assert fake.fetched() == [folders.HUB_FIRST]
    assert not (tmp_path / "run").exists()


def test_a_local_folder_wins_even_when_named_like_a_hub_id(tmp_path, hub, capsys, monkeypatch):
    fake, model = hub
    (tmp_path / "tiny-org").mkdir()
    fake.files.rename(tmp_path / REPO_ID)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "import", f"hf={REPO_ID}", "out=run")
    assert code == 0, err
    assert fake.calls == []
    assert_same_weights(tmp_path / "run", model)
    imported_from = json.loads((tmp_path / "run" / "imported_from.json").read_text())
    assert imported_from["source"] == str(tmp_path / REPO_ID)
    assert out.startswith(f"imported {REPO_ID} (gpt2, ")


@pytest.mark.long
def test_offline_a_model_in_the_hf_cache_still_imports(tmp_path, cli):
    """The real CLI and huggingface_hub, offline, over a cache laid out as huggingface_hub writes it."""
    files, model = exported(tmp_path)
    cache = tmp_path / "hf-cache"
    repo = cache / "models--tiny-org--tiny-gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (repo / "snapshots" / COMMIT / name).write_bytes((files / name).read_bytes())
    env = {"HF_HUB_CACHE": str(cache)}
    # conftest: HF_HUB_OFFLINE=1
    r = cli("import", f"hf={REPO_ID}", f"out={tmp_path / 'a'}", env=env)
    # no connectivity check either
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr
    assert_same_weights(tmp_path / "a", model)
    r = cli(
        "import",
        f"hf={REPO_ID}",
        f"out={tmp_path / 'b'}",
        env={**env, **NO_PROXY, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert r.returncode == 0, r.stderr
    assert "is unreachable" in r.stderr
    assert f"using {REPO_ID}@{COMMIT} from the Hugging Face cache" in r.stderr
    assert_same_weights(tmp_path / "b", model)


def test_offline_import_fails_fast_in_one_line_naming_hf_hub_offline(tmp_path, cli):
    """The real CLI and huggingface_hub with an empty cache: HF_HUB_OFFLINE=1, then the hub unreachable."""
    cache = {"HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    # conftest: HF_HUB_OFFLINE=1
    r = cli("import", "hf=openai-community/gpt2", f"out={tmp_path / 'run'}", env=cache)
    one_line_error(r, "openai-community/gpt2", "HF_HUB_OFFLINE", "gptkit import hf=/path/to/folder")
    r = cli(
        "import",
        "hf=openai-community/gpt2",
        f"out={tmp_path / 'run'}",
        env={**cache, **NO_PROXY, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    one_line_error(r, "is unreachable", "HF_HUB_OFFLINE", "gptkit import hf=/path/to/folder")
    r = cli(
        "train", "init_from=hf:openai-community/gpt2", f"runs_dir={tmp_path / 'runs'}", "name=ft", env=cache
    )
    one_line_error(r, "HF_HUB_OFFLINE", "gptkit train init_from=hf:/path/to/folder")
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs" / "ft" / "checkpoints").exists()


def test_an_unreachable_hub_is_one_short_connect_then_the_cache_only(tmp_path, monkeypatch):
    """Why no network fails in seconds: one TCP connect with hub.TIMEOUT_S answers, and huggingface_hub is
    then asked for the local cache only (local_files_only: no downloads, no retries)."""
    import huggingface_hub

    from gptkit import hub

    connects, asked = [], []
    real = huggingface_hub.snapshot_download

    def refused(address, timeout):
        connects.append((address, timeout))
        raise ConnectionRefusedError(111, "Connection refused")

    def snapshot_download(*args, **kwargs):
        asked.append(kwargs["local_files_only"])
        return real(*args, **kwargs)

    monkeypatch.setattr("gptkit.hub.socket.create_connection", refused)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for k, v in {**NO_PROXY, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(GptkitError, match="is unreachable"):
        folders.locate("openai-community/gpt2")
    assert connects == [(("127.0.0.1", 9), hub.TIMEOUT_S)]
    assert asked and all(asked)


# ---- train init_from=hf:<owner/name | folder> ------------------------------------------------------
def test_init_from_import_is_reused_until_its_source_changes(tmp_path):
    repo, model = exported(tmp_path)
    runs = tmp_path / "runs"
    out, src, reused = folders.import_cached(str(repo), runs, "ALT")
    assert (out, src.spec, reused) == (runs / "repo-imported", str(repo.resolve()), False)
    assert_same_weights(out, model)
    ckpt = out / "checkpoints" / "last.ckpt"
    stamp = ckpt.stat().st_mtime_ns
    assert folders.import_cached(str(repo), runs, "ALT")[2] is True
    assert ckpt.stat().st_mtime_ns == stamp

    # the folder is written again (e.g. exported anew): imported again
    later = time.time() + 5
    os.utime(repo / "model.safetensors", (later, later))
    assert folders.import_cached(str(repo), runs, "ALT")[2] is False
    assert sorted(p.name for p in runs.iterdir() if not p.name.endswith(".lock")) == ["repo-imported"]

    # not an import: never replaced
    (runs / "mine-imported").mkdir()
    (runs / "mine-imported" / "notes.txt").write_text("mine")
    repo.rename(tmp_path / "mine")
    with pytest.raises(GptkitError, match="is not an import by gptkit"):
        folders.import_cached(str(tmp_path / "mine"), runs, "ALT")
    assert (runs / "mine-imported" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("source", ["hub id", "local folder"])
def test_train_init_from_hf_imports_then_fine_tunes(tmp_path, hub, capsys, monkeypatch, source):
    fake, model = hub
    # the Hydra app sets sys.argv
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(shakespeare(20_000).lower())
    runs = tmp_path / "runs"
    spec, imported, pinned = (
        (f"{REPO_ID}@v1", runs / "tiny-gpt2-imported", f"{REPO_ID}@{COMMIT}")
        if source == "hub id"
        else (str(fake.files), runs / "repo-imported", str(fake.files))
    )
    code = gptkit_main(
        [
            "train",
            f"init_from=hf:{spec}",
            "data=files",
            f"data.paths=[{corpus}]",
            "trainer.batch_size=2",
            "trainer.max_steps=2",
            "trainer.val_windows=2",
            "trainer.progress=false",
            "optim.lr=1e-12",
            "optim.min_lr=0",
            "optim.warmup_steps=0",
            f"runs_dir={runs}",
            "name=ft",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert f"init_from=hf:{spec}: imported {pinned} into {imported} (kept for later runs)" in err
    if source == "hub id":
        assert fake.calls[0]["revision"] == "v1" and fake.fetched() == [
            folders.HUB_FIRST,
            folders.HUB_WEIGHTS,
        ]
    else:
        assert fake.calls == []
    assert_same_weights(imported, model)

    ft_cfg = yaml.safe_load((runs / "ft" / "config.yaml").read_text())
    # the exact source, for the record
    assert ft_cfg["init_from"] == f"hf:{pinned}"
    assert ft_cfg["model"] == {**model.cfg.to_dict(), "name": imported.name.removesuffix("-imported")}
    after = torch.load(runs / "ft" / "checkpoints" / "last.ckpt", weights_only=True)
    assert after["global_step"] == 2
    # two steps at lr 1e-12 from the imported weights, not a fresh init
    for k, v in model.state_dict().items():
        torch.testing.assert_close(after["state_dict"]["model." + k], v, rtol=0, atol=1e-9)
    assert (runs / "ft" / "tokenizer.json").read_text() == (imported / "tokenizer.json").read_text()


# ---- data.paths=[hf:owner/name]: a Hub dataset's files through the local readers --------------------------
DATASET = "data-org/tiny-sft"
CHAT = [
    [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w.upper()}]
    for w in ("ab", "cd", "ef", "gh", "ij")
]
# (kind, records with gptkit's field names, data.hf.columns: gptkit's field <- the dataset's column)
KINDS = {
    "chat": ([{"messages": m} for m in CHAT], {"messages": "conversation"}),
    "preference": (
        [{"prompt": f"say {w}", "chosen": w.upper(), "rejected": w} for w in ("ab", "cd", "ef", "gh")],
        {"chosen": "good", "rejected": "bad"},
    ),
    "prompts": (
        [{"prompt": f"upper {w}", "answer": w.upper(), "level": i} for i, w in enumerate(("ab", "cd", "ef"))],
        {"prompt": "question"},
    ),
}


def as_dataset(records, columns):
    """The records with the dataset's column names (data.hf.columns read backwards)."""
    back = {v: k for k, v in columns.items()}
    return [{back.get(k, k): v for k, v in r.items()} for r in records]


class FakeDatasetHub(FakeHub):
    """huggingface_hub.snapshot_download for a dataset repository (repo_type="dataset") whose files are those
    of the folder `files`, subfolders included, laid out as the cache lays a dataset out."""

    def __call__(
        self, repo_id, *, repo_type=None, revision=None, allow_patterns=None, local_files_only=False
    ):
        from huggingface_hub import errors

        assert repo_type == "dataset"
        self.calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": list(allow_patterns)})
        if self.error is not None:
            raise self.error
        snapshot = self.cache / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
        for f in sorted(p for p in self.files.rglob("*") if p.is_file()):
            name = f.relative_to(self.files).as_posix()
            if any(fnmatch(name, p) for p in allow_patterns):
                if local_files_only and not (snapshot / name).is_file():
                    raise errors.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                (snapshot / name).write_bytes(f.read_bytes())
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(snapshot)


@pytest.fixture
def dataset_hub(tmp_path, monkeypatch):
    """Online, with FakeDatasetHub serving DATASET from tmp_path/dataset (empty: the test writes it)."""
    fake = FakeDatasetHub(tmp_path / "dataset", tmp_path / "hf-cache")
    fake.files.mkdir()
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr("gptkit.hub.check_hub_reachable", lambda timeout, instead="": None)
    return fake


def arrays(data) -> dict:
    import numpy as np

    (npz,) = data.dir.glob("*.npz")
    with np.load(npz) as z:
        return {k: z[k].copy() for k in z.files}


@pytest.mark.parametrize("kind", list(KINDS))
def test_hub_dataset_rows_equal_the_local_files_rows_and_the_manifest_names_the_commit(
    tmp_path, dataset_hub, kind
):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gptkit.data import prepare

    records, columns = KINDS[kind]
    hub_records = as_dataset(records, columns)
    # the dataset: its train split as two parquet shards under data/, its validation split one jsonl file,
    # and files of another split and of no split, which are not read
    (dataset_hub.files / "data").mkdir()
    pq.write_table(
        pa.Table.from_pylist(hub_records[:2]), dataset_hub.files / "data" / "train-00000-of-00002.parquet"
    )
    pq.write_table(
        pa.Table.from_pylist(hub_records[2:]), dataset_hub.files / "data" / "train-00001-of-00002.parquet"
    )
    write_jsonl(dataset_hub.files / "data" / "validation.jsonl", hub_records[-1:])
    write_jsonl(dataset_hub.files / "data" / "test.jsonl", hub_records[:1])
    (dataset_hub.files / "README.md").write_text("# a dataset card")
    local = write_jsonl(tmp_path / "train.jsonl", records)
    val = write_jsonl(tmp_path / "val.jsonl", records[-1:])
    common = {"kind": kind, "template": "chatml"}
    want = prepare(
        {**common, "paths": [str(local)], "val_paths": [str(val)]}, {"kind": "byte"}, cache_dir=tmp_path / "c"
    )
    hf = {"split": "train", "val_split": "validation", "subset": None, "files": None, "columns": columns}
    got = prepare(
        {**common, "paths": [f"hf:{DATASET}@v1"], "val_paths": [f"hf:{DATASET}"], "hf": hf},
        {"kind": "byte"},
        cache_dir=tmp_path / "c",
    )
    # the same rows as the local files, read by the same reader
    mine, theirs = arrays(got), arrays(want)
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert np.array_equal(mine[k], theirs[k]), k
    if kind == "prompts":
        # the records the rewards read, under gptkit's names
        kept = json.loads((got.dir / "rows.json").read_text())
        assert kept["train"]["rows"] == json.loads((want.dir / "rows.json").read_text())["train"]["rows"]
        assert kept["train"]["rows"][0]["prompt"] == "upper ab"
    assert [c["revision"] for c in dataset_hub.calls] == ["v1", None]
    files = ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    assert got.manifest["source"]["hub"] == [
        {
            "repo": DATASET,
            "revision": "v1",
            "commit": COMMIT,
            "split": "train",
            "subset": None,
            "files": files,
        },
        {
            "repo": DATASET,
            "revision": None,
            "commit": COMMIT,
            "split": "validation",
            "subset": None,
            "files": ["data/validation.jsonl"],
        },
    ]
    assert f"hf:{DATASET}@{COMMIT} (train: {', '.join(files)})" in got.manifest["source"]["description"]
    # data.hf at its defaults is no part of a cache key: the folders of a gptkit before it are still found
    from gptkit.data.settings import settings
    from gptkit.data.templated import key_settings, template_for
    from gptkit.tokenizer import tokenizer_spec

    s = settings({**common, "paths": [str(local)]})
    tok = tokenizer_spec({"kind": "byte"})
    key = key_settings(s, tok, template_for("chatml", tok), [local])
    assert "hf" in s and "hf" not in key
    assert "hf" in key_settings({**s, "hf": hf}, tok, template_for("chatml", tok), [local])


def test_hub_dataset_subsets_files_and_bad_specs(tmp_path, dataset_hub):
    from gptkit.data import prepare

    records = [{"messages": m} for m in CHAT]
    (dataset_hub.files / "en" / "train").mkdir(parents=True)
    write_jsonl(dataset_hub.files / "en" / "train" / "0000.jsonl", records)
    write_jsonl(dataset_hub.files / "raw.jsonl", records[:2])
    tok = {"kind": "byte"}

    def chat(spec, **hf):
        return prepare(
            {"kind": "chat", "paths": [spec], "template": "chatml", "hf": hf}, tok, cache_dir=tmp_path / "c"
        )

    # the Hub's parquet-conversion layout: <subset>/<split>/...
    assert chat(f"hf:{DATASET}", subset="en").manifest["source"]["hub"][0]["files"] == ["en/train/0000.jsonl"]
    assert chat(f"hf:{DATASET}", files=["raw.jsonl"]).train.n == 1
    for spec, hf, needle in [
        ("hf:no-owner", {}, "is not a Hub dataset; write hf:owner/name"),
        (f"hf:{DATASET}", {"split": "dev"}, "has no jsonl, json or parquet files of split 'dev'"),
        (f"hf:{DATASET}", {"subset": "en", "columns": ["messages"]}, "must map gptkit's fields"),
    ]:
        with pytest.raises(GptkitError, match=needle):
            chat(spec, **hf)
    dataset_hub.error = http_error("RepositoryNotFoundError", 404)
    with pytest.raises(GptkitError, match="is not a dataset on the Hugging Face Hub"):
        chat(f"hf:{DATASET}")


def test_offline_or_unreachable_hub_data_fails_fast_in_one_line(tmp_path, capsys, monkeypatch):
    """The real huggingface_hub with an empty cache: HF_HUB_OFFLINE=1, then the hub unreachable."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "gc"))
    monkeypatch.delenv("GPTKIT_VERB", raising=False)
    # a template of its own: a tokenizer built here has none, and a template is checked before any download
    args = (
        "prepare",
        "data=chat",
        f"data.paths=[hf:{DATASET}]",
        "data.hf.split=train_sft",
        "data.template=chatml",
    )
    # conftest: HF_HUB_OFFLINE=1
    for needles in (
        [f"hf:{DATASET} is not in the Hugging Face cache", "HF_HUB_OFFLINE", "data.paths=[train.jsonl]"],
        ["is unreachable", "data.paths=[train.jsonl]"],
    ):
        code, out, err = run_main(capsys, *args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (
            err
        )
        for n in needles:
            assert n in err, (n, err)
        env = {
            **NO_PROXY,
            "HF_HUB_OFFLINE": "0",
            "HF_DATASETS_OFFLINE": "0",
            "HF_ENDPOINT": "http://127.0.0.1:9",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    assert not (tmp_path / "gc").exists() or not any((tmp_path / "gc").rglob("manifest.json"))


# ---- gptkit export ... push_to_hub=owner/name --------------------------------------------------------------
TOKEN = "hf_secretTOKENnotToBeSeen0123"
MODEL_REPO = "me/tiny-model"


class FakeApi:
    """huggingface_hub.HfApi, recording each call (and each uploaded folder's files and card); `fail`: the
    exception upload_folder raises."""

    calls: list = []
    fail: Exception | None = None

    def __init__(self, token=None):
        FakeApi.calls.append(("HfApi", token == TOKEN))

    def create_repo(self, repo_id, *, repo_type, private, exist_ok):
        FakeApi.calls.append(("create_repo", repo_id, repo_type, private, exist_ok))

    def upload_folder(self, *, repo_id, repo_type, folder_path, commit_message):
        if FakeApi.fail is not None:
            raise FakeApi.fail
        root = Path(folder_path)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        FakeApi.calls.append(("upload_folder", repo_id, files, (root / "README.md").read_text()))

    def upload_file(self, *, path_or_fileobj, path_in_repo, repo_id, repo_type, commit_message):
        FakeApi.calls.append(("upload_file", repo_id, path_in_repo, path_or_fileobj))


@pytest.fixture
def model_hub(monkeypatch):
    FakeApi.calls, FakeApi.fail = [], None
    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr("gptkit.hub.check_hub_reachable", lambda timeout, instead="": None)
    monkeypatch.delenv("GPTKIT_VERB", raising=False)
    return FakeApi


def test_push_to_hub_uploads_the_export_with_its_model_card_and_never_the_token(tmp_path, model_hub, capsys):
    from gptkit.accounting import count_params

    run, model, _ = make_run(tmp_path)
    manifest = {
        "source": {
            "kind": "chat",
            "description": f"conversations from hf:{DATASET}@{COMMIT}",
            "sha256": "ab" * 32,
            "hub": [
                {
                    "repo": DATASET,
                    "revision": None,
                    "commit": COMMIT,
                    "split": "train",
                    "subset": None,
                    "files": ["data/train.jsonl"],
                }
            ],
        },
        "tokenizer": {"kind": "char", "vocab_size": 65},
        "splits": {
            "train": {"conversations": 90, "tokens": 12345},
            "val": {"conversations": 10, "tokens": 1234},
        },
    }
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "evals").mkdir()
    row = {"task": "arc_easy", "metric": "acc", "value": 0.3125, "stderr": 0.02, "n": 64}
    old = {**row, "value": 0.25}
    (run / "evals" / "arc_easy-1.json").write_text(
        json.dumps({"date": "2026-01-01", "task": "arc_easy", "rows": [old]})
    )
    (run / "evals" / "arc_easy-2.json").write_text(
        json.dumps({"date": "2026-02-01", "task": "arc_easy", "rows": [row]})
    )
    out = tmp_path / "export"
    code, stdout, err = run_main(
        capsys, "export", f"run={run}", f"out={out}", f"push_to_hub={MODEL_REPO}", "license=apache-2.0"
    )
    assert code == 0, err
    calls = model_hub.calls
    assert calls[0] == ("HfApi", True)
    assert calls[1] == ("create_repo", MODEL_REPO, "model", True, True)
    ((_, repo, files, card_text),) = [c for c in calls if c[0] == "upload_folder"]
    assert (
        repo == MODEL_REPO
        and "README.md" in files
        and "config.json" in files
        and "model.safetensors" in files
    )
    assert card_text == (out / "README.md").read_text()
    front = yaml.safe_load(card_text.split("---")[1])
    assert front == {
        "library_name": "transformers",
        "license": "apache-2.0",
        "tags": ["gptkit", "text-generation"],
        "datasets": [DATASET],
    }
    total = count_params(model.cfg).total
    assert f"| total | {total:,} |" in card_text
    assert f"at commit `{COMMIT}`, split train: data/train.jsonl" in card_text
    # the newest results of each task
    assert "| arc_easy | acc | 0.3125 | 0.02 | 64 |" in card_text and "0.25 |" not in card_text
    assert "passed: exported and imported back: logits max |diff|" in card_text
    assert "transformers' model of the folder" in card_text
    assert "| model.safetensors |" in card_text and "12,345 tokens" in card_text
    assert f"pushed {out} to https://huggingface.co/{MODEL_REPO} (private)" in stdout
    # the token: in no output, no file of the export
    assert TOKEN not in stdout + err
    assert not any(TOKEN.encode() in p.read_bytes() for p in out.rglob("*") if p.is_file())

    # an upload that fails: one line without the token, the export kept
    from gptkit.hf import push

    model_hub.fail = RuntimeError(f"401 Unauthorized: Authorization: Bearer {TOKEN}")
    with pytest.raises(GptkitError) as failed:
        push.check(MODEL_REPO, False).upload(out, card_text)
    said = str(failed.value)
    assert "the upload failed (RuntimeError: 401 Unauthorized" in said and "<HF_TOKEN>" in said
    assert TOKEN not in said and "\n" not in said and (out / "model.safetensors").is_file()
    assert ("create_repo", MODEL_REPO, "model", False, True) in model_hub.calls


@pytest.mark.parametrize(
    "case, needles",
    [
        ("no token", ["needs a Hugging Face token with write access in HF_TOKEN", "nothing was exported"]),
        ("offline", ["HF_HUB_OFFLINE=1 forbids uploading"]),
        ("unreachable", ["is unreachable", "nothing was exported"]),
        ("bad id", ["is not a Hub repository id"]),
    ],
)
def test_push_to_hub_refused_in_one_line_before_anything_is_written(
    tmp_path, model_hub, capsys, monkeypatch, case, needles
):
    run, _, _ = make_run(tmp_path)
    repo = "not a repo" if case == "bad id" else MODEL_REPO
    if case == "no token":
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "unreachable":
        monkeypatch.setattr("gptkit.hub.check_hub_reachable", REAL_CHECK)
        for k, v in {**NO_PROXY, "HF_ENDPOINT": "http://127.0.0.1:9"}.items():
            monkeypatch.setenv(k, v)
    code, stdout, err = run_main(
        capsys, "export", f"run={run}", f"out={tmp_path / 'out'}", f"push_to_hub={repo}"
    )
    assert code == 2 and stdout == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (
        err
    )
    for n in needles:
        assert n in err, (n, err)
    assert not (tmp_path / "out").exists() and model_hub.calls == []


def test_model_cards_of_adapters_and_a_gguf_file(tmp_path, model_hub):
    from gptkit.hf import card, push

    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base-model"}))
    (adapters / "adapter_model.safetensors").write_bytes(b"x" * 10)
    text = card.model_card(adapters, MODEL_REPO, tmp_path / "run", {}, None, None, [], "not measured")
    front = yaml.safe_load(text.split("---")[1])
    assert front == {
        "library_name": "peft",
        "tags": ["gptkit", "text-generation", "peft", "lora"],
        "base_model": "org/base-model",
    }
    assert "| adapter_model.safetensors | 10 B |" in text and "no data manifest" in text
    gguf = tmp_path / "model-Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    text = card.model_card(gguf, MODEL_REPO, tmp_path / "run", {}, None, None, [], "not measured")
    assert yaml.safe_load(text.split("---")[1]) == {"tags": ["gptkit", "text-generation", "gguf"]}
    assert "| model-Q8_0.gguf | 64 B |" in text
    # one file: it and its card, uploaded as README.md
    assert push.check(MODEL_REPO, True).upload(gguf, text) == ["README.md", "model-Q8_0.gguf"]
    uploads = [c[1:] for c in model_hub.calls if c[0] == "upload_file"]
    assert uploads == [(MODEL_REPO, "model-Q8_0.gguf", str(gguf)), (MODEL_REPO, "README.md", text.encode())]
    assert "Push(repo_id='me/tiny-model', private=True)" == repr(push.check(MODEL_REPO, True))
