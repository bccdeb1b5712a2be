"""Issue 47, fourth pass (inputs): a path option that is a URL is refused in one line, never made a folder
named `s3:`; a hand-edited plan.json is checked by trace."""

import os

import pytest
from conftest import run_main

from gptkit.errors import ConfigError
from gptkit.options import PATH_KEYS, check_paths, is_path_key

URL = "s3://bucket/x"
# every path option of every verb: (verb and its other args, the path option)
PATH_OPTIONS = [
    ("train", f"runs_dir={URL}"),
    ("train", f"init_from={URL}"),
    ("train", f"resume={URL}"),
    ("train data=files", f"data.paths=[corpus.txt,{URL}]"),
    ("train data=files data.paths=[corpus.txt]", f"data.val_paths=[{URL}]"),
    ("train data=prepared", f"data.dir={URL}"),
    ("train tokenizer=file", f"tokenizer.path={URL}"),
    ("prepare data=files data.paths=[corpus.txt]", f"cache_dir={URL}"),
    ("prepare data=files", f"data.paths=[{URL}]"),
    ("sample", f"run={URL}"),
    ("sample run=runs/x", f"prompt_file={URL}"),
    ("chat", f"run={URL}"),
    ("chat run=runs/x", f"template={URL}"),
    ("serve", f"run={URL}"),
    ("serve run=runs/x", f"template={URL}"),
    ("eval", f"run={URL}"),
    ("eval run=runs/x", f"out={URL}"),
    ("eval run=runs/x", f"tasks={URL}"),
    ("export run=runs/x", f"out={URL}"),
    ("export", f"run={URL}"),
    ("import hf=folder", f"out={URL}"),
    ("import out=runs/y", f"hf={URL}"),
    ("consolidate", f"run={URL}"),
    ("consolidate run=runs/x", f"out={URL}"),
    ("attention", f"run={URL}"),
    ("attention run=runs/x", f"out={URL}"),
    ("plot", f"run={URL}"),
    ("trace", f"run={URL}"),
    ("trace run=latest", f"runs_dir={URL}"),
    ("verify", f"dir={URL}"),
    ("bench data", f"bench.file={URL}"),
    ("bench data", f"bench.out={URL}"),
    ("bench optim", f"bench.runs_dir={URL}"),
]


@pytest.mark.parametrize(
    "verb_args, option", PATH_OPTIONS, ids=[f"{v.split()[0]}-{o}" for v, o in PATH_OPTIONS]
)
def test_a_url_in_any_path_option_is_one_line_and_makes_no_folder(
    tmp_path, monkeypatch, capsys, verb_args, option
):
    monkeypatch.chdir(tmp_path)
    key = option.split("=")[0]
    code, out, err = run_main(capsys, *verb_args.split(), option)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines == [
        f"error: {key}={URL}: URLs (s3://) are not supported yet; give a local "
        + ("folder" if key.endswith("dir") else "path")
    ], err
    # nothing made here, least of all a folder named after the scheme
    assert not any(p.name.startswith("s3:") for p in tmp_path.rglob("*"))
    assert list(tmp_path.iterdir()) == []


def test_hf_prefix_of_init_from_still_works_and_hf_url_gets_the_spelling(tmp_path, monkeypatch, capsys):
    from gptkit.fsio import check_local_path

    # hf:<owner/name | folder> is init_from's own scheme-like prefix: not a URL
    for ok in ("hf:owner/name", "hf:/models/llama", "runs/x", "relative/s3:/x", "C:/x", None, 3):
        check_local_path("init_from", ok)
    with pytest.raises(ConfigError, match=r"^init_from=hf://owner/name: write init_from=hf:<owner/name"):
        check_local_path("init_from", "hf://owner/name")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", "init_from=hf://owner/name")
    assert code == 2 and err.count("\n") == 1 and "init_from=hf:<owner/name" in err, err


def test_a_url_set_by_a_preset_is_refused_as_the_command_line_is():
    # what an experiment preset composes: checked after composition
    with pytest.raises(ConfigError, match=r"^runs_dir=gs://b/runs: URLs \(gs://\)"):
        check_paths({"runs_dir": "gs://b/runs", "model": {"name": "x"}})
    with pytest.raises(ConfigError, match=r"^data\.val_paths=file:///x: URLs \(file://\)"):
        check_paths({"data": {"kind": "files", "paths": ["a.txt"], "val_paths": ["file:///x"]}})
    # text is not a path: a prompt may quote a URL
    check_paths({"prompt": "see https://example.com", "system": "s3://x is a bucket", "run": "runs/x"})
    assert is_path_key("data.sources.web.paths") and not is_path_key("prompt")
    assert {"run", "out", "runs_dir", "init_from", "resume", "cache_dir", "paths"} <= set(PATH_KEYS)


def test_gptkit_cache_as_a_url_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "corpus.txt").write_text("hello world\n" * 50)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTKIT_CACHE", URL)
    code, _, err = run_main(capsys, "prepare", "data=files", "data.paths=[corpus.txt]", "tokenizer=byte")
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"error: GPTKIT_CACHE={URL}: URLs (s3://) are not supported yet; give a local path"
    ], err
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]
