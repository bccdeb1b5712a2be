"""`gptkit prepare` through the CLI: the happy path, the cache message, and every bad input as one
line on stderr, a non-zero exit, and nothing half-written left in the cache."""

import json
import os

import pytest


def prepare(cli, tmp_path, *args, env=None):
    r = cli("prepare", f"cache_dir={tmp_path / 'cache'}", "progress=false", *args, env=env)
    return r


def assert_one_line_error(r, *needles):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[-1], lines[-1]


def assert_nothing_left(tmp_path):
    cache = tmp_path / "cache"
    assert not cache.exists() or list(cache.iterdir()) == []


def test_prepare_then_cache_hit(cli, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("to be or not to be, that is the question\n" * 20)
    r = prepare(cli, tmp_path, "data=files", f"data.paths=[{f}]", "tokenizer=char", "seq_len=64")
    assert r.returncode == 0, r.stderr
    assert "prepared" in r.stderr and "train tokens" in r.stdout
    (folder,) = (tmp_path / "cache").iterdir()
    m = json.loads((folder / "manifest.json").read_text())
    assert m["tokenizer"]["kind"] == "char" and m["tokenizer"]["vocab_size"] == len(set(f.read_text()))
    r = prepare(cli, tmp_path, "data=files", f"data.paths=[{f}]", "tokenizer=char")
    assert r.returncode == 0 and "cache hit" in r.stderr


@pytest.mark.parametrize("case", ["missing", "glob", "empty", "short", "undecodable", "fifo"])
def test_bad_corpus(cli, tmp_path, case):
    f = tmp_path / "a.txt"
    if case == "missing":
        args, needles = [f"data.paths=[{tmp_path / 'nope.txt'}]"], ["nope.txt does not exist"]
    elif case == "glob":
        args, needles = [f"data.paths=['{tmp_path}/*.md']"], ["matches no files"]
    elif case == "empty":
        f.write_text("")
        args, needles = [f"data.paths=[{f}]"], ["a.txt is empty"]
    elif case == "short":
        f.write_text("far too short\n" * 3)
        args, needles = [f"data.paths=[{f}]", "seq_len=64"], ["shorter than one window", "65"]
    # opening it would block forever: refused before anything is read
    elif case == "fifo":
        os.mkfifo(f)
        args, needles = [f"data.paths=[{f}]"], ["a.txt is a FIFO (named pipe)", "give regular files"]
    else:
        f.write_bytes("ok text\n".encode() * 10 + b"\xc3\x28 broken\n")
        args, needles = (
            [f"data.paths=[{f}]"],
            ["a.txt: byte 80", "not valid UTF-8", "encoding_errors=replace"],
        )
    r = prepare(cli, tmp_path, "data=files", *args)
    assert_one_line_error(r, *needles)
    # a short corpus is a fine cache entry; only the window check fails
    if case != "short":
        assert_nothing_left(tmp_path)


def test_unknown_tokenizer_kind(cli, tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text for a tokenizer\n" * 10)
    r = prepare(cli, tmp_path, "data=files", f"data.paths=[{f}]", "tokenizer.kind=wordpiece")
    assert_one_line_error(r, "unknown tokenizer kind 'wordpiece'")
    assert_nothing_left(tmp_path)


def test_vocab_too_large_for_the_chosen_dtype(cli, tmp_path):
    from conftest import big_vocab_tokenizer

    tok = big_vocab_tokenizer(tmp_path / "big.json")
    f = tmp_path / "a.txt"
    f.write_text("w1 w70 w69999 " * 20)
    r = prepare(
        cli,
        tmp_path,
        "data=files",
        f"data.paths=[{f}]",
        "data.dtype=uint16",
        "tokenizer=file",
        f"tokenizer.path={tok}",
    )
    assert_one_line_error(r, "70000 tokens", "data.dtype=uint32")
    assert_nothing_left(tmp_path)


def prepared_folder(tmp_path):
    from gptkit.data import prepare as prepare_api

    f = tmp_path / "a.txt"
    f.write_text("some text\n" * 50)
    return f, prepare_api(
        {"kind": "files", "paths": [str(f)]}, {"kind": "byte"}, cache_dir=tmp_path / "cache", progress=False
    ).dir


def test_edited_manifest(cli, tmp_path):
    f, folder = prepared_folder(tmp_path)
    m = json.loads((folder / "manifest.json").read_text())
    m["splits"]["train"]["tokens"] += 1
    (folder / "manifest.json").write_text(json.dumps(m))
    # the cache entry is checked before use
    r = prepare(cli, tmp_path, "data=files", f"data.paths=[{f}]")
    assert_one_line_error(r, "edited or corrupted", f"delete {folder}")


def test_truncated_manifest(cli, tmp_path):
    _, folder = prepared_folder(tmp_path)
    mf = folder / "manifest.json"
    mf.write_text(mf.read_text()[:40])
    r = prepare(cli, tmp_path, "data=prepared", f"data.dir={folder}")
    assert_one_line_error(r, "corrupted (not valid JSON", f"delete {folder}")


def test_shards_from_another_tokenizer(cli, tmp_path):
    _, folder = prepared_folder(tmp_path)
    r = prepare(cli, tmp_path, "data=prepared", f"data.dir={folder}", "tokenizer=char")
    assert_one_line_error(r, "written with tokenizer byte", "not the configured char")


def test_hub_without_network_fails_in_one_line(cli, tmp_path):
    args = ("data=hub", "data.name=Salesforce/wikitext", "data.config=wikitext-2-raw-v1")
    # conftest sets HF_HUB_OFFLINE=1
    r = prepare(cli, tmp_path, *args)
    assert_one_line_error(r, "Salesforce/wikitext", "data=files")
    # online mode with the hub endpoint unreachable: the connectivity check answers, not minutes of retries
    no_proxy = {v: "" for v in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    r = prepare(
        cli,
        tmp_path,
        *args,
        env={
            "HF_HUB_OFFLINE": "0",
            "HF_DATASETS_OFFLINE": "0",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            **no_proxy,
        },
    )
    assert_one_line_error(r, "is unreachable", "data=files")
    assert_nothing_left(tmp_path)


def test_an_unreachable_hub_is_one_connect_with_data_timeout_s_and_datasets_is_never_called(
    tmp_path, monkeypatch
):
    """Why no network fails in seconds: one TCP connect, bounded by data.timeout_s, answers before
    datasets (and its minutes of retries) is called at all."""
    import datasets

    from gptkit.data import prepare
    from gptkit.errors import GptkitError

    connects = []

    def refused(address, timeout):
        connects.append((address, timeout))
        raise ConnectionRefusedError(111, "Connection refused")

    def never(*args, **kwargs):
        raise AssertionError("datasets.load_dataset called with the hub unreachable")

    monkeypatch.setattr("gptkit.hub.socket.create_connection", refused)
    monkeypatch.setattr(datasets, "load_dataset", never)
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "http_proxy", "https_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    data = {"kind": "hub", "name": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "timeout_s": 3}
    with pytest.raises(GptkitError, match="is unreachable .*data=files"):
        prepare(data, {"kind": "byte"}, cache_dir=tmp_path / "cache", progress=False)
    assert connects == [(("127.0.0.1", 9), 3.0)]
    assert_nothing_left(tmp_path)
