"""Stateless sampling of training windows, and the fixed validation windows.

The batch of micro-step `step` is a pure function of (seed, step, rank, world_size): step draws a
global batch of batch_size * world_size distinct window starts from a generator seeded with
(seed, step), and rank r takes the slice [r * batch_size, (r + 1) * batch_size). So

  - resuming at step s gives exactly the batches an uninterrupted run sees (no iterator state),
  - ranks never share a window within a step,
  - world 2 x batch 6 sees the same windows as world 1 x batch 12.

data.pack (PACKS) says what a window's documents may see. stream: windows are cut from the token
stream and attention crosses document boundaries. documents: the same windows, plus doc_ids [B, T]
(the number of EOS tokens before each position: an EOS ends its own document), so that the model
attends only inside each document (and, with model.position_reset, restarts positions there).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from gptkit.data.settings import PACKS
from gptkit.errors import GptkitError


def check_window(n_tokens: int, seq_len: int, split: str) -> None:
    """A split must hold at least one window of seq_len + 1 tokens; else a one-line error."""
    if n_tokens < seq_len + 1:
        raise GptkitError(
            f"the {split} split has {n_tokens} tokens, shorter than one window of seq_len+1="
            f"{seq_len + 1}; give a longer corpus or a shorter trainer.seq_len (the training "
            "window)"
        )


def check_pack(pack: str, eos_id: int | None) -> None:
    """data.pack is stream or documents, and documents needs an EOS between documents."""
    if pack not in PACKS:
        raise GptkitError(f"data.pack={pack!r} is not one of {', '.join(PACKS)}")
    if pack == "documents" and eos_id is None:
        raise GptkitError(
            "data.pack=documents needs an EOS token between documents and these shards have "
            "none; prepare them with a tokenizer that has one (tokenizer.eos_token) or use "
            "data.pack=stream"
        )


def doc_ids(x, eos_id: int):
    """[B, T] int32: the number of EOS tokens before each position of x [B, T] (an EOS ends its document)."""
    eos = (x == eos_id).to(torch.int32)  # [B, T]
    return eos.cumsum(1, dtype=torch.int32) - eos


def windows(
    tokens: np.ndarray,
    starts: np.ndarray,
    seq_len: int,
    eos_id: int | None = None,
    *,
    vocab_size: int | None = None,
):
    """(x, y) int64 tensors [len(starts), seq_len] from windows of seq_len + 1 tokens at `starts`;
    (x, y, doc_ids) when an EOS id is given (data.pack=documents). A token id >= vocab_size (a corrupted
    shard) is a one-line GptkitError naming the shard."""
    idx = starts[:, None] + np.arange(seq_len + 1)  # [B, seq_len + 1]
    ids = tokens[idx]  # [B, seq_len + 1]
    if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
        raise GptkitError(
            f"{getattr(tokens, 'filename', None) or 'the token shard'} holds token id "
            f"{int(ids.max())}, outside the tokenizer's {vocab_size} ids: it is corrupted; "
            f"delete its folder and prepare the data again"
        )
    w = torch.from_numpy(ids.astype(np.int64))  # [B, seq_len + 1]
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()  # [B, seq_len] each
    return (x, y) if eos_id is None else (x, y, doc_ids(x, eos_id))


class WindowSampler:
    """Random training windows of seq_len + 1 tokens; batch(step, rank, world_size) is pure."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        seed: int,
        eos_id: int | None = None,
        *,
        vocab_size: int | None = None,
    ) -> None:
        check_window(len(tokens), seq_len, "train")
        self.tokens, self.batch_size = tokens, int(batch_size)
        self.seq_len, self.seed = int(seq_len), int(seed)
        # given: batches carry doc_ids (data.pack=documents)
        self.eos_id = eos_id
        # token ids must be below it (checked per batch)
        self.vocab_size = vocab_size
        # window starts 0 .. n - seq_len - 1
        self.n_starts = len(tokens) - seq_len

    def starts(self, step: int, world_size: int = 1) -> np.ndarray:
        """The global batch's window starts for micro-step `step`: [batch_size * world_size], distinct."""
        n = self.batch_size * world_size
        if n > self.n_starts:
            raise GptkitError(
                f"the train split has only {self.n_starts} distinct windows of "
                f"{self.seq_len + 1} tokens, fewer than a global batch of {n}; give more text "
                "or a smaller batch"
            )
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        return rng.choice(self.n_starts, size=n, replace=False)  # [batch_size * world_size]

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The window starts of rank `rank`'s micro-batch of micro-step `step`: [batch_size]."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        return self.starts(step, world_size)[rank * self.batch_size : (rank + 1) * self.batch_size]

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        mine = self.mine(step, rank, world_size)  # [batch_size]
        return windows(self.tokens, mine, self.seq_len, self.eos_id, vocab_size=self.vocab_size)


def val_starts(n_tokens: int, seq_len: int, n_windows: int | None) -> np.ndarray:
    """Fixed validation windows: `n_windows` evenly spaced starts, or (None) every non-overlapping window."""
    check_window(n_tokens, seq_len, "val")
    # the last valid start
    last = n_tokens - seq_len - 1
    if n_windows is None:
        return np.arange(0, last + 1, seq_len + 1)  # [n_tokens // (seq_len + 1)]
    if n_windows < 1:
        raise GptkitError(f"val_windows={n_windows} must be >= 1 (or null for every window)")
    return np.unique(np.linspace(0, last, int(n_windows)).round().astype(np.int64))  # [<= n_windows]


class ValWindows(Dataset):
    """The fixed validation windows of a split: (inputs, targets) pairs at evenly spread starts."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        n_windows: int | None,
        eos_id: int | None = None,
        *,
        vocab_size: int | None = None,
    ) -> None:
        self.tokens, self.seq_len, self.eos_id, self.vocab_size = tokens, seq_len, eos_id, vocab_size
        self.starts = val_starts(len(tokens), seq_len, n_windows)  # [n_windows]

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        return tuple(
            t[0]
            for t in windows(
                self.tokens, self.starts[i : i + 1], self.seq_len, self.eos_id, vocab_size=self.vocab_size
            )
        )


class TaggedWindows(Dataset):
    """A val set's items, each followed by its index in the set (a 0-d int64 tensor): it travels through any
    sampler, so the loss of every window can be told to its source, and a DistributedSampler's padding
    duplicates told from the original (training/module.py)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        return (*self.ds[i], torch.tensor(i, dtype=torch.long))
