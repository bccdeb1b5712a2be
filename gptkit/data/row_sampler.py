"""The rows of a templated kind's micro-batches (data=chat, preference, unpaired, prompts): which rows each
micro-step and rank trains on, a pure function of the seed and the step."""

from __future__ import annotations

from typing import Any

import numpy as np

from gptkit.errors import GptkitError


class RowSampler:
    """The rows of micro-step `step` are a pure function of (seed, step, rank, world_size), as WindowSampler's
    windows: a resumed run sees exactly the batches an uninterrupted one would. `rows` has len() and
    batch(indices); too_few: the one line when the rows are fewer than a global batch ({n} rows, {batch})."""

    def __init__(self, rows: Any, batch_size: int, seed: int, too_few: str) -> None:
        self.rows, self.batch_size, self.seed, self.too_few = rows, int(batch_size), int(seed), too_few

    def picked(self, step: int, world_size: int = 1) -> np.ndarray:
        """The rows of micro-step `step` over all the ranks, rank 0's first: [batch_size * world_size]
        distinct indices."""
        n = self.batch_size * world_size
        if n > len(self.rows):
            raise GptkitError(self.too_few.format(n=len(self.rows), batch=n))
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, int(step)])))
        return rng.choice(len(self.rows), size=n, replace=False)

    def mine(self, step: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """The rows of rank `rank`'s micro-batch of micro-step `step`: [batch_size] indices."""
        return self.picked(step, world_size)[rank * self.batch_size : (rank + 1) * self.batch_size]

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        return self.rows.batch(self.mine(step, rank, world_size))
