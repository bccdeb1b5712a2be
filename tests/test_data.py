"""prepare(): each corpus kind from local files, shards and manifest, the cache, dtype choice, checks."""

import json
import re

import numpy as np
import pytest
from conftest import big_vocab_tokenizer

from gptkit.data import check_tokenizer, check_vocab, load_prepared, prepare
from gptkit.errors import GptkitError

BYTE = {"kind": "byte"}
BYTE_EOS = {"kind": "byte", "eos_token": "<|endoftext|>"}
DOC_A = "Alpha document, first of two.\n" * 30
DOC_B = "Beta document: second of two.\n" * 30


def prep(tmp_path, data, tok=BYTE, **kw):
    return prepare(data, tok, cache_dir=tmp_path / "cache", progress=False, **kw)


def all_tokens(p):
    return np.concatenate([p.train_tokens(), p.val_tokens()])


def test_txt_files_and_globs_in_order_with_eos_between_documents(tmp_path):
    (tmp_path / "a.txt").write_text(DOC_A)
    (tmp_path / "b.txt").write_text(DOC_B)
    p = prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "*.txt")]}, BYTE_EOS)
    assert p.eos_id == 256 and p.vocab_size == 257
    expected = list(DOC_A.encode()) + [256] + list(DOC_B.encode()) + [256]
    assert all_tokens(p).tolist() == expected
    n_val = round(len(expected) * 0.1)
    # the validation split is the tail
    assert len(p.val_tokens()) == n_val
    assert p.val_tokens().tolist() == expected[-n_val:]
    assert p.train_tokens().dtype == np.uint16
    assert p.manifest["splits"]["train"]["tokens"] == len(expected) - n_val
    assert p.manifest["validation"] == {"how": "fraction", "fraction": 0.1, "documents": 2}
    assert p.tokenizer().encode("Alpha").ids == list(b"Alpha")
    # shards are read-only memory maps
    with pytest.raises(ValueError):
        p.train_tokens()[0] = 1


def test_several_paths_keep_their_order_and_val_files(tmp_path):
    (tmp_path / "a.txt").write_text(DOC_A)
    (tmp_path / "b.txt").write_text(DOC_B)
    (tmp_path / "v.txt").write_text("held out\n")
    p = prep(
        tmp_path,
        {
            "kind": "files",
            "paths": [str(tmp_path / "b.txt"), str(tmp_path / "a.txt")],
            "val_paths": [str(tmp_path / "v.txt")],
        },
    )
    assert bytes(p.train_tokens().astype(np.uint8)) == (DOC_B + DOC_A).encode()
    assert bytes(p.val_tokens().astype(np.uint8)) == b"held out\n"
    assert p.manifest["validation"]["how"] == "files"


def test_each_file_is_read_once_through_a_link_loop_an_overlapping_glob_or_a_path_given_twice(
    tmp_path, capsys
):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text(DOC_A)
    (tree / "sub" / "b.txt").write_text(DOC_B)
    # `**` follows it again and again (tree/sub/up/sub/up/...), until the path is too long
    (tree / "sub" / "up").symlink_to("..")
    expected = list(DOC_A.encode()) + [256] + list(DOC_B.encode()) + [256]
    capsys.readouterr()
    p = prep(tmp_path, {"kind": "files", "paths": [str(tree / "**" / "*.txt")]}, BYTE_EOS)
    assert all_tokens(p).tolist() == expected
    assert p.manifest["source"]["files"] == [str(tree / "a.txt"), str(tree / "sub" / "b.txt")]
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert re.fullmatch(
        r"note: data.paths: skipped \d+ paths to files already listed \(.*\); each file is read once", note
    )
    # listed twice, or by a path and a glob: the same rule, the same corpus
    for paths in (
        [tree / "a.txt", tree / "a.txt", tree / "sub" / "b.txt"],
        [tree / "a.txt", tree / "**" / "*.txt"],
    ):
        p = prep(tmp_path, {"kind": "files", "paths": [str(x) for x in paths]}, BYTE_EOS)
        assert all_tokens(p).tolist() == expected
        assert "note: data.paths: skipped " in capsys.readouterr().err
    p = prep(tmp_path, {"kind": "files", "paths": [str(tree / "a.txt"), str(tree / "a.txt")]}, BYTE_EOS)
    assert "skipped 1 path to files" in capsys.readouterr().err


