"""Chat / instruction data (data=chat): conversations rendered with a chat template, loss on the assistant's
tokens.

    records (jsonl / json / parquet)  messages: [{role, content}, ...]   or   prompt + response (+ system)
      -> checked (roles, an assistant turn, file and row named in every error: gptkit.data.records)
      -> rendered with a chat template (gptkit.chat_templates: Jinja, as transformers renders it)
      -> token ids + an assistant mask per token, cached (ChatData); a conversation longer than the longest
         row a run can train on (model.max_seq_len + 1: RowLimit) is measured on prefixes, never encoded
         whole, and kept as its first tokens, flagged long
      -> rows of seq_len + 1 tokens: packed (data.pack=documents, with doc_ids) or one per row (pad)
      -> batches (x, y[, doc_ids]) whose targets are -100 outside the assistant's turns
         (data.train_on=assistant)

Templates (data.template): `auto` takes the template saved with the tokenizer (a run's chat.json, or the
chat_template of a transformers folder's tokenizer_config.json / chat_template.jinja); `chatml` and `llama3`
are built in, and their special tokens are added to a tokenizer that lacks them; any other value is a file
(.jinja, or a tokenizer_config.json / chat.json holding one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat_templates import (
    CHAT_FILE,
    add_special_tokens,
    assistant_spans,
    encode_conversation,
    resolve_template,
)
from gptkit.data.build import cutter_for
from gptkit.data.cache import REBUILD, check_folder, publish_folder, templated_folder
from gptkit.data.console import say
from gptkit.data.face import MANIFEST, TOKENIZER, BuildOptions, Feed, Prepared
from gptkit.data.files import expand_paths, spelled_in
from gptkit.data.records import conversation, records
from gptkit.data.settings import allows_special_text, keyed_special_text
from gptkit.errors import GptkitError
from gptkit.tokenizer import (
    TokenizerSpec,
    build_tokenizer,
    file_sha256,
    spec_special_tokens,
    tokenizer_sha256,
)

# torch is imported where a batch is made.

TRAIN_ON = ("assistant", "all")
# data.pack of conversations: several whole conversations in a row, or one (the rest padding)
ROW_PACKS = ("documents", "pad")
TRUNCATE = ("drop", "cut")
FORMAT = "gptkit-chat"
# 2: the manifest's checksum and its files' CRC-32; conversations longer than a row kept as their first
# row_limit tokens, flagged long. Part of the cache key: a folder of version 1 is not read, the data is
# prepared again from its files (a cache; version 1 could not tell a damaged folder from a good one)
FORMAT_VERSION = 2
# a text of at most this many characters per token of the longest row is encoded whole (it may fit, and
# costs what a row costs); a longer one is first measured on prefixes (RowLimit)
WHOLE_CHARS_PER_TOKEN = 8
# how rows are made from the tokens: no part of the cache key
ROW_KEYS = ("train_on", "pack", "truncate")
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=chat is conversations (a data=chat run's val/loss, on the "
    "assistant's tokens, is in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


def read_conversations(files: list[Path], s: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every conversation of the files as (file:row, messages), checked; none at all is an error."""
    out = [(where, conversation(rec, where, s)) for f in files for where, rec in records(f, s["format"])]
    if not out:
        raise GptkitError(f"{', '.join(map(str, files))}: no conversations")
    return out


# ---- the prepared (cached) form --------------------------------------------------------------------------
@dataclass
class ChatSplit:
    """One split of prepared chat data: the tokens of every conversation, the loss mask, and the offsets."""

    ids: np.ndarray  # [n_tokens] every conversation's tokens, one after another
    mask: np.ndarray  # [n_tokens] uint8: 1 on the assistant's tokens
    offsets: np.ndarray  # [n_conversations + 1] where each conversation starts in ids
    # [n_conversations] bool: longer than the folder's row_limit, only its first row_limit tokens kept
    long: np.ndarray | None = None

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

    def table(self) -> list[tuple[str, str]]:
        rows = super().table()
        return rows[:1] + [("template", str(self.manifest["template"]))] + rows[1:]


