"""Evaluation over every window of a token sequence: loss, perplexity, bits per token, and the size of the
scored text (for bits per byte / per character). The logic of `gptkit eval`, usable from Python."""

from __future__ import annotations


def window_starts(n_tokens: int, seq_len: int, stride: int, max_windows: int | None = None) -> list[int]:
    """Start of each evaluation window: window s feeds tokens[s : s+seq_len] and predicts
    tokens[s+1 : s+seq_len+1]; a window starts only while the previous one has not reached the last token."""
    starts = [s for s in range(0, n_tokens - 1, stride) if s == 0 or s - stride + seq_len < n_tokens - 1]
    return starts[: int(max_windows)] if max_windows else starts


def evaluate(model, tokens, seq_len: int, stride: int, batch_size: int, max_windows=None, progress=None,
             eos_id: int | None = None) -> dict:
    """Sum of the NLL over every scored target; each target tokens[1:] is scored exactly once. With eos_id
    (a run trained with data.pack=documents) attention stays inside each document of a window, as in training."""
    import math
    import time

    import numpy as np
    import torch
    import torch.nn.functional as F

    from gptkit.data.windows import doc_ids

    N = len(tokens)
    starts = window_starts(N, seq_len, stride, max_windows)
    device = model.tok_emb.weight.device
    nll, scored = 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(starts), batch_size):
            chunk = starts[b : b + batch_size]
            x = torch.zeros(len(chunk), seq_len, dtype=torch.long)  # [B, seq_len]
            y = torch.full((len(chunk), seq_len), -100, dtype=torch.long)  # [B, seq_len], -100: not scored
            for i, s in enumerate(chunk):
                n = min(seq_len, N - 1 - s)
                x[i, :n] = torch.from_numpy(np.asarray(tokens[s : s + n], dtype=np.int64))
                target = torch.from_numpy(np.asarray(tokens[s + 1 : s + n + 1], dtype=np.int64))
                first = 0 if s == 0 else seq_len - stride  # targets before it were scored by the previous window
                y[i, first:n] = target[first:]
            docs = None if eos_id is None else doc_ids(x, eos_id).to(device)  # [B, seq_len]
            logits = model(x.to(device), doc_ids=docs).logits  # [B, seq_len, V]
            nll += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), ignore_index=-100,
                                   reduction="sum").item()
            scored += int((y != -100).sum())
            if progress is not None:
                progress(len(chunk))
    seconds = time.perf_counter() - t0
    loss = nll / scored
    return {"tokens_scored": scored, "windows": len(starts), "seq_len": seq_len, "stride": stride, "nll_sum": nll,
            "loss": loss, "perplexity": math.exp(loss), "bits_per_token": loss / math.log(2),
            "seconds": seconds, "tokens_per_s": scored / seconds if seconds else 0.0,
            "last_target": (starts[-1] + min(seq_len, N - 1 - starts[-1])) if starts else 0,
            "documents": eos_id is not None}


def scored_text_size(tokenizer, tokens, last_target: int) -> tuple[int, int]:
    """(UTF-8 bytes, characters) of the text of the scored targets tokens[1 : last_target + 1]."""
    import numpy as np

    n_bytes = n_chars = 0
    step = 1 << 20  # decode in pieces: bounded memory on a big corpus
    for a in range(1, last_target + 1, step):
        text = tokenizer.decode(np.asarray(tokens[a : min(a + step, last_target + 1)]).tolist())
        n_bytes += len(text.encode("utf-8"))
        n_chars += len(text)
    return n_bytes, n_chars
