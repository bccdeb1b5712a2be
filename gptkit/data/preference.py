"""Preference pairs for DPO (data=preference, objective=dpo): a prompt and two answers, chosen and rejected.

    records (jsonl / json / parquet, read as data=chat reads them)
        prompt + chosen + rejected (+ system)        strings
        messages + chosen + rejected                 the conversation so far, then the two assistant answers
      -> checked (both answers present, text, not empty, not equal; the conversation as data=chat checks it;
         file and row named in every error)
      -> each answer rendered after the conversation with the chat template, as the assistant's next turn
         (encode, through gptkit.data.templated's Encoder.answer): token ids + a mask on the answer's tokens
         only (end-of-turn token included)
      -> cached (PreferenceData; the build, the folder and its load are every templated kind's:
         gptkit.data.templated, KIND), split into train and val pairs; an answer longer than the longest row
         a run can train on (model.max_seq_len + 1) is measured, never encoded whole, and kept as its first
         tokens (gptkit.data.templated.RowLimit)
      -> rows of seq_len + 1 tokens, one sequence per row, padded: a pair is two rows (PairRows)
      -> batches (x, y) of [2 * batch_size, seq_len]: rows 2i / 2i + 1 the chosen / rejected answer of
         pair i, targets -100 outside the answer (gptkit.training.dpo reads them so)

A pair longer than a row (prompt + either answer) is a one-line error naming its file and row
(data.truncate=error), left out (drop) or cut to the row (cut; left out when no answer token remains),
the ones left out or cut counted in the start-up line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gptkit.data.face import Feed, Origin, Span
from gptkit.data.records import prompt_conversation
from gptkit.data.row_sampler import RowSampler
from gptkit.data.templated import (
    ChatSplit,
    Encoder,
    Seq,
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

TRUNCATE = ("error", "drop", "cut")
SIDES = ("chosen", "rejected")
# the one line of a global batch larger than the pairs (as data=chat's)
TOO_FEW = (
    "the chat data makes {n} training rows, fewer than a global batch of {batch}; give more conversations "
    "or a smaller trainer.batch_size"
)
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=preference is DPO's answer pairs (a DPO run's val/loss and "
    "val/rewards/* are in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


# ---- the record reader and the row maker -----------------------------------------------------------------
def preference_pair(rec: Any, where: str, s: dict[str, Any]) -> tuple[list[dict[str, Any]], str, str]:
    """(the conversation before the answers, chosen, rejected) of a record, checked; GptkitError naming
    `where` otherwise."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    answers = []
    for field in (s["chosen_field"], s["rejected_field"]):
        if field not in rec or rec[field] is None:
            raise GptkitError(
                f"{where}: a preference record needs {s['chosen_field']} and "
                f"{s['rejected_field']} answers (data.chosen_field, data.rejected_field); it "
                f"has no {field} (fields: {', '.join(map(str, rec)) or 'none'})"
            )
        if not isinstance(rec[field], str):
            raise GptkitError(
                f"{where}: {field} must be text (the assistant's answer), got {type(rec[field]).__name__}"
            )
        if not rec[field].strip():
            raise GptkitError(f"{where}: {field} is empty")
        answers.append(rec[field])
    if answers[0] == answers[1]:
        raise GptkitError(
            f"{where}: {s['chosen_field']} and {s['rejected_field']} are the same text, so the "
            "pair prefers nothing"
        )
    ends = "it holds the conversation before the answers, which are the assistant's next turn"
    msgs = prompt_conversation(rec, where, s, ends, "a preference record", " before its answers")
    return msgs, answers[0], answers[1]


def encode(pair, where: str, enc: Encoder) -> list[Seq]:
    """Each answer rendered after the conversation as the assistant's turn: (ids, mask on the answer's
    tokens only, long) of chosen, then rejected."""
    msgs, *answers = pair
    return [enc.answer(msgs, a, where) for a in answers]


# ---- the prepared (cached) form -------------------------------------------------------------------------
@dataclass
class PairSplit:
    """One split of prepared pairs: the chosen and the rejected sequences (pair i is item i of both) and
    where each pair came from (file and row)."""

    chosen: ChatSplit
    rejected: ChatSplit
    where: list[str]

    @property
    def n(self) -> int:
        return self.chosen.n


