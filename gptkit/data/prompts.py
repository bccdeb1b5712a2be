"""Prompts with answers for reinforcement learning (data=prompts, objective=grpo): what the model answers
during training, and the fields its rewards read.

    records (jsonl / json / parquet, read as data=chat reads them)
        prompt (+ system) + any other fields          e.g. {"prompt": "upper abc", "answer": "ABC"}
        messages + any other fields                   the conversation so far, ending with a user's turn
      -> checked (the prompt text, the conversation as data=chat checks it; file and row named in every error)
      -> rendered with the chat template up to the assistant's turn (the generation prompt): token ids
         (encode); a prompt longer than the longest row a run can train on (model.max_seq_len + 1) is
         measured, never encoded whole (gptkit.data.templated.RowLimit)
      -> cached (PromptData; the build, the folder and its load are every templated kind's:
         gptkit.data.templated, KIND): the ids of every prompt, and each record as JSON with its file and row
      -> batches (PromptBatch) of trainer.batch_size prompts per rank, drawn by (seed, step, rank): their ids
         (right-padded), lengths, records and where each sits in the step's global batch

A prompt that leaves no room for a completion in a row of trainer.seq_len tokens is a one-line error naming
its file and row (data.truncate=error) or left out (drop; counted at start-up).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    check_row_limit,
    first_val,
    shown,
    split_where,
)
from gptkit.errors import GptkitError

TRUNCATE = ("error", "drop")
# the one line of a global batch larger than the prompts
TOO_FEW = (
    "the prompt data has {n} training prompts, fewer than a global batch of {batch}; give more prompts or a "
    "smaller trainer.batch_size"
)
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=prompts is prompts for objective=grpo (a GRPO run's val "
    "rewards are in its metrics.csv; data=prompts 'data.paths=[...]' samples=n scores sampled answers); pass "
    "a text corpus: data=files 'data.paths=[held_out.txt]'"
)


# ---- the record reader and the row maker -----------------------------------------------------------------
def prompt_messages(rec: Any, where: str, s: dict[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    """(the conversation a record asks the assistant to continue, the record), checked; GptkitError naming
    `where`."""
    ends = "a prompt is the conversation before the assistant's answer, which the model writes"
    return prompt_conversation(rec, where, s, ends, "a prompt record"), rec


def rendered(template, msgs: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered up to the assistant's turn (the generation prompt)."""
    try:
        return template.render(msgs, add_generation_prompt=True)
    except GptkitError as exc:
        raise GptkitError(f"{where}: the chat template {template.name} failed to render: {exc}") from None


def encode(prompt, where: str, enc: Encoder) -> list[Seq]:
    """(ids, no mask, long) of the prompt rendered up to the assistant's turn. long: longer than the row
    limit, of which only the first limit.tokens are kept (never encoded whole)."""
    msgs, _ = prompt
    ids, _, long = enc.encode(msgs, where, *rendered(enc.template, msgs, where), prompt=True)
    if not len(ids):
        raise GptkitError(f"{where}: the prompt renders to no tokens")
    return [(ids, np.zeros(len(ids), dtype=np.uint8), long)]


def plain_record(rec: dict) -> dict:
    """The record as JSON keeps it (what a reward reads): values JSON cannot hold become their text."""
    return json.loads(json.dumps(rec, default=str))


# ---- the prepared (cached) form -------------------------------------------------------------------------
@dataclass
class PromptSplit:
    """One split of prepared prompts: their tokens (ChatSplit, no mask), records and file:row."""

    tokens: ChatSplit
    rows: list[dict]
    where: list[str]

    @property
    def n(self) -> int:
        return self.tokens.n

    def ids(self, i: int) -> list[int]:
        a, b = int(self.tokens.offsets[i]), int(self.tokens.offsets[i + 1])
        return self.tokens.ids[a:b].astype(np.int64).tolist()


class PromptData(TemplatedData):
    """Tokenized prompts (train and val: PromptSplit) and their records, tokenizer and template: what
    data=prompts prepares."""

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Batches of prompts drawn by (seed, step, rank) (PromptSampler); the first val_windows val prompts,
        each with its index in the set (the objective counts each once under DDP), batched by collate_prompts.
        Every prompt leaves room for a completion in a row of seq_len tokens (data.truncate). data.pack does
        not apply."""
        check_row_limit(self, seq_len, "prompts")
        train, val = (
            PromptRows.of(split, seq_len, self.settings["truncate"]) for split in (self.train, self.val)
        )
        items = [val.item(i) for i in range(first_val(len(val), val_windows))]
        pad = self.pad_id
        sampler = PromptSampler(train, batch_size, seed, pad)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            """Each prompt of the micro-batch (the objective samples its completions from it): its file and
            line, and its rendered text."""
            show = shown(self, chars)
            out = []
            for row, i in enumerate(sampler.mine(step, rank, world_size)):
                ids, _, _, where = train.item(i)
                span = Span(train.kept[i], *split_where(where), len(ids))
                out.append(Origin(row, None, f"prompt {i:,} of {len(train):,}", [span], show(ids)))
            return out

        return Feed(
            sampler,
            items,
            collate=lambda batch: collate_prompts(batch, pad),
            lines=[describe_prompts(train, val, seq_len, self.settings)],
            tracer=tracer,
        )


KIND = TemplatedKind(
    name="prompts",
    read_record=prompt_messages,
    texts=lambda template, prompt, where: [template.render(prompt[0], add_generation_prompt=True)[0]],
    encode=encode,
    data=PromptData,
    split=lambda seqs, where, rows: PromptSplit(seqs[0], rows, where),
    # the records, for the rewards (rows.json)
    keep=lambda prompt: plain_record(prompt[1]),
    npz="prompts.npz",
    sides=("",),
    format="gptkit-prompts",
    format_version=1,
    # how rows are made from the tokens: no part of the cache key
    row_keys=("truncate",),
    choices=(("truncate", TRUNCATE),),
    paths="prompts.jsonl,...] (jsonl, json or parquet files of a prompt or messages, and the fields the "
    "rewards read, e.g. answer",
    record="prompt",
    records="prompts",
    description="prompts",
)


# ---- batches -------------------------------------------------------------------------------------------
class PromptBatch(NamedTuple):
    """A micro-batch of prompts, what objective=grpo reads.

    ids      [B, T] int64, each prompt's tokens then padding (pad id)
    lengths  [B] int64: each prompt's tokens
    index    [B] int64: each prompt's index in its split (the val items: in the val set)
    slots    [B] int64: each prompt's place in the step's global batch (rank * batch_size + i; val: index)
    step     [] int64: the micro-step whose batch this is (-1: validation)
    rows     the records (dicts, as JSON holds them): what the rewards read
    where    each record's file and row"""

    ids: torch.Tensor
    lengths: torch.Tensor
    index: torch.Tensor
    slots: torch.Tensor
    step: torch.Tensor
    rows: list
    where: list

    def prompts(self) -> list[list[int]]:
        """Each prompt's token ids."""
        return [row[:n] for row, n in zip(self.ids.tolist(), self.lengths.tolist())]


