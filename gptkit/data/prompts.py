"""Prompts with answers for reinforcement learning (data=prompts, objective=grpo): what the model answers
during training, and the fields its rewards read.

    records (jsonl / json / parquet, read as data=chat reads them)
        prompt (+ system) + any other fields          e.g. {"prompt": "upper abc", "answer": "ABC"}
        messages + any other fields                   the conversation so far, ending with a user's turn
      -> checked (the prompt text, the conversation as data=chat checks it; file and row named in every error)
      -> rendered with the chat template (gptkit.data.chat) up to the assistant's turn (the generation
         prompt): token ids; a prompt longer than the longest row a run can train on (model.max_seq_len + 1)
         is measured, never encoded whole (gptkit.data.templated.RowLimit)
      -> cached (PromptData): the ids of every prompt, and each record as JSON with its file and row
      -> batches (PromptBatch) of trainer.batch_size prompts per rank, drawn by (seed, step, rank): their ids
         (right-padded), lengths, records and where each sits in the step's global batch

A prompt that leaves no room for a completion in a row of trainer.seq_len tokens is a one-line error naming
its file and row (data.truncate=error) or left out (drop; counted at start-up).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from gptkit.chat_templates import encode_conversation
from gptkit.data.cache import REBUILD, check_folder
from gptkit.data.chat import split_where
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

FORMAT = "gptkit-prompts"
FORMAT_VERSION = 1
TRUNCATE = ("error", "drop")
# how rows are made from the tokens: no part of the cache key
ROW_KEYS = ("truncate",)
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=prompts is prompts for objective=grpo (a GRPO run's val "
    "rewards are in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


def check_settings(s: dict[str, Any]) -> dict[str, Any]:
    """data=prompts' complete settings, checked (one-line errors)."""
    if s["truncate"] not in TRUNCATE:
        raise GptkitError(f"data.truncate={s['truncate']!r} is not one of {', '.join(TRUNCATE)}")
    if not s["paths"]:
        raise GptkitError(
            "data=prompts needs data.paths=[prompts.jsonl,...] (jsonl, json or parquet files of a prompt or "
            "messages, and the fields the rewards read, e.g. answer)"
        )
    if s["val_paths"] is None and not 0.0 < float(s["val_fraction"]) < 1.0:
        raise GptkitError(f"data.val_fraction={s['val_fraction']} must be between 0 and 1 (exclusive)")
    allows_special_text(s)
    return s


