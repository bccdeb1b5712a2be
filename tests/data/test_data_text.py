"""Text files are tokenized in byte ranges that each worker reads, decodes and cuts itself, ending only at
safe cuts that the main process finds with short reads: the shards are those of the main process reading,
decoding and cutting everything (sources.TEXT_RANGES=False, as before), for every tokenizer kind and worker
count, on awkward text; the errors are its errors; a killed build continues bit-identically."""

import numpy as np
import pytest
from conftest import as_text, interrupt_prepare, prepare_error, shakespeare, shard_bytes, small_tasks
from conftest import tokenizer_settings as tokenizer_of

import gptkit.data.build as build
import gptkit.data.files as data_files
import gptkit.data.shards as shards
import gptkit.data.sources as sources
from gptkit.data import prepare
from gptkit.data.ranges import text_cuts
from gptkit.data.tokenize import Cutter
from gptkit.tokenizer import build_tokenizer

EOS = "<|endoftext|>"


@pytest.fixture
def small(monkeypatch):
    """Pieces and tasks small enough that a 20 kB file is many ranges and many pieces."""
    small_tasks(monkeypatch)
    # the old path reads (and decodes) in parts
    monkeypatch.setattr(data_files, "READ_BYTES", 2048)
    # the main process reads a little of each range
    monkeypatch.setattr("gptkit.data.ranges.SCAN_BLOCK", 64)


def awkward(tmp_path) -> dict:
    """Files whose nominal range ends fall inside multi-byte characters (CJK, emoji), in whitespace runs,
    near literal special tokens, with CRLF lines; a file with 5,000 letters in a row and one with NUL bytes
    (forced cuts: read as before), leading whitespace, small files."""
    s = shakespeare(60_000)
    files = {
        "plain": s[:20_000],
        "cjk": ("日本語のテキスト。🙂 é\n" * 900),
        "special": "".join(f"w{i}{EOS}x{EOS}{EOS}\n{EOS}y {i}\n" for i in range(700)),
        "spaces": "".join(f"{s[i * 50 : i * 50 + 40]}\n{' ' * (i % 97)}\n\n\t \n" for i in range(300)),
        "crlf": s[20_000:32_000].replace("\n", "\r\n"),
        "letters": s[32_000:38_000] + "a" * 5000 + s[38_000:44_000],
        "nul": s[44_000:48_000] + "\x00" * 4000 + s[48_000:52_000],
        "lead": "   \n\n " + s[52_000:60_000],
        "tiny": "hi",
        "tail": s[:9000] + "\n\n   \n",
    }
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"{name}.txt"
        out[name].write_text(text, encoding="utf-8", newline="")
    return out


