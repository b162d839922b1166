"""Batches for one worker: which rows of each global batch are this worker's, epoch by epoch.

Two loaders, one interface (`steps_per_epoch`, `epoch(e, start_step)`), and one rule: the rows of a
step depend only on the seed, the epoch, the step and the global batch, never on the number of
workers or the strategy. Data-parallel rank r takes the r-th slice of each global batch; the pipeline
and tensor-parallel ranks of one replica read the same slice. So every layout trains the same global
batches as one process, and a run resumed on another number of workers or under another layout
continues at the exact row it stopped at.

- `MemoryLoader` holds the whole split in memory (read once, through Ray Data under Ray) and draws
  every global batch from a permutation of all its rows seeded by (seed, epoch).
- `StreamLoader` reads the split's Parquet shards as it goes, for data sets too large to hold:
  in an order of shards seeded by (seed, epoch), a window of several shards at a time, the rows of
  each window permuted by a generator seeded by (seed, epoch, window), so that a batch mixes rows of
  several shards (a split written in order -- an image folder class by class, a corpus document by
  document -- would otherwise give batches of a few classes or documents). It holds one window of
  stored rows and decodes only its own slice of each global batch (images: only its own files), the
  next batch in a thread while the step trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

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

    def epoch(self, epoch: int, start_step: int = 0, start_row: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The epoch's batches from step `start_step`, or from its row `start_row` (a run whose batch
        changed: the rows before it were trained on at other batch sizes)."""
        perm = self.order(epoch)
        first = start_step * self.global_batch if start_row is None else start_row
        for begin in range(first, self.n - self.global_batch + 1, self.global_batch):
            idx = perm[begin + self.offset: begin + self.offset + self.local]
            yield {k: v[idx] for k, v in self.arrays.items()}


class StreamLoader:
    """This replica's slice of each global batch, streamed from the Parquet shards under `path`.

    Why not Ray Data's streaming split: it hands blocks to workers as they ask for them, so which rows a
    worker trains depends on the number of workers and on timing, and the pipeline and tensor ranks of
    one replica would read different rows; no Ray Data API gives one order for every worker count. Each
    worker reads every shard here (the whole window, with pyarrow; decoding only its slice), so the path
    must be readable from every worker, as Ray Data's read tasks need it to be."""

    #: shards a window holds at least (all of them where the split has fewer)
    WINDOW_SHARDS = 4

    def __init__(self, path: str, decode: Callable[[dict], dict[str, torch.Tensor]], global_batch: int,
                 dp_rank: int, dp_size: int, seed: int, window_rows: int | None = None, prefetch: bool = True):
        import pyarrow.parquet as pq

        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        self.files = sorted(str(f) for f in Path(path).glob("*.parquet"))
        self.rows = [pq.ParquetFile(f).metadata.num_rows for f in self.files]
        self.decode, self.global_batch, self.seed, self.prefetch = decode, global_batch, seed, prefetch
        self.local = global_batch // dp_size
        self.offset = dp_rank * self.local
        self.n = sum(self.rows)
        self.steps_per_epoch = self.n // global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"global batch {global_batch} is larger than the {self.n} rows of the split")
        # rows held at once: several global batches, and the rows of WINDOW_SHARDS shards
        self.window_rows = window_rows or max(8 * global_batch, sum(sorted(self.rows)[-self.WINDOW_SHARDS:]))

    def windows(self, epoch: int) -> list[list[int]]:
        """The shards of each window of an epoch, in the epoch's order (by their row counts alone)."""
        g = torch.Generator().manual_seed(_seed(self.seed, epoch))
        out, rows = [[]], 0
        for i in torch.randperm(len(self.files), generator=g).tolist():
            if rows >= self.window_rows:
                out.append([])
                rows = 0
            out[-1].append(i)
            rows += self.rows[i]
        return out

    def _window(self, epoch: int, w: int, shards: list[int]):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.concat_tables([pq.read_table(self.files[i]) for i in shards])
        g = torch.Generator().manual_seed(_seed(self.seed, epoch, w))
        return table.take(pa.array(torch.randperm(len(table), generator=g).numpy()))

    def epoch(self, epoch: int, start_step: int = 0, start_row: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """As MemoryLoader.epoch."""
        first = start_step * self.global_batch if start_row is None else start_row
        batches = (self.decode(rows) for rows in self._rows(epoch, first))
        return _ahead(batches) if self.prefetch else batches

    def _rows(self, epoch: int, first: int) -> Iterator[dict]:
        """This replica's stored rows of each step from the epoch's row `first` (those before it were
        trained on already), undecoded."""
        import pyarrow as pa

        pending, held, at, end = [], 0, first, 0
        for w, shards in enumerate(self.windows(epoch)):
            begin, end = end, end + sum(self.rows[i] for i in shards)  # the window's rows in the epoch
            if end <= first:  # wholly before the resumed step: not read
                continue
            table = self._window(epoch, w, shards)
            if begin < first:
                table = table.slice(first - begin)
            pending.append(table)
            held += len(table)
            while held >= self.global_batch and at + self.global_batch <= self.n:
                rows = pa.concat_tables(pending)
                batch = rows.slice(self.offset, self.local)
                yield {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.column_names}
                pending, held, at = [rows.slice(self.global_batch)], held - self.global_batch, at + self.global_batch
            if at + self.global_batch > self.n:
                return


def _seed(*parts: int) -> int:
    """A generator seed from (seed, epoch[, window]), within the 64 bits torch takes, for any seed."""
    import hashlib

    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _ahead(items: Iterator, depth: int = 2) -> Iterator:
    """`items` computed in a thread, up to `depth` ahead of the consumer (decoding images, reading the
    next window while the step trains); its errors are raised where the item would have come, and a
    consumer that stops early stops the thread."""
    import queue
    import threading

    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry) -> bool:
        """Hand `entry` over, unless the consumer has stopped (then False)."""
        while not stop.is_set():
            try:
                out.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((done, e))

    thread = threading.Thread(target=produce, daemon=True, name="stream-loader")
    thread.start()
    try:
        while True:
            item, error = out.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()


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
