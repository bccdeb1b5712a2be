"""Unpaired labelled completions for KTO (data=unpaired, objective=kto): a prompt, one completion and whether
it is desirable.

    records (jsonl / json / parquet, read as data=chat reads them)
        prompt + completion + label (+ system)        strings, label true (desirable) or false
        messages + completion + label                 the conversation so far, then the assistant's answer
      -> checked (the label a JSON boolean, the completion non-empty text, the conversation as data=chat
         checks it; file and row named in every error)
      -> the completion rendered after the conversation with the chat template, as the assistant's next turn
         (gptkit.data.templated's Encoder.answer): token ids + a mask on the completion's tokens only
      -> cached (UnpairedData; the build, the folder and its load are every templated kind's: KIND), the
         labels kept in rows.json
      -> rows of seq_len + 1 tokens, one completion per row, padded (UnpairedRows)
      -> batches (x, y, kl_x, kl_y, labels): x, y [batch_size, seq_len] the rows (targets -100 outside the
         completion), kl_x, kl_y the same prompts each followed by the completion of the previous row of the
         micro-step's rows over all the ranks (rank 0's first; the last row's for the first: TRL's KTO
         "cycled" mismatched pairs, which estimate the KL reference point, taken over the global micro-batch
         rather than TRL's per-device one, so that the pairs do not depend on how the rows are split over the
         ranks: on one process they are TRL's), labels [batch_size] bool

A row longer than seq_len + 1 tokens is a one-line error naming its file and row (data.truncate=error) or
left out (drop; counted at start-up). A mismatched row longer than a row is cut to it, as TRL truncates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gptkit.data.face import Feed, Origin, Span
from gptkit.data.records import prompt_conversation
from gptkit.data.row_sampler import RowSampler
from gptkit.data.templated import (
    ChatSplit,
    TemplatedData,
    TemplatedKind,
    answer_text,
    check_row_limit,
    first_val,
    lost,
    shown,
    split_where,
)
from gptkit.errors import GptkitError

TRUNCATE = ("error", "drop")
TOO_FEW = (
    "the unpaired data makes {n} training rows, fewer than a global batch of {batch}; give more records or "
    "a smaller trainer.batch_size"
)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=unpaired is KTO's labelled completions (a KTO run's val/loss "
    "is in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


# ---- the record reader and the row maker -----------------------------------------------------------------
def unpaired_record(rec: Any, where: str, s: dict[str, Any]) -> tuple[list[dict[str, Any]], str, bool]:
    """(the conversation before the completion, the completion, its label), checked; GptkitError naming
    `where` otherwise."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    cf, lf = s["completion_field"], s["label_field"]
    if rec.get(lf) is None:
        raise GptkitError(
            f"{where}: a KTO record needs a {lf} (data.label_field): true for a desirable completion, false "
            f"for an undesirable one; it has none (fields: {', '.join(map(str, rec)) or 'none'})"
        )
    if not isinstance(rec[lf], bool):
        raise GptkitError(f"{where}: {lf} must be true or false, got {rec[lf]!r}")
    if rec.get(cf) is None:
        raise GptkitError(
            f"{where}: a KTO record needs a {cf} (data.completion_field), the assistant's answer; it has "
            f"none (fields: {', '.join(map(str, rec))})"
        )
    if not isinstance(rec[cf], str) or not rec[cf].strip():
        raise GptkitError(f"{where}: {cf} must be non-empty text (the assistant's answer)")
    ends = "it holds the conversation before the completion, which is the assistant's next turn"
    msgs = prompt_conversation(rec, where, s, ends, "a KTO record", " before its completion")
    return msgs, rec[cf], rec[lf]


@dataclass
class UnpairedSplit:
    """One split of prepared rows: the sequences, each one's label and where it came from."""

    seqs: ChatSplit
    labels: list[bool]
    where: list[str]

    @property
    def n(self) -> int:
        return self.seqs.n


class UnpairedData(TemplatedData):
    """Tokenized labelled completions (train and val: UnpairedSplit): what data=unpaired prepares."""

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Batches of rows with their mismatched rows and labels, drawn by (seed, step, rank); the val rows
        batched the same way, each row's index in the set last (the objective counts each once)."""
        s = self.settings
        check_row_limit(self, seq_len, "completions")
        train, val = (
            make_unpaired_rows(split, seq_len, s["truncate"], self.pad_id) for split in (self.train, self.val)
        )
        # the val rows by index: a val batch is made of them (val.batch), each row's index last
        items = list(range(first_val(len(val), val_windows)))
        sampler = UnpairedSampler(train, batch_size, seed, TOO_FEW)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            show = shown(self, chars)
            out = []
            for j, r in enumerate(sampler.mine(step, rank, world_size)):
                i = train.index[int(r)]
                source, where = split_where(self.train.where[i])
                label = "a desirable" if train.labels[int(r)] else "an undesirable"
                n = len(train.answers[int(r)])
                span = Span(i, source, f"{where}, {label} completion", n)
                out.append(
                    Origin(
                        j, None, f"row {int(r):,} of {len(train):,}", [span], show(train.row(int(r))[0][:-1])
                    )
                )
            return out

        return Feed(
            sampler,
            items,
            collate=lambda rows: val.batch(rows, index=True),
            lines=[describe_rows(train, val, seq_len, s)],
            tracer=tracer,
        )


