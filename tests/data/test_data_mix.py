"""data=mix: sources cached on their own, windows a pure function of (seed, step, rank) with ranks
disjoint, start-up shares and epochs, per-source tokens in metrics, bad mixtures one line."""

import numpy as np
import pytest
from conftest import shakespeare

from gptkit.data import MixedData, prepare
from gptkit.errors import GptkitError


@pytest.fixture
def texts(tmp_path):
    paths = {}
    for name, (n, start) in {"a": (12_000, 0), "b": (4_000, 40_000), "c": (3_000, 80_000)}.items():
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text(shakespeare(n, start=start))
    return paths


def mix(paths, weights, **kw):
    return {
        "kind": "mix",
        "sources": {n: {"kind": "files", "paths": [str(paths[n])], "weight": w} for n, w in weights.items()},
        **kw,
    }


def test_sources_are_cached_on_their_own_and_windows_follow_the_shares(tmp_path, texts, capsys):
    cache = tmp_path / "cache"
    m = prepare(mix(texts, {"a": 3, "b": 1}), {"kind": "byte"}, cache_dir=cache, progress=False)
    assert isinstance(m, MixedData) and m.shares == [0.75, 0.25]
    capsys.readouterr()
    m3 = prepare(mix(texts, {"a": 3, "b": 1, "c": 1}), {"kind": "byte"}, cache_dir=cache, progress=False)
    err = capsys.readouterr().err
    # only the new source is prepared
    assert err.count("cache hit") == 2 and err.count("prepared ") == 1
    assert [p.dir for p in m3.parts[:2]] == [p.dir for p in m.parts]

    from gptkit.data.mixture import MixtureSampler

    s = MixtureSampler([p.train_tokens() for p in m.parts], m.shares, batch_size=8, seq_len=16, seed=3)
    drawn = np.concatenate([s.sources(step) for step in range(400)])
    assert abs((drawn == 0).mean() - 0.75) < 0.03
    x, y = s.batch(7)
    assert x.shape == (8, 16) and (x[:, 1:] == y[:, :-1]).all()
    # pure in (seed, step, rank): world 2 x batch 4 is world 1 x batch 8 split in two; ranks disjoint
    s2 = MixtureSampler([p.train_tokens() for p in m.parts], m.shares, batch_size=4, seq_len=16, seed=3)
    r0, r1 = s2.batch(7, 0, 2), s2.batch(7, 1, 2)
    src, starts = s2.starts(7, 2)
    assert len(set(zip(src.tolist(), starts.tolist()))) == 8
    one = MixtureSampler([p.train_tokens() for p in m.parts], m.shares, batch_size=8, seq_len=16, seed=3)
    assert (np.concatenate([r0[0], r1[0]]) == one.batch(7)[0].numpy()).all()
    assert (one.batch(7)[0] == one.batch(7)[0]).all() and not (one.batch(8)[0] == one.batch(7)[0]).all()
    assert one.consumed(400, 1).tolist() == np.bincount(drawn, minlength=2).tolist()


def test_a_bpe_mixture_shares_one_tokenizer_trained_on_every_source(tmp_path, texts):
    m = prepare(
        mix(texts, {"a": 1, "b": 1}),
        {"kind": "bpe", "vocab_size": 300},
        cache_dir=tmp_path / "c",
        progress=False,
    )
    assert m.parts[0].manifest["tokenizer"]["sha256"] == m.parts[1].manifest["tokenizer"]["sha256"]
    tok = m.tokenizer()
    for p, name in zip(m.parts, "ab"):
        ids = np.concatenate([p.train_tokens(), p.val_tokens()]).tolist()
        assert tok.decode(ids).replace("<|endoftext|>", "") == texts[name].read_text()


