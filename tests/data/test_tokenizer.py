"""Tokenizers: each kind round-trips text, ids are what the kind promises, errors are one line."""

import pytest
from conftest import shakespeare

from gptkit.data.tokenize import split_long
from gptkit.errors import GptkitError
from gptkit.tokenizer import build_tokenizer, describe_characters, tokenizer_sha256, unknown_characters

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\tAll: Speak, speak! 3.14 café\n"
UNICODE = "naïve café — 日本語 🙂\x00\n"


def corpus():
    return lambda: iter([TEXT, "Second doc: more words, more merges. " * 20])


def test_byte_ids_are_the_utf8_bytes_and_round_trip():
    tok = build_tokenizer({"kind": "byte"})
    assert tok.get_vocab_size() == 256
    ids = tok.encode(UNICODE).ids
    assert ids == list(UNICODE.encode("utf-8"))
    assert tok.decode(ids) == UNICODE


def test_byte_special_tokens_come_after_the_bytes():
    tok = build_tokenizer({"kind": "byte", "eos_token": "<|endoftext|>"})
    assert tok.get_vocab_size() == 257
    assert tok.token_to_id("<|endoftext|>") == 256


def test_char_vocab_is_the_corpus_characters_in_code_point_order():
    tok = build_tokenizer({"kind": "char"}, texts=lambda: iter(["cab", "a\nb"]))
    assert tok.get_vocab() == {"\n": 0, "a": 1, "b": 2, "c": 3}
    ids = tok.encode("abc\n").ids
    assert ids == [1, 2, 3, 0]
    assert tok.decode(ids) == "abc\n"


def test_char_round_trips_unicode_and_rejects_unknown_characters():
    tok = build_tokenizer({"kind": "char"}, texts=lambda: iter([UNICODE, TEXT]))
    assert tok.decode(tok.encode(UNICODE + TEXT).ids) == UNICODE + TEXT
    # one id per code point
    assert len(tok.encode(UNICODE).ids) == len(UNICODE)
    assert unknown_characters(tok, "ZaZ\u20ac") == ["Z", "\u20ac"]
    assert describe_characters(["Z", "\u20ac"]) == "'Z' (U+005A), '\u20ac' (U+20AC)"
    unk = build_tokenizer({"kind": "char", "unk_token": "<|unk|>"}, texts=lambda: iter(["ab"]))
    assert unk.encode("aZ").ids == [0, unk.token_to_id("<|unk|>")]
    # mapped to <|unk|>: its own unknown id
    assert unknown_characters(unk, "aZ") == ["Z"]


