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
from conftest import char_tokenizer, one_line_error, random_gpt, run_main, shakespeare

from gptkit.cli import main as gptkit_main
from gptkit.errors import GptkitError
from gptkit.hf import folders
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
