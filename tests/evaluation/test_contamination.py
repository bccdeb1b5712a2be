"""Contamination (`gptkit contamination`, `gptkit eval decontaminate=`) on a corpus where known task items
were planted: every planted item found, in the right document and place, none invented; and sampled
evaluation (`gptkit eval samples= k=`): pass@k against a brute-force enumeration, maj@k's tie rule, the keyed
samples the same on a rerun."""

import itertools
import json
import random
from fractions import Fraction

import pytest
from conftest import REPO, run_main, shakespeare, tokenizer_settings

from gptkit.evaluation import contamination as C
from gptkit.evaluation.sampled import item_figures, majority, pass_at_k

lm_eval = pytest.importorskip("lm_eval")

# made-up words: none occurs in the corpus (Shakespeare), so only what is planted can match
SYLLABLES = ["zor", "blax", "quen", "vit", "mork", "tash", "plim", "drov", "gux", "yeb", "snar", "kwo"]
N_ITEMS, PLANTED = 12, {2: "c.jsonl", 5: "c.jsonl", 9: "t.txt"}


def items() -> list[dict]:
    rng = random.Random(7)
    out = []
    for _ in range(N_ITEMS):
        words = ["".join(rng.sample(SYLLABLES, 3)) for _ in range(16)]
        out.append({"prompt": " ".join(words[:14]), "answer": " " + " ".join(words[14:])})
    return out


TASK = """task: planted
dataset_path: json
dataset_kwargs:
  data_files:
    test: planted.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 3
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


# the same items, judged leniently so a random model is right about 3 times in 4: exact_match with every
# character but the lower-case vowels ignored, against "x": a sample is right when it holds none
SAMPLED = (
    TASK.replace("task: planted", "task: vowels")
    .replace('doc_to_target: "{{answer}}"', 'doc_to_target: "x"')
    .replace("max_gen_toks: 3", "max_gen_toks: 2")
    .replace(
        "    higher_is_better: true",
        '    higher_is_better: true\n    regexes_to_ignore: ["[^aeiou]"]',
    )
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A task of 12 items (16 made-up words each), a corpus (40 JSON-lines records and a text file of
    Shakespeare) with items 2 and 5 planted in records 11 and 30 (upper-cased, with punctuation: the
    normalization must see through it) and item 9 in the text file, across a piece boundary; item 7's first
    12 words (one short of a 13-gram) in record 20. A run (random tiny model, char tokenizer) on it."""
    import torch

    from gptkit.model import GPT, ModelConfig
    from gptkit.runs import write_run_folder
    from gptkit.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("planted")
    rows = items()
    (d / "planted.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "planted.yaml").write_text(TASK)
    (d / "vowels.yaml").write_text(SAMPLED)
    text = lambda r: r["prompt"] + r["answer"]  # noqa: E731
    records = [shakespeare(150, start=300 * i) for i in range(40)]
    records[11] = records[11][:70] + " " + text(rows[2]).upper().replace(" ", ", ") + ". " + records[11][70:]
    records[30] = text(rows[5]) + "\n" + records[30]
    records[20] = records[20][:50] + " " + " ".join(text(rows[7]).split()[:12]) + " " + records[20][50:]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
    body = shakespeare(6_000, start=20_000)
    at = 2_460  # the item spans tokens 2,461 .. ~2,600: the piece boundary at 2,500 (PIECE_TOKENS patched)
    (d / "t.txt").write_text(body[:at] + " " + text(rows[9]) + " " + body[at:])
    tok_cfg = {"kind": "char", "special_tokens": [], "eos_token": "<|endoftext|>", "unk_token": None}
    corpus = [(d / "c.jsonl").read_text(), (d / "t.txt").read_text(), (d / "planted.jsonl").read_text()]
    tok = build_tokenizer(tok_cfg, texts=lambda: corpus)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=128, n_layers=1, n_heads=2, d_model=16)
    config = {
        "data": {"kind": "files", "paths": [str(d / "c.jsonl"), str(d / "t.txt")]},
        "tokenizer": tok_cfg,
    }
    run = write_run_folder(d / "run", config, GPT(cfg).eval(), tok)
    return d, run, rows, at + 1


