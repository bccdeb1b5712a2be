"""The Lightning DataModule of a run: any prepared data kind, through its face (gptkit/data/face.py).

train: an endless IterableDataset of the feed's sampler batches starting at micro-step
       trainer.global_step * trainer.accumulate_grad_batches (Lightning restores global_step before it
       asks for the dataloader, so a resumed run continues exactly), for trainer.global_rank of
       trainer.world_size. Without a trainer: step 0, rank 0 of 1.
val:   the feed's fixed validation items, the same for every run on the same data, batched in order.
       `val_sources` (from the feed) names each item's source when the items carry their index in the set
       (LitGPT then counts each once under DDP and reports val/loss/<source> for a mixture).

What a batch holds is the kind's business: windows (x, y) or (x, y, doc_ids) of a token stream, rows of
conversations, pairs of answers; this module never asks which.
"""

from __future__ import annotations

import sys

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from gptkit.data.face import Prepared


class TrainBatches(IterableDataset):
    """Yields sampler.batch(step, rank, world_size) for step = start, start + 1, ... forever."""

    def __init__(self, sampler, start_step: int, rank: int, world_size: int) -> None:
        self.sampler, self.start_step, self.rank, self.world_size = sampler, start_step, rank, world_size

    def __iter__(self):
        step = self.start_step
        while True:
            # x, y (, doc_ids): [batch_size, seq_len]
            yield self.sampler.batch(step, self.rank, self.world_size)
            step += 1


def data_ranks(trainer) -> tuple[int, int]:
    """(this rank's place, how many) among the ranks that read distinct batches: every rank (DDP); with
    trainer=fsdp the dp coordinate of the run's mesh (training/mesh.py: the cp x tp ranks around a data rank
    read its batches), which the strategy's distributed_sampler_kwargs give."""
    ranks = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return ranks.get("rank", trainer.global_rank), ranks.get("num_replicas", trainer.world_size)


class TokenDataModule(L.LightningDataModule):
    """Stateless training batches drawn by (seed, step, rank) and fixed validation items, of any kind."""

    def __init__(
        self,
        prepared: Prepared,
        batch_size: int = 12,
        seq_len: int = 128,
        seed: int = 1337,
        val_windows: int | None = 200,
        pack: str | None = None,
    ) -> None:
        super().__init__()
        self.prepared, self.batch_size, self.seq_len = prepared, int(batch_size), int(seq_len)
        self.seed, self.val_windows = int(seed), val_windows
        self.feed = prepared.connect(self.batch_size, self.seq_len, self.seed, val_windows, pack)
        self.sampler = self.feed.sampler
        # (source names: [] for one source, [n_val] source index of each val item); None: untagged items
        self.val_sources = self.feed.val_sources

    def setup(self, stage: str) -> None:
        trainer = getattr(self, "trainer", None)
        if stage != "fit" or not (trainer is None or trainer.is_global_zero):
            return
        budget = None
        if trainer is not None:
            budget = (
                trainer.max_steps
                * trainer.accumulate_grad_batches
                * data_ranks(trainer)[1]
                * self.batch_size
                * self.seq_len
            )
        for line in self.feed.announce(budget):
            print(line, file=sys.stderr)

    def source_tokens(self, step: int) -> dict[str, float]:
        """data/tokens_<source>: train tokens drawn from each source in the first `step` optimizer steps, all
        ranks (empty for one source)."""
        trainer = getattr(self, "trainer", None)
        accum, world = (
            (1, 1) if trainer is None else (trainer.accumulate_grad_batches, data_ranks(trainer)[1])
        )
        counts = self.feed.consumed(step * accum, world)
        return {f"data/tokens_{name}": float(n * self.seq_len) for name, n in counts.items()}

    def _position(self) -> tuple[int, int, int]:
        """(micro-step to start at, rank, world size) from the attached trainer, if any."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 0, 1
        return trainer.global_step * trainer.accumulate_grad_batches, *data_ranks(trainer)

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
        return DataLoader(
            self.feed.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=0,
            pin_memory=self._pin(),
            collate_fn=self.feed.collate,
        )