class PreferenceData(TemplatedData):
    """Tokenized preference pairs (train and val: PairSplit), their tokenizer and template: what
    data=preference prepares."""

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Batches of pairs (make_pair_rows: chosen and rejected side by side), drawn by (seed, step, rank);
        the val pairs each with its index in the set (the objective counts each once under DDP), batched by
        pair_collate. data.pack does not apply: one answer per row."""
        s = self.settings
        train, val = pair_rows(self, seq_len)
        # a precomputed reference (dpo.reference=precomputed): each pair's [2] summed answer log-probs
        ref = self.outputs.get("reference")
        if ref is not None:
            train.ref, val.ref = (torch.from_numpy(ref[f"{split}_logps"]).view(-1, 2) for split in SPLITS)
        items = [val.item(i) for i in range(first_val(len(val), val_windows))]
        sampler = RowSampler(train, batch_size, seed, TOO_FEW)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            show = shown(self, chars)
            out = []
            for j, p in enumerate(sampler.mine(step, rank, world_size)):
                pair = train.index[int(p)]
                source, where = split_where(self.train.where[pair])
                for k, side in enumerate(SIDES):
                    n = int((train.y[int(p), k] != -100).sum())
                    span = Span(pair, source, f"{where}, the {side} answer", n)
                    text = show(train.x[int(p), k])
                    out.append(Origin(2 * j + k, None, f"pair {int(p):,} of {len(train):,}", [span], text))
            return out

        return Feed(
            sampler,
            items,
            collate=pair_collate,
            lines=[describe_pairs(train, val, seq_len, s)],
            tracer=tracer,
        )


KIND = TemplatedKind(
    name="preference",
    read_record=preference_pair,
    # char and bpe are built from the rendered text of both answers
    texts=lambda template, pair, where: (answer_text(template, pair[0], a, where) for a in pair[1:]),
    encode=encode,
    data=PreferenceData,
    split=lambda seqs, where, rows: PairSplit(*seqs, where),
    npz="pairs.npz",
    sides=SIDES,
    mask_count="answer_tokens",
    format="gptkit-preference",
    # 2: as data=chat's: checksums, long answers kept as their first tokens
    format_version=2,
    # how rows are made from the tokens: no part of the cache key
    row_keys=("truncate",),
    choices=(("truncate", TRUNCATE),),
    paths="pairs.jsonl,...] (jsonl, json or parquet files of prompt/messages, chosen and rejected",
    record="pair",
    records="pairs",
    description="preference pairs",
    none="preference pairs",
)


# ---- rows and batches -------------------------------------------------------------------------------------
SPLITS = ("train", "val")


def pair_rows(data: PreferenceData, seq_len: int) -> tuple[PairRows, PairRows]:
    """The train and val rows of a run of seq_len (make_pair_rows, the folder's data.truncate)."""
    check_row_limit(data, seq_len, "answers")
    rows = (
        make_pair_rows(split, seq_len, data.settings["truncate"], data.pad_id)
        for split in (data.train, data.val)
    )
    return tuple(rows)


@dataclass
class PairRows:
    """The pairs as rows: x, y [P, 2, seq_len] int64 ([:, 0] chosen, [:, 1] rejected; y = -100 outside the
    answer), with the pairs cut or dropped (truncate) counted."""

    x: Any
    y: Any
    cut: int
    dropped: int
    # file and row of the first pair left out
    first_dropped: str | None
    # pairs in the split, before any was dropped
    pairs: int
    # [P] each kept pair's index in the split
    index: list[int] = dataclasses.field(default_factory=list)
    # [P, 2] float32: the reference's summed answer log-probs of each row, precomputed (None: the run
    # computes them); batches then carry them last
    ref: Any = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, pairs):
        """(x, y) [2 * len(pairs), seq_len]: rows 2i, 2i + 1 the chosen, rejected answer of pairs[i]; with a
        precomputed reference, then its log-probs [2 * len(pairs)] in the same order."""
        out = self.x[pairs].flatten(0, 1), self.y[pairs].flatten(0, 1)
        return out if self.ref is None else (*out, self.ref[pairs].flatten())

    def __getitem__(self, i: int):
        """Pair i as (x, y) [2, seq_len] each (a validation item; pair_collate batches them)."""
        return self.x[i], self.y[i]

    def item(self, i: int):
        """Validation pair i with its index in the set (0-d), then, when precomputed, its reference
        log-probs [2]: pair_collate makes them the indices [n] and [n, 2]."""
        index = torch.tensor(i, dtype=torch.long)
        return (
            (self.x[i], self.y[i], index) if self.ref is None else (self.x[i], self.y[i], index, self.ref[i])
        )