def test_cuts_are_safe_places_and_files_without_them_are_read_as_before(tmp_path, small):
    f = awkward(tmp_path)
    cutter = Cutter("gpt2", [EOS])
    for name in ("plain", "cjk", "special", "spaces", "crlf", "lead", "tail"):
        data = f[name].read_bytes()
        cuts = text_cuts(str(f[name]), len(data), 3000, cutter)
        assert cuts, name
        text = data.decode()
        for c in cuts:
            # a character boundary (decodes), and a cut the Cutter accepts
            k = len(data[:c].decode())
            assert k in set(cutter._candidates(text, k - 1, k + 2, None)) and cutter._clear(text, k), name
        assert all(b - a >= 3000 for a, b in zip([0, *cuts], cuts)), name
    for name in ("letters", "nul"):
        assert text_cuts(str(f[name]), f[name].stat().st_size, 3000, cutter) is None, name
    assert text_cuts(str(f["tiny"]), 2, 3000, cutter) == []


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "file"])
def test_ranges_give_the_shards_of_the_old_path(tmp_path, small, monkeypatch, kind):
    """Old path (the main process reads, decodes and cuts) against the ranges, 1 and 2 workers. byte: EOS;
    char: none (a newline separates documents); bpe: a BOS, validation files; file: a Metaspace tokenizer.json
    (Cutter mode verify: read as before)."""
    f = awkward(tmp_path)
    names = sorted(f)
    data = {"kind": "files", "paths": [str(f[n]) for n in names], "val_fraction": 0.1}
    tok = tokenizer_of(kind, tmp_path)
    # Cutter mode verify: slow to check, and read as before
    if kind == "file":
        data = {**data, "paths": [str(f["plain"]), str(f["cjk"])]}
    if kind == "bpe":
        data = {
            **data,
            "bos": True,
            "paths": [str(f[n]) for n in names[:-3]],
            "val_paths": [str(f[n]) for n in names[-3:]],
        }
    decoded = []
    real = data_files._decoded_chunks
    monkeypatch.setattr(data_files, "_decoded_chunks", lambda p, *a: decoded.append(p.name) or real(p, *a))
    # (char and bpe train on all of this small corpus: not counted)
    train = build._train_tokenizer
    monkeypatch.setattr(build, "_train_tokenizer", lambda *a: (train(*a), decoded.clear())[0])

    monkeypatch.setattr(sources, "TEXT_RANGES", False)
    old = prepare({**data, "workers": 1}, tok, cache_dir=tmp_path / "old", progress=False)
    assert old.manifest["tasks"] == "batches of pieces"
    monkeypatch.setattr(sources, "TEXT_RANGES", True)
    for workers in (1, 2) if kind == "bpe" else (1,):
        decoded.clear()
        new = prepare({**data, "workers": workers}, tok, cache_dir=tmp_path / f"new{workers}", progress=False)
        # one cache entry: the same data
        assert new.dir.name == old.dir.name
        assert shard_bytes(new) == shard_bytes(old), workers
    if kind == "file":
        assert new.manifest["tasks"] == "batches of pieces"
        return
    assert new.manifest["tasks"].startswith("byte ranges of the text files (2 file(s) read here")
    # the others: read by whoever ran their ranges
    assert sorted(decoded) == ["letters.txt", "nul.txt"]
    # each file encoded whole is its stretch of the shards
    # the files' <|endoftext|> as text
    t = as_text(new.tokenizer())
    ids = np.concatenate([new.train_tokens(), new.val_tokens()]).tolist()
    bos = [t.token_to_id("<|bos|>")] if kind == "bpe" else []
    want = []
    for n in (names[:-3] + names[-3:]) if kind == "bpe" else names:
        text = f[n].read_bytes().decode()
        text += "\n" if new.eos_id is None and not text.endswith("\n") else ""
        want += (
            bos
            + t.encode(text, add_special_tokens=False).ids
            + ([new.eos_id] if new.eos_id is not None else [])
        )
    # byte and char: no cut changes an id, forced or not (bpe: forced cuts in two files)
    if kind != "bpe":
        assert ids == want


def error(tmp_path, monkeypatch, files, ranges, tok=None, workers=1):
    return prepare_error(tmp_path, monkeypatch, "TEXT_RANGES", files, ranges, tok, workers)


