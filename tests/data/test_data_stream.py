"""Data at scale: files read in bounded pieces give the ids of the whole text, any worker count gives the
same shards, tiktoken gives HF's ids, non-regular files are refused, the hub streams, BPE trains on a
bounded sample, progress says MB/s and tokens."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import as_text, shakespeare, tiny_run, wait_for

from gptkit.data import prepare
from gptkit.errors import GptkitError

EOS = "<|endoftext|>"


def one_step(f, runs, model, *extra):
    """The overrides of a 1-step `train` of `model` (1 layer, width 32) on the text file f, named `model`."""
    keys = dict(model=model, tokenizer=None, batch_size=2, steps=1, val_every=None, val_windows=1)
    return tiny_run(f, runs, model, *extra, **keys, checkpoint_every=None, log_every=None, warmup=None)


def prep(tmp_path, data, tok, **kw):
    return prepare(data, tok, cache_dir=tmp_path / "cache", progress=False, **kw)


def all_ids(p):
    return np.concatenate([p.train_tokens(), p.val_tokens()]).tolist()


def awkward_text() -> str:
    """Text whose cuts are hard: a 12k-character line of words, a run of CJK letters, punctuation runs,
    literal special tokens, whitespace runs, lines ending in spaces."""
    base = shakespeare(30_000)
    lines = base.splitlines()
    text = "\n".join(line + " " * (i % 3) for i, line in enumerate(lines))
    long_line = " ".join(w for line in lines[:2000] for w in line.split())[:12_000]
    # letter runs shorter than HARD_CHARS
    cjk = ("日本語のテキスト" * 120 + "。" + "漢字" * 200 + "、") * 8
    return (
        text[:10_000]
        + "\n"
        + long_line
        + "\n"
        + cjk
        + "\n"
        + f"x{EOS}y " * 300
        + "-=" * 600
        + "\n"
        + "   \n\n\t" * 200
        + text[10_000:]
        + "  trailing  \n\n  spaces "
    )


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces, windows and reads small enough that a 60 kB text is cut in many places."""
    monkeypatch.setattr("gptkit.data.tokenize.PIECE_CHARS", 700)
    monkeypatch.setattr("gptkit.data.tokenize.HARD_CHARS", 1500)
    monkeypatch.setattr("gptkit.data.tokenize.BATCH_CHARS", 3000)
    monkeypatch.setattr("gptkit.data.files.READ_BYTES", 997)