def pair_collate(items):
    """Validation pairs (x, y [2, seq_len] each, and optionally their index: a 0-d tensor) -> one batch
    (x, y [2 * n, seq_len], pairs side by side; the indices [n])."""
    cols = list(zip(*items))
    return (*(torch.cat(t) for t in cols[:2]), *(torch.stack(t) for t in cols[2:]))


def make_pair_rows(split: PairSplit, seq_len: int, truncate: str, pad_id: int) -> PairRows:
    """Each answer with its conversation as one row of seq_len + 1 tokens (inputs: the first seq_len,
    targets: the last seq_len), padded with pad_id (no loss). A pair longer than a row: one-line error
    (truncate=error), left out (drop), or cut to the row (cut; left out when no answer token remains)."""
    width = seq_len + 1
    ids_rows, mask_rows, index = [], [], []
    cut = dropped = 0
    first_dropped = None
    for i in range(split.n):
        sides, long = [], None
        for side, part in zip(SIDES, (split.chosen, split.rejected)):
            a, b = int(part.offsets[i]), int(part.offsets[i + 1])
            sides.append((side, part.ids[a:b].astype(np.int64), part.mask[a:b].astype(bool)))
            # a long answer: its first row_limit >= width tokens kept
            long = long or (side if part.is_long(i) else None)
        longest = max(len(ids) for _, ids, _ in sides)
        if longest > width or long:
            if truncate == "error":
                side = long or next(s for s, ids, _ in sides if len(ids) == longest)
                count = f"more than {longest:,}" if long else f"{longest}"
                raise GptkitError(
                    f"{split.where[i]}: the prompt with the {side} answer makes {count} "
                    f"tokens, more than a row of {width} (trainer.seq_len + 1); use "
                    "data.truncate=drop or data.truncate=cut, or a longer trainer.seq_len / "
                    "model.max_seq_len"
                )
            if truncate == "drop" or any(not m[1:width].any() for _, _, m in sides):
                dropped += 1
                first_dropped = first_dropped or split.where[i]
                continue
            cut += 1
        index.append(i)
        for _, ids, mask in sides:
            ids, mask = ids[:width], mask[:width]
            fill = width - len(ids)
            ids_rows.append(np.concatenate([ids, np.full(fill, pad_id, dtype=np.int64)]))
            mask_rows.append(np.concatenate([mask, np.zeros(fill, dtype=bool)]))
    if not ids_rows:
        raise GptkitError(
            f"every pair is longer than a row of {width} tokens and data.truncate={truncate} "
            "left them all out; use a longer trainer.seq_len / model.max_seq_len"
        )
    ids = torch.from_numpy(np.stack(ids_rows))  # [2P, seq_len + 1]
    mask = torch.from_numpy(np.stack(mask_rows))  # [2P, seq_len + 1]
    y = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))  # [2P, seq_len]
    x = ids[:, :-1]  # [2P, seq_len]
    return PairRows(
        x.reshape(-1, 2, seq_len).contiguous(),
        y.reshape(-1, 2, seq_len).contiguous(),
        cut,
        dropped,
        first_dropped,
        split.n,
        index,
    )


def describe_pairs(train: PairRows, val: PairRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: pairs, rows, the share of targets on the answers, pairs cut or dropped."""
    gone, first = lost(train, val), train.first_dropped or val.first_dropped
    over = (
        f"; pairs longer than {seq_len + 1} tokens: {', '.join(gone)} (data.truncate={s['truncate']}"
        + (f", first dropped: {first}" if first else "")
        + ")"
        if gone
        else f"; no pair is longer than {seq_len + 1} tokens"
    )
    share = float((train.y != -100).float().mean())
    return (
        f"preference data: {len(train):,} train pairs ({2 * len(train):,} rows of {seq_len}: chosen and "
        f"rejected side by side), {len(val):,} val pairs; {share:.1%} of the train targets are answer "
        f"tokens{over}"
    )
