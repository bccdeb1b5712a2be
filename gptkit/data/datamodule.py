"""The Lightning DataModule over prepared token shards.

train: an endless IterableDataset of sampler batches starting at micro-step
       trainer.global_step * trainer.accumulate_grad_batches (Lightning restores global_step before it
       asks for the dataloader, so a resumed run continues exactly), for trainer.global_rank of
       trainer.world_size. Without a trainer: step 0, rank 0 of 1.
val:   a fixed, deterministic map-style set of windows, the same for every run on the same data; every
       val item ends with its window's index in the (concatenated) val set, and `val_sources` gives the
       source of each index, so that LitGPT counts each window once under DDP (DistributedSampler pads
       with repeats) and reports val/loss as the exact token mean over the distinct windows.
pack="documents": every batch is (x, y, doc_ids) instead of (x, y) (see gptkit.data.windows).
data=chat (a ChatData): rows of whole conversations instead of windows, targets -100 where no loss
       (gptkit.data.chat); the same stateless choice of rows per step.
data=preference (a PreferenceData): batches of pairs, (x, y) [2 * batch_size, seq_len] with the chosen and
       the rejected answer of each pair side by side (gptkit.data.preference); the same stateless choice.
data=mix (a MixedData): windows from every source by its share (gptkit.data.mixture.MixtureSampler), the
val windows of every source, the sources announced at setup, their tokens consumed in `source_tokens`;
       `val_sources` then also names the sources (LitGPT reports val/loss/<source>).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import ConcatDataset, DataLoader, Dataset, IterableDataset

from gptkit.data.chat import ChatData, ChatSampler, describe_rows, make_rows
from gptkit.data.mixture import MixedData, MixtureSampler, announce
from gptkit.data.preference import PreferenceData, describe_pairs, make_pair_rows, pair_collate, pair_sampler
from gptkit.data.prepared import PreparedData
from gptkit.data.windows import WindowSampler, check_pack, check_window, val_starts, windows


class TrainBatches(IterableDataset):
    """Yields sampler.batch(step, rank, world_size) for step = start, start + 1, ... forever."""

    def __init__(self, sampler: WindowSampler, start_step: int, rank: int, world_size: int) -> None:
        self.sampler, self.start_step, self.rank, self.world_size = sampler, start_step, rank, world_size

    def __iter__(self):
        step = self.start_step
        while True:
            # x, y (, doc_ids): [batch_size, seq_len]
            yield self.sampler.batch(step, self.rank, self.world_size)
            step += 1


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


class TokenDataModule(L.LightningDataModule):
    """The Lightning DataModule of a run: stateless training windows drawn by (seed, step, rank) from
    prepared shards, a mixture or chat rows, and fixed validation windows."""

    def __init__(
        self,
        prepared: PreparedData | ChatData | PreferenceData | MixedData,
        batch_size: int = 12,
        seq_len: int = 128,
        seed: int = 1337,
        val_windows: int | None = 200,
        pack: str = "stream",
    ) -> None:
        super().__init__()
        self.prepared, self.batch_size, self.seq_len = prepared, int(batch_size), int(seq_len)
        self.seed, self.val_windows = int(seed), val_windows
        # (source names: [] for one corpus, [n_val_windows] source index of each val window), set by
        # val_dataloader; None for data=chat
        self.val_sources: tuple[list[str], torch.Tensor] | None = None
        if isinstance(prepared, ChatData):
            self._chat_rows(prepared)
            return
        if isinstance(prepared, PreferenceData):
            self._pair_rows(prepared)
            return
        check_pack(pack, prepared.eos_id)
        self.eos_id = prepared.eos_id if pack == "documents" else None
        self.parts = prepared.parts if isinstance(prepared, MixedData) else [prepared]
        if isinstance(prepared, MixedData):
            self.sampler = MixtureSampler(
                [p.train_tokens() for p in self.parts],
                prepared.shares,
                self.batch_size,
                self.seq_len,
                self.seed,
                self.eos_id,
                vocab_size=prepared.vocab_size,
            )
        else:
            self.sampler = WindowSampler(
                prepared.train_tokens(),
                self.batch_size,
                self.seq_len,
                self.seed,
                self.eos_id,
                vocab_size=prepared.vocab_size,
            )
        for p in self.parts:
            check_window(len(p.val_tokens()), self.seq_len, "val")
        self._consumed: dict = {}

    def setup(self, stage: str) -> None:
        trainer = getattr(self, "trainer", None)
        rank_zero = trainer is None or trainer.is_global_zero
        if isinstance(self.prepared, MixedData) and stage == "fit" and rank_zero:
            budget = (
                None
                if trainer is None
                else (
                    trainer.max_steps
                    * trainer.accumulate_grad_batches
                    * trainer.world_size
                    * self.batch_size
                    * self.seq_len
                )
            )
            announce(self.prepared, budget)

    def source_tokens(self, step: int) -> dict[str, float]:
        """data/tokens_<source>: train tokens drawn from each source of a mixture in the first `step`
        optimizer steps, all ranks (empty for one source)."""
        if not isinstance(self.prepared, MixedData):
            return {}
        trainer = getattr(self, "trainer", None)
        accum, world = (1, 1) if trainer is None else (trainer.accumulate_grad_batches, trainer.world_size)
        counts = self.sampler.consumed(step * accum, world, self._consumed)
        return {f"data/tokens_{n}": float(c * self.seq_len) for n, c in zip(self.prepared.names, counts)}

    def _chat_rows(self, chat: ChatData) -> None:
        s = chat.settings
        train, val = (
            make_rows(split, self.seq_len, s["pack"], s["train_on"], s["truncate"], chat.pad_id)
            for split in (chat.train, chat.val)
        )
        self.sampler = ChatSampler(train, self.batch_size, self.seed)
        n_val = len(val) if self.val_windows is None else min(len(val), int(self.val_windows))
        # rows of [seq_len] tensors, batched by the loader
        self._val = [val.batch(i) for i in range(n_val)]
        if rank_zero_only.rank == 0:
            import sys

            print(describe_rows(train, val, self.seq_len, s), file=sys.stderr)

    def _pair_rows(self, data: PreferenceData) -> None:
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        s = data.settings
        train, val = (
            make_pair_rows(split, self.seq_len, s["truncate"], data.pad_id)
            for split in (data.train, data.val)
        )
        self.sampler = pair_sampler(train, self.batch_size, self.seed)
        n_val = len(val) if self.val_windows is None else min(len(val), int(self.val_windows))
        # pairs (x, y [2, seq_len], their index in the val set), batched by pair_collate: the index lets
        # LitGPT count each pair once under DDP (DistributedSampler pads a rank with repeats)
        self._val = [(*val[i], torch.tensor(i, dtype=torch.long)) for i in range(n_val)]
        if rank_zero_only.rank == 0:
            import sys

            print(describe_pairs(train, val, self.seq_len, s), file=sys.stderr)

    def _position(self) -> tuple[int, int, int]:
        """(micro-step to start at, rank, world size) from the attached trainer, if any."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 0, 1
        return trainer.global_step * trainer.accumulate_grad_batches, trainer.global_rank, trainer.world_size

    def _pin(self) -> bool:
        """Pinned host memory on a GPU: Lightning then copies each batch with non_blocking=True, so the copy
        overlaps the running step instead of waiting for it."""
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        step, rank, world = self._position()
        return DataLoader(
            TrainBatches(self.sampler, step, rank, world),
            batch_size=None,
            num_workers=0,
            pin_memory=self._pin(),
        )

    def val_dataloader(self) -> DataLoader:
        if isinstance(self.prepared, ChatData):
            return DataLoader(
                self._val, batch_size=self.batch_size, shuffle=False, num_workers=0, pin_memory=self._pin()
            )
        if isinstance(self.prepared, PreferenceData):
            return DataLoader(
                self._val,
                batch_size=self.batch_size,
                shuffle=False,
                num_workers=0,
                pin_memory=self._pin(),
                collate_fn=pair_collate,
            )
        each = None if self.val_windows is None else max(1, int(self.val_windows) // len(self.parts))
        n = each if len(self.parts) > 1 else self.val_windows
        sets = [
            ValWindows(p.val_tokens(), self.seq_len, n, self.eos_id, vocab_size=self.prepared.vocab_size)
            for p in self.parts
        ]
        sizes = torch.tensor([len(v) for v in sets])
        source_of = torch.repeat_interleave(torch.arange(len(sets)), sizes)  # [n_val_windows]
        names = list(self.prepared.names) if isinstance(self.prepared, MixedData) else []
        # one corpus: no names (no per-source figures), source 0
        self.val_sources = (names, source_of)
        ds = TaggedWindows(ConcatDataset(sets))
        return DataLoader(
            ds, batch_size=self.batch_size, shuffle=False, num_workers=0, pin_memory=self._pin()
        )
