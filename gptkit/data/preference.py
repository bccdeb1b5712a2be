"""Preference pairs for DPO (data=preference, objective=dpo): a prompt and two answers, chosen and rejected.

    records (jsonl / json / parquet, read as data=chat reads them)
        prompt + chosen + rejected (+ system)        strings
        messages + chosen + rejected                 the conversation so far, then the two assistant answers
      -> checked (both answers present, text, not empty, not equal; the conversation as data=chat checks it;
         file and row named in every error)
      -> each answer rendered after the conversation with the chat template (gptkit.data.chat), as the
         assistant's next turn: token ids + a mask on the answer's tokens only (end-of-turn token included)
      -> cached (PreferenceData), split into train and val pairs; an answer longer than the longest row a
         run can train on (model.max_seq_len + 1) is measured, never encoded whole, and kept as its first
         tokens (gptkit.data.chat.RowLimit)
      -> rows of seq_len + 1 tokens, one sequence per row, padded: a pair is two rows (PairRows)
      -> batches (x, y) of [2 * batch_size, seq_len]: rows 2i / 2i + 1 the chosen / rejected answer of
         pair i, targets -100 outside the answer (gptkit.training.dpo reads them so)

A pair longer than a row (prompt + either answer) is a one-line error naming its file and row
(data.truncate=error), left out (drop) or cut to the row (cut; left out when no answer token remains),
the ones left out or cut counted in the start-up line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptkit.chat_templates import assistant_spans, encode_conversation
from gptkit.data.cache import REBUILD, check_folder
from gptkit.data.chat import ChatSampler, split_where
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

FORMAT = "gptkit-preference"
# 2: as data=chat's (gptkit.data.chat.FORMAT_VERSION): checksums, long answers kept as their first tokens
FORMAT_VERSION = 2
TRUNCATE = ("error", "drop", "cut")
SIDES = ("chosen", "rejected")
# how rows are made from the tokens: no part of the cache key
ROW_KEYS = ("truncate",)
# why gptkit eval cannot score it (gptkit.data.kinds)
NOT_SCORED = (
    "eval scores windows of a text corpus; data=preference is DPO's answer pairs (a DPO run's val/loss and "
    "val/rewards/* are in its metrics.csv); pass a text corpus: data=files 'data.paths=[held_out.txt]'"
)


def check_settings(s: dict[str, Any]) -> dict[str, Any]:
    """data=preference's complete settings, checked (one-line errors)."""
    if s["truncate"] not in TRUNCATE:
        raise GptkitError(f"data.truncate={s['truncate']!r} is not one of {', '.join(TRUNCATE)}")
    if not s["paths"]:
        raise GptkitError(
            "data=preference needs data.paths=[pairs.jsonl,...] (jsonl, json or parquet files "
            "of prompt/messages, chosen and rejected)"
        )
    if s["val_paths"] is None and not 0.0 < float(s["val_fraction"]) < 1.0:
        raise GptkitError(f"data.val_fraction={s['val_fraction']} must be between 0 and 1 (exclusive)")
    allows_special_text(s)
    return s


def preference_pair(rec: Any, where: str, s: dict[str, Any]) -> tuple[list[dict[str, Any]], str, str]:
    """(the conversation before the answers, chosen, rejected) of a record, checked; GptkitError naming
    `where` otherwise."""
    if not isinstance(rec, dict):
        raise GptkitError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    mf, pf, sf = s["messages_field"], s["prompt_field"], s["system_field"]
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
    if mf in rec:
        msgs = rec[mf]
        last = msgs[-1] if isinstance(msgs, list) and msgs else None
        if isinstance(last, dict) and last.get("role") == "assistant":
            raise GptkitError(
                f"{where}: {mf} ends with an assistant turn; it holds the conversation before "
                f"the answers, which are the assistant's next turn"
            )
    elif pf in rec:
        if not isinstance(rec[pf], str) or not rec[pf].strip():
            raise GptkitError(f"{where}: {pf} must be non-empty text")
        msgs = ([{"role": "system", "content": rec[sf]}] if rec.get(sf) else []) + [
            {"role": "user", "content": rec[pf]}
        ]
    else:
        raise GptkitError(
            f"{where}: a preference record needs a {mf} list or a {pf} (data.messages_field, "
            f"data.prompt_field) before its answers"
        )
    # data=chat's reading of a messages list
    as_chat = {**s, "response_field": None}
    # conversation() names the problem
    if not isinstance(msgs, list) or not msgs:
        conversation({mf: msgs}, where, as_chat)
    msgs_checked = conversation({mf: [*msgs, {"role": "assistant", "content": answers[0]}]}, where, as_chat)
    return msgs_checked[:-1], answers[0], answers[1]


