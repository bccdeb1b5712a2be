"""What data=chat and data=preference share: the prepared folder (TemplatedData), the build that makes one
(TemplatedBuild: files, template, cache folder, tokenizer, manifest, publish), rows measured before they are
encoded (RowLimit), and the checks of a cached folder.

    TemplatedBuild.open(...)      the files, the template and the cache folders of the settings
      .cached(load)               a folder the cache holds (checked), or None
      .tokenizer(texts)           the configured tokenizer (char/bpe: built from the rendered texts) with the
                                  template's special tokens added
      .n_train(n, what)           how many of n records train (the last val_fraction validate)
      .manifest(...)              the manifest fields both kinds write
      .publish(...)               the folder written atomically, then loaded
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from gptkit.chat_templates import CHAT_FILE, add_special_tokens, resolve_template
from gptkit.data.build import cutter_for
from gptkit.data.cache import REBUILD, publish_folder, templated_folder
from gptkit.data.console import say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions, Prepared
from gptkit.data.files import expand_paths, spelled_in
from gptkit.data.settings import keyed_special_text
from gptkit.errors import GptkitError
from gptkit.tokenizer import (
    TokenizerSpec,
    build_tokenizer,
    file_sha256,
    spec_special_tokens,
    tokenizer_sha256,
)

# a text of at most this many characters per token of the longest row is encoded whole (it may fit, and
# costs what a row costs); a longer one is first measured on prefixes (RowLimit)
WHOLE_CHARS_PER_TOKEN = 8


# ---- the prepared (cached) form --------------------------------------------------------------------------
@dataclass
class ChatSplit:
    """One split of prepared chat data: the tokens of every conversation, the loss mask, and the offsets."""

    ids: np.ndarray  # [n_tokens] every conversation's tokens, one after another
    mask: np.ndarray  # [n_tokens] uint8: 1 on the assistant's tokens
    offsets: np.ndarray  # [n_conversations + 1] where each conversation starts in ids
    # [n_conversations] bool: longer than the folder's row_limit, only its first row_limit tokens kept
    long: np.ndarray | None = None

    @classmethod
    def from_arrays(cls, z: Any, prefix: str) -> "ChatSplit":
        """The split an .npz holds under `prefix` (sequence_arrays wrote it)."""
        long = z[f"{prefix}_long"].astype(bool)
        return cls(z[f"{prefix}_ids"], z[f"{prefix}_mask"], z[f"{prefix}_offsets"], long)

    @property
    def n(self) -> int:
        return len(self.offsets) - 1

    def is_long(self, i: int) -> bool:
        return self.long is not None and bool(self.long[i])


@dataclass
class RowLimit:
    """The longest row a run can train on, in tokens (model.max_seq_len + 1; None: not known, every text is
    encoded whole), and how a text longer than that is measured without being encoded whole: by the token
    count of prefixes that end where the tokenizer may be cut without changing a token (gptkit.data.tokenize's
    Cutter), each twice the last, until one holds more than `tokens` tokens or is the whole text. So every
    conversation that fits is encoded whole, exactly as before; one that does not is encoded as such a
    prefix, its first `tokens` tokens kept (all that data.truncate=cut takes of it) and flagged long. (For
    byte-level BPE a run of HARD_CHARS characters with no such place is cut anyway, as the token-shard build
    cuts it: the tokens next to that cut may differ from the whole text's.)"""

    tokens: int | None
    tokenizer: Any = None
    spec: TokenizerSpec | None = None
    # made on the first long text (it reads the tokenizer's JSON)
    _cutter: Any = field(default=None, repr=False)

    def fit(self, text: str, spans: list[tuple[int, int]]) -> tuple[str, list[tuple[int, int]], bool]:
        """(text, spans, False) when the text may fit or cannot be cut; (a prefix of it that holds more than
        `tokens` tokens, the spans within it, True) otherwise."""
        if self.tokens is None or len(text) <= self.tokens * WHOLE_CHARS_PER_TOKEN:
            return text, spans, False
        n = self.tokens * WHOLE_CHARS_PER_TOKEN
        while n < len(text):
            c = self._cut(text, n)
            if c is None:
                break
            if self._count(text[:c]) > self.tokens:
                return text[:c], [(a, min(b, c)) for a, b in spans if a < c], True
            n = 2 * c
        return text, spans, False

    def _cut(self, text: str, n: int) -> int | None:
        """The first place at or after n where the text may be cut (None: none before its end)."""
        if self._cutter is None:
            self._cutter = cutter_for(self.tokenizer, self.spec)
        lo = n
        while lo < len(text):
            hi = min(len(text), lo + self._cutter.hard_chars)
            c = self._cutter.cut(text, lo, hi, hi < len(text))
            if c is not None:
                return c
            lo = hi
        return None

    def _count(self, text: str) -> int:
        # _fast (tokenizers >= 0.21): without offsets
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return len(encode([text], add_special_tokens=False)[0].ids)


@dataclass
class TemplatedData(Prepared):
    """A prepared data=chat or data=preference folder: its manifest, the settings it was read with, the
    tokenizer (with the template's special tokens) and the chat template, which the run folder keeps."""

    dir: Path
    manifest: dict[str, Any]
    # the data config (train_on, pack, truncate, ...)
    settings: dict[str, Any]

    @property
    def template_path(self) -> Path:
        return self.dir / CHAT_FILE

    @property
    def pad_id(self) -> int:
        return int(self.manifest["tokenizer"]["pad_id"])

    def run_files(self) -> dict[str, Path]:
        """The tokenizer and the template `gptkit chat` talks with."""
        return {**super().run_files(), CHAT_FILE: self.template_path}

    # what a record is called in the counts ("conversations", "pairs"), the manifest's key of their count
    record_name = "records"

    def counts(self) -> str:
        tr, va = self.manifest["splits"]["train"], self.manifest["splits"]["val"]
        n = self.record_name
        return (
            f"template {self.manifest['template']}: {tr[n]:,} train / {va[n]:,} val {n}, {tr['tokens']:,} "
            f"train tokens{long_note(self.manifest, n)}"
        )

    def table(self) -> list[tuple[str, str]]:
        rows = super().table()
        return rows[:1] + [("template", str(self.manifest["template"]))] + rows[1:]


def check_row_limit(prepared: TemplatedData, seq_len: int, what: str) -> None:
    """Rows of seq_len + 1 tokens need the long conversations' (or answers') first seq_len + 1 tokens: a
    one-line error when the folder kept fewer (prepared for a shorter model.max_seq_len)."""
    limit = prepared.manifest.get("row_limit")
    if limit is not None and manifest_longs(prepared.manifest) and seq_len + 1 > int(limit):
        raise GptkitError(
            f"{prepared.dir} keeps the {what} longer than {limit} tokens as their first {limit} (prepared "
            f"for model.max_seq_len={int(limit) - 1}); rows of {seq_len + 1} tokens need more of them: "
            f"prepare the data for that model.max_seq_len, or use trainer.seq_len<={int(limit) - 1}"
        )


def manifest_longs(manifest: dict[str, Any]) -> int:
    """Conversations (or pairs) of a folder kept as their first row_limit tokens."""
    return sum(int(v.get("long", 0)) for v in manifest["splits"].values())


def long_note(manifest: dict[str, Any], what: str) -> str:
    """What the counts line adds for a folder that kept long conversations (or pairs) cut to its row_limit."""
    longs, limit = manifest_longs(manifest), manifest.get("row_limit")
    return f"; {longs:,} {what} longer than {limit:,} tokens, kept as their first {limit:,}" if longs else ""


def key_settings(s: dict[str, Any], tok: TokenizerSpec, template, files: list[Path]) -> dict[str, Any]:
    """The settings a chat or preference cache key holds: special_tokens_in_content=text only when the
    files may spell a special token of the template or the tokenizer (gptkit.data.files.spelled_in), where
    it makes other ids than before; otherwise the key of every gptkit before it."""
    formats = [
        "parquet"
        if s["format"] == "parquet" or (s["format"] == "auto" and f.suffix.lower() == ".parquet")
        else "json"
        for f in files
    ]
    return keyed_special_text(
        s, lambda: spelled_in(files, [*template.special_tokens, *spec_special_tokens(tok)], formats)
    )


def template_for(spec: str, tok: TokenizerSpec):
    """data.template for this tokenizer (auto: the template saved next to a tokenizer.json), compiled: a
    template that is not Jinja fails before any file is read."""
    template = resolve_template(spec, tok.path if tok.kind == "file" else None)
    template.compiled  # noqa: B018
    return template


def tokenizer_record(tokenizer, tok: TokenizerSpec, template) -> dict[str, Any]:
    """The manifest's tokenizer entry of a chat or preference folder: its settings, size, hash, and the ids
    of EOS, padding (EOS, else 0) and the template's end of turn."""
    eos = tok.eos_token
    eos_id = tokenizer.token_to_id(eos) if eos else None
    end = template.end_of_turn().strip()
    return {
        **tok.settings,
        "vocab_size": tokenizer.get_vocab_size(),
        "sha256": tokenizer_sha256(tokenizer),
        "eos_id": eos_id,
        "pad_id": eos_id if eos_id is not None else 0,
        "end_of_turn": end,
        "end_of_turn_id": tokenizer.token_to_id(end) if end else None,
    }


def check_split(split: ChatSplit, n: int, tokens: int) -> None:
    """The arrays of one split agree with each other and with the manifest's counts (ValueError if not)."""
    off = split.offsets
    if (
        split.n != n
        or len(split.ids) != tokens
        or len(split.mask) != tokens
        or off[0] != 0
        or off[-1] != tokens
        or (np.diff(off) < 0).any()
        or (split.long is not None and len(split.long) != n)
    ):
        raise ValueError(
            f"its arrays do not hold the {n:,} conversations of {tokens:,} tokens of its manifest"
        )


def check_tokenizer_file(folder: Path, manifest: dict[str, Any]) -> None:
    """The folder's tokenizer.json is the one its tokens were made with (its hash in the manifest)."""
    f = folder / TOKENIZER
    if not f.is_file() or file_sha256(f) != manifest["tokenizer"]["sha256"]:
        raise GptkitError(
            f"{folder} is damaged ({TOKENIZER} is missing or is not the tokenizer its tokens were made "
            f"with); {REBUILD}"
        )


@dataclass
class TemplatedBuild:
    """One data=chat or data=preference build: its settings, tokenizer spec and options, the files it reads,
    the template, and the cache folders (of this row limit first, then of every one) and key."""

    kind: str
    s: dict[str, Any]
    tok: TokenizerSpec
    opts: BuildOptions
    train_files: list[Path]
    val_files: list[Path]
    template: Any
    folders: list[Path]
    key: str
    content: str

    @classmethod
    def open(
        cls,
        kind: str,
        s: dict[str, Any],
        tok: TokenizerSpec,
        opts: BuildOptions,
        row_keys,
        format_version: int,
    ) -> "TemplatedBuild":
        """The files, the template and the cache folders of the (checked) settings; a template that is not
        Jinja fails before any file is read."""
        train_files = expand_paths(s["paths"], "data.paths")
        val_files = expand_paths(s["val_paths"], "data.val_paths") if s["val_paths"] else []
        template = template_for(s["template"], tok)
        files = train_files + val_files
        folders, key, content = templated_folder(
            kind,
            key_settings(s, tok, template, files),
            row_keys,
            format_version,
            tok,
            template,
            files,
            opts.cache,
            opts.force,
            opts.row_limit,
        )
        return cls(kind, s, tok, opts, train_files, val_files, template, folders, key, content)

    @property
    def allow_special_text(self) -> bool:
        """data.special_tokens_in_content=allow: spelled special tokens become control tokens (as before)."""
        return self.s["special_tokens_in_content"] == "allow"

    def cached(self, load: Callable[[Path, dict[str, Any]], Prepared]) -> Prepared | None:
        """The folder the cache holds for these settings (checked by `load`), or None."""
        for folder in self.folders:
            if (folder / MANIFEST).is_file():
                data = load(folder, self.s)
                say(f"cache hit: {folder} ({data.counts()})")
                return data
        return None

    def tokenizer(self, texts: Callable[[], Iterable[str]]):
        """(the configured tokenizer, the template's special tokens added to it): char and bpe are built from
        `texts` (the rendered records)."""
        if self.tok.built_from_corpus:
            tokenizer = build_tokenizer(self.tok, texts, progress=False)
        else:
            tokenizer = build_tokenizer(self.tok)
        return tokenizer, add_special_tokens(tokenizer, self.template)

    def n_train(self, n: int, what: str) -> int:
        """How many of the n records of data.paths train: all with data.val_paths, else all but the last
        val_fraction (at least one each)."""
        if self.val_files:
            return n
        n_train = min(n - 1, max(1, round(n * (1 - float(self.s["val_fraction"])))))
        if n_train < 1:
            raise GptkitError(
                f"data.paths hold {n} {what}(s); data={self.kind} needs at least 2 (one for validation) or "
                "data.val_paths"
            )
        return n_train

    def manifest(
        self, fmt: str, format_version: int, what: str, tokenizer, added: list[str], limit: RowLimit, splits
    ) -> dict[str, Any]:
        """The manifest of the folder: format, key, source, template, the tokenizer's record, the row limit
        and the splits' counts (`splits`: {split: {count: ...}})."""
        val = f" (val: {', '.join(map(str, self.val_files))})" if self.val_files else ""
        return {
            "format": fmt,
            "format_version": format_version,
            "cache_key": self.key,
            "source": {
                "kind": self.kind,
                "description": f"{what} from {', '.join(map(str, self.train_files))}{val}",
                "sha256": self.content,
            },
            "template": self.template.name,
            "added_tokens": added,
            "tokenizer": tokenizer_record(tokenizer, self.tok, self.template),
            # records longer than this many tokens are kept as their first this many (long)
            "row_limit": limit.tokens,
            "splits": splits,
        }

    def publish(
        self,
        manifest: dict[str, Any],
        arrays: dict[str, dict[str, Any]],
        tokenizer,
        load: Callable[[Path, dict[str, Any]], Prepared],
        added: list[str],
        extra: dict[str, str] | None = None,
    ) -> Prepared:
        """Write the folder (atomically: cache.publish_folder) and load it. A folder that holds long records
        is of this row limit; without any, of every one."""
        final = self.folders[0] if manifest_longs(manifest) else self.folders[-1]
        publish_folder(self.opts.cache, final, arrays, tokenizer, self.template, manifest, extra=extra)
        data = load(final, self.s)
        note = f"; added {', '.join(added)} to the tokenizer" if added else ""
        say(f"prepared {final} ({data.counts()}{note})")
        return data


def sequence_arrays(prefix: str, seqs: list[tuple[np.ndarray, np.ndarray, bool]]) -> dict[str, np.ndarray]:
    """The arrays of one list of encoded records ((ids, mask, long) each) as the .npz holds them:
    <prefix>_ids, _mask (one after another), _offsets (where each starts), _long."""
    return {
        f"{prefix}_ids": np.concatenate([ids for ids, _, _ in seqs] or [np.zeros(0, np.uint32)]),
        f"{prefix}_mask": np.concatenate([m for _, m, _ in seqs] or [np.zeros(0, np.uint8)]),
        f"{prefix}_offsets": np.cumsum([0] + [len(ids) for ids, _, _ in seqs], dtype=np.int64),
        f"{prefix}_long": np.array([long for _, _, long in seqs], dtype=np.uint8),
    }