def test_jsonl_json_and_parquet_records_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"content": t, "n": i}) for i, t in enumerate(["one", "", "two"])) + "\n"
    )
    (tmp_path / "b.json").write_text(json.dumps([{"content": "three"}, {"content": "four"}]))
    pq.write_table(pa.table({"content": ["five", "six"]}), tmp_path / "c.parquet")
    files = [str(tmp_path / f) for f in ("a.jsonl", "b.json", "c.parquet")]
    p = prep(
        tmp_path, {"kind": "files", "paths": files, "text_field": "content", "val_fraction": 0.2}, BYTE_EOS
    )
    ids = all_tokens(p).tolist()
    docs = bytes(i if i < 256 else ord("|") for i in ids).decode()
    # empty records are skipped
    assert docs == "one|two|three|four|five|six|"
    assert p.manifest["validation"]["documents"] == 6


def test_pydoc_is_the_offline_default_corpus(tmp_path):
    from pydoc_data.topics import topics

    p = prep(tmp_path, {"kind": "pydoc"})
    n = len(all_tokens(p))
    # ~0.5 MB of English
    assert n > 300_000
    assert bytes(p.train_tokens()[:200].astype(np.uint8)).decode() in topics[sorted(topics)[0]]
    assert "pydoc_data" in p.manifest["source"]["description"]


def test_shakespeare_is_built_in(tmp_path):
    """data=shakespeare (the reference recipe's corpus) ships inside gptkit: nanoGPT's char-level split."""
    p = prep(tmp_path, {"kind": "shakespeare"}, {"kind": "char"})
    # the cache key of this corpus and tokenizer, as every gptkit since format 2 computes it
    assert p.dir.name == "shakespeare-char-e81bf9071cd35753"
    assert p.vocab_size == 65
    assert len(p.train_tokens()) + len(p.val_tokens()) == 1_115_394
    # the last 10%
    assert len(p.val_tokens()) == 111_539
    assert p.tokenizer().decode(p.train_tokens()[:14].tolist()) == "First Citizen:"


def test_cache_hit_and_invalidation(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text(DOC_A)
    data = {"kind": "files", "paths": [str(src)]}
    p1 = prep(tmp_path, data)
    mtime = (p1.dir / "train.bin").stat().st_mtime_ns
    capsys.readouterr()
    p2 = prep(tmp_path, data)
    assert "cache hit" in capsys.readouterr().err
    # not rewritten
    assert p2.dir == p1.dir and (p2.dir / "train.bin").stat().st_mtime_ns == mtime
    # a changed source file
    src.write_text(DOC_A + "changed\n")
    p3 = prep(tmp_path, data)
    assert "prepared" in capsys.readouterr().err
    assert p3.dir != p1.dir and len(all_tokens(p3)) == len(DOC_A) + 8
    # a changed tokenizer
    p4 = prep(tmp_path, data, BYTE_EOS)
    assert p4.dir not in (p1.dir, p3.dir) and p4.eos_id == 256
    p5 = prep(tmp_path, data, force=True)
    assert p5.dir == p3.dir and (p5.dir / "train.bin").stat().st_mtime_ns != mtime
    leftovers = [d.name for d in (tmp_path / "cache").iterdir() if d.name.startswith(".")]
    assert leftovers == []


def test_file_tokenizer_cache_follows_its_content(tmp_path):
    from gptkit.tokenizer import build_tokenizer

    (tmp_path / "a.txt").write_text(DOC_A)
    tok_file = tmp_path / "tok.json"
    build_tokenizer(BYTE).save(str(tok_file))
    data = {"kind": "files", "paths": [str(tmp_path / "a.txt")]}
    p1 = prep(tmp_path, data, {"kind": "file", "path": str(tok_file)})
    # the same file at another path: the same tokens
    copy = tmp_path / "elsewhere" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(tok_file.read_bytes())
    assert prep(tmp_path, data, {"kind": "file", "path": str(copy)}).dir == p1.dir
    build_tokenizer(BYTE_EOS).save(str(tok_file))
    p2 = prep(tmp_path, data, {"kind": "file", "path": str(tok_file)})
    assert p1.dir != p2.dir and p2.vocab_size == 257


def test_uint32_is_chosen_when_the_vocab_does_not_fit_uint16(tmp_path):
    tok = {"kind": "file", "path": str(big_vocab_tokenizer(tmp_path / "big.json"))}
    (tmp_path / "a.txt").write_text(" ".join(f"w{i}" for i in (1, 65_535, 65_536, 69_999) * 10))
    p = prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "a.txt")]}, tok)
    assert p.dtype == "uint32" and p.train_tokens().dtype == np.uint32 and p.vocab_size == 70_000
    assert all_tokens(p).tolist()[:4] == [1, 65_535, 65_536, 69_999]
    with pytest.raises(GptkitError, match="more than uint16 can hold"):
        prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "a.txt")], "dtype": "uint16"}, tok)