KIND = TemplatedKind(
    name="unpaired",
    read_record=unpaired_record,
    texts=lambda template, r, where: [answer_text(template, r[0], r[1], where)],
    encode=lambda r, where, enc: [enc.answer(r[0], r[1], where)],
    data=UnpairedData,
    split=lambda seqs, where, rows: UnpairedSplit(seqs[0], [bool(x["label"]) for x in rows], where),
    keep=lambda r: {"label": bool(r[2])},
    npz="unpaired.npz",
    sides=("",),
    mask_count="completion_tokens",
    format="gptkit-unpaired",
    format_version=1,
    row_keys=("truncate",),
    choices=(("truncate", TRUNCATE),),
    paths="completions.jsonl,...] (jsonl, json or parquet files of prompt/messages, completion and label",
    record="completion",
    records="completions",
    description="labelled completions",
    none="labelled completions",
)


# ---- rows and batches -------------------------------------------------------------------------------------
class UnpairedSampler(RowSampler):
    """RowSampler's rows, each with its mismatched completion: that of the previous row of micro-step
    `step`'s rows over all the ranks (cyclic), the same pairs whatever the world size."""

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        picked = self.picked(step, world_size)  # [batch_size * world_size]
        mates = np.roll(picked, 1)
        mine = slice(rank * self.batch_size, (rank + 1) * self.batch_size)
        return self.rows.batch(picked[mine], mates=mates[mine])


@dataclass
class UnpairedRows:
    """The rows of a split: each one's prompt tokens and completion tokens (with the mask of what follows
    the prompt: 1 on the completion's tokens), its label and its index in the split."""

    prompts: list[np.ndarray]
    answers: list[np.ndarray]
    masks: list[np.ndarray]
    labels: list[bool]
    seq_len: int
    pad_id: int
    dropped: int = 0
    first_dropped: str | None = None
    index: list[int] = field(default_factory=list)

    @property
    def cut(self) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.prompts)

    def row(self, i: int, answer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) [seq_len + 1] of row i's prompt followed by row `answer`'s completion (its own when
        None), cut to the row and padded."""
        j = i if answer is None else answer
        ids = np.concatenate([self.prompts[i], self.answers[j]])[: self.seq_len + 1]
        mask = np.concatenate([np.zeros(len(self.prompts[i]), dtype=bool), self.masks[j]])[: self.seq_len + 1]
        fill = self.seq_len + 1 - len(ids)
        ids = np.concatenate([ids, np.full(fill, self.pad_id, dtype=np.int64)])
        mask = np.concatenate([mask, np.zeros(fill, dtype=bool)])
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def batch(self, rows, index: bool = False, mates=None):
        """(x, y, kl_x, kl_y [n, seq_len], labels [n] bool (, the rows' indices [n])) of rows: kl row k is
        row k's prompt with the completion of row mates[k] (by default row k-1's, row n-1's for k = 0; a
        batch of one: its own)."""
        rows = [int(r) for r in rows]
        mates = [rows[k - 1] for k in range(len(rows))] if mates is None else [int(m) for m in mates]
        own = [self.row(r) for r in rows]
        mismatched = [self.row(r, m) for r, m in zip(rows, mates)]

        def xy(parts):
            ids = torch.stack([p[0] for p in parts])  # [n, seq_len + 1]
            mask = torch.stack([p[1] for p in parts])
            y = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
            return ids[:, :-1].contiguous(), y

        x, y = xy(own)
        kl_x, kl_y = xy(mismatched)
        labels = torch.tensor([self.labels[r] for r in rows], dtype=torch.bool)
        out = (x, y, kl_x, kl_y, labels)
        return (*out, torch.tensor(rows, dtype=torch.long)) if index else out


def make_unpaired_rows(split: UnpairedSplit, seq_len: int, truncate: str, pad_id: int) -> UnpairedRows:
    """Each record as a prompt and a completion (split where its mask starts); one longer than a row of
    seq_len + 1 tokens: a one-line error (truncate=error) or left out (drop)."""
    width = seq_len + 1
    out = UnpairedRows([], [], [], [], seq_len, pad_id)
    for i in range(split.n):
        a, b = int(split.seqs.offsets[i]), int(split.seqs.offsets[i + 1])
        ids = split.seqs.ids[a:b].astype(np.int64)
        mask = split.seqs.mask[a:b].astype(bool)
        if len(ids) > width or split.seqs.is_long(i):
            if truncate == "error":
                raise GptkitError(
                    f"{split.where[i]}: the prompt with its completion makes "
                    f"{'more than ' if split.seqs.is_long(i) else ''}{len(ids)} tokens, more than a row of "
                    f"{width} (trainer.seq_len + 1); use data.truncate=drop, or a longer trainer.seq_len / "
                    "model.max_seq_len"
                )
            out.dropped += 1
            out.first_dropped = out.first_dropped or split.where[i]
            continue
        start = int(np.argmax(mask)) if mask.any() else len(ids)
        out.prompts.append(ids[:start])
        out.answers.append(ids[start:])
        out.masks.append(mask[start:])
        out.labels.append(bool(split.labels[i]))
        out.index.append(i)
    if not out.prompts and split.n:
        raise GptkitError(
            f"every completion is longer than a row of {width} tokens and data.truncate={truncate} left them "
            "all out; use a longer trainer.seq_len / model.max_seq_len"
        )
    return out


def describe_rows(train: UnpairedRows, val: UnpairedRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: rows, the desirable share, rows dropped."""
    gone, first = lost(train, val), train.first_dropped or val.first_dropped
    over = (
        f"; completions longer than {seq_len + 1} tokens: {', '.join(gone)} (data.truncate={s['truncate']}"
        + (f", first dropped: {first}" if first else "")
        + ")"
        if gone
        else f"; no completion is longer than {seq_len + 1} tokens"
    )
    good = sum(train.labels)
    return (
        f"unpaired data: {len(train):,} train completions ({good:,} desirable, {len(train) - good:,} "
        f"undesirable; rows of {seq_len}, each with a mismatched row for the KL estimate), {len(val):,} val"
        f"{over}"
    )