def test_bad_input_is_the_same_one_line_error_as_before(tmp_path, small, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text(shakespeare(9000))
    body = shakespeare(9000, start=9000).encode()
    cases = {
        # in the second or third range
        "late byte": body + b"caf\xe9 au lait\n" + body,
        "first byte": b"\xff" + body,
        # the file ends inside a character
        "cut char": body + "日本".encode()[:4],
        "empty": b"",
        "blank": b"\n  \n\t",
        "blank big": b" \n" * 5000,
    }
    for what, content in cases.items():
        f = tmp_path / f"{what.replace(' ', '-')}.txt"
        f.write_bytes(content)
        new = error(tmp_path, monkeypatch, [good, f], True)
        assert new == error(tmp_path, monkeypatch, [good, f], False), what
        assert str(f) in new and "\n" not in new, what
    # a file read as before (no safe cut) fails after a ranged one with a bad byte: that error comes first
    nul = tmp_path / "nul-blank.txt"
    nul.write_bytes(b" " * 5000)
    assert text_cuts(str(nul), 5000, 3000, Cutter("any")) is None
    # the bad byte in the last range: still in flight at nul's error
    last = tmp_path / "last-range.txt"
    last.write_bytes(body * 2 + b"caf\xe9 au lait\n" + body[:500])
    pair = [last, nul]
    # (a trained bpe would meet the bad byte in training, in either path)
    bpe = tmp_path / "bpe.json"
    tok = build_tokenizer({"kind": "bpe", "vocab_size": 300}, texts=lambda: [body.decode()])
    bpe.write_text(tok.to_str())
    msg = error(tmp_path, monkeypatch, pair, True, {"kind": "file", "path": str(bpe)}, workers=2)
    assert msg == error(tmp_path, monkeypatch, pair, False) and "is not valid UTF-8" in msg
    late = tmp_path / "late-byte.txt"
    assert text_cuts(str(late), late.stat().st_size, 3000, Cutter("any")), "read as before"
    assert f"byte {len(body) + 3} " in error(tmp_path, monkeypatch, [late], True)


def test_whitespace_files_are_skipped_by_stdlib_and_leading_whitespace_kept(tmp_path, small, monkeypatch):
    """data=stdlib reads text files with blank=skip: a file of only whitespace is no document there."""
    files = []
    for i, text in enumerate(["", " \n\n", "  \n" + shakespeare(7000), "\n", shakespeare(500, start=100)]):
        p = tmp_path / f"m{i}.py"
        p.write_text(text)
        files.append(p)
    monkeypatch.setattr(sources, "stdlib_files", lambda include_tests=True: files)
    out = {}
    for ranges in (False, True):
        monkeypatch.setattr(sources, "TEXT_RANGES", ranges)
        p = prepare(
            {"kind": "stdlib", "workers": 1},
            {"kind": "byte", "eos_token": EOS},
            cache_dir=tmp_path / f"s{ranges}",
            progress=False,
        )
        out[ranges] = shard_bytes(p)
        assert p.manifest["validation"]["documents"] == 2
    assert out[True] == out[False]


def test_a_killed_text_build_continues_bit_identically(tmp_path, small, monkeypatch):
    """Ctrl-C after some ranges keeps the complete shards; the next prepare skips the ranges they hold and
    ends with the uninterrupted build's files."""
    # a commit after every range
    monkeypatch.setattr(shards, "SHARD_TOKENS", 1)
    f = tmp_path / "a.txt"
    f.write_text(shakespeare(30_000))
    data, tok = {"kind": "files", "paths": [str(f)], "workers": 1}, {"kind": "char", "eos_token": EOS}
    ref = prepare(data, tok, cache_dir=tmp_path / "ref", progress=False)
    assert ref.manifest["tasks"] == "byte ranges of the text files"
    state = interrupt_prepare(monkeypatch, data, tok, tmp_path / "cache", 4)
    assert state["splits"]["all"]["batches"] == 3 and state["layout"]["text_tasks"] == "byte ranges"
    again = prepare(data, tok, cache_dir=tmp_path / "cache", progress=False)
    assert shard_bytes(again) == shard_bytes(ref)


def test_progress_counts_the_bytes_of_the_files(tmp_path, small, monkeypatch, capfd):
    monkeypatch.setattr("gptkit.data.console.Progress.PLAIN_EVERY_S", 0.0)
    f = tmp_path / "a.txt"
    f.write_text(shakespeare(30_000) + "é" * 10)
    prepare({"kind": "files", "paths": [str(f)]}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=True)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("tokenizing:")]
    assert len(lines) >= 3 and "MB/s" in lines[0]
    assert f"{f.stat().st_size / 1000:.1f} kB of {f.stat().st_size / 1000:.1f} kB (100%)" in lines[-1]


def test_bytes_that_are_not_utf8_with_replace(tmp_path, small, monkeypatch):
    """encoding_errors=replace: ranges never end beside a bad byte (several may be one U+FFFD)."""
    s = shakespeare(20_000).encode()
    f = tmp_path / "latin.txt"
    f.write_bytes(
        b"".join(
            s[i : i + 500] + [b"\xe9", b"\xe2\x82", b"\xff\xfe", b"\xf0\x9f"][i % 4]
            for i in range(0, len(s), 500)
        )
    )
    assert text_cuts(str(f), f.stat().st_size, 3000, Cutter("gpt2"))
    out = []
    for ranges in (False, True):
        monkeypatch.setattr(sources, "TEXT_RANGES", ranges)
        p = prepare(
            {"kind": "files", "paths": [str(f)], "encoding_errors": "replace", "workers": 1},
            {"kind": "byte", "eos_token": EOS},
            cache_dir=tmp_path / f"r{ranges}",
            progress=False,
        )
        out.append(shard_bytes(p))
    assert out[0] == out[1]
