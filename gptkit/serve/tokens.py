"""What one token id is, alone: its text (as the tokenizer decodes it) and its bytes (what it adds to the
output's UTF-8). Log-probs name tokens this way (OpenAI's `token` and `bytes`), and a grammar engine reads
the whole vocabulary as bytes (gptkit/serve/grammar.py).

    byte-level BPE (gptkit's byte and bpe kinds, GPT-2 style files)   the vocabulary's characters mapped
                                                                      back to the bytes they stand for
    byte fallback (<0xE2>), sentencepiece's "▁"                       that byte; "▁" is a space
    anything else                                                     the token decoded alone, as UTF-8
    special tokens (<|endoftext|>...)                                 their text; `special` lists them
"""

from __future__ import annotations

import re
from functools import lru_cache

from gptkit.tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """The text and bytes of each id of a tokenizers.Tokenizer, for a model of vocab_size ids (ids the
    tokenizer does not have are b"" and special)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.byte_level = "ByteLevel" in repr(getattr(tokenizer, "decoder", None))
        self.unbyte = {c: b for b, c in bytes_to_unicode().items()}
        added = tokenizer.get_added_tokens_decoder() if hasattr(tokenizer, "get_added_tokens_decoder") else {}
        self.special = {i for i, t in added.items() if getattr(t, "special", True)}
        self.special |= set(range(tokenizer.get_vocab_size(), vocab_size))
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, i: int) -> str:
        if i in self.special:
            return self.tokenizer.id_to_token(i) or ""
        return self.tokenizer.decode([i])

    def _bytes(self, i: int) -> bytes:
        piece = self.tokenizer.id_to_token(i)
        if piece is None:
            return b""
        if i in self.special:
            return piece.encode()
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        m = _BYTE_FALLBACK.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:
            return piece.replace("▁", " ").encode()
        return self.tokenizer.decode([i]).encode()

    def vocabulary(self) -> list[bytes]:
        """Every id's bytes, in id order (special ids: b"", which a grammar never allows)."""
        return [b"" if i in self.special else self._bytes(i) for i in range(self.vocab_size)]