@dataclass
class ChatData(TemplatedData):
    """Tokenized conversations (train and val), their tokenizer and template: what data=chat prepares."""

    train: ChatSplit
    val: ChatSplit

    def counts(self) -> str:
        tr, va = self.manifest["splits"]["train"], self.manifest["splits"]["val"]
        return (
            f"template {self.manifest['template']}: {tr['conversations']:,} train / {va['conversations']:,} "
            f"val conversations, {tr['tokens']:,} train tokens{long_note(self.manifest, 'conversations')}"
        )

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Rows of whole conversations (make_rows), drawn by (seed, step, rank) as windows are; the first
        val_windows val rows (batched by the loader), untagged."""
        s = {**self.settings, "pack": pack or self.settings["pack"]}
        if s["pack"] not in ROW_PACKS:
            raise GptkitError(f"data.pack={s['pack']!r} is not one of {', '.join(ROW_PACKS)}")
        check_row_limit(self, seq_len, "conversations")
        train, val = (
            make_rows(split, seq_len, s["pack"], s["train_on"], s["truncate"], self.pad_id)
            for split in (self.train, self.val)
        )
        n_val = len(val) if val_windows is None else min(len(val), int(val_windows))
        # rows of [seq_len] tensors, batched by the loader
        rows = [val.batch(i) for i in range(n_val)]
        return Feed(ChatSampler(train, batch_size, seed), rows, lines=[describe_rows(train, val, seq_len, s)])


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


def check_settings(s: dict[str, Any]) -> dict[str, Any]:
    """data=chat's complete settings, checked (one-line errors)."""
    for key, allowed in (("train_on", TRAIN_ON), ("pack", ROW_PACKS), ("truncate", TRUNCATE)):
        if s[key] not in allowed:
            raise GptkitError(f"data.{key}={s[key]!r} is not one of {', '.join(allowed)}")
    if not s["paths"]:
        raise GptkitError(
            "data=chat needs data.paths=[conversations.jsonl,...] (jsonl, json or parquet files)"
        )
    if s["val_paths"] is None and not 0.0 < float(s["val_fraction"]) < 1.0:
        raise GptkitError(f"data.val_fraction={s['val_fraction']} must be between 0 and 1 (exclusive)")
    allows_special_text(s)
    return s


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


def prepare_chat(s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> ChatData:
    """Conversations -> token ids + assistant masks (train and val), the tokenizer (with the template's
    special tokens) and the template, cached by (files, settings, tokenizer, template). Every bad record is
    a one-line GptkitError naming its file and row, raised before anything is written."""
    s = check_settings(s)
    train_files = expand_paths(s["paths"], "data.paths")
    val_files = expand_paths(s["val_paths"], "data.val_paths") if s["val_paths"] else []
    template = template_for(s["template"], tok)
    files = train_files + val_files
    folders, key, content = templated_folder(
        "chat",
        key_settings(s, tok, template, files),
        ROW_KEYS,
        FORMAT_VERSION,
        tok,
        template,
        files,
        opts.cache,
        opts.force,
        opts.row_limit,
    )
    for folder in folders:
        if (folder / MANIFEST).is_file():
            data = load_chat(folder, s)
            say(f"cache hit: {folder} ({data.counts()})")
            return data

    convs = read_conversations(train_files, s)
    val_convs = read_conversations(val_files, s) if val_files else []
    rendered = [(where, m, assistant_spans(template, m, where)) for where, m in convs + val_convs]
    if tok.built_from_corpus:
        tokenizer = build_tokenizer(tok, lambda: (text for _, _, (text, _) in rendered), progress=False)
    else:
        tokenizer = build_tokenizer(tok)
    added = add_special_tokens(tokenizer, template)
    allow = s["special_tokens_in_content"] == "allow"
    limit = RowLimit(opts.row_limit, tokenizer, tok)
    # (ids, mask, long) of each conversation, as arrays: what is kept
    encoded = []
    for where, m, (text, spans) in rendered:
        cut, cut_spans, long = limit.fit(text, spans)
        ids, mask = encode_conversation(
            tokenizer, template, m, where, rendered=(cut, cut_spans), prefix=long, allow_special_text=allow
        )
        if long:
            ids, mask = ids[: limit.tokens], mask[: limit.tokens]
        elif spans and not any(mask):
            raise GptkitError(f"{where}: the assistant's text renders to no tokens")
        encoded.append((np.asarray(ids, dtype=np.uint32), np.asarray(mask, dtype=np.uint8), long))
    # the texts: only what was encoded of them is kept
    rendered.clear()
    n_train = len(convs)
    # the last val_fraction of the conversations (at least one each)
    if not val_files:
        n_train = min(n_train - 1, max(1, round(n_train * (1 - float(s["val_fraction"])))))
        if n_train < 1:
            raise GptkitError(
                f"data.paths hold {len(convs)} conversation(s); data=chat needs at least 2 "
                "(one for validation) or data.val_paths"
            )
    splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "source": {
            "kind": "chat",
            "description": "chat conversations from "
            f"{', '.join(map(str, train_files))}"
            + (f" (val: {', '.join(map(str, val_files))})" if val_files else ""),
            "sha256": content,
        },
        "template": template.name,
        "added_tokens": added,
        "tokenizer": tokenizer_record(tokenizer, tok, template),
        # conversations longer than this many tokens are kept as their first this many (long)
        "row_limit": limit.tokens,
        "splits": {
            k: {
                "conversations": len(v),
                "tokens": sum(len(ids) for ids, _, _ in v),
                "loss_tokens": sum(int(m.sum()) for _, m, _ in v),
                "long": sum(long for _, _, long in v),
            }
            for k, v in splits.items()
        },
    }
    arrays = {}
    for k, v in splits.items():
        arrays[f"{k}_ids"] = np.concatenate([ids for ids, _, _ in v] or [np.zeros(0, np.uint32)])
        arrays[f"{k}_mask"] = np.concatenate([m for _, m, _ in v] or [np.zeros(0, np.uint8)])
        arrays[f"{k}_offsets"] = np.cumsum([0] + [len(ids) for ids, _, _ in v], dtype=np.int64)
        arrays[f"{k}_long"] = np.array([long for _, _, long in v], dtype=np.uint8)
    # a folder that holds long conversations is of this row limit; without any, of every one
    final = folders[0] if manifest_longs(manifest) else folders[-1]
    publish_folder(opts.cache, final, {"conversations.npz": arrays}, tokenizer, template, manifest)
    data = load_chat(final, s)
    note = f"; added {', '.join(added)} to the tokenizer" if added else ""
    say(f"prepared {final} ({data.counts()}{note})")
    return data


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