@dataclass
class PromptRows:
    """The prompts of a split that fit a row of seq_len tokens with room for a completion, with the ones
    left out (data.truncate=drop) counted."""

    split: PromptSplit
    # indices into split of the kept prompts
    kept: list[int]
    dropped: int
    first_dropped: str | None
    longest: int

    @classmethod
    def of(cls, split: PromptSplit, seq_len: int, truncate: str) -> "PromptRows":
        """A prompt of seq_len tokens or more leaves no room for a completion in a row: one-line error
        (truncate=error) or left out (drop)."""
        kept, dropped, first = [], 0, None
        lengths = np.diff(split.tokens.offsets)
        for i in range(split.n):
            if lengths[i] >= seq_len or split.tokens.is_long(i):
                if truncate == "error":
                    count = (
                        f"more than {int(lengths[i]):,}" if split.tokens.is_long(i) else f"{int(lengths[i])}"
                    )
                    raise GptkitError(
                        f"{split.where[i]}: the prompt makes {count} tokens with the chat template, which "
                        f"leaves no room for an answer in a row of {seq_len} (trainer.seq_len); use "
                        "data.truncate=drop, or a longer trainer.seq_len / model.max_seq_len"
                    )
                dropped += 1
                first = first or split.where[i]
                continue
            kept.append(i)
        if split.n and not kept:
            raise GptkitError(
                f"every prompt is {seq_len} tokens or longer and data.truncate=drop left them all out; use "
                "a longer trainer.seq_len / model.max_seq_len"
            )
        longest = max((int(lengths[i]) for i in kept), default=0)
        return cls(split, kept, dropped, first, longest)

    def __len__(self) -> int:
        return len(self.kept)

    def item(self, i: int) -> tuple[list[int], int, dict, str]:
        """Prompt i (of the kept ones) as (ids, i, record, file:row)."""
        j = self.kept[i]
        return self.split.ids(j), i, self.split.rows[j], self.split.where[j]


def collate_prompts(items: list[tuple[list[int], int, dict, str]], pad_id: int, slots=None, step: int = -1):
    """Prompt items (ids, index, record, file:row) -> a PromptBatch, right-padded with pad_id; slots: their
    places in the step's global batch (None: their indices)."""
    n = max(len(ids) for ids, *_ in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)  # [B, T]
    for r, (p, *_) in enumerate(items):
        ids[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    index = torch.tensor([i for _, i, _, _ in items], dtype=torch.long)  # [B]
    return PromptBatch(
        ids,
        torch.tensor([len(p) for p, *_ in items], dtype=torch.long),
        index,
        index.clone() if slots is None else torch.as_tensor(slots, dtype=torch.long),
        torch.tensor(int(step), dtype=torch.long),
        [rec for _, _, rec, _ in items],
        [w for *_, w in items],
    )


class PromptSampler(RowSampler):
    """The prompts of micro-step `step` are a pure function of (seed, step, rank, world_size), as data=chat's
    rows: a global batch of batch_size * world_size distinct prompts, rank r taking its r-th share."""

    def __init__(self, rows: PromptRows, batch_size: int, seed: int, pad_id: int) -> None:
        super().__init__(rows, batch_size, seed, TOO_FEW)
        self.pad_id = int(pad_id)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> PromptBatch:
        first = rank * self.batch_size
        items = [self.rows.item(i) for i in self.mine(step, rank, world_size)]
        return collate_prompts(items, self.pad_id, range(first, first + self.batch_size), step)

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """The indices (of the kept prompts) of micro-step `step`'s prompts on `rank`."""
        return super().mine(step, rank, world_size).tolist()


def describe_prompts(train: PromptRows, val: PromptRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: prompts, the longest, the fields a reward can read, prompts left out."""
    dropped = train.dropped + val.dropped
    first = train.first_dropped or val.first_dropped
    over = (
        f"; {dropped} prompt(s) of {seq_len} tokens or more left out (data.truncate=drop, first: {first})"
        if dropped
        else ""
    )
    fields = sorted({k for r in train.split.rows[:100] for k in r})
    return (
        f"prompt data: {len(train):,} train prompts, {len(val):,} val; the longest {train.longest} tokens "
        f"(rows of {seq_len}: room for at least {seq_len - train.longest} new tokens); record fields: "
        f"{', '.join(fields)}{over}"
    )
