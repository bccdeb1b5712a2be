"""The templated data kinds (data=chat, data=preference, data=prompts): records rendered with a chat template,
then token ids (and a mask) per record. A kind is its record reader and its row maker (TemplatedKind); the
build, the cached folder, its load and the sampler are one, here.

    KIND = TemplatedKind(name, read_record, texts, encode, data, split, ...)   # in the kind's own file
    KIND.prepare(settings, tok, opts)  settings checked (KIND.check), the folder of the cache or built (one
                                       process builds, the others wait for it: cache.one_builder):
      records read (KIND.read_record, every problem one line naming the file and row)
      -> (KIND.render) -> the tokenizer (char/bpe: built from KIND.texts) -> KIND.encode: (ids, mask, long)
         of each side (one for chat and prompts, chosen and rejected for preference) through an Encoder
         (RowLimit: a text longer than a row is measured, never encoded whole)
      -> the folder: manifest.json, <npz> (each split's sides), where.json (or rows.json: the records, kept
         for the rewards), tokenizer.json, chat.json; written atomically (TemplatedBuild.publish)
    KIND.load(folder, settings)        the folder checked (checksums, counts) -> KIND.data (a TemplatedData)
    RowSampler(rows, batch_size, seed, too_few)  the rows of a micro-step: a pure function of (seed, step,
                                       rank, world size), for every kind's Feed

    TemplatedBuild.open(...)      the files, the template and the cache folders of the settings
      .cached(load)               a folder the cache holds (checked), or None
      .tokenizer(texts)           the configured tokenizer (char/bpe: built from the rendered texts) with the
                                  template's special tokens added
      .n_train(n, what)           how many of n records train (the last val_fraction validate)
      .manifest(...)              the manifest fields every kind writes
      .publish(...)               the folder written atomically, then loaded

A new kind (records with a prompt and an answer, say) is a file with its reader, its row maker (the Encoder
renders a prompt and an answer: Encoder.answer) and its TemplatedData subclass's `connect`, a preset in
conf/data/, and one row `templated(KIND)` in gptkit/data/kinds.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from gptkit.chat_formats.tools import Conversation, tools_of
from gptkit.chat_templates import (
    CHAT_FILE,
    add_special_tokens,
    assistant_spans,
    encode_conversation,
    resolve_template,
)
from gptkit.data import hub_files
from gptkit.data.build import cutter_for
from gptkit.data.cache import REBUILD, check_folder, one_builder, publish_folder, templated_folder
from gptkit.data.console import say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions, Prepared
from gptkit.data.files import spelled_in
from gptkit.data.provenance import TextBytes, show
from gptkit.data.records import records
from gptkit.data.settings import allows_special_text, defaults, keyed_special_text
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
    """A prepared folder of a templated kind: its manifest, the settings it was read with, the tokenizer (with
    the template's special tokens) and the chat template, which the run folder keeps, and its splits. A kind
    subclasses it with its `connect` (the rows of a run) and what a record is called."""

    dir: Path
    manifest: dict[str, Any]
    # the data config (train_on, pack, truncate, ...)
    settings: dict[str, Any]
    # the kind's splits (TemplatedKind.split: ChatSplit, PairSplit, PromptSplit)
    train: Any
    val: Any
    # what a record is called in the counts ("conversations", "pairs"), the manifest's key of their count
    record_name: str = "records"
    # a frozen model's precomputed outputs the rows carry, by name (gptkit/data/frozen_outputs.py: set by
    # the run that reads them, after checking they fit its rows)
    outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def template_path(self) -> Path:
        return self.dir / CHAT_FILE

    @property
    def pad_id(self) -> int:
        return int(self.manifest["tokenizer"]["pad_id"])

    def run_files(self) -> dict[str, Path]:
        """The tokenizer and the template `gptkit chat` talks with."""
        return {**super().run_files(), CHAT_FILE: self.template_path}

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
    it makes other ids than before, and tools when they may hold tools or tool calls; otherwise the key of
    every gptkit before it."""
    formats = [
        "parquet"
        if s["format"] == "parquet" or (s["format"] == "auto" and f.suffix.lower() == ".parquet")
        else "json"
        for f in files
    ]
    key = keyed_special_text(
        s, lambda: spelled_in(files, [*template.special_tokens, *spec_special_tokens(tok)], formats)
    )
    # data.hf (hub datasets in data.paths, gptkit/data/hub_files.py) at its defaults: the key of every gptkit
    # before it
    if "hf" in key and s.get("kind") and key["hf"] == defaults(s["kind"]).get("hf"):
        key = {k: v for k, v in key.items() if k != "hf"}
    # records that may carry tools or tool calls (gptkit.chat_formats.tools) render them now, where every
    # gptkit before dropped them: another key for those files alone (no folder prepared without them is read)
    if spelled_in(files, ['"tools"', '"tool_calls"'], formats):
        key = {**key, "tools": 1}
    return key


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


def check_split(split: ChatSplit, n: int, tokens: int, what: str = "conversations") -> None:
    """The arrays of one split (n `what`) agree with each other and with the manifest's counts (ValueError
    if not)."""
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
        raise ValueError(f"its arrays do not hold the {n:,} {what} of {tokens:,} tokens of its manifest")


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
    """One build of a templated kind: its settings, tokenizer spec and options, the files it reads, the
    template, and the cache folders (of this row limit first, then of every one) and key."""

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
    # the hub datasets data.paths and data.val_paths name (their files are in train_files, val_files)
    hub: list[hub_files.HubFiles] = field(default_factory=list)

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
        """The files (a hub dataset's downloaded: gptkit/data/hub_files.py), the template and the cache
        folders of the (checked) settings; a template that is not Jinja fails before any file is read."""
        template = template_for(s["template"], tok)
        hf = s.get("hf") or {}
        train_files, hub = hub_files.expand(s["paths"], "data.paths", hf, hf.get("split") or "train")
        val_files: list[Path] = []
        if s["val_paths"]:
            val_split = hf.get("val_split") or "validation"
            val_files, val_hub = hub_files.expand(s["val_paths"], "data.val_paths", hf, val_split)
            hub += val_hub
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
        return cls(kind, s, tok, opts, train_files, val_files, template, folders, key, content, hub)

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
        source = {
            "kind": self.kind,
            "description": f"{what} from {', '.join(map(str, self.train_files))}{val}",
            "sha256": self.content,
        }
        if self.hub:
            # where the hub datasets' files came from: repository, revision, commit, split, files
            source["description"] = f"{what} from {', '.join(h.describe() for h in self.hub)}"
            source["hub"] = [h.record() for h in self.hub]
        return {
            "format": fmt,
            "format_version": format_version,
            "cache_key": self.key,
            "source": source,
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


def split_where(where: str) -> tuple[str | None, str]:
    """A record's "<file> line 12" (or record, row) as (file, "line 12")."""
    for word in (" line ", " record ", " row "):
        head, sep, tail = where.rpartition(word)
        if sep:
            return head, f"{word.strip()} {tail}"
    return None, where


def shown(data: Prepared, chars: int) -> Callable[[Any], str]:
    """ids -> their first `chars` characters, as `gptkit trace` shows a row (the tokenizer read once)."""
    decode = TextBytes(data.tokenizer()).text
    return lambda ids: show(decode(np.asarray(ids[: 4 * chars + 8])), chars)


def first_val(n: int, val_windows: int | None) -> int:
    """How many of n validation items a run reads (val_windows: at most that many; None: all)."""
    return n if val_windows is None else min(n, int(val_windows))


def lost(train: Any, val: Any) -> list[str]:
    """Records longer than a row, cut and dropped (train and val together), for a start-up line."""
    cut, dropped = train.cut + val.cut, train.dropped + val.dropped
    return ([f"{cut} cut"] if cut else []) + ([f"{dropped} dropped"] if dropped else [])


# ---- a kind: its record reader and its row maker, over one build and one load ----------------------------
# (ids uint32, mask uint8: 1 on the tokens that carry loss, long: kept as its first row_limit tokens)
Seq = tuple[np.ndarray, np.ndarray, bool]
SPLITS = ("train", "val")


@dataclass
class Encoder:
    """What a row maker encodes with: the tokenizer (with the template's special tokens), the template, the
    row limit, and whether a special token the data spells becomes a control token (allow_special_text)."""

    tokenizer: Any
    template: Any
    limit: RowLimit
    allow_special_text: bool

    def encode(
        self, msgs: list[dict], where: str, text: str, spans: list[tuple[int, int]], prompt: bool = False
    ) -> Seq:
        """(ids, mask, long) of `msgs` rendered as `text` (mask: the tokens of `spans`; prompt: rendered up
        to the assistant's turn). long: longer than the row limit, of which only the first limit.tokens
        are returned (the text measured on prefixes, never encoded whole)."""
        text, spans, long = self.limit.fit(text, spans)
        ids, mask = encode_conversation(
            self.tokenizer,
            self.template,
            msgs,
            where,
            add_generation_prompt=prompt,
            rendered=(text, spans),
            prefix=long,
            allow_special_text=self.allow_special_text,
        )
        if long:
            ids, mask = ids[: self.limit.tokens], mask[: self.limit.tokens]
        return np.asarray(ids, dtype=np.uint32), np.asarray(mask, dtype=np.uint8), long

    def answer(self, msgs: list[dict], answer: str, where: str) -> Seq:
        """The conversation followed by `answer` as the assistant's turn; the mask marks the answer's tokens
        only (not earlier assistant turns of `msgs`)."""
        # the prompt's tools too (a Conversation's)
        conversation = Conversation([*msgs, {"role": "assistant", "content": answer}], tools_of(msgs))
        text, spans = assistant_spans(self.template, conversation, where)
        ids, mask, long = self.encode(conversation, where, text, spans[-1:])
        if not long and not mask.any():
            raise GptkitError(f"{where}: an answer renders to no tokens")
        return ids, mask, long


def answer_text(template, msgs: list[dict], answer: str, where: str) -> str:
    """The text of the conversation followed by `answer` as the assistant's turn (a char/bpe tokenizer is
    built from it)."""
    conversation = Conversation([*msgs, {"role": "assistant", "content": answer}], tools_of(msgs))
    return assistant_spans(template, conversation, where)[0]


@dataclass(frozen=True)
class TemplatedKind:
    """One templated kind: its names, its record reader and its row maker. Everything else (the settings'
    shared checks, reading the files, the tokenizer, the counts, the folder and its load) is the same for
    every kind and written once, here (prepare, load)."""

    # data=<name>; the cache folder's prefix; the word of a not-prepared-<name>-folder error
    name: str
    # the manifest's format and its version (part of the cache key)
    format: str
    format_version: int
    # the settings that only choose rows (no part of the cache key)
    row_keys: tuple[str, ...]
    # (setting, its allowed values), checked in this order
    choices: tuple[tuple[str, tuple[str, ...]], ...]
    # what data.paths holds, for the error when it is empty: "conversations.jsonl,...] (jsonl, json or ..."
    paths: str
    # one record ("conversation": data.paths hold 1 conversation(s)); the manifest's count of them and the
    # word of its counts ("conversations"); the source's description
    record: str
    records: str
    description: str
    # the arrays' file, and the sides of a record ("": one sequence; preference: chosen and rejected)
    npz: str
    sides: tuple[str, ...]
    # (record, where, settings) -> the checked record; a one-line GptkitError naming `where` otherwise
    read_record: Callable[[Any, str, dict[str, Any]], Any]
    # (template, checked record, where) -> the texts a char/bpe tokenizer is built from
    texts: Callable[[Any, Any, str], Iterable[str]]
    # (checked record, where, Encoder) -> one Seq per side (the row maker)
    encode: Callable[[Any, str, Encoder], list[Seq]]
    # the folder's Prepared, made as data(folder, manifest, settings, train, val, records)
    data: Callable[..., Any]
    # (the sides' ChatSplits, where (None: not read), records (None: none kept)) -> the kind's split
    split: Callable[[list[ChatSplit], list[str] | None, list[dict] | None], Any]
    # the manifest's count of the tokens of the mask (None: not counted)
    mask_count: str | None = None
    # (checked record) -> what rows.json keeps of it (the fields a reward reads); None: where.json
    keep: Callable[[Any], dict] | None = None
    # (template, checked record, where) -> the record rendered once, read by texts and encode
    render: Callable[[Any, Any, str], Any] | None = None
    # where.json is read when a row is traced (the folders of an older gptkit have none), not at load
    lazy_where: bool = False
    # what `<files>: no ...` says of files without a record (None: records)
    none: str | None = None

    def check(self, s: dict[str, Any]) -> dict[str, Any]:
        """The kind's complete settings, checked (one-line errors)."""
        for key, allowed in self.choices:
            if s[key] not in allowed:
                raise GptkitError(f"data.{key}={s[key]!r} is not one of {', '.join(allowed)}")
        if not s["paths"]:
            raise GptkitError(f"data={self.name} needs data.paths=[{self.paths})")
        if s["val_paths"] is None and not 0.0 < float(s["val_fraction"]) < 1.0:
            raise GptkitError(f"data.val_fraction={s['val_fraction']} must be between 0 and 1 (exclusive)")
        allows_special_text(s)
        return s

    def read(self, files: list[Path], s: dict[str, Any]) -> list[tuple[str, Any]]:
        """Every record of the files as (file:row, checked record); none at all is an error."""
        # data.hf.columns: the dataset's columns under gptkit's field names
        mapping = hub_files.columns(s.get("hf"))
        out = [
            (where, self.read_record(hub_files.renamed(rec, mapping), where, s))
            for f in files
            for where, rec in records(f, s["format"])
        ]
        if not out:
            raise GptkitError(f"{', '.join(map(str, files))}: no {self.none or self.records}")
        return out

    def counts(self, encoded: list[tuple[str, list[Seq], Any]]) -> dict[str, int]:
        """The manifest's counts of one split: records, tokens (every side), the mask's tokens, long
        records (one side long)."""
        seqs = [seq for _, sides, _ in encoded for seq in sides]
        out = {self.records: len(encoded), "tokens": sum(len(ids) for ids, _, _ in seqs)}
        if self.mask_count:
            out[self.mask_count] = sum(int(m.sum()) for _, m, _ in seqs)
        out["long"] = sum(any(long for _, _, long in sides) for _, sides, _ in encoded)
        return out

    def prefix(self, split: str, side: str) -> str:
        """The arrays' names of one side of a split in the .npz (sequence_arrays)."""
        return f"{split}_{side}" if side else split

    def prepare(self, s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> Any:
        """Records -> token ids and masks of each side (train and val), the tokenizer (with the template's
        special tokens) and the template, cached by (files, settings, tokenizer, template). Every bad record
        is a one-line GptkitError naming its file and row, raised before anything is written."""
        build = TemplatedBuild.open(self.name, self.check(s), tok, opts, self.row_keys, self.format_version)
        cached = build.cached(self.load)
        if cached is not None:
            return cached
        # one process builds (another node on a shared cache waits for it, then reads its folder)
        with one_builder(opts.cache, build.folders[-1].name):
            cached = build.cached(self.load)
            return cached if cached is not None else self.build_folder(build, opts)

    def build_folder(self, build: TemplatedBuild, opts: BuildOptions) -> Any:
        """The folder of `build`, written now (prepare holds its one_builder lock)."""
        s, template = build.s, build.template
        train = self.read(build.train_files, s)
        every = train + (self.read(build.val_files, s) if build.val_files else [])
        if self.render is not None:
            every = [(where, self.render(template, r, where)) for where, r in every]
        tokenizer, added = build.tokenizer(lambda: (t for w, r in every for t in self.texts(template, r, w)))
        limit = RowLimit(opts.row_limit, tokenizer, build.tok)
        enc = Encoder(tokenizer, template, limit, build.allow_special_text)
        # (where, a Seq per side, what rows.json keeps): only what was encoded of the texts is kept
        encoded = [
            (where, self.encode(r, where, enc), None if self.keep is None else self.keep(r))
            for where, r in every
        ]
        every.clear()
        n_train = build.n_train(len(train), self.record)
        splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
        counts = {k: self.counts(v) for k, v in splits.items()}
        manifest = build.manifest(
            self.format, self.format_version, self.description, tokenizer, added, limit, counts
        )
        arrays = {
            k: a
            for split, v in splits.items()
            for i, side in enumerate(self.sides)
            for k, a in sequence_arrays(self.prefix(split, side), [sides[i] for _, sides, _ in v]).items()
        }
        # each record's file and line (`gptkit trace`), and what is kept of it
        if self.keep is None:
            extra = {"where.json": json.dumps({k: [w for w, _, _ in v] for k, v in splits.items()})}
        else:
            kept = {
                k: {"rows": [r for _, _, r in v], "where": [w for w, _, _ in v]} for k, v in splits.items()
            }
            extra = {"rows.json": json.dumps(kept)}
        return build.publish(manifest, {self.npz: arrays}, tokenizer, self.load, added, extra=extra)

    def load(self, folder: Path, settings: dict[str, Any]) -> Any:
        """A prepared folder (manifest.json, the .npz, where.json or rows.json), checked against its manifest
        (check_folder: the checksum, each file's CRC-32, so also the tokenizer's) and the arrays and records
        against its counts."""
        manifest = check_folder(folder, self.format, self.name)
        try:
            side = None
            if self.keep is not None:
                side = json.loads((folder / "rows.json").read_text(encoding="utf-8"))
            elif not self.lazy_where:
                side = json.loads((folder / "where.json").read_text(encoding="utf-8"))
            with np.load(folder / self.npz) as z:
                seqs = {k: [ChatSplit.from_arrays(z, self.prefix(k, s)) for s in self.sides] for k in SPLITS}
            splits = {
                k: self._split(manifest["splits"][k], seqs[k], None if side is None else side[k])
                for k in SPLITS
            }
        # a file the manifest's CRC-32 matches, and yet not what this gptkit wrote (or a bug)
        except Exception as exc:  # noqa: BLE001 - np.load and json fail in many ways on a damaged file
            raise GptkitError(f"{folder} is damaged ({self.npz}: {str(exc)[:160]}); {REBUILD}") from None
        check_tokenizer_file(folder, manifest)
        return self.data(folder, manifest, settings, splits["train"], splits["val"], self.records)

    def _split(self, counts: dict[str, Any], seqs: list[ChatSplit], side: Any) -> Any:
        """One split of a folder, its arrays checked against the manifest's counts (ValueError if not)."""
        n, tokens = counts[self.records], int(counts["tokens"])
        for part in seqs:
            check_split(part, n, tokens if len(seqs) == 1 else len(part.ids), self.records)
        if sum(len(part.ids) for part in seqs) != tokens:
            raise ValueError(f"its arrays do not hold the {n:,} {self.records} of its manifest")
        rows, where = (side["rows"], side["where"]) if self.keep is not None else (None, side)
        if any(x is not None and len(x) != n for x in (rows, where)):
            raise ValueError(f"its records do not hold the {n:,} {self.records} of its manifest")
        return self.split(seqs, where, rows)
