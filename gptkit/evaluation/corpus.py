"""Evaluation over every window of a token sequence: loss, perplexity, bits per token, and the size of the
scored text (for bits per byte / per character). The logic of `gptkit eval`, usable from Python.

Two scoring conventions (`gptkit eval scoring=`):
  gptkit   the corpus as one stream, as training saw it (documents joined by the EOS after each one): every
           token after the first is scored once, the EOS included (it counts 0 bytes).
  lm-eval  each document on its own, as lm-eval's loglikelihood_rolling scores it: a BOS first (the EOS when
           the tokenizer has no BOS), every token of the document scored, no EOS. With stride=seq_len these
           are exactly lm-eval's rolling windows (lm_eval.utils.get_rolling_token_windows, context_len=1).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from gptkit.data.windows import doc_ids

SCORINGS = ("gptkit", "lm-eval")


def window_starts(n_tokens: int, seq_len: int, stride: int, max_windows: int | None = None) -> list[int]:
    """Start of each evaluation window: window s feeds tokens[s : s+seq_len] and predicts
    tokens[s+1 : s+seq_len+1]; a window starts only while the previous one has not reached the last token."""
    starts = [s for s in range(0, n_tokens - 1, stride) if s == 0 or s - stride + seq_len < n_tokens - 1]
    return starts[: int(max_windows)] if max_windows else starts


def scored_windows(
    n_tokens: int, seq_len: int, stride: int, align_last: bool = False
) -> list[tuple[int, int]]:
    """(start, first) per window_starts window: it scores targets first.. of the window (the earlier ones were
    scored by the window before). align_last (scoring=lm-eval, as lm-eval's rolling windows): a last window
    shorter than seq_len starts earlier instead, so that it ends at the last token and its new targets see a
    full window of context."""
    starts = window_starts(n_tokens, seq_len, stride)
    out = [(s, 0 if s == 0 else seq_len - stride) for s in starts]
    if align_last and len(starts) > 1 and n_tokens - 1 - starts[-1] < seq_len:
        # the window ends at the last token
        start = n_tokens - 1 - seq_len
        # the last target the window before it scored
        done = starts[-2] + seq_len
        out[-1] = (start, done - start)
    return out


def lm_eval_documents(tokens, eos_id: int | None, prefix_id: int) -> list[np.ndarray]:
    """scoring=lm-eval: the documents of a token stream (split at each EOS, which is dropped; no EOS: one
    document), each as [prefix_id] + its tokens. Empty documents are left out."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if eos_id is None:
        pieces = [tokens]
    else:
        cuts = np.flatnonzero(tokens == eos_id)
        pieces = np.split(tokens, cuts)
        # each piece after a cut starts with the EOS
        pieces = [pieces[0]] + [p[1:] for p in pieces[1:]]
    prefix = np.array([prefix_id], dtype=np.int64)
    return [np.concatenate([prefix, p]) for p in pieces if len(p)]


def evaluate(
    model,
    tokens,
    seq_len: int,
    stride: int,
    batch_size: int,
    max_windows=None,
    progress=None,
    eos_id: int | None = None,
) -> dict:
    """Sum of the NLL over every scored target; each target tokens[1:] is scored exactly once. With eos_id
    (a run trained with data.pack=documents) attention stays inside each document of a window, as in
    training."""
    res = evaluate_sequences(model, [tokens], seq_len, stride, batch_size, max_windows, progress, eos_id)
    res["last_target"] = res.pop("last_targets")[0]
    return res


def evaluate_sequences(
    model,
    sequences,
    seq_len: int,
    stride: int,
    batch_size: int,
    max_windows=None,
    progress=None,
    eos_id: int | None = None,
    align_last: bool = False,
) -> dict:
    """evaluate() over several sequences, each windowed on its own (the windows of all of them batched
    together): targets seq[1:] of every sequence are scored once. `last_targets[i]` is the index of the last
    target of sequence i that was scored (0: none, when max_windows stopped before it). align_last: see
    scored_windows."""
    plan = [
        (i, s, first)
        for i, seq in enumerate(sequences)
        for s, first in scored_windows(len(seq), seq_len, stride, align_last)
    ]
    if max_windows:
        plan = plan[: int(max_windows)]
    device = model.tok_emb.weight.device
    nll, scored = 0.0, 0
    last_targets = [0] * len(sequences)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(plan), batch_size):
            chunk = plan[b : b + batch_size]
            x = torch.zeros(len(chunk), seq_len, dtype=torch.long)  # [B, seq_len]
            y = torch.full((len(chunk), seq_len), -100, dtype=torch.long)  # [B, seq_len], -100: not scored
            for row, (i, s, first) in enumerate(chunk):
                tokens = sequences[i]
                n = min(seq_len, len(tokens) - 1 - s)
                x[row, :n] = torch.from_numpy(np.asarray(tokens[s : s + n], dtype=np.int64))
                target = torch.from_numpy(np.asarray(tokens[s + 1 : s + n + 1], dtype=np.int64))
                y[row, first:n] = target[first:]
                last_targets[i] = s + n
            docs = None if eos_id is None else doc_ids(x, eos_id).to(device)  # [B, seq_len]
            logits = model(x.to(device), doc_ids=docs).logits  # [B, seq_len, V]
            nll += F.cross_entropy(
                logits.float().flatten(0, 1), y.to(device).flatten(), ignore_index=-100, reduction="sum"
            ).item()
            scored += int((y != -100).sum())
            if progress is not None:
                progress(len(chunk))
    seconds = time.perf_counter() - t0
    loss = nll / scored if scored else float("nan")
    return {
        "tokens_scored": scored,
        "windows": len(plan),
        "seq_len": seq_len,
        "stride": stride,
        "nll_sum": nll,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_token": loss / math.log(2),
        "seconds": seconds,
        "tokens_per_s": scored / seconds if seconds else 0.0,
        "last_targets": last_targets,
        "documents": eos_id is not None,
    }


def scored_text_size(tokenizer, tokens, last_target: int) -> tuple[int, int]:
    """(UTF-8 bytes, characters) of the text of the scored targets tokens[1 : last_target + 1]."""
    n_bytes = n_chars = 0
    # decode in pieces: bounded memory on a big corpus
    step = 1 << 20
    for a in range(1, last_target + 1, step):
        text = tokenizer.decode(np.asarray(tokens[a : min(a + step, last_target + 1)]).tolist())
        n_bytes += len(text.encode("utf-8"))
        n_chars += len(text)
    return n_bytes, n_chars