def metaspace_tokenizer(path, text):
    """A tokenizer.json that is no GPT-2 byte-level BPE (Metaspace pre-tokenizer): cut only where verified."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", EOS], show_progress=False)
    )
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["char", "byte", "bpe", "file"])
def test_a_file_read_in_bounded_pieces_gives_the_ids_of_the_whole_text(tmp_path, small_pieces, kind):
    from gptkit.data.tokenize import Cutter

    text = awkward_text()
    f = tmp_path / "doc.txt"
    f.write_text(text)
    tok = {
        "char": {"kind": "char", "eos_token": EOS},
        "byte": {"kind": "byte", "eos_token": EOS},
        "bpe": {"kind": "bpe", "vocab_size": 400, "min_frequency": 1},
        "file": {
            "kind": "file",
            "eos_token": EOS,
            "path": str(metaspace_tokenizer(tmp_path / "meta.json", text)),
        },
    }[kind]
    cuts = []
    real = Cutter.cut
    Cutter.cut = lambda self, *a: cuts.append(real(self, *a)) or cuts[-1]
    try:
        p = prep(tmp_path, {"kind": "files", "paths": [str(f)], "workers": 1}, tok)
    finally:
        Cutter.cut = real
    # the document really was cut, in many places
    assert sum(c is not None for c in cuts) > 40
    # the text's <|endoftext|> as text
    whole = as_text(p.tokenizer()).encode(text, add_special_tokens=False).ids + [p.eos_id]
    assert all_ids(p) == whole


def test_a_run_without_any_safe_cut_is_cut_anyway_and_said(tmp_path, small_pieces, capsys):
    """A file of NUL bytes: for byte any cut keeps the ids; BPE notes the forced cuts."""
    f = tmp_path / "zeros.txt"
    f.write_bytes(b"\0" * 20_000)
    p = prep(tmp_path, {"kind": "files", "paths": [str(f)], "workers": 1}, {"kind": "byte"})
    # the newline that separates documents without an EOS
    assert all_ids(p) == [0] * 20_000 + [10]
    p = prep(tmp_path, {"kind": "files", "paths": [str(f)], "workers": 1}, {"kind": "bpe", "vocab_size": 300})
    assert "cut(s) fell inside a run of over" in capsys.readouterr().err
    assert p.tokenizer().decode(all_ids(p)) == "\0" * 20_000


def test_shards_do_not_depend_on_the_worker_count(tmp_path, small_pieces):
    (tmp_path / "a.txt").write_text(awkward_text())
    (tmp_path / "b.txt").write_text(shakespeare(20_000, start=50_000))
    tok = {"kind": "bpe", "vocab_size": 500}
    data = {"kind": "files", "paths": [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]}
    one = prepare({**data, "workers": 1}, tok, cache_dir=tmp_path / "one", progress=False)
    two = prepare({**data, "workers": 2}, tok, cache_dir=tmp_path / "two", progress=False)
    # data.workers is no part of the cache key
    assert one.dir.name == two.dir.name
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (one.dir / name).read_bytes() == (two.dir / name).read_bytes(), name
    assert one.manifest["encoder"] == "tiktoken"
    # HF tokenizers in the workers: they read the tokenizer from the build folder's tokenizer.json
    meta = {"kind": "file", "path": str(metaspace_tokenizer(tmp_path / "meta.json", shakespeare(5_000)))}
    data = {"kind": "files", "paths": [str(tmp_path / "b.txt")]}
    one = prepare({**data, "workers": 1}, meta, cache_dir=tmp_path / "one", progress=False)
    two = prepare({**data, "workers": 2}, meta, cache_dir=tmp_path / "two", progress=False)
    assert two.manifest["encoder"] == "hf" and two.manifest["workers"] == 2
    assert (one.dir / "train.bin").read_bytes() == (two.dir / "train.bin").read_bytes()
    assert (one.dir / "val.bin").read_bytes() == (two.dir / "val.bin").read_bytes()


def test_a_tokenization_worker_imports_neither_torch_nor_the_rest_of_gptkit_data():
    # a spawned worker imports gptkit.data.workers (and so the package gptkit.data first): torch there
    # cost each worker 1.3 s of CPU, a third of a 2-worker prepare of 60 MB on 2 cores
    code = (
        "import sys, gptkit.data.workers, tokenizers; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('gptkit.data.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['gptkit.data.tokenize', 'gptkit.data.workers']"


def test_tiktoken_from_the_same_merges_gives_the_ids_of_hf_tokenizers_on_tricky_text():
    from tokenizers import Tokenizer

    from gptkit.data.tokenize import (
        TRICKY,
        EncoderSpec,
        build_encoder,
        choose_engine,
        hf_encoder,
        text_encoder,
    )
    from gptkit.tokenizer import build_tokenizer

    corpus = [
        shakespeare(40_000),
        TRICKY * 3,
        "I'm   you've\t\tthey'LL  \n\n  ２０２６年  e\u0301\u0301 🙂🙂 ''s",
    ]
    tok = build_tokenizer(
        {"kind": "bpe", "vocab_size": 700, "min_frequency": 1}, texts=lambda: iter(corpus), progress=False
    )
    js = tok.to_str()
    tricky = [
        TRICKY,
        corpus[2],
        f"a{EOS}b {EOS}{EOS}\n",
        " \u00a0\u2003 x \r\n\r\n y",
        "\x1c\x1d\x1e\x1f\x85 z",
        "123456789 1.5e10 x1y2z3",
        "'''' 's 'S 'd't",
        "ǅungla Ⅻ ⅷ ¼ ½ 𝔘𝔫𝔦",
        shakespeare(5_000, start=90_000),
    ]
    # special tokens' strings as text (the default), and as the tokens (data.special_tokens_in_content=allow)
    for allow in (False, True):
        assert choose_engine(js, "bpe", allow_special_text=allow)[0] == "tiktoken"
        spec = EncoderSpec(js, "tiktoken", (EOS,) if allow else (), None, "uint32", allow_special_text=allow)
        fast = build_encoder(spec)
        hf = hf_encoder(text_encoder(Tokenizer.from_str(js), allow))
        for t in tricky:
            assert fast([t])[0].tolist() == hf([t])[0], (allow, repr(t[:40]))
        # a literal <|endoftext|>: its id only with allow
        assert (tok.token_to_id(EOS) in hf([f"a{EOS}b"])[0]) == allow


def test_a_tokenizer_that_tiktoken_cannot_run_falls_back_to_hf(tmp_path):
    from gptkit.data.tokenize import choose_engine

    text = shakespeare(5_000)
    path = metaspace_tokenizer(tmp_path / "meta.json", text)
    assert choose_engine(path.read_text(), "file")[0] == "hf"


@pytest.mark.parametrize("what", ["fifo", "device"])
def test_fifos_and_devices_are_refused_before_anything_is_read(tmp_path, what):
    if what == "fifo":
        path = tmp_path / "fifo"
        # opening it for reading would block forever
        os.mkfifo(path)
        needle = "is a FIFO"
    else:
        path, needle = "/dev/zero", "is a character device"
    with pytest.raises(GptkitError, match=needle):
        prep(tmp_path, {"kind": "files", "paths": [str(path)]}, {"kind": "byte"})
    with pytest.raises(GptkitError, match=needle):
        prep(
            tmp_path,
            {"kind": "files", "paths": [str(tmp_path / "*")] if what == "fifo" else ["/dev/zer?"]},
            {"kind": "byte"},
        )


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc")
def test_a_data_file_that_fails_to_read_is_one_line_naming_it(tmp_path):
    # reading /proc/self/mem at offset 0 fails with EIO, as a bad disk sector would
    for kind, name in (("files", "f.txt"), ("files", "f.json"), ("tokens", "f.bin")):
        (tmp_path / name).symlink_to("/proc/self/mem")
        with pytest.raises(GptkitError) as err:
            prep(tmp_path, {"kind": kind, "paths": [str(tmp_path / name)]}, {"kind": "byte"})
        msg = str(err.value)
        assert "/mem: cannot read it (Input/output error)" in msg and "\n" not in msg, (kind, msg)
        assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_jsonl_streams_line_by_line_and_names_a_bad_line(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(
        "".join(json.dumps({"text": f"record {i} " * 5, "id": i}) + "\n" for i in range(50))
        + '{"text": "broken\n'
    )
    with pytest.raises(GptkitError, match=r"a.jsonl: the line at byte \d+ is not valid JSON"):
        prep(tmp_path, {"kind": "files", "paths": [str(f)]}, {"kind": "byte"})
    f.write_text("".join(json.dumps({"body": "x"}) + "\n" for _ in range(3)))
    with pytest.raises(GptkitError, match=r"records have no field 'text' \(fields: body\)"):
        prep(tmp_path, {"kind": "files", "paths": [str(f)]}, {"kind": "byte"})


def write_parquet(folder, n_files=3, rows=40):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    texts = []
    for i in range(n_files):
        t = [f"file {i} row {r}: " + shakespeare(200, start=1000 * (i * rows + r)) for r in range(rows)]
        pq.write_table(
            pa.table({"text": t, "n": list(range(rows))}), folder / f"part-{i}.parquet", row_group_size=7
        )
        texts += t
    return texts


def test_hub_streams_through_datasets_streaming_loader(tmp_path, monkeypatch):
    """data=hub calls load_dataset(..., streaming=True): nothing is downloaded first. Here the "hub" is
    datasets' own streaming loader over local parquet shards."""
    import datasets

    texts = write_parquet(tmp_path / "hub")
    real = datasets.load_dataset
    calls = []

    def fake(name, config=None, split=None, revision=None, streaming=False, **kw):
        calls.append((name, config, split, streaming))
        files = sorted(str(p) for p in (tmp_path / "hub").glob("*.parquet"))
        return real("parquet", data_files={"train": files}, split="train", streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    p = prep(
        tmp_path,
        {"kind": "hub", "name": "someone/corpus", "workers": 1},
        {"kind": "bpe", "vocab_size": 300, "train_chars": 3_000},
    )
    # streamed, always
    assert calls and all(c[3] is True for c in calls)
    assert "streamed" in p.manifest["source"]["description"]
    tok = as_text(p.tokenizer())
    expected = [i for t in texts for i in tok.encode(t).ids + [p.eos_id]]
    # every shard, in order
    assert all_ids(p) == expected


def test_hub_streaming_mocked_load_dataset(tmp_path, monkeypatch):
    """A mocked load_dataset(streaming=True) that returns an iterable dataset of dict batches."""
    import datasets

    class Stream:
        column_names = ["text"]
        n_shards = 1

        def iter(self, batch_size):
            for i in range(0, 30, batch_size):
                yield {"text": [f"doc {j}\n" for j in range(i, min(30, i + batch_size))]}

    seen = {}

    def fake(name, config=None, split=None, revision=None, streaming=False, **kw):
        seen["streaming"] = streaming
        return Stream()

    monkeypatch.setattr(datasets, "load_dataset", fake)
    p = prep(tmp_path, {"kind": "hub", "name": "a/b"}, {"kind": "byte"})
    assert seen["streaming"] is True
    assert bytes(all_ids(p)).decode() == "".join(f"doc {j}\n" for j in range(30))


def test_bpe_trains_on_a_bounded_evenly_spread_sample(tmp_path, capsys):
    from gptkit.data.build import training_sample
    from gptkit.data.kinds import open_corpus

    head, tail = "alpha beta gamma\n" * 3_000, "omega psi chi\n" * 3_000
    f = tmp_path / "big.txt"
    f.write_text(head + shakespeare(200_000) + tail)
    corpus = open_corpus(
        {
            "kind": "files",
            "paths": [str(f)],
            "val_paths": None,
            "format": "auto",
            "text_field": "text",
            "encoding_errors": "strict",
        }
    )
    texts, what = training_sample(corpus, 60_000)
    sample = "".join(texts())
    assert 0.8 * 60_000 <= len(sample) <= 60_000 and "evenly spaced" in what
    # from both ends of the file
    assert "alpha beta" in sample and "omega psi" in sample
    p = prep(
        tmp_path,
        {"kind": "files", "paths": [str(f)]},
        {"kind": "bpe", "vocab_size": 300, "train_chars": 60_000},
    )
    err = capsys.readouterr().err
    assert "training byte-level BPE 300 on a sample of 60.0 kchars" in err and "train_chars=60,000" in err
    assert p.tokenizer().decode(all_ids(p)).startswith("alpha beta")


def test_progress_lines_say_mb_per_s_tokens_and_eta(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr("gptkit.data.tokenize.BATCH_CHARS", 10_000)
    monkeypatch.setattr("gptkit.data.tokenize.PIECE_CHARS", 5_000)
    monkeypatch.setattr("gptkit.data.console.Progress.PLAIN_EVERY_S", 0.0)
    f = tmp_path / "a.txt"
    f.write_text(shakespeare(50_000))
    prepare({"kind": "files", "paths": [str(f)]}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=True)
    # not a terminal: plain lines
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("tokenizing:")]
    assert len(lines) >= 3 and "MB/s" in lines[0] and "ETA" in lines[0] and " of 50.0 kB (" in lines[0]
    # the text and the newline that ends it
    assert "50,001 tokens" in lines[-1] and "(100%)" in lines[-1]


def test_data_workers_must_be_a_positive_integer(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text\n" * 10)
    with pytest.raises(GptkitError, match="data.workers=0 must be an integer >= 1"):
        prep(tmp_path, {"kind": "files", "paths": [str(f)], "workers": 0}, {"kind": "byte"})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# ---- data.bos ---------------------------------------------------------------------------------------
def test_bos_auto_is_off_for_a_model_with_learned_positions(tmp_path, capsys, monkeypatch):
    from conftest import run_main
    from omegaconf import OmegaConf

    from gptkit.data.settings import for_model as bos_for_model

    assert bos_for_model({"kind": "files", "bos": "auto"}, "rope") == {"kind": "files", "bos": "auto"}
    assert bos_for_model({"kind": "files", "bos": "auto"}, "learned")["bos"] is False
    # asked for: kept
    assert bos_for_model({"kind": "files", "bos": True}, "learned")["bos"] is True
    mixed = bos_for_model(
        {
            "kind": "mix",
            "sources": {
                "a": {"kind": "files", "weight": 1},
                "b": {"kind": "pydoc", "bos": True, "weight": 1},
            },
        },
        "learned",
    )
    assert mixed["sources"]["a"]["bos"] is False and mixed["sources"]["b"]["bos"] is True
    f = tmp_path / "a.txt"
    f.write_text(shakespeare(6_000))
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "cache"))
    tok = ["tokenizer=byte", "tokenizer.special_tokens=['<s>']", "tokenizer.eos_token='</s>'"]
    for model, want in (("gpt2-tiny", None), ("llama-tiny", 256)):
        code, _, err = run_main(capsys, "train", *one_step(f, tmp_path / "runs", model, *tok))
        assert code == 0, err
        saved = OmegaConf.load(tmp_path / "runs" / model / "config.yaml")
        assert saved.data.bos == ("auto" if want else False)
        data = OmegaConf.to_container(saved.data)
        tok_cfg = {"kind": "byte", "special_tokens": ["<s>"], "eos_token": "</s>"}
        assert prepare(data, tok_cfg, cache_dir=tmp_path / "cache" / "data", progress=False).bos_id == want