def test_manifest_checks(tmp_path):
    (tmp_path / "a.txt").write_text(DOC_A)
    p = prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "a.txt")]})
    assert load_prepared(p.dir).manifest == p.manifest
    m = p.manifest
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 256 and m["tokenizer"]["eos_id"] is None
    assert len(m["source"]["sha256"]) == 64 and len(m["tokenizer"]["sha256"]) == 64
    assert m["gptkit_version"] and m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == len(DOC_A)

    check_vocab(p, 256)
    with pytest.raises(GptkitError, match="model.vocab_size=255"):
        check_vocab(p, 255)
    check_tokenizer(p, BYTE)
    with pytest.raises(GptkitError, match="written with tokenizer byte"):
        check_tokenizer(p, {"kind": "char"})
    with pytest.raises(GptkitError, match="written with tokenizer byte"):
        check_tokenizer(p, BYTE_EOS)

    edited = dict(m, dtype="uint32")
    (p.dir / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(GptkitError, match="edited or corrupted"):
        load_prepared(p.dir)
    (p.dir / "manifest.json").write_text(json.dumps(m))
    (p.dir / "tokenizer.json").write_text((p.dir / "tokenizer.json").read_text().replace('"Ā"', '"X"', 1))
    with pytest.raises(GptkitError, match="not the tokenizer that wrote these shards"):
        load_prepared(p.dir)


def test_prepared_folder_is_reused_only_with_its_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text(DOC_A)
    p = prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "a.txt")]})
    again = prep(tmp_path, {"kind": "prepared", "dir": str(p.dir)})
    assert again.dir == p.dir
    with pytest.raises(GptkitError, match="not the configured char"):
        prep(tmp_path, {"kind": "prepared", "dir": str(p.dir)}, {"kind": "char"})