def read_pairs(files: list[Path], s: dict[str, Any]) -> list[tuple[str, list[dict], str, str]]:
    """Every pair of the files as (file:row, conversation, chosen, rejected), checked; none is an error."""
    out = [(where, *preference_pair(rec, where, s)) for f in files for where, rec in records(f, s["format"])]
    if not out:
        raise GptkitError(f"{', '.join(map(str, files))}: no preference pairs")
    return out


def answer_tokens(
    tokenizer,
    template,
    msgs: list[dict],
    answer: str,
    where: str,
    limit: RowLimit,
    allow_special_text: bool = False,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, mask, long) of the conversation followed by `answer` as the assistant's turn; the mask marks the
    answer's tokens only (not earlier assistant turns of `msgs`). long: longer than limit.tokens, of which
    only the first limit.tokens are returned (the text never encoded whole). Special tokens that the prompt
    or the answer spell are text (allow_special_text: control tokens, as before)."""
    conversation = [*msgs, {"role": "assistant", "content": answer}]
    text, spans = assistant_spans(template, conversation, where)
    text, spans, long = limit.fit(text, spans[-1:])
    ids, mask = encode_conversation(
        tokenizer,
        template,
        conversation,
        where,
        rendered=(text, spans),
        prefix=long,
        allow_special_text=allow_special_text,
    )
    if long:
        ids, mask = ids[: limit.tokens], mask[: limit.tokens]
    elif not any(mask):
        raise GptkitError(f"{where}: an answer renders to no tokens")
    return np.asarray(ids, dtype=np.uint32), np.asarray(mask, dtype=np.uint8), long


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


@dataclass
class PreferenceData(TemplatedData):
    """Tokenized preference pairs (train and val), their tokenizer and template: what data=preference
    prepares."""

    train: PairSplit
    val: PairSplit

    record_name = "pairs"

    def connect(
        self, batch_size: int, seq_len: int, seed: int, val_windows: int | None, pack: str | None = None
    ) -> Feed:
        """Batches of pairs (make_pair_rows: chosen and rejected side by side), drawn by (seed, step, rank);
        the val pairs each with its index in the set (the objective counts each once under DDP), batched by
        pair_collate. data.pack does not apply: one answer per row."""
        s = self.settings
        check_row_limit(self, seq_len, "answers")
        train, val = (
            make_pair_rows(split, seq_len, s["truncate"], self.pad_id) for split in (self.train, self.val)
        )
        n_val = len(val) if val_windows is None else min(len(val), int(val_windows))
        items = [(*val[i], torch.tensor(i, dtype=torch.long)) for i in range(n_val)]
        sampler = pair_sampler(train, batch_size, seed)

        def tracer(step: int, rank: int, world_size: int, chars: int) -> list[Origin]:
            decode = TextBytes(self.tokenizer()).text
            out = []
            for j, p in enumerate(sampler.mine(step, rank, world_size)):
                pair = train.index[int(p)]
                source, where = split_where(self.train.where[pair])
                for k, side in enumerate(SIDES):
                    x = train.x[int(p), k]  # [seq_len]
                    n = int((train.y[int(p), k] != -100).sum())
                    span = Span(pair, source, f"{where}, the {side} answer", n)
                    text = show(decode(x[: 4 * chars + 8].numpy()), chars)
                    out.append(Origin(2 * j + k, None, f"pair {int(p):,} of {len(train):,}", [span], text))
            return out

        return Feed(
            sampler,
            items,
            collate=pair_collate,
            lines=[describe_pairs(train, val, seq_len, s)],
            tracer=tracer,
        )


def prepare_preference(s: dict[str, Any], tok: TokenizerSpec, opts: BuildOptions) -> PreferenceData:
    """Preference records -> token ids + answer masks of both answers (train and val), the tokenizer (with
    the template's special tokens) and the template, cached by (files, settings, tokenizer, template).
    Every bad record is a one-line GptkitError naming its file and row, raised before anything is
    written."""
    build = TemplatedBuild.open("preference", check_settings(s), tok, opts, ROW_KEYS, FORMAT_VERSION)
    cached = build.cached(load_preference)
    if cached is not None:
        return cached
    s, template = build.s, build.template
    pairs = read_pairs(build.train_files, s)
    val_pairs = read_pairs(build.val_files, s) if build.val_files else []
    every = pairs + val_pairs

    # char and bpe are built from the rendered text of both answers
    def texts():
        for where, msgs, *answers in every:
            for a in answers:
                yield assistant_spans(template, [*msgs, {"role": "assistant", "content": a}], where)[0]

    tokenizer, added = build.tokenizer(texts)
    allow, limit = build.allow_special_text, RowLimit(opts.row_limit, tokenizer, tok)
    encoded = [
        (where, [answer_tokens(tokenizer, template, msgs, a, where, limit, allow) for a in answers])
        for where, msgs, *answers in every
    ]
    n_train = build.n_train(len(pairs), "pair")
    splits = {"train": encoded[:n_train], "val": encoded[n_train:]}
    counts = {
        k: {
            "pairs": len(v),
            "tokens": sum(len(ids) for _, sides in v for ids, _, _ in sides),
            "answer_tokens": sum(int(m.sum()) for _, sides in v for _, m, _ in sides),
            # pairs with a long answer
            "long": sum(any(long for _, _, long in sides) for _, sides in v),
        }
        for k, v in splits.items()
    }
    manifest = build.manifest(FORMAT, FORMAT_VERSION, "preference pairs", tokenizer, added, limit, counts)
    arrays = {
        k: v
        for split, pairs_of in splits.items()
        for i, side in enumerate(SIDES)
        for k, v in sequence_arrays(f"{split}_{side}", [sides[i] for _, sides in pairs_of]).items()
    }
    # each pair's file and line
    where = json.dumps({k: [w for w, _ in v] for k, v in splits.items()})
    return build.publish(
        manifest, {"pairs.npz": arrays}, tokenizer, load_preference, added, extra={"where.json": where}
    )


def load_preference(folder: Path, settings: dict[str, Any]) -> PreferenceData:
    """A prepared preference folder (manifest.json, pairs.npz, where.json), checked against its manifest
    (check_folder: the checksum, each file's CRC-32, so also the tokenizer's) and the arrays against its
    counts."""
    manifest = check_folder(folder, FORMAT, "preference")
    try:
        where = json.loads((folder / "where.json").read_text(encoding="utf-8"))
        with np.load(folder / "pairs.npz") as z:
            splits = {
                k: PairSplit(*(ChatSplit.from_arrays(z, f"{k}_{s}") for s in SIDES), where[k])
                for k in ("train", "val")
            }
        for k, split in splits.items():
            n = manifest["splits"][k]["pairs"]
            for side in (split.chosen, split.rejected):
                check_split(side, n, len(side.ids))
            if len(split.where) != n or sum(len(p.ids) for p in (split.chosen, split.rejected)) != int(
                manifest["splits"][k]["tokens"]
            ):
                raise ValueError(f"its arrays do not hold the {n:,} pairs of its manifest")
    # a file the manifest's CRC-32 matches, and yet not what this gptkit wrote (or a bug)
    except Exception as exc:  # noqa: BLE001 - np.load fails in many ways on a damaged file
        raise GptkitError(f"{folder} is damaged (pairs.npz: {str(exc)[:160]}); {REBUILD}") from None
    check_tokenizer_file(folder, manifest)
    return PreferenceData(folder, manifest, settings, splits["train"], splits["val"])


# ---- rows and batches -------------------------------------------------------------------------------------
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

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, pairs):
        """(x, y) [2 * len(pairs), seq_len]: rows 2i, 2i + 1 the chosen, rejected answer of pairs[i]."""
        return self.x[pairs].flatten(0, 1), self.y[pairs].flatten(0, 1)

    def __getitem__(self, i: int):
        """Pair i as (x, y) [2, seq_len] each (a validation item; pair_collate batches them)."""
        return self.x[i], self.y[i]


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


def pair_sampler(rows: PairRows, batch_size: int, seed: int) -> ChatSampler:
    """The pairs of micro-step N are a pure function of (seed, N, rank, world size), as data=chat's rows."""
    return ChatSampler(rows, batch_size, seed)


def describe_pairs(train: PairRows, val: PairRows, seq_len: int, s: dict[str, Any]) -> str:
    """The start-up line: pairs, rows, the share of targets on the answers, pairs cut or dropped."""
    cut, dropped = train.cut + val.cut, train.dropped + val.dropped
    lost = ([f"{cut} cut"] if cut else []) + ([f"{dropped} dropped"] if dropped else [])
    first = train.first_dropped or val.first_dropped
    over = (
        f"; pairs longer than {seq_len + 1} tokens: {', '.join(lost)} (data.truncate={s['truncate']}"
        + (f", first dropped: {first}" if first else "")
        + ")"
        if lost
        else f"; no pair is longer than {seq_len + 1} tokens"
    )
    share = float((train.y != -100).float().mean())
    return (
        f"preference data: {len(train):,} train pairs ({2 * len(train):,} rows of {seq_len}: chosen and "
        f"rejected side by side), {len(val):,} val pairs; {share:.1%} of the train targets are answer "
        f"tokens{over}"
    )