def load_chat(folder: Path, settings: dict[str, Any]) -> ChatData:
    """A prepared chat folder (manifest.json + conversations.npz), checked against its manifest (check_folder:
    the checksum, each file's CRC-32, so also the tokenizer's) and the arrays against its counts."""
    manifest = check_folder(folder, FORMAT, "chat")
    try:
        with np.load(folder / "conversations.npz") as z:
            splits = {
                k: ChatSplit(z[f"{k}_ids"], z[f"{k}_mask"], z[f"{k}_offsets"], z[f"{k}_long"].astype(bool))
                for k in ("train", "val")
            }
        for k, split in splits.items():
            check_split(split, manifest["splits"][k]["conversations"], manifest["splits"][k]["tokens"])
    # a file the manifest's CRC-32 matches, and yet not what this gptkit wrote (or a bug)
    except Exception as exc:  # noqa: BLE001 - np.load fails in many ways on a damaged file
        raise GptkitError(f"{folder} is damaged (conversations.npz: {str(exc)[:160]}); {REBUILD}") from None
    check_tokenizer_file(folder, manifest)
    return ChatData(folder, manifest, settings, splits["train"], splits["val"])


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


# ---- rows and batches ------------------------------------------------------------------------------------
@dataclass
class ChatRows:
    """Training rows: x, y [N, seq_len] int64 (y = -100 where no loss), doc_ids [N, seq_len] int32
    (data.pack=documents)."""

    x: Any
    y: Any
    # None with data.pack=pad
    doc_ids: Any | None
    # conversations longer than a row, cut (data.truncate=cut)
    cut: int
    # conversations longer than a row, left out (drop; or cut before any assistant token)
    dropped: int
    conversations: int

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def loss_share(self) -> float:
        return float((self.y != -100).float().mean()) if len(self) else 0.0

    def batch(self, rows):
        out = (self.x[rows], self.y[rows])
        return out if self.doc_ids is None else (*out, self.doc_ids[rows])