def prompt_messages(rec: Any, where: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a record asks the assistant to continue, checked; GptkitError naming `where`."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    mf, pf, sf = s["messages_field"], s["prompt_field"], s["system_field"]
    if mf in rec:
        msgs = rec[mf]
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            raise GptkitError(
                f"{where}: {mf} ends with an assistant turn; a prompt is the conversation before the "
                "assistant's answer, which the model writes"
            )
    elif pf in rec:
        if not isinstance(rec[pf], str) or not rec[pf].strip():
            raise GptkitError(f"{where}: {pf} must be non-empty text")
        msgs = ([{"role": "system", "content": rec[sf]}] if rec.get(sf) else []) + [
            {"role": "user", "content": rec[pf]}
        ]
    else:
        raise GptkitError(
            f"{where}: a prompt record needs a {mf} list or a {pf} (data.messages_field, data.prompt_field); "
            f"it has {', '.join(map(str, rec)) or 'none'}"
        )
    # data=chat's reading of a messages list (it asks for an assistant turn: one is added, then dropped)
    as_chat = {**s, "response_field": None}
    if not isinstance(msgs, list) or not msgs:
        conversation({mf: msgs}, where, as_chat)
    return conversation({mf: [*msgs, {"role": "assistant", "content": "-"}]}, where, as_chat)[:-1]


def read_prompts(files: list[Path], s: dict[str, Any]) -> list[tuple[str, list[dict], dict]]:
    """Every prompt of the files as (file:row, conversation, record), checked; none is an error."""
    out = [
        (where, prompt_messages(rec, where, s), rec) for f in files for where, rec in records(f, s["format"])
    ]
    if not out:
        raise GptkitError(f"{', '.join(map(str, files))}: no prompts")
    return out


def prompt_tokens(
    tokenizer, template, msgs: list[dict], where: str, limit: RowLimit, allow_special_text: bool = False
) -> tuple[np.ndarray, bool]:
    """(ids, long) of the conversation rendered up to the assistant's turn (the generation prompt). long:
    longer than limit.tokens, of which only the first limit.tokens are returned (never encoded whole).
    Special tokens the messages spell are text (allow_special_text: control tokens, as before)."""
    try:
        text, spans = template.render(msgs, add_generation_prompt=True)
    except GptkitError as exc:
        raise GptkitError(f"{where}: the chat template {template.name} failed to render: {exc}") from None
    text, spans, long = limit.fit(text, spans)
    ids, _ = encode_conversation(
        tokenizer,
        template,
        msgs,
        where,
        add_generation_prompt=True,
        rendered=(text, spans),
        prefix=long,
        allow_special_text=allow_special_text,
    )
    if long:
        ids = ids[: limit.tokens]
    if not ids:
        raise GptkitError(f"{where}: the prompt renders to no tokens")
    return np.asarray(ids, dtype=np.uint32), long


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


@dataclass
class PromptData(TemplatedData):
    """Tokenized prompts (train and val) and their records, tokenizer and template: what data=prompts
    prepares."""

    train: PromptSplit
    val: PromptSplit

    record_name = "prompts"

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
        n_val = len(val) if val_windows is None else min(len(val), int(val_windows))
        items = [val.item(i) for i in range(n_val)]
        pad = self.pad_id
        sampler = PromptSampler(train, batch_size, seed, pad)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            """Each prompt of the micro-batch (the objective samples its completions from it): its file and
            line, and its rendered text."""
            decode = TextBytes(self.tokenizer()).text
            out = []
            for row, i in enumerate(sampler.mine(step, rank, world_size)):
                ids, _, _, where = train.item(i)
                span = Span(train.kept[i], *split_where(where), len(ids))
                text = show(decode(np.asarray(ids[: 4 * chars + 8])), chars)
                out.append(Origin(row, None, f"prompt {i:,} of {len(train):,}", [span], text))
            return out

        return Feed(
            sampler,
            items,
            collate=lambda batch: collate_prompts(batch, pad),
            lines=[describe_prompts(train, val, seq_len, self.settings)],
            tracer=tracer,
        )


def prepare_prompts(s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> PromptData:
    """Prompt records -> token ids of each prompt rendered up to the assistant's turn (train and val), the
    records, the tokenizer (with the template's special tokens) and the template, cached by (files, settings,
    tokenizer, template). Every bad record is a one-line GptkitError naming its file and row, raised before
    anything is written."""
    build = TemplatedBuild.open("prompts", check_settings(s), tok, opts, ROW_KEYS, FORMAT_VERSION)
    cached = build.cached(load_prompts)
    if cached is not None:
        return cached
    s, template = build.s, build.template
    prompts = read_prompts(build.train_files, s)
    val_prompts = read_prompts(build.val_files, s) if build.val_files else []
    every = prompts + val_prompts

    def texts():
        for _, msgs, _ in every:
            yield template.render(msgs, add_generation_prompt=True)[0]

    tokenizer, added = build.tokenizer(texts)
    allow, limit = build.allow_special_text, RowLimit(opts.row_limit, tokenizer, tok)
    encoded = []
    for where, msgs, rec in every:
        ids, long = prompt_tokens(tokenizer, template, msgs, where, limit, allow)
        encoded.append((where, plain_record(rec), (ids, np.zeros(len(ids), dtype=np.uint8), long)))
    n_train = build.n_train(len(prompts), "prompt")
    splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
    counts = {
        k: {
            "prompts": len(v),
            "tokens": sum(len(seq[0]) for _, _, seq in v),
            "long": sum(bool(seq[2]) for _, _, seq in v),
        }
        for k, v in splits.items()
    }
    manifest = build.manifest(FORMAT, FORMAT_VERSION, "prompts", tokenizer, added, limit, counts)
    arrays = {
        k: v for split, v in splits.items() for k, v in sequence_arrays(split, [e[2] for e in v]).items()
    }
    rows = json.dumps(
        {k: {"rows": [r for _, r, _ in v], "where": [w for w, _, _ in v]} for k, v in splits.items()}
    )
    return build.publish(
        manifest, {"prompts.npz": arrays}, tokenizer, load_prompts, added, extra={"rows.json": rows}
    )


def load_prompts(folder: Path, settings: dict[str, Any]) -> PromptData:
    """A prepared prompts folder (manifest.json, prompts.npz, rows.json), checked against its manifest
    (check_folder: the checksum, each file's CRC-32) and the arrays and records against its counts."""
    manifest = check_folder(folder, FORMAT, "prompts")
    try:
        rows = json.loads((folder / "rows.json").read_text(encoding="utf-8"))
        with np.load(folder / "prompts.npz") as z:
            splits = {
                k: PromptSplit(ChatSplit.from_arrays(z, k), rows[k]["rows"], rows[k]["where"])
                for k in ("train", "val")
            }
        for k, split in splits.items():
            n = manifest["splits"][k]["prompts"]
            check_split(split.tokens, n, manifest["splits"][k]["tokens"])
            if len(split.rows) != n or len(split.where) != n:
                raise ValueError(f"its records do not hold the {n:,} prompts of its manifest")
    # a file the manifest's CRC-32 matches, and yet not what this gptkit wrote (or a bug)
    except Exception as exc:  # noqa: BLE001 - np.load and json fail in many ways on a damaged file
        raise GptkitError(f"{folder} is damaged (prompts: {str(exc)[:160]}); {REBUILD}") from None
    check_tokenizer_file(folder, manifest)
    return PromptData(folder, manifest, settings, splits["train"], splits["val"])


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


class PromptSampler:
    """The prompts of micro-step `step` are a pure function of (seed, step, rank, world_size), as data=chat's
    rows: a global batch of batch_size * world_size distinct prompts, rank r taking its r-th share."""

    def __init__(self, rows: PromptRows, batch_size: int, seed: int, pad_id: int) -> None:
        self.rows, self.batch_size, self.seed, self.pad_id = rows, int(batch_size), int(seed), int(pad_id)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> PromptBatch:
        n = self.batch_size * world_size
        if n > len(self.rows):
            raise GptkitError(
                f"the prompt data has {len(self.rows)} training prompts, fewer than a global batch of {n}; "
                "give more prompts or a smaller trainer.batch_size"
            )
        first = rank * self.batch_size
        items = [self.rows.item(i) for i in self.mine(step, rank, world_size)]
        return collate_prompts(items, self.pad_id, range(first, first + self.batch_size), step)

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """The indices (of the kept prompts) of micro-step `step`'s prompts on `rank`."""
        n = self.batch_size * world_size
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        picked = rng.choice(len(self.rows), size=n, replace=False)  # [batch_size * world_size], distinct
        first = rank * self.batch_size
        return picked[first : first + self.batch_size].tolist()


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
