"""Batches for one worker: which rows of each global batch are this worker's, epoch by epoch.

Two loaders, one interface (`steps_per_epoch`, `epoch(e, start_step)`):

- `MemoryLoader` holds the whole split in memory (read once, through Ray Data under Ray) and draws
  every global batch from a permutation seeded by (seed, epoch); data-parallel rank r takes the
  r-th slice. Every worker count and strategy therefore sees exactly the same global batches, so
  losses compare one to one, and a resumed run restarts at the exact row it stopped at.
- `StreamLoader` streams this worker's shard (Ray Data's streaming split) for data sets too large
  to hold; order within an epoch is shuffled by a local buffer and is not reproducible row by row.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch


class MemoryLoader:
    def __init__(self, arrays: dict[str, torch.Tensor], global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool = True):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        self.arrays, self.global_batch, self.seed, self.shuffle = arrays, global_batch, seed, shuffle
        self.n = len(next(iter(arrays.values())))
        self.local = global_batch // dp_size
        self.offset = dp_rank * self.local
        self.steps_per_epoch = self.n // global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"global batch {global_batch} is larger than the {self.n} rows of the split")

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        perm = self.order(epoch)
        for step in range(start_step, self.steps_per_epoch):
            idx = perm[step * self.global_batch + self.offset: step * self.global_batch + self.offset + self.local]
            yield {k: v[idx] for k, v in self.arrays.items()}


class StreamLoader:
    def __init__(self, batches: Callable[[int], Iterable[dict[str, torch.Tensor]]], local_batch: int,
                 rows_per_worker: int):
        """`batches(epoch)` yields this worker's decoded batches of `local_batch` rows for one epoch."""
        self.batches, self.local = batches, local_batch
        self.steps_per_epoch = rows_per_worker // local_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"per-worker batch {local_batch} is larger than the {rows_per_worker} rows per worker")

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        for step, batch in enumerate(self.batches(epoch)):
            if step >= self.steps_per_epoch:
                return
            if step >= start_step:  # resuming mid-epoch: skip what was already trained on
                yield batch


def eval_batches(arrays: dict[str, torch.Tensor], batch: int, dp_rank: int, dp_size: int,
                 limit: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's part of the validation split (rows rank, rank + dp, ...): every row is evaluated by
    exactly one data-parallel rank, so summed metrics cover the split once."""
    n = len(next(iter(arrays.values())))
    if limit:
        n = min(n, limit)
    idx = torch.arange(dp_rank, n, dp_size)
    for start in range(0, len(idx), batch):
        sel = idx[start:start + batch]
        yield {k: v[sel] for k, v in arrays.items()}