def make_rows(
    split: ChatSplit, seq_len: int, pack: str, train_on: str, truncate: str, pad_id: int
) -> ChatRows:
    """Conversations as rows of seq_len + 1 tokens (inputs: the first seq_len, targets: the last seq_len).
    pack=documents fills each row with whole conversations in order (a conversation that does not fit starts
    the next row); pad puts one conversation in each row. The rest of a row is padding (pad_id, no loss, its
    own document). A conversation longer than a row is cut to it or dropped (truncate); one cut before any
    assistant token is dropped. A target carries loss when its token is the assistant's (train_on=assistant)
    or any token of the same conversation (all)."""
    import torch

    width = seq_len + 1
    rows_ids: list[np.ndarray] = []
    rows_mask: list[np.ndarray] = []
    rows_doc: list[np.ndarray] = []
    cur_ids: list[np.ndarray] = []
    cur_mask: list[np.ndarray] = []
    cur_doc: list[np.ndarray] = []
    used = cut = dropped = 0

    def close_row() -> None:
        nonlocal used
        if not cur_ids:
            return
        fill = width - used
        ids = np.concatenate(cur_ids + [np.full(fill, pad_id, dtype=np.int64)])
        mask = np.concatenate(cur_mask + [np.zeros(fill, dtype=np.uint8)])
        doc = np.concatenate(cur_doc + [np.full(fill, len(cur_doc), dtype=np.int32)])
        rows_ids.append(ids)
        rows_mask.append(mask)
        rows_doc.append(doc)
        cur_ids.clear()
        cur_mask.clear()
        cur_doc.clear()
        used = 0

    for i in range(split.n):
        a, b = int(split.offsets[i]), int(split.offsets[i + 1])
        ids, mask = split.ids[a:b].astype(np.int64), split.mask[a:b].copy()
        if train_on == "all":
            mask[:] = 1
        # a long one: its first row_limit >= width tokens kept
        if len(ids) > width or split.is_long(i):
            if truncate == "drop":
                dropped += 1
                continue
            ids, mask = ids[:width], mask[:width]
            if not mask[1:].any():
                dropped += 1
                continue
            cut += 1
        if pack == "pad" or used + len(ids) > width:
            close_row()
        cur_ids.append(ids)
        cur_mask.append(mask)
        cur_doc.append(np.full(len(ids), len(cur_doc), dtype=np.int32))
        used += len(ids)
    close_row()
    if not rows_ids:
        raise GptkitError(
            f"every conversation is longer than a row of {width} tokens and data.truncate=drop "
            "left them all out; use data.truncate=cut or a longer trainer.seq_len / "
            "model.max_seq_len"
        )
    ids = torch.from_numpy(np.stack(rows_ids))  # [N, seq_len + 1]
    mask = torch.from_numpy(np.stack(rows_mask)).bool()  # [N, seq_len + 1]
    doc = torch.from_numpy(np.stack(rows_doc))  # [N, seq_len + 1]
    # a target in the same conversation as its input
    same_doc = doc[:, 1:] == doc[:, :-1]
    y = torch.where(mask[:, 1:] & same_doc, ids[:, 1:], torch.full_like(ids[:, 1:], -100))  # [N, seq_len]
    x = ids[:, :-1].contiguous()  # [N, seq_len]
    docs = doc[:, :-1].contiguous() if pack == "documents" else None
    return ChatRows(x, y.contiguous(), docs, cut, dropped, split.n)


class ChatSampler:
    """The rows of micro-step `step` are a pure function of (seed, step, rank, world_size), as WindowSampler's
    windows: a resumed run sees exactly the batches an uninterrupted one would."""

    def __init__(self, rows: ChatRows, batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.seed = rows, int(batch_size), int(seed)

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        n = self.batch_size * world_size
        if n > len(self.rows):
            raise GptkitError(
                f"the chat data makes {len(self.rows)} training rows, fewer than a global "
                f"batch of {n}; give more conversations or a smaller trainer.batch_size"
            )
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        picked = rng.choice(len(self.rows), size=n, replace=False)  # [batch_size * world_size], distinct
        picked = picked[rank * self.batch_size : (rank + 1) * self.batch_size]
        return self.rows.batch(picked)


def describe_rows(train: ChatRows, val: ChatRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: rows, the share of target positions that carry loss, conversations cut or
    dropped."""
    # train and val together
    cut, dropped = train.cut + val.cut, train.dropped + val.dropped
    lost = ([f"{cut} cut"] if cut else []) + ([f"{dropped} dropped"] if dropped else [])
    over = (
        f"; conversations longer than {seq_len + 1} tokens: {', '.join(lost)} (data.truncate={s['truncate']})"
        if lost
        else f"; no conversation is longer than {seq_len + 1} tokens"
    )
    return (
        f"chat data: {train.conversations:,} train conversations in {len(train):,} rows of {seq_len} "
        f"(data.pack={s['pack']}), {val.conversations:,} val in {len(val):,}; {train.loss_share():.1%} "
        f"of the train targets carry loss (data.train_on={s['train_on']}){over}"
    )
