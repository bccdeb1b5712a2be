"""Chat / instruction data (data=chat): conversations rendered with a chat template, loss on the assistant's
tokens.

    records (jsonl / json / parquet)  messages: [{role, content}, ...]   or   prompt + response (+ system)
      -> checked (roles, an assistant turn, file and row named in every error: gptkit.data.records)
      -> rendered with a chat template (gptkit.chat_templates: Jinja, as transformers renders it)
      -> token ids + an assistant mask per token (encode), cached (ChatData; the build, the folder and its
         load are every templated kind's: gptkit.data.templated, KIND); a conversation longer than the
         longest row a run can train on (model.max_seq_len + 1: RowLimit) is measured on prefixes, never
         encoded whole, and kept as its first tokens, flagged long
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
from typing import Any

import numpy as np

from gptkit.chat_templates import assistant_spans
from gptkit.data.face import Feed, Origin, Span
from gptkit.data.records import conversation
from gptkit.data.row_sampler import RowSampler
from gptkit.data.templated import (
    ChatSplit,
    Encoder,
    Seq,
    TemplatedData,
    TemplatedKind,
    check_row_limit,
    first_val,
    lost,
    shown,
    split_where,
)
from gptkit.errors import GptkitError

# torch is imported where a batch is made.

TRAIN_ON = ("assistant", "all")
# data.pack of conversations: several whole conversations in a row, or one (the rest padding)
ROW_PACKS = ("documents", "pad")
TRUNCATE = ("drop", "cut")
# each conversation's file and line, by split (written since issue 39; an older folder has none)
WHERE = "where.json"
# the one line of a global batch larger than the rows
TOO_FEW = (
    "the chat data makes {n} training rows, fewer than a global batch of {batch}; give more conversations "
    "or a smaller trainer.batch_size"
)
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=chat is conversations (a data=chat run's val/loss, on the "
    "assistant's tokens, is in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


# ---- the record reader and the row maker -----------------------------------------------------------------
def rendered(template, msgs: list[dict[str, Any]], where: str):
    """(messages, (text, the assistant's spans)): a conversation rendered once, read by the tokenizer's
    build and by encode."""
    return msgs, assistant_spans(template, msgs, where)


def encode(conv, where: str, enc: Encoder) -> list[Seq]:
    """The conversation's ids and the assistant's mask (kept as its first row_limit tokens when longer)."""
    msgs, (text, spans) = conv
    ids, mask, long = enc.encode(msgs, where, text, spans)
    if not long and spans and not mask.any():
        raise GptkitError(f"{where}: the assistant's text renders to no tokens")
    return [(ids, mask, long)]


class ChatData(TemplatedData):
    """Tokenized conversations (train and val: ChatSplit), their tokenizer and template: what data=chat
    prepares."""

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
        train, val = chat_rows(self, seq_len, s["pack"])
        # a precomputed teacher (distill.teacher=precomputed): the training rows carry its top-k
        teacher = self.outputs.get("teacher")
        if teacher is not None:
            import torch

            keys = ("train_offsets", "train_ids", "train_logps")
            train.topk = tuple(torch.from_numpy(teacher[k]) for k in keys)
        # rows of [seq_len] tensors, batched by the loader
        rows = [val.batch(i) for i in range(first_val(len(val), val_windows))]
        sampler = RowSampler(train, batch_size, seed, TOO_FEW)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            show = shown(self, chars)
            out = []
            for i, r in enumerate(sampler.mine(step, rank, world_size)):
                spans = [Span(c, *self.where_of(c), n) for c, n in train.held[int(r)]]
                out.append(Origin(i, None, f"row {int(r):,} of {len(train):,}", spans, show(train.x[int(r)])))
            return out

        return Feed(sampler, rows, lines=[describe_rows(train, val, seq_len, s)], tracer=tracer)


KIND = TemplatedKind(
    name="chat",
    read_record=lambda rec, where, s: conversation(rec, where, s),
    render=rendered,
    texts=lambda template, conv, where: [conv[1][0]],
    encode=encode,
    data=ChatData,
    split=lambda seqs, where, rows: seqs[0],
    npz="conversations.npz",
    sides=("",),
    mask_count="loss_tokens",
    lazy_where=True,
    format="gptkit-chat",
    # 2: the manifest's checksum and its files' CRC-32; conversations longer than a row kept as their first
    # row_limit tokens, flagged long. Part of the cache key: a folder of version 1 is not read, the data is
    # prepared again from its files (a cache; version 1 could not tell a damaged folder from a good one)
    format_version=2,
    # how rows are made from the tokens: no part of the cache key
    row_keys=("train_on", "pack", "truncate"),
    choices=(("train_on", TRAIN_ON), ("pack", ROW_PACKS), ("truncate", TRUNCATE)),
    paths="conversations.jsonl,...] (jsonl, json or parquet files",
    record="conversation",
    records="conversations",
    description="chat conversations",
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
    # [N] the conversations (their index in the split) each row holds, in order, and their tokens there
    held: list[list[tuple[int, int]]] = field(default_factory=list)
    # a precomputed teacher's top-k at the label positions (y != -100) of every row, in order: (offsets
    # [N + 1] int64 into ids [M, k] int32 and log-probs [M, k] float32); None: none
    topk: Any = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def loss_share(self) -> float:
        return float((self.y != -100).float().mean()) if len(self) else 0.0

    def batch(self, rows):
        """(x, y[, doc_ids]) of the rows; with a precomputed teacher, then its top-k ids (int64) and
        log-probs (float32) [len(rows), seq_len, k], 0 where there is no label."""
        out = (self.x[rows], self.y[rows])
        out = out if self.doc_ids is None else (*out, self.doc_ids[rows])
        return out if self.topk is None else (*out, *self.dense_topk(rows))

    def dense_topk(self, rows):
        import torch

        offsets, ids, logps = self.topk
        rows = torch.as_tensor(rows).reshape(-1)
        k = ids.shape[1]
        out_ids = torch.zeros(len(rows), self.y.shape[1], k, dtype=torch.int64)
        out_logps = torch.zeros(len(rows), self.y.shape[1], k, dtype=torch.float32)
        for b, r in enumerate(rows.tolist()):
            labels = self.y[r] != -100  # [seq_len]
            a, e = int(offsets[r]), int(offsets[r + 1])
            out_ids[b, labels] = ids[a:e].long()
            out_logps[b, labels] = logps[a:e].float()
        return out_ids, out_logps


def chat_rows(data: ChatData, seq_len: int, pack: str | None = None) -> tuple[ChatRows, ChatRows]:
    """The train and val rows of a run of seq_len (make_rows with the folder's settings; pack: data.pack)."""
    s = data.settings
    check_row_limit(data, seq_len, "conversations")
    pack = pack or s["pack"]
    rows = (
        make_rows(split, seq_len, pack, s["train_on"], s["truncate"], data.pad_id)
        for split in (data.train, data.val)
    )
    return tuple(rows)


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


def describe_rows(train: ChatRows, val: ChatRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: rows, the share of target positions that carry loss, conversations cut or
    dropped."""
    # train and val together
    gone = lost(train, val)
    over = (
        f"; conversations longer than {seq_len + 1} tokens: {', '.join(gone)} (data.truncate={s['truncate']})"
        if gone
        else f"; no conversation is longer than {seq_len + 1} tokens"
    )
    return (
        f"chat data: {train.conversations:,} train conversations in {len(train):,} rows of {seq_len} "
        f"(data.pack={s['pack']}), {val.conversations:,} val in {len(val):,}; {train.loss_share():.1%} "
        f"of the train targets carry loss (data.train_on={s['train_on']}){over}"
    )
