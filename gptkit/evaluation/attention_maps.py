"""Attention maps as one PNG: a grid of layers (rows) x heads (columns), query (y) vs key (x).

The probabilities come from the eager backend (`GPT.forward(..., return_attention=True)` always
uses it), softmax in fp32. Each cell's colour scale runs from 0 to its own largest probability,
so a head that spreads its attention thin stays readable. Token
labels are drawn on the left column and the bottom row when the tokens fit (<= 48 of them). A linear-attention
layer (Gated DeltaNet: model.layer_types `linear`) has no probabilities: its row is left out, the others keep
their layer numbers.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Optional, Sequence

from gptkit.errors import GptkitError

# matplotlib (~0.5 s) and torch are imported where a map is drawn.

MAX_LABELED_TOKENS = 48
ATTENTION_DIR = "attention"


def attention_probs(model, ids: Sequence[int]):
    """Per layer [n_heads, T, T] fp32 CPU probabilities for one sequence of ids (None for a linear layer);
    GptkitError when no layer has any."""
    import torch

    T = len(ids)
    if T == 0:
        raise GptkitError('the text has no tokens; give text="..."')
    if T > model.cfg.max_seq_len:
        raise GptkitError(
            f"the text has {T} tokens, more than model.max_seq_len={model.cfg.max_seq_len}; shorten it"
        )
    idx = torch.tensor([list(ids)], device=model.tok_emb.weight.device)  # [1, T]
    with torch.inference_mode():
        out = model(idx, return_attention=True, logits_to_keep=1)
    # per layer [n_heads, T, T], or None
    probs = [None if a is None else a[0].float().cpu() for a in out.attentions]
    if all(p is None for p in probs):
        raise GptkitError(
            "this model has no softmax attention layer (every layer is linear: Gated DeltaNet), so there are "
            "no attention probabilities to draw"
        )
    return probs


def token_labels(tokenizer, ids: Sequence[int]) -> list[str]:
    """One short printable label per token (newline, tab and space made visible)."""
    labels = []
    for i in ids:
        s = tokenizer.decode([i]) or tokenizer.id_to_token(i) or "?"
        s = s.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "␣")
        labels.append(s if len(s) <= 8 else s[:7] + "…")
    return labels


def render_grid(probs, labels: Optional[list[str]], title: str) -> bytes:
    """PNG bytes of the layers x heads grid; probs: per layer [n_heads, T, T] (None: a linear layer, left
    out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (layer number, [n_heads, T, T]) of the layers drawn
    drawn = [(i, p) for i, p in enumerate(probs) if p is not None]
    L, H, T = len(drawn), drawn[0][1].shape[0], drawn[0][1].shape[-1]
    show_labels = labels is not None and T <= MAX_LABELED_TOKENS
    cell = 2.2 if not show_labels else max(2.2, 0.16 * T)
    # a grid of [T, T] cells
    fig, axes = plt.subplots(L, H, figsize=(cell * H + 1.0, cell * L + 1.0), squeeze=False)
    for layer, (number, layer_probs) in enumerate(drawn):
        for head in range(H):
            ax = axes[layer][head]
            p = layer_probs[head].numpy()  # [T, T] query x key
            ax.imshow(p, cmap="viridis", vmin=0.0, vmax=max(float(p.max()), 1e-6), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=9)
            if head == 0:
                ax.set_ylabel(f"layer {number}\nquery", fontsize=9)
            if layer == L - 1:
                ax.set_xlabel("key", fontsize=8)
            if show_labels and head == 0:
                ax.set_yticks(range(T), labels, fontsize=6)
            if show_labels and layer == L - 1:
                ax.set_xticks(range(T), labels, fontsize=6, rotation=90)
    height = cell * L + 1.0
    fig.suptitle(title, fontsize=10, y=1 - 0.1 / height)
    # keep the column titles clear of the title
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def default_path(run_dir: Path, text: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:40] or "text"
    return Path(run_dir) / ATTENTION_DIR / f"attention-{slug}.png"


def mean_entropy_bits(probs) -> list[list[float] | None]:
    """Per layer and head, the mean entropy of the query rows in bits: 0 = every query attends to one key
    (None for a linear layer)."""
    return [
        None if layer is None else [float(-(p * p.clamp_min(1e-12).log2()).sum(-1).mean()) for p in layer]
        for layer in probs
    ]


def write_for_run(run, ids: Sequence[int], out: Optional[str | Path] = None):
    """Write the PNG for `ids` under the loaded run (runs.Run); return (its path, the probabilities:
    per layer [n_heads, T, T])."""
    from gptkit.fsio import atomic_write_bytes

    text = run.tokenizer.decode(list(ids))
    probs = attention_probs(run.model, ids)
    labels = token_labels(run.tokenizer, ids)
    path = Path(out) if out else default_path(run.dir, text)
    drawn = [p for p in probs if p is not None]
    linear = len(probs) - len(drawn)
    title = (
        f"{run.dir.name}: attention, {len(drawn)} layers x {drawn[0].shape[0]} heads, {len(ids)} tokens"
        + (f" ({linear} linear layers: no probabilities)" if linear else "")
    )
    atomic_write_bytes(path, render_grid(probs, labels, title))
    return path, probs