def test_a_train_after_a_plain_prepare_uses_its_shards(tmp_path, capsys, monkeypatch):
    """data.bos=auto is keyed by what it means: a plain prepare (no model: auto) and a GPT-2 train (auto is
    off) share one cache entry when the tokenizer has no BOS; with a BOS, so do prepare and a Llama train."""
    from conftest import run_main

    f = tmp_path / "a.txt"
    f.write_text(shakespeare(6_000))
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "cache"))
    bos_tok = ["tokenizer.special_tokens=['<s>']", "tokenizer.eos_token='</s>'"]
    for model, tok in (("gpt2-tiny", []), ("llama-tiny", bos_tok)):
        code, _, err = run_main(
            capsys, "prepare", "data=files", f"data.paths=[{f}]", "tokenizer=byte", *tok, "progress=false"
        )
        assert code == 0 and "prepared " in err, err
        code, _, err = run_main(
            capsys, "train", *one_step(f, tmp_path / "runs", model, "tokenizer=byte", *tok)
        )
        assert code == 0, err
        assert "cache hit: " in err and "prepared " not in err and "tokenizing" not in err, err
    folders = sorted(p.name for p in (tmp_path / "cache" / "data").iterdir())
    # one per tokenizer, none per model
    assert len(folders) == 2, folders