def test_every_planted_item_is_found_where_it_was_planted_and_none_is_invented(planted, capsys, monkeypatch):
    d, run, rows, at = planted
    monkeypatch.setattr(C, "PIECE_TOKENS", 500)
    code, out, err = run_main(capsys, "contamination", f"run={run}", f"tasks={d / 'planted.yaml'}", "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep == json.loads((run / "contamination.json").read_text())
    t = rep["tasks"]["planted"]
    assert (t["items"], t["too_short"], t["contaminated"]) == (N_ITEMS, 0, 3)
    assert t["flagged"] == sorted(PLANTED) and t["share"] == pytest.approx(3 / N_ITEMS)
    assert rep["documents_scanned"] == 41 and rep["n"] == 13 and rep["normalize"] == "lm-eval"
    lines = (d / "c.jsonl").read_bytes().splitlines(keepends=True)
    for item in rep["items"]:
        (doc,) = item["documents"]
        assert doc["file"] == str(d / PLANTED[item["doc_id"]]), doc
        if item["doc_id"] == 9:
            # the text file: its byte offset
            assert doc["byte_in_text"] == at and doc["where"] == f"byte {at:,}"
            assert doc["document"] == 40
        else:
            record = {2: 11, 5: 30}[item["doc_id"]]
            line = sum(len(x) for x in lines[:record])
            assert doc["document"] == record
            assert doc["where"].startswith(f"line {record + 1} (byte {line:,})"), doc
            want = 71 if item["doc_id"] == 2 else 0
            assert doc["byte_in_text"] == want
        # every 13-gram of a planted item matches once
        assert item["matches"] == item["ngrams"] == 16 - 13 + 1

    # n=12: item 7's 12 words are found too (n is the option it says); normalize=none misses the upper-cased
    code, out, err = run_main(
        capsys,
        "contamination",
        "data=prepared",
        f"data.dir={C_dir(run)}",
        f"tasks={d / 'planted.yaml'}",
        "n=12",
        "normalize=none",
        f"out={d / 'r12.json'}",
    )
    assert code == 0, err
    r12 = json.loads((d / "r12.json").read_text())
    assert r12["tasks"]["planted"]["flagged"] == [5, 7, 9], r12["tasks"]
    assert "planted" in out and "25.0%" in out

    # run= with data=: another corpus (the JSON-lines file alone, all of it trained) in the run's tokenizer
    code, out, err = run_main(
        capsys,
        "contamination",
        f"run={run}",
        "data=files",
        f"data.paths=[{d / 'c.jsonl'}]",
        "data.val_fraction=0.01",
        f"tasks={d / 'planted.yaml'}",
        f"out={d / 'jsonl.json'}",
    )
    assert code == 0, err
    assert json.loads((d / "jsonl.json").read_text())["tasks"]["planted"]["flagged"] == [2, 5]

    # eval without the flagged items: 9 of 12 scored, and said
    code, out, err = run_main(
        capsys,
        "eval",
        f"run={run}",
        f"tasks={d / 'planted.yaml'}",
        f"decontaminate={run / 'contamination.json'}",
        "progress=false",
        "device=cpu",
        "--json",
    )
    assert code == 0, err
    res = json.loads(out)
    assert "task planted: 3 of 12 item(s) left out (flagged)" in err
    assert res["decontaminated"] == {"planted": {"dropped": 3, "of": 12}}
    assert [r["n"] for r in res["rows"] if r["task"] == "planted"] == [9]


def C_dir(run):
    """The prepared folder of a run's data."""
    from omegaconf import OmegaConf

    from gptkit.data import prepare
    from gptkit.runs import read_config

    saved = OmegaConf.create(read_config(run))
    return prepare(saved.data, saved.tokenizer, progress=False).dir


def test_sampled_eval_is_pass_at_k_of_keyed_samples_the_same_on_a_rerun(planted, capsys):
    """samples=4 k=[1,2,4] on 5 items: each sample judged by the task's own metric (its filters and
    exact_match settings), pass@k the estimator over them, maj@k the majority answer's score; a rerun draws
    the same samples (keyed)."""
    import re

    d, run, _, _ = planted
    args = ["eval", f"run={run}", f"tasks={d / 'vowels.yaml'}", "samples=4", "k=[1,2,4]", "limit=5"]
    files = []
    for _ in range(2):
        code, out, err = run_main(capsys, *args, "progress=false", "device=cpu", "--json")
        assert code == 0, err
        res = json.loads(out)
        files.append(json.loads(open(res["files"][0]).read()))
    metrics = {r["metric"]: r for r in res["rows"]}
    assert set(metrics) == {f"{m}@{k} (exact_match)" for m in ("pass", "maj") for k in (1, 2, 4)}
    a, b = (f["results"]["items"] for f in files)
    assert a == b and len(a) == 5
    right = [x["none"]["correct"] for x in a.values()]
    # the task's metric judged each sample: right when no vowel is left
    for x in a.values():
        assert x["none"]["correct"] == [not re.search("[aeiou]", t) for t in x["none"]["answers"]]
    assert 0 < sum(map(sum, right)) < 20, right
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(r), k) for r in right) / 5
        assert metrics[f"pass@{k} (exact_match)"]["value"] == pytest.approx(want)
        maj = [
            float(
                r[x["none"]["answers"].index(majority([t.strip() or None for t in x["none"]["answers"][:k]]))]
            )
            for r, x in zip(right, a.values())
        ]
        assert metrics[f"maj@{k} (exact_match)"]["value"] == pytest.approx(sum(maj) / 5)
    assert metrics["pass@1 (exact_match)"]["value"] < metrics["pass@4 (exact_match)"]["value"]