def test_start_up_shares_epochs_and_the_max_epochs_warning(tmp_path, texts):
    m = prepare(
        mix(texts, {"a": 1, "b": 3}, max_epochs=2), {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False
    )
    lines = m.sources_lines(budget_tokens=20_000)
    assert lines[0].startswith("  a: 10,801 train tokens, share 25.0%, 0.46 epochs")
    assert "  b: 3,601 train tokens, share 75.0%, 4.17 epochs" in lines[1]
    (warning,) = [ln for ln in lines if ln.startswith("warning:")]
    assert "'b' would be repeated 4.2 times, more than data.max_epochs=2" in warning


@pytest.mark.parametrize(
    "sources, needle",
    [
        ({"a": {"kind": "files", "weight": 0}}, r"data.sources.a.weight=0 must be > 0"),
        ({"a": {"kind": "files", "weight": -1}}, r"weight=-1 must be > 0"),
        ({"a": {"kind": "files", "weight": "lots"}}, r"weight='lots' is not a number"),
        ({"a": {"kind": "files", "weight": True}}, r"weight=True is not a number"),
        ({"a": {"kind": "files", "weight": float("inf")}}, r"data.sources.a.weight=inf is not finite"),
        ({"a": {"kind": "files", "weight": float("nan")}}, r"data.sources.a.weight=nan is not finite"),
        (
            {"a": {"kind": "files", "weight": 1}, "b": {"kind": "files", "weight": float("inf")}},
            r"b.weight=inf",
        ),
        ({"a": {"kind": "files"}}, r"data.sources.a has no weight"),
        ({"a": {"kind": "files", "weight": 1, "pathz": ["x"]}}, r"unknown key 'pathz'; did you mean paths\?"),
        ({"a": {"kind": "mix", "weight": 1, "sources": {}}}, r"data.sources.a is itself a mix"),
        ({"a": {"kind": "nope", "weight": 1}}, r"data.sources.a.kind='nope'"),
        ({}, r"data=mix needs named sources"),
    ],
)
def test_bad_mixtures_are_one_line(tmp_path, texts, sources, needle):
    for s in sources.values():
        if s.get("kind") == "files" and "paths" not in s and "pathz" not in s:
            s["paths"] = [str(texts["a"])]
    with pytest.raises(GptkitError, match=needle):
        prepare(
            {"kind": "mix", "sources": sources}, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False
        )
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


@pytest.mark.parametrize(
    "b, needle",
    [
        ({"paths": ["missing.txt"]}, r"data.sources.b.paths: .*missing.txt does not exist"),
        (
            {"paths": ["a.txt"], "val_paths": ["missing.txt"]},
            r"data.sources.b.val_paths: .*missing.txt does not",
        ),
        ({}, r"data.sources.b \(kind files\) needs its files: data.sources.b.paths=\[file,...\]"),
    ],
)
def test_a_source_without_its_files_is_one_line_before_any_source_is_prepared(
    tmp_path, texts, b, needle, capsys
):
    """.ci/fault-loop's bad input: the line names the source's own key, and the sources before it are not
    prepared first (nothing is written; no "data source 'a':" line before the error)."""
    data = mix(texts, {"a": 1})
    data["sources"]["b"] = {
        "kind": "files",
        "weight": 1,
        **{k: [str(tmp_path / f) for f in v] for k, v in b.items()},
    }
    with pytest.raises(GptkitError, match=needle):
        prepare(data, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists() and capsys.readouterr().err == ""


def test_shares_of_huge_or_tiny_weights_neither_overflow_nor_vanish(tmp_path, texts):
    from gptkit.data.kinds import MIXABLE
    from gptkit.data.mixture import mix_sources

    d = mix(texts, {"a": 1e308, "b": 1e308})
    assert [w for _, w in mix_sources(d, MIXABLE).values()] == [1e308, 1e308]
    assert MixedData(["a", "b"], [None, None], [1e308, 1e308], 4.0).shares == [0.5, 0.5]
    three = MixedData(["a", "b", "c"], [None] * 3, [1e308, 1e308, 5e307], 4.0).shares
    assert three == pytest.approx([0.4, 0.4, 0.2]) and sum(three) == pytest.approx(1.0)
    assert MixedData(["a", "b"], [None, None], [5e-324, 1.5e-323], 4.0).shares == [0.25, 0.75]


def test_a_source_with_no_documents_is_one_line(tmp_path, texts):
    (tmp_path / "blank.txt").write_text("  \n\n")
    data = mix(texts, {"a": 1})
    data["sources"]["blank"] = {"kind": "files", "paths": [str(tmp_path / "blank.txt")], "weight": 1}
    with pytest.raises(GptkitError, match="blank.txt holds only whitespace"):
        prepare(data, {"kind": "byte"}, cache_dir=tmp_path / "c", progress=False)


def test_train_on_a_mixture_resumes_bit_exactly_with_per_source_tokens(tmp_path, texts, capsys, monkeypatch):
    import csv

    from conftest import run_main, tiny_run

    sources = (
        f"data.sources={{a: {{kind: files, paths: [{texts['a']}], weight: 0.7}}, "
        f"b: {{kind: files, paths: [{texts['b']}], weight: 0.3}}}}"
    )
    # val_windows: 3 a windows + 3 b, a batch of a and b, then one of b alone
    keys = dict(data="mix", steps=8, val_every=4, val_windows=6, log_every=2, warmup=None)
    common = tiny_run(None, tmp_path / "runs", None, sources, **keys)
    monkeypatch.setenv("GPTKIT_CACHE", str(tmp_path / "cache"))
    code, _, err = run_main(capsys, "train", *common, "name=full")
    assert code == 0, err
    assert "data mixture (2 sources):" in err and "share 70.0%" in err
    code, _, err = run_main(capsys, "train", *common, "name=cut", "trainer.stop_at_step=4")
    assert code == 0, err
    code, _, err = run_main(
        capsys, "train", f"resume={tmp_path / 'runs' / 'cut'}", "trainer.stop_at_step=null"
    )
    assert code == 0, err

    def rows(name):
        with open(tmp_path / "runs" / name / "metrics.csv") as f:
            return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]

    full = rows("full")
    assert rows("cut") == full
    # a training row (of step 8, the last)
    last = [r for r in full if r["data/tokens_a"]][-1]
    assert (
        int(last["step"]) == 8 and float(last["data/tokens_a"]) + float(last["data/tokens_b"]) == 8 * 4 * 32
    )
    assert 0 < float(last["data/tokens_b"]) < float(last["data/tokens_a"])
    # val/loss/<source>: that source's mean token loss over its own val windows; val/loss: over all of them
    val = [r for r in full if r["val/loss"]][-1]
    assert int(val["step"]) == 8 and "val loss a: " in err and "val loss b: " in err
    import torch

    from gptkit.data.datamodule import TokenDataModule
    from gptkit.runs import load_model

    model = load_model(tmp_path / "runs" / "full")[-1].eval()
    m = prepare(
        mix(texts, {"a": 0.7, "b": 0.3}), {"kind": "char"}, cache_dir=tmp_path / "cache", progress=False
    )
    dm = TokenDataModule(m, batch_size=4, seq_len=32, val_windows=6)
    batches = list(dm.val_dataloader())
    with torch.no_grad():
        # 6 full windows
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        # not the mean of batch means
        assert abs(float(val["val/loss"]) - float(model(x, y).loss)) < 1e-6
        for s, name in enumerate(m.names):
            rows_of = dm.val_sources[1] == s
            x = torch.cat([b[0] for b in batches])[rows_of]
            y = torch.cat([b[1] for b in batches])[rows_of]
            assert len(x) == 3 and abs(float(val[f"val/loss/{name}"]) - float(model(x, y).loss)) < 1e-6