def test_bos_auto_uses_a_tokenizer_s_own_bos_before_every_document(tmp_path):
    import torch

    from gptkit.data.windows import doc_ids

    for i, t in enumerate(["first doc\n", "second\n", "third one\n"]):
        (tmp_path / f"{i}.txt").write_text(t)
    data = {"kind": "files", "paths": [str(tmp_path / f"{i}.txt") for i in range(3)], "val_fraction": 0.2}
    tok = {"kind": "byte", "special_tokens": ["<s>"], "eos_token": "</s>"}
    # bos: auto, and this tokenizer has a BOS of its own
    p = prep(tmp_path, data, tok)
    bos, eos = p.bos_id, p.eos_id
    assert bos == 256 and eos == 257 and p.manifest["tokenizer"]["bos_id"] == 256
    want = [i for t in ["first doc\n", "second\n", "third one\n"] for i in [bos, *t.encode(), eos]]
    assert all_ids(p) == want
    # data.pack=documents: a BOS starts its document
    d = doc_ids(torch.tensor([want]), eos)[0].tolist()
    assert [d[i] for i, t in enumerate(want) if t == bos] == [0, 1, 2]
    assert prep(tmp_path, {**data, "bos": False}, tok).bos_id is None
    # GPT-2 style: <|endoftext|> is no BOS
    plain = prep(tmp_path, data, {"kind": "bpe", "vocab_size": 300})
    assert plain.bos_id is None
    with pytest.raises(GptkitError, match="data.bos=true but the tokenizer has no BOS token"):
        prep(tmp_path, {**data, "bos": True}, {"kind": "byte"})
    with pytest.raises(GptkitError, match="data.bos='yes' must be auto, true or false"):
        prep(tmp_path, {**data, "bos": "yes"}, {"kind": "byte"})


