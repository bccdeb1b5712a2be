"""JSON-lines corpora are tokenized in byte ranges that each worker reads, parses and cuts itself: the shards
are those of the line-by-line path (sources.JSONL_RANGES=False, as before), for every tokenizer kind and
worker count, the errors are its errors, and a killed build continues bit-identically."""

import json

import numpy as np
import pytest
from conftest import as_text, interrupt_prepare, prepare_error, shakespeare, shard_bytes, small_tasks
from conftest import metaspace_tokenizer as metaspace
from conftest import tokenizer_settings as tokenizer_of

import gptkit.data.files as data_files
import gptkit.data.sources as sources
from gptkit.data import prepare

EOS = "<|endoftext|>"


@pytest.fixture
def small(monkeypatch):
    """Pieces and tasks small enough that a 50 kB corpus is many ranges and its long records many pieces."""
    small_tasks(monkeypatch)


def records() -> list:
    """Awkward records: long ones (cut in many places), CJK, a literal special token, JSON escapes and
    surrogate pairs, a number as text, an empty text, one without the field, whitespace between tokens."""
    text = shakespeare(40_000)
    out: list = []
    at = 0
    for i in range(40):
        n = [60, 900, 5000, 200, 3][i % 5]
        out.append({"text": text[at : at + n], "id": i})
        at += n
    out[3] = {"id": 3, "text": ("日本語のテキスト" * 100 + "。") * 3}
    out[7] = {"text": f"a{EOS}b {EOS}\n\n  x  ", "meta": {"k": [1, 2]}}
    out[11] = {"text": "caf\u00e9 \U0001f600 \u2003 tab\there\r\nline"}
    out[13] = {"text": 42}
    out[17] = {"text": ""}
    out[19] = {"body": "no text field here"}
    return out


def write(path, recs, blank_every=6):
    lines = []
    for i, r in enumerate(recs):
        lines.append(json.dumps(r, ensure_ascii=i % 2 == 0))
        if i % blank_every == 0:
            # a blank line
            lines.append("  ")
    # \r between JSON tokens (splitlines cuts there)
    lines[2] = lines[2].replace('", "id"', '",\r "id"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expected_ids(p, recs, bos=None):
    """Each record's text encoded whole by the saved tokenizer (special tokens' strings as text), with BOS/EOS
    (or the newline separator)."""
    tok = as_text(p.tokenizer())
    out = []
    for r in recs:
        t = r.get("text")
        if not t:
            continue
        t = str(t)
        if p.eos_id is None and not t.endswith("\n"):
            t += "\n"
        out += ([bos] if bos is not None else []) + tok.encode(t, add_special_tokens=False).ids
        out += [p.eos_id] if p.eos_id is not None else []
    return out


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "file"])
def test_ranges_give_the_shards_of_the_line_by_line_path(tmp_path, small, monkeypatch, kind):
    """Old path (line by line in the main process) against the ranges, with 1 and 2 workers, and both against
    each record encoded whole. byte: EOS; char: none (a newline separates documents); bpe: a BOS; file: a
    Metaspace tokenizer.json (every cut verified in the worker), validation files, 2 workers."""
    recs = records()
    a, b = write(tmp_path / "a.jsonl", recs[:25]), write(tmp_path / "b.jsonl", recs[25:], blank_every=4)
    data = {"kind": "files", "paths": [str(a), str(b)], "val_fraction": 0.1}
    bos = False
    tok = tokenizer_of(kind, tmp_path)
    if kind == "bpe":
        data, bos = {**data, "bos": True}, True
    if kind == "file":
        c = write(tmp_path / "c.jsonl", recs[30:36])
        data = {**data, "val_paths": [str(c)]}
    parsed_here = []
    real = data_files._json_record
    monkeypatch.setattr(data_files, "_json_record", lambda *a: parsed_here.append(1) or real(*a))

    monkeypatch.setattr(sources, "JSONL_RANGES", False)
    old = prepare({**data, "workers": 1}, tok, cache_dir=tmp_path / "old", progress=False)
    assert old.manifest["tasks"] == "batches of pieces" and parsed_here
    monkeypatch.setattr(sources, "JSONL_RANGES", True)
    for workers in (1, 2) if kind in ("bpe", "file") else (1,):
        parsed_here.clear()
        new = prepare({**data, "workers": workers}, tok, cache_dir=tmp_path / f"new{workers}", progress=False)
        assert new.manifest["tasks"] == "byte ranges of the JSON-lines files"
        # one cache entry: the same data
        assert new.dir.name == old.dir.name
        assert shard_bytes(new) == shard_bytes(old), workers
    # the main process parsed no line: the workers read their ranges
    if kind == "file":
        assert new.manifest["workers"] == 2 and not parsed_here
    ids = np.concatenate([new.train_tokens(), new.val_tokens()]).tolist()
    bos_id = new.tokenizer().token_to_id("<|bos|>") if bos else None
    assert ids == expected_ids(new, recs[:25] + recs[25:] + (recs[30:36] if kind == "file" else []), bos_id)


def error(tmp_path, monkeypatch, files, ranges, tok=None, workers=1):
    return prepare_error(tmp_path, monkeypatch, "JSONL_RANGES", files, ranges, tok, workers)