class CountingTokenizer:
    """A real char tokenizer that counts the encode calls it answers."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, 0

    def encode(self, *args, **kw):
        self.calls += 1
        return self.tok.encode(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_unknown_characters_asks_the_tokenizer_about_each_character_once():
    # a server checks every prompt: a prompt of k distinct characters was 2k encode calls every time
    tok = CountingTokenizer(build_tokenizer({"kind": "char"}, texts=lambda: iter([TEXT])))
    prompt = "Before we proceed \u20acZ"
    first = unknown_characters(tok, prompt)
    assert first == ["\u20ac", "Z"]
    asked = tok.calls
    assert asked >= len(set(prompt))
    # the same answers again (and for a prompt of the same characters), without asking the tokenizer
    assert unknown_characters(tok, prompt) == first
    assert unknown_characters(tok, "Z proceed we \u20ac") == ["Z", "\u20ac"]
    assert tok.calls == asked
    # a vocabulary that grew is asked anew: Z is known now
    tok.tok.add_tokens(["Z"])
    assert unknown_characters(tok, prompt) == ["\u20ac"]
    assert tok.calls > asked


def sentencepiece_tokenizer(unk: bool = True, byte_fallback: bool = True):
    """A Llama 2 / Mistral style tokenizer.json: BPE over '▁'-joined pieces with <0xNN> byte tokens, a
    Metaspace pre-tokenizer (prepend_scheme first), and the decoder that strips the leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)} if byte_fallback else {})
    for t in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "ll", "▁hell", "▁hello"]:
        vocab[t] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    model = models.BPE(
        vocab, merges, unk_token="<unk>" if unk else None, byte_fallback=byte_fallback, fuse_unk=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


PROMPTS = [" hello", "hello world", " ", "  two spaces", "\n\tcafé — 日本語 🙂", "<unk> spelled"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_sentencepiece_with_byte_fallback_knows_every_character(prompt):
    from gptkit.inference.generate import encode_prompt

    tok = sentencepiece_tokenizer()
    # the decoder strips the leading space: a round trip would call ' ' unknown
    assert tok.decode(tok.encode(" ").ids) == ""
    assert unknown_characters(tok, prompt) == []
    ids = encode_prompt(tok, prompt, bos_id=1)
    assert ids and tok.token_to_id("<unk>") not in ids


def test_sentencepiece_without_byte_fallback_names_what_becomes_unk():
    from gptkit.inference.generate import encode_prompt

    tok = sentencepiece_tokenizer(byte_fallback=False)
    assert unknown_characters(tok, " hello") == []
    assert unknown_characters(tok, " hello €x") == ["€", "x"]
    with pytest.raises(GptkitError, match=r"2 character\(s\) the tokenizer has never seen: '€'"):
        encode_prompt(tok, " hello €x", bos_id=1)
    # neither an unknown token nor bytes: what it drops is unknown
    bare = sentencepiece_tokenizer(unk=False, byte_fallback=False)
    assert bare.encode("hello x", add_special_tokens=False).tokens == ["▁hello", "▁"]
    assert unknown_characters(bare, " hello x€") == ["x", "€"]


def test_byte_level_bpe_knows_every_character():
    bpe = build_tokenizer(
        {"kind": "bpe", "vocab_size": 280, "min_frequency": 1}, texts=corpus(), progress=False
    )
    for prompt in [*PROMPTS, UNICODE, "\x01\u2028"]:
        assert unknown_characters(bpe, prompt) == []


def test_bpe_trains_to_the_vocab_size_with_special_tokens_and_round_trips():
    cfg = {
        "kind": "bpe",
        "vocab_size": 300,
        "min_frequency": 1,
        "special_tokens": ["<|endoftext|>"],
        "eos_token": "<|endoftext|>",
    }
    tok = build_tokenizer(cfg, texts=corpus(), progress=False)
    assert 256 < tok.get_vocab_size() <= 300
    assert tok.token_to_id("<|endoftext|>") is not None
    for text in (TEXT, UNICODE):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    # it learned merges
    assert len(tok.encode(TEXT).ids) < len(TEXT.encode())
    # the same corpus and settings give the same tokenizer
    assert tokenizer_sha256(build_tokenizer(cfg, texts=corpus(), progress=False)) == tokenizer_sha256(tok)


def test_file_tokenizer_loads_any_tokenizer_json(tmp_path):
    bpe = build_tokenizer(
        {"kind": "bpe", "vocab_size": 280, "min_frequency": 1}, texts=corpus(), progress=False
    )
    path = tmp_path / "tok.json"
    bpe.save(str(path))
    tok = build_tokenizer({"kind": "file", "path": str(path)})
    assert tok.encode(TEXT).ids == bpe.encode(TEXT).ids
    assert tok.decode(tok.encode(TEXT).ids) == TEXT


def test_file_tokenizer_errors(tmp_path):
    with pytest.raises(GptkitError, match="nope.json does not exist"):
        build_tokenizer({"kind": "file", "path": str(tmp_path / "nope.json")})
    with pytest.raises(GptkitError, match="needs tokenizer.path"):
        build_tokenizer({"kind": "file"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GptkitError, match="not a valid tokenizer.json"):
        build_tokenizer({"kind": "file", "path": str(bad)})
    with pytest.raises(GptkitError, match="eos_token"):
        build_tokenizer({"kind": "file", "path": str(_byte_file(tmp_path)), "eos_token": "<|missing|>"})


def test_a_tokenizer_file_with_an_id_beyond_its_entries_or_a_duplicate_id_is_one_line(tmp_path):
    import json

    good = tmp_path / "eos.json"
    build_tokenizer({"kind": "byte", "eos_token": "<|endoftext|>"}).save(str(good))

    def edited(name, edit):
        d = json.loads(good.read_text())
        edit(d)
        (tmp_path / name).write_text(json.dumps(d))
        return {"kind": "file", "path": str(tmp_path / name)}

    def vocab(d):
        return d["model"]["vocab"]

    # an id of 2^31-1 would make a model of 2^31 embedding rows
    big = edited("big.json", lambda d: vocab(d).update(a=2**31 - 1))
    with pytest.raises(GptkitError) as err:
        build_tokenizer(big)
    msg = str(err.value)
    assert (
        "big.json: the token 'a' has id 2,147,483,647, not below the 257 entries" in msg and "\n" not in msg
    )
    with pytest.raises(GptkitError, match=r"dup.json: the tokens 'a' and 'b' both have id 97"):
        build_tokenizer(edited("dup.json", lambda d: vocab(d).update(b=97)))
    # an added token that is also in the vocabulary, by the same id, is one entry (an added token that is not
    # in it gets the next free id, whatever the file says)
    both = edited("both.json", lambda d: vocab(d).update({"<|endoftext|>": 256}))
    assert build_tokenizer({**both, "eos_token": "<|endoftext|>"}).get_vocab_size() == 257


def _byte_file(tmp_path):
    p = tmp_path / "byte.json"
    build_tokenizer({"kind": "byte"}).save(str(p))
    return p


def test_unknown_kind_is_an_error():
    with pytest.raises(GptkitError, match="unknown tokenizer kind 'wordpiece'"):
        build_tokenizer({"kind": "wordpiece"})


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_cutting_long_documents_changes_no_token(kind):
    """prepare() cuts long documents for parallel encoding; the tokens must be those of the whole text."""
    lines = shakespeare(60_000).splitlines()
    # every other line ends in a space: " \n" is then a frequent pair, and a cut between the two breaks it
    text = "\n".join(line + " " * (i % 2) for i, line in enumerate(lines)) + "  trailing  \n\n  spaces \n"
    pieces = split_long(text, size=2_000)
    assert len(pieces) > 10 and "".join(pieces) == text
    tok = build_tokenizer(
        {"kind": kind, "vocab_size": 400, "min_frequency": 1}, texts=lambda: iter([text]), progress=False
    )
    joined = [i for enc in tok.encode_batch(pieces) for i in enc.ids]
    assert joined == tok.encode(text).ids