# ---- data=tokens ------------------------------------------------------------------------------------
def llmc_shard(path, ids, magic=20240520, version=1, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [magic, version, len(ids) if count is None else count]
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype="<u2").tobytes())
    return path


def test_token_files_of_nanogpt_and_llmc_are_trained_on_as_given(tmp_path):
    from gptkit.tokenizer import build_tokenizer

    tok_file = tmp_path / "tok.json"
    build_tokenizer({"kind": "byte", "special_tokens": [EOS], "eos_token": EOS}).save(str(tok_file))
    tok = {"kind": "file", "path": str(tok_file), "eos_token": EOS}
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 257, 3000, dtype=np.uint16), rng.integers(0, 257, 500, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    llmc_shard(tmp_path / "val.bin", val)
    data = {
        "kind": "tokens",
        "paths": [str(tmp_path / "train.bin")],
        "val_paths": [str(tmp_path / "val.bin")],
        "vocab_size": 320,
    }
    p = prep(tmp_path, data, tok)
    assert p.vocab_size == 320 and p.eos_id == 256 and p.manifest["source"]["formats"] == ["raw", "llmc"]
    assert p.train_tokens().tolist() == train.tolist() and p.val_tokens().tolist() == val.tolist()
    # found again by content
    assert prep(tmp_path, data, tok).dir == p.dir

    bad = {
        "big id": (
            lambda: np.array([1, 2, 400], np.uint16).tofile(tmp_path / "x.bin"),
            r"x.bin: token 2 is id 400, not below data.vocab_size=320",
        ),
        "odd size": (
            lambda: (tmp_path / "x.bin").write_bytes(b"\1\2\3"),
            r"x.bin: 3 bytes is not a multiple of 2",
        ),
        "magic": (lambda: llmc_shard(tmp_path / "x.bin", [1, 2], magic=7), r"x.bin: bad magic 7"),
        "version": (lambda: llmc_shard(tmp_path / "x.bin", [1, 2], version=2), r"llm.c shard version 2"),
        "count": (lambda: llmc_shard(tmp_path / "x.bin", [1, 2], count=5), r"header says 5 tokens"),
        "short": (
            lambda: (tmp_path / "x.bin").write_bytes(np.asarray([20240520, 1], "<i4").tobytes()),
            r"x.bin: 8 bytes is shorter than the 1,024-byte header of an llm.c shard",
        ),
    }
    for what, (make, needle) in bad.items():
        make()
        fmt = "llmc" if what == "magic" else "auto"
        with pytest.raises(GptkitError, match=needle):
            prep(tmp_path, {**data, "paths": [str(tmp_path / "x.bin")], "format": fmt}, tok)
    with pytest.raises(GptkitError, match="give the tokenizer that made them"):
        prep(tmp_path, data, {"kind": "char"})


def big_token_file(path, n=1_500_000):
    """A raw uint16 token file of n byte ids (3 MB by default: its copy takes a moment)."""
    np.random.default_rng(0).integers(0, 256, n, dtype=np.uint16).tofile(path)
    return path


def start_token_prepare(tmp_path, big, cache, name):
    """`python -m gptkit prepare data=tokens` of `big` into `cache`, started now; its stderr goes to
    tmp_path/<name>.err."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPTKIT_VERB", "GPTKIT_FAULT")}
    args = ["data=tokens", f"data.paths=[{big}]", "tokenizer=byte", "progress=false", f"cache_dir={cache}"]
    with open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "gptkit", "prepare", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=tmp_path,
        )


def check_token_folder(cache, big):
    """The cache holds one complete prepared folder of `big` (train + val are its tokens) and nothing else."""
    from gptkit.data import load_prepared

    (folder,) = cache.iterdir()
    p = load_prepared(folder)
    p.wait_checked()
    assert all_ids(p) == np.fromfile(big, dtype=np.uint16).tolist()
    assert sorted(f.name for f in folder.iterdir()) == [
        "manifest.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]
    return folder


@pytest.mark.long
def test_token_file_builds_started_together_all_succeed_on_one_complete_folder(tmp_path):
    big = big_token_file(tmp_path / "big.bin")
    cache = tmp_path / "cache"
    procs = [start_token_prepare(tmp_path, big, cache, f"p{i}") for i in range(3)]
    codes = [p.wait(timeout=600) for p in procs]
    errs = [(tmp_path / f"p{i}.err").read_text() for i in range(3)]
    assert codes == [0, 0, 0], errs
    folder = check_token_folder(cache, big)
    # every one of them names that folder
    assert all(str(folder) in e for e in errs), errs


@pytest.mark.long
def test_a_token_file_build_waits_for_a_live_builder_and_takes_over_a_dead_ones_folder(tmp_path, capsys):

    from conftest import run_main

    from gptkit.fsio import lock_file

    big = big_token_file(tmp_path / "big.bin")
    # the folder name the build will have (the cache key does not depend on the cache folder)
    args = ["data=tokens", f"data.paths=[{big}]", "tokenizer=byte", "progress=false"]
    code, _, err = run_main(capsys, "prepare", *args, f"cache_dir={tmp_path / 'probe'}")
    assert code == 0, err
    (probe,) = (tmp_path / "probe").iterdir()
    cache = tmp_path / "cache"
    partial = cache / f".{probe.name}.partial"
    partial.mkdir(parents=True)
    # a builder at work: its lock held, its half-written file
    (partial / "all.bin").write_bytes(b"half")
    lock = lock_file(partial / ".building")
    try:
        procs = [start_token_prepare(tmp_path, big, cache, f"w{i}") for i in range(2)]
        errs = ["", ""]

        def both_wait() -> bool:
            errs[:] = [(tmp_path / f"w{i}.err").read_text() for i in range(2)]
            return all("waiting" in e for e in errs)

        # both say they wait (a process that ends instead fails the test)
        wait_for(both_wait, procs, 600)
        assert all(p.poll() is None for p in procs), errs
        assert all(f"another prepare is building {probe.name}; waiting for it" in e for e in errs), errs
        # the live builder's folder is untouched, and nothing is taken for a result
        assert (partial / "all.bin").read_bytes() == b"half"
        assert sorted(p.name for p in cache.iterdir()) == [partial.name]
    finally:
        # the builder dies: its folder is taken over
        os.close(lock)
    codes = [p.wait(timeout=600) for p in procs]
    errs = [(tmp_path / f"w{i}.err").read_text() for i in range(2)]
    assert codes == [0, 0], errs
    assert check_token_folder(cache, big).name == probe.name

    # a dead builder's folder found before any build starts: taken over at once
    data = {"kind": "tokens", "paths": [str(big)]}
    dead = tmp_path / "c2" / f".{probe.name}.partial"
    dead.mkdir(parents=True)
    (dead / ".building").touch()
    (dead / "train.bin").write_bytes(b"junk")
    p = prepare(data, {"kind": "byte"}, cache_dir=tmp_path / "c2", progress=False)
    assert p.dir.name == probe.name
    check_token_folder(tmp_path / "c2", big)


def test_a_full_disk_during_a_token_file_build_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    import errno

    from gptkit.data import tokenfiles

    big = big_token_file(tmp_path / "big.bin", n=5000)
    data = {"kind": "tokens", "paths": [str(big)]}
    cache = tmp_path / "cache"
    real_copy, real_tail = tokenfiles._copy, tokenfiles.copy_tail
    for exc in (
        OSError(errno.ENOSPC, "No space left on device"),
        # numpy's ndarray.tofile on a full disk (no errno, no file named)
        OSError("Not enough free space to write 6000 bytes after offset 4000"),
    ):
        for where in ("_copy", "copy_tail"):

            def full(*args, exc=exc):
                # the file being written: half of it, then no space
                written = args[2] if where == "_copy" else args[1]
                written.write_bytes(b"\0" * 400)
                raise exc

            monkeypatch.setattr(tokenfiles, where, full)
            with pytest.raises(GptkitError) as err:
                prepare(data, {"kind": "byte"}, cache_dir=cache, progress=False)
            monkeypatch.setattr(tokenfiles, "_copy", real_copy)
            monkeypatch.setattr(tokenfiles, "copy_tail", real_tail)
            msg = str(err.value)
            assert msg.startswith(f"no space left on the disk writing {cache}/tokens-byte-"), msg
            assert "it needs about 9.77 KiB" in msg and "free some space" in msg and "\n" not in msg, msg
            # nothing half-written is left in the cache
            assert list(cache.iterdir()) == [], list(cache.iterdir())
    # with space it is built
    p = prepare(data, {"kind": "byte"}, cache_dir=cache, progress=False)
    assert check_token_folder(cache, big) == p.dir


def test_an_empty_train_or_val_split_of_token_files_is_refused_at_prepare(tmp_path):
    tokens = np.arange(3000, dtype=np.uint16) % 256
    tokens.tofile(tmp_path / "t.bin")
    llmc_shard(tmp_path / "zero.bin", [])
    tok = {"kind": "byte"}
    cases = {
        "train": (
            {"paths": [str(tmp_path / "zero.bin")], "val_paths": [str(tmp_path / "t.bin")]},
            "data.paths",
        ),
        "val": (
            {"paths": [str(tmp_path / "t.bin")], "val_paths": [str(tmp_path / "zero.bin")]},
            "data.val_paths",
        ),
    }
    for split, (paths, key) in cases.items():
        with pytest.raises(GptkitError) as err:
            prep(tmp_path, {"kind": "tokens", **paths}, tok)
        msg = str(err.value)
        assert f"the {split} split" in msg and "zero.bin" in msg and "0 tokens" in msg and key in msg, msg
        assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
    # an empty shard beside a full one adds nothing, and is no error
    p = prep(
        tmp_path, {"kind": "tokens", "paths": [str(tmp_path / "zero.bin"), str(tmp_path / "t.bin")]}, tok
    )
    assert all_ids(p) == tokens.tolist()


@pytest.mark.long
def test_bench_data_measures_every_tokenizer_and_worker_count_on_one_file(tmp_path, capsys):
    """`gptkit bench data` on a small generated file: each tokenizer's encoders alone (with their ids checked
    against HF's), prepare with 1 and 2 workers (the same tokens either way), and the 40 GB projection bound
    by the slower of the workers and the one main process that feeds them."""
    from conftest import run_main

    out = tmp_path / "bench.json"
    code, _, err = run_main(
        capsys,
        "bench",
        "data",
        "bench.size_mb=0.4",
        "bench.tokenizers=[byte,bpe-300]",
        "bench.train_chars=100000",
        "bench.encode_mb=0.1",
        "bench.steps=1",
        "bench.batches=2",
        "bench.threads=1",
        f"bench.out={out}",
    )
    assert code == 0, err
    r = json.loads(out.read_text())
    byte, bpe = r["tokenizers"]["byte"], r["tokenizers"]["bpe-300"]
    assert byte["encoders"]["utf8"]["same_ids"] and bpe["encoders"]["tiktoken"]["same_ids"]
    for row in (byte, bpe):
        one, two = row["prepare"]["1"], row["prepare"]["2"]
        assert one["tokens"] == two["tokens"] > 0 and one["ratio_to_workers_x_fastest"] > 0
    assert bpe["prepare"]["2"]["workers"] == 2 and bpe["prepare"]["2"]["encoder"] == "tiktoken"
    assert r["reading"]["read_decode_mb_per_s"] > 0 and r["reading"]["read_decode_cut_mb_per_s"] > 0
    pr = r["projection_40gb_16_cores"]
    assert pr["mb_per_s"] == min(pr["workers_mb_per_s"], pr["main_process_mb_per_s"]) > 0
    # the same text as JSON lines
    one, two = bpe["prepare_jsonl"]["1"], bpe["prepare_jsonl"]["2"]
    assert one["tokens"] == two["tokens"] > 0 and two["tasks"] == "byte ranges of the JSON-lines files"
    assert r["projection_40gb_16_cores_jsonl"]["main_process_mb_per_s"] > 0
    # mb_per_s is rounded to 0.1 and minutes to 0.1: at a few MB/s (a loaded machine) that is a few percent
    assert pr["minutes"] == pytest.approx(40e3 / pr["mb_per_s"] / 60, rel=0.05, abs=0.1)