def test_replacement_policy_for_undecodable_bytes(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good text \xff\xfe more text\n")
    data = {"kind": "files", "paths": [str(tmp_path / "bad.txt")], "val_fraction": 0.2}
    with pytest.raises(GptkitError, match=r"bad.txt: byte 10 .* not valid UTF-8"):
        prep(tmp_path, data)
    p = prep(tmp_path, dict(data, encoding_errors="replace"))
    text = p.tokenizer().decode(all_tokens(p).tolist())
    assert text == "good text \ufffd\ufffd more text\n"


def test_undecodable_json_names_file_and_offset(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(GptkitError, match=r"a.jsonl: byte 30 .* not valid UTF-8"):
        prep(tmp_path, {"kind": "files", "paths": [str(tmp_path / "a.jsonl")]})


def test_byte_shards_equal_the_saved_tokenizers_encoding(tmp_path):
    """prepare() takes byte ids from the UTF-8 text directly; they must be what tokenizer.json encodes,
    a literal special token inside the text encoded as text (HF's encode_special_tokens), or as the token
    with data.special_tokens_in_content=allow."""
    docs = [UNICODE_DOC, "a literal <|endoftext|> inside a document\n", DOC_A]
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    data = {"kind": "files", "paths": [str(tmp_path / f"{i}.txt") for i in range(3)]}
    for allow, eos in ((False, 3), (True, 4)):
        p = prep(tmp_path, {**data, "special_tokens_in_content": "allow" if allow else "text"}, BYTE_EOS)
        tok = p.tokenizer()
        tok.encode_special_tokens = not allow
        expected = [i for d in docs for i in tok.encode(d).ids + [p.eos_id]]
        assert all_tokens(p).tolist() == expected
        # three documents (and with allow, one literal special token)
        assert expected.count(p.eos_id) == eos


UNICODE_DOC = "naïve café — 日本語 🙂\n" * 5


def test_stdlib_corpus_is_the_standard_library_sources():
    from gptkit.data.kinds import open_corpus
    from gptkit.data.sources import stdlib_files

    every, no_tests = stdlib_files(True), stdlib_files(False)
    assert len(every) > 500 and len(no_tests) < len(every)
    assert any(f.name == "json" or f.parent.name == "json" for f in every)
    assert not any("site-packages" in f.parts for f in every)
    corpus = open_corpus({"kind": "stdlib", "include_tests": False, "encoding_errors": "replace"})
    assert corpus.n_bytes > 5_000_000 and "standard library" in corpus.description
    assert "def " in next(corpus.train_docs())


def test_every_data_kind_is_one_preset_and_one_table_row():
    """conf/data/<kind>.yaml holds a kind's defaults (the one place they are written) and gptkit/data/kinds.py
    its row; a partial dict from Python means the same settings as the composed YAML."""
    from omegaconf import OmegaConf

    from gptkit.conf_files import conf_dir
    from gptkit.data.kinds import KINDS
    from gptkit.data.settings import settings
    from gptkit.tokenizer import tokenizer_spec

    presets = {p.stem: p for p in (conf_dir() / "data").glob("*.yaml")}
    assert set(presets) == set(KINDS)
    for kind, preset in presets.items():
        y = OmegaConf.to_container(OmegaConf.load(preset))
        assert y["kind"] == kind
        given = {k: v for k, v in y.items() if v != "???"}
        assert settings({"kind": kind}) == {
            **settings(given),
            **{k: None for k, v in y.items() if v == "???"},
        }
    for preset in (conf_dir() / "tokenizer").glob("*.yaml"):
        y = OmegaConf.to_container(OmegaConf.load(preset))
        if y["kind"] == "file":
            continue
        assert tokenizer_spec({"kind": y["kind"]}) == tokenizer_spec(y)


def test_a_tokenizer_that_cannot_encode_the_corpus_names_the_characters(tmp_path):
    """Fine-tuning a char model on text with new characters: the error names them, not WordLevel's [UNK]."""
    from gptkit.tokenizer import build_tokenizer

    tok_file = tmp_path / "char.json"
    tok_file.write_text(build_tokenizer({"kind": "char"}, texts=lambda: iter(["abc \n"])).to_str())
    (tmp_path / "new.txt").write_text("abc cab\nab€ Zz\n")
    with pytest.raises(
        GptkitError,
        match=r"3 character\(s\) it has never seen: '€' \(U\+20AC\), 'Z' "
        r"\(U\+005A\), "
        r"'z' \(U\+007A\)",
    ):
        prep(
            tmp_path,
            {"kind": "files", "paths": [str(tmp_path / "new.txt")]},
            {"kind": "file", "path": str(tok_file)},
        )
