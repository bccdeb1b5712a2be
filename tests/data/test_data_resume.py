"""A prepare killed with SIGKILL at any moment is continued by the next one from its last complete shard,
and the result is bit-identical to an uninterrupted build; nothing half-written is trusted."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S, shakespeare

SMALL = dict(PIECE_CHARS=600, HARD_CHARS=1200, BATCH_CHARS=2000)
SHARD_TOKENS = 1500


def script(cache, data, tok):
    return textwrap.dedent(f"""
        import gptkit.data, gptkit.data.shards as s, gptkit.data.tokenize as t
        for k, v in {SMALL!r}.items():
            setattr(t, k, v)
        s.SHARD_TOKENS = {SHARD_TOKENS}
        gptkit.data.prepare({data!r}, {tok!r}, cache_dir={str(cache)!r}, progress=False)
    """)


def run(cache, data, tok, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "GPTKIT_FAULT"}
    if fault:
        env["GPTKIT_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-c", script(cache, data, tok)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text(shakespeare(30_000))
    (tmp_path / "b.txt").write_text(shakespeare(20_000, start=60_000))
    return {"kind": "files", "paths": [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], "workers": 1}


def folder(cache):
    (d,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return d


def files(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.name != "manifest.json"}


@pytest.mark.parametrize(
    "faults, workers",
    [
        (("prepare-shard@3", "prepare-batch@2"), 2),
        pytest.param(("prepare-batch@17", "prepare-shards"), 1, marks=pytest.mark.long),
        (("prepare-batch@1",), 1),
        # killed before its first commit: all.bin holds only uncommitted batches
    ],
)
def test_a_killed_prepare_continues_from_its_last_complete_shard_bit_identically(
    tmp_path, corpus, faults, workers
):
    """With 2 workers the killed prepare's worker processes must also go: run() waits for the end of the
    output pipes they hold (its timeout would fail the test)."""
    tok = {"kind": "char", "eos_token": "<|endoftext|>"}
    corpus = {**corpus, "workers": workers}
    ref = run(tmp_path / "ref", corpus, tok)
    assert ref.returncode == 0, ref.stderr
    cache = tmp_path / "cache"
    # killed, then killed again while continuing
    for fault in faults:
        r = run(cache, corpus, tok, fault)
        assert r.returncode == -signal.SIGKILL, (fault, r.stderr)
        (partial,) = cache.glob(".*.partial")
        # (killed with the manifest written, before the rename)
        if fault != "prepare-shards":
            assert not any(p.name == "manifest.json" for p in partial.iterdir())
        if fault != faults[0]:
            assert "continuing the interrupted build" in r.stderr
        (partial / "progress.json.tmp-junk").write_text("a half-written leftover")
    r = run(cache, corpus, tok)
    assert r.returncode == 0, r.stderr
    assert "continuing the interrupted build" in r.stderr or faults[-1] == "prepare-shards"
    # no leftovers
    assert sorted(p.name for p in cache.iterdir()) == [folder(tmp_path / "ref").name]
    assert files(folder(cache)) == files(folder(tmp_path / "ref"))
    m = json.loads((folder(cache) / "manifest.json").read_text())
    ref_m = json.loads((folder(tmp_path / "ref") / "manifest.json").read_text())
    assert m["splits"] == ref_m["splits"]
    # where each document ends and which file it came from (train.docs: compared above) survive the kills
    assert m["documents"] == ref_m["documents"] and m["documents"]["train"]["documents"] == 2


def test_a_shard_changed_after_the_kill_is_not_trusted(tmp_path, corpus):
    tok = {"kind": "byte"}
    cache = tmp_path / "cache"
    r = run(cache, corpus, tok, "prepare-shard@4")
    assert r.returncode == -signal.SIGKILL, r.stderr
    (partial,) = cache.glob(".*.partial")
    shard = partial / "all.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    r = run(cache, corpus, tok)
    assert r.returncode == 0 and "does not match its record; building it again" in r.stderr, r.stderr
    ref = run(tmp_path / "ref", corpus, tok)
    assert ref.returncode == 0
    assert files(folder(cache)) == files(folder(tmp_path / "ref"))