def test_bad_input_is_the_same_one_line_error_as_line_by_line(tmp_path, small, monkeypatch):
    # the text field must show within the first 5 records
    monkeypatch.setattr(data_files, "RECORDS", 5)
    good = write(tmp_path / "good.jsonl", records()[:20])
    body = "".join(json.dumps({"body": f"record {i} " * 40}) + "\n" for i in range(4))
    cases = {
        "utf8": b'{"text": "fine"}\n' * 300 + b'{"text": "caf\xe9"}\n',
        "json": b'{"text": "fine"}\n' * 300 + b'{"text": "broken\n',
        "object": b'{"text": "fine"}\n' * 300 + b"[1, 2]\n",
        # the 5th record lacks the field too: that error comes before the bad line after it
        "first records": (body + json.dumps({"body": "x"}) + "\n[bad\n").encode(),
        "no field": body.encode(),
        "no text": b'{"text": ""}\n\n{"text": null}\n',
        "empty": b"",
        "blank": b"\n  \n",
    }
    for what, content in cases.items():
        f = tmp_path / f"{what.replace(' ', '-')}.jsonl"
        f.write_bytes(content)
        new = error(tmp_path, monkeypatch, [good, f], True)
        assert new == error(tmp_path, monkeypatch, [good, f], False), what
        assert str(f) in new and "\n" not in new, what
    # the offset of the bad byte in the file
    at = len(b'{"text": "fine"}\n' * 300 + b'{"text": "caf')
    assert f"byte {at} " in error(tmp_path, monkeypatch, [tmp_path / "utf8.jsonl"], True)
    assert "(fields: body)" in error(tmp_path, monkeypatch, [tmp_path / "first-records.jsonl"], True)


def test_an_error_in_a_worker_reaches_the_user_as_its_one_line(tmp_path, small, monkeypatch, capsys):
    """With 2 workers: an empty file is found by the worker that reads its range (a GptkitError raised
    there), a bad line by the worker too (returned, raised here in order): both as the line-by-line path
    words them, and from the command line one `error:` line with exit 2."""
    from conftest import run_main

    good = write(tmp_path / "good.jsonl", records()[:20])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n' * 100 + b"{nope\n")
    meta = metaspace(tmp_path / "meta.json")
    tok = {"kind": "file", "path": meta, "eos_token": EOS}
    msg = error(tmp_path, monkeypatch, [good, tmp_path / "empty.jsonl"], True, tok, workers=2)
    assert msg == f"{tmp_path / 'empty.jsonl'} is empty; remove it from data.paths or give it some text"
    monkeypatch.setattr(sources, "JSONL_RANGES", True)
    code, _, err = run_main(
        capsys,
        "prepare",
        "data=files",
        f"data.paths=[{good},{tmp_path / 'bad.jsonl'}]",
        "tokenizer=file",
        f"tokenizer.path={meta}",
        "data.workers=2",
        "progress=false",
    )
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and line == (
        f"error: {tmp_path / 'bad.jsonl'}: the line at byte 1700 is not valid "
        "JSON (Expecting property name enclosed in double quotes); fix the file or "
        "set data.format"
    ), err


def test_a_killed_jsonl_build_continues_bit_identically(tmp_path, small, monkeypatch):
    """Ctrl-C keeps the complete shards; the next prepare skips the ranges they hold and ends with the
    uninterrupted build's files. The text field is only in the ranges the killed build wrote: they are read
    again for the checks (skipped unread, the file would seem to have no text field at all)."""
    import gptkit.data.shards as shards

    # a commit after every range that has tokens
    monkeypatch.setattr(shards, "SHARD_TOKENS", 1)
    texts = [{"text": shakespeare(1400, start=2000 * i)} for i in range(5)]
    f = write(tmp_path / "a.jsonl", texts + [{"body": "x " * 500, "n": i} for i in range(8)])
    ranges = list(data_files.line_ranges([f], "text", "strict", 3000))
    first_body = f.read_bytes().index(b'{"body"')
    n_text = sum(r.start < first_body for r in ranges)
    assert 2 <= n_text < len(ranges) - 2
    data, tok = {"kind": "files", "paths": [str(f)], "workers": 1}, {"kind": "char", "eos_token": EOS}
    ref = prepare(data, tok, cache_dir=tmp_path / "ref", progress=False)
    # stopped at the first range without the text field
    state = interrupt_prepare(monkeypatch, data, tok, tmp_path / "cache", n_text + 1)
    assert state["splits"]["all"]["batches"] == n_text
    again = prepare(data, tok, cache_dir=tmp_path / "cache", progress=False)
    assert shard_bytes(again) == shard_bytes(ref)


def test_progress_counts_the_bytes_of_the_files(tmp_path, small, monkeypatch, capfd):
    monkeypatch.setattr("gptkit.data.console.Progress.PLAIN_EVERY_S", 0.0)
    f = write(tmp_path / "a.jsonl", records())
    prepare({"kind": "files", "paths": [str(f)]}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=True)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("tokenizing:")]
    assert len(lines) >= 3 and "MB/s" in lines[0] and "ETA" in lines[0]
    assert "(100%)" in lines[-1] and " tokens" in lines[-1]
