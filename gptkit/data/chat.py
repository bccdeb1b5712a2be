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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.chat_templates import assistant_spans, encode_conversation
from gptkit.data.cache import REBUILD, check_folder
from gptkit.data.face import BuildOptions, Feed, Origin, Span
from gptkit.data.provenance import TextBytes, show
from gptkit.data.records import conversation, records
from gptkit.data.settings import allows_special_text
from gptkit.data.templated import (
    ChatSplit,
    RowLimit,
    TemplatedBuild,
    TemplatedData,
    check_row_limit,
    check_split,
    check_tokenizer_file,
    sequence_arrays,
)
from gptkit.errors import GptkitError
from gptkit.tokenizer import TokenizerSpec

# torch is imported where a batch is made.

TRAIN_ON = ("assistant", "all")
# data.pack of conversations: several whole conversations in a row, or one (the rest padding)
ROW_PACKS = ("documents", "pad")
TRUNCATE = ("drop", "cut")
FORMAT = "gptkit-chat"
# each conversation's file and line, by split (written since issue 39; an older folder has none)
WHERE = "where.json"
# 2: the manifest's checksum and its files' CRC-32; conversations longer than a row kept as their first
# row_limit tokens, flagged long. Part of the cache key: a folder of version 1 is not read, the data is
# prepared again from its files (a cache; version 1 could not tell a damaged folder from a good one)
FORMAT_VERSION = 2
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


@dataclass
class ChatData(TemplatedData):
    """Tokenized conversations (train and val), their tokenizer and template: what data=chat prepares."""

    train: ChatSplit
    val: ChatSplit

    record_name = "conversations"

    def where_of(self, i: int) -> tuple[str | None, str]:
        """(file, "line 12") of train conversation i; (None, "file and line not recorded") for a folder
        prepared before they were (WHERE)."""
        if not hasattr(self, "_where"):
            f = self.dir / WHERE
            self._where = json.loads(f.read_text(encoding="utf-8"))["train"] if f.is_file() else None
        if self._where is None:
            return None, "its file and line are not recorded (prepared by an older gptkit)"
        return split_where(self._where[i])

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
        sampler = ChatSampler(train, batch_size, seed)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            decode = TextBytes(self.tokenizer()).text
            out = []
            for i, r in enumerate(sampler.mine(step, rank, world_size)):
                spans = [Span(c, *self.where_of(c), n) for c, n in train.held[int(r)]]
                text = show(decode(train.x[int(r), : 4 * chars + 8].numpy()), chars)
                out.append(Origin(i, None, f"row {int(r):,} of {len(train):,}", spans, text))
            return out

        return Feed(sampler, rows, lines=[describe_rows(train, val, seq_len, s)], tracer=tracer)


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