def test_bad_contamination_and_sampling_options_are_one_line(planted, capsys):
    d, run, _, _ = planted
    task = f"tasks={d / 'planted.yaml'}"
    bad = {
        ("contamination", f"run={run}", task, "n=0"): "n=0 must be an integer >= 1",
        ("contamination", f"run={run}", task, "normalize=nfkc"): "normalize='nfkc' must be one of",
        ("contamination", task): "give run=<run folder>",
        ("contamination", "data=prepared", f"data.dir={d / 'nope'}", task): "no such folder",
        ("eval", f"run={run}", task, "samples=2", "k=[1,4]"): "k=4 is larger than the samples per item",
        ("eval", f"run={run}", task, "samples=0"): "samples=0 must be an integer >= 1",
        ("eval", f"run={run}", f"tasks={REPO / 'tests/evals/tiny_mc.yaml'}", "samples=2"): (
            "task tiny_mc is a multiple_choice task; pass@k and maj@k (samples=) score generation tasks"
        ),
        (
            "eval",
            f"run={run}",
            task,
            f"decontaminate={d / 'planted.yaml'}",
        ): "is not a `gptkit contamination`",
    }
    for args, message in bad.items():
        code, out, err = run_main(capsys, *args, "progress=false")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (
            args,
            err,
        )


# ---- the estimators ------------------------------------------------------------------------------------
def test_pass_at_k_is_the_chance_a_k_subset_holds_a_correct_sample():
    """Against every k-subset of n samples (exact fractions), every n <= 7, c, k."""
    for n in range(1, 8):
        for c in range(n + 1):
            right = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(right, k))
                want = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12), (n, c, k)
    # large n: stable (no huge binomials)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001) and pass_at_k(1000, 0, 500) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_maj_at_k_votes_the_most_frequent_answer_and_a_tie_goes_to_the_first_seen():
    assert majority(["b", "a", "a", "b", "c"]) == "b"
    assert majority([None, "x", None]) == "x" and majority([None, None]) is None
    assert majority(["a", "b", "b"]) == "b"
    answers, right = ["7", "9", "9", "7"], [True, False, False, True]
    f = item_figures(right, answers, lambda a: a == "7", [1, 2, 3, 4])
    # k=3: 9 twice; k=4: a tie of 7 and 9, 7 seen first
    assert [f[f"maj@{k}"] for k in (1, 2, 3, 4)] == [1.0, 1.0, 0.0, 1.0]


def test_the_ngrams_are_lm_evals_janitor_ngrams():
    from lm_eval.decontamination.janitor import Janitor, word_ngrams

    text = "It's  a TEST, of: the\tjanitor's (normalization) -- 13 grams?! Über Café\nnew line x y z w"
    j = Janitor(ngram_n=5)
    theirs = list(word_ngrams(j.normalize_string(text), 5))
    words = C.words_of(text, C.NORMALIZATIONS["lm-eval"])
    assert [" ".join(words[i : i + 5]) for i in range(len(words) - 4)] == theirs


@pytest.mark.parametrize("kind", ["byte", "char", "bpe", "file"])
def test_the_fast_decode_is_the_tokenizers_decode(kind, tmp_path, monkeypatch):
    """TokenBytes (a flat table of each token's bytes) gives what decode_batch(skip_special_tokens=True)
    gives, on random ids (special tokens, bytes cut mid-character included); a tokenizer it does not know
    (a Metaspace tokenizer.json) has no table."""
    import numpy as np

    from gptkit.tokenizer import build_tokenizer

    text = shakespeare(3_000) + " café — naïve 日本語 ✓"
    tok = build_tokenizer(tokenizer_settings(kind, tmp_path), texts=lambda: [text])
    fast = C.TokenBytes(tok)
    if kind == "file":
        assert fast.table is None
        return
    assert fast.table is not None
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.array(tok.encode(text).ids), rng.integers(0, tok.get_vocab_size(), 500)])
    bounds = [0, 1, 700, 701, 2_000, len(ids) - 300, len(ids)]
    want = tok.decode_batch([ids[a:b].tolist() for a, b in zip(bounds, bounds[1:])], skip_special_tokens=True)
    assert fast.texts(ids, bounds) == want
    # a long document read in pieces: a character cut by a piece boundary is read whole
    if kind == "byte":
        grams = C.TaskNgrams(3, C.NORMALIZATIONS["lm-eval"])
        grams.add("t", 0, "naïve 日本語 ✓ zorblax")
        doc = np.array(tok.encode("x " * 5 + "naïve 日本語 ✓ zorblax y").ids)
        scan = C.Scan(grams, tok, None, "d")
        for piece in (7, 8, 9, 10, 12, 13):
            monkeypatch.setattr(C, "PIECE_TOKENS", piece)
            scan._long(doc, 0, len(doc), None)
        assert grams.items[0].matches == 6 * 2