def prepare_chat(s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> ChatData:
    """Conversations -> token ids + assistant masks (train and val), the tokenizer (with the template's
    special tokens) and the template, cached by (files, settings, tokenizer, template). Every bad record is
    a one-line GptkitError naming its file and row, raised before anything is written."""
    build = TemplatedBuild.open("chat", check_settings(s), tok, opts, ROW_KEYS, FORMAT_VERSION)
    cached = build.cached(load_chat)
    if cached is not None:
        return cached
    s, template = build.s, build.template
    convs = read_conversations(build.train_files, s)
    val_convs = read_conversations(build.val_files, s) if build.val_files else []
    rendered = [(where, m, assistant_spans(template, m, where)) for where, m in convs + val_convs]
    tokenizer, added = build.tokenizer(lambda: (text for _, _, (text, _) in rendered))
    limit = RowLimit(opts.row_limit, tokenizer, tok)
    # (ids, mask, long) of each conversation, as arrays: what is kept
    encoded = []
    for where, m, (text, spans) in rendered:
        cut, cut_spans, long = limit.fit(text, spans)
        ids, mask = encode_conversation(
            tokenizer,
            template,
            m,
            where,
            rendered=(cut, cut_spans),
            prefix=long,
            allow_special_text=build.allow_special_text,
        )
        if long:
            ids, mask = ids[: limit.tokens], mask[: limit.tokens]
        elif spans and not any(mask):
            raise GptkitError(f"{where}: the assistant's text renders to no tokens")
        encoded.append((np.asarray(ids, dtype=np.uint32), np.asarray(mask, dtype=np.uint8), long))
    # the texts: only what was encoded of them is kept
    rendered.clear()
    n_train = build.n_train(len(convs), "conversation")
    splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
    counts = {
        k: {
            "conversations": len(v),
            "tokens": sum(len(ids) for ids, _, _ in v),
            "loss_tokens": sum(int(m.sum()) for _, m, _ in v),
            "long": sum(long for _, _, long in v),
        }
        for k, v in splits.items()
    }
    manifest = build.manifest(FORMAT, FORMAT_VERSION, "chat conversations", tokenizer, added, limit, counts)
    arrays = {k: v for split, seqs in splits.items() for k, v in sequence_arrays(split, seqs).items()}
    # each conversation's file and line (`gptkit trace`)
    wheres = [where for where, _ in convs + val_convs]
    where = json.dumps({"train": wheres[:n_train], "val": wheres[n_train:]})
    return build.publish(
        manifest, {"conversations.npz": arrays}, tokenizer, load_chat, added, extra={WHERE: where}
    )


def load_chat(folder: Path, settings: dict[str, Any]) -> ChatData:
    """A prepared chat folder (manifest.json + conversations.npz), checked against its manifest (check_folder:
    the checksum, each file's CRC-32, so also the tokenizer's) and the arrays against its counts."""
    manifest = check_folder(folder, FORMAT, "chat")
    try:
        with np.load(folder / "conversations.npz") as z:
            splits = {k: ChatSplit.from_arrays(z, k) for k in ("train", "val")}
        for k, split in splits.items():
            check_split(split, manifest["splits"][k]["conversations"], manifest["splits"][k]["tokens"])
    # a file the manifest's CRC-32 matches, and yet not what this gptkit wrote (or a bug)
    except Exception as exc:  # noqa: BLE001 - np.load fails in many ways on a damaged file
        raise GptkitError(f"{folder} is damaged (conversations.npz: {str(exc)[:160]}); {REBUILD}") from None
    check_tokenizer_file(folder, manifest)
    return ChatData(folder, manifest, settings, splits["train"], splits["val"])


def split_where(where: str) -> tuple[str | None, str]:
    """A record's "<file> line 12" (or record, row) as (file, "line 12")."""
    for word in (" line ", " record ", " row "):
        head, sep, tail = where.rpartition(word)
        if sep:
            return head, f"{word.strip()} {tail}"
    return None, where


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
    # [N] the conversations (their index in the split) each row holds, in order, and their tokens there
    held: list[list[tuple[int, int]]] = field(default_factory=list)

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
    # (conversation, its tokens) of each row, and of the row being filled
    held: list[list[tuple[int, int]]] = []
    cur_held: list[tuple[int, int]] = []
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
        held.append(list(cur_held))
        cur_ids.clear()
        cur_mask.clear()
        cur_doc.clear()
        cur_held.clear()
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
        cur_held.append((i, len(ids)))
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
    return ChatRows(x, y.contiguous(), docs, cut, dropped, split.n, held)


class ChatSampler:
    """The rows of micro-step `step` are a pure function of (seed, step, rank, world_size), as WindowSampler's
    windows: a resumed run sees exactly the batches an uninterrupted one would."""

    def __init__(self, rows: ChatRows, batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.seed = rows, int(batch_size), int(seed)

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The rows of rank `rank`'s micro-batch of micro-step `step`: [batch_size] indices."""
        n = self.batch_size * world_size
        if n > len(self.rows):
            raise GptkitError(
                f"the chat data makes {len(self.rows)} training rows, fewer than a global "
                f"batch of {n}; give more conversations or a smaller trainer.batch_size"
            )
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        picked = rng.choice(len(self.rows), size=n, replace=False)  # [batch_size * world_size], distinct
        return picked[rank * self.batch_size : (rank + 1) * self.batch_size]

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        return self.rows.batch(self.mine(step, rank, world_size))


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
