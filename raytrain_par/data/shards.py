"""Parquet shards: how prepared data is stored on disk and decoded back into tensors.

Rows are stored with fixed-size binary cells (int32 token ids, uint8 pixels) so that any reader,
pyarrow here or Ray Data on a cluster, hands back the same bytes, and decoding is one
`np.frombuffer` per batch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

ROWS_PER_SHARD = 16384
# Validation fraction held out of sets with no validation split of their own.
DEFAULT_VAL_FRACTION = 0.05


@dataclass
class DatasetInfo:
    """What a worker needs to know of a prepared data set. JSON-serialisable."""

    name: str
    kind: str  # "text" | "image"
    train_path: str
    val_path: str
    num_train: int
    num_val: int
    seq_len: int | None = None
    vocab_size: int | None = None
    tokenizer_path: str | None = None
    image_shape: list[int] | None = None  # [C, H, W] as stored
    num_classes: int | None = None
    mean: float = 0.0
    std: float = 1.0
    # Rows whose pixels are decoded by Ray Data from image files listed in the shards (ImageNet).
    encoded_images: bool = False
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "DatasetInfo":
        return cls(**d)

    @property
    def sample_bytes(self) -> int:
        if self.kind == "text":
            return 4 * (self.seq_len + 1)
        c, h, w = self.image_shape
        return c * h * w


def write_split(directory: Path, columns: dict[str, np.ndarray]) -> int:
    """Write one split (`columns`: equal-length arrays, first axis = rows) as Parquet shards."""
    with SplitWriter(directory) as out:
        out.add(columns)
    return out.num_rows


class SplitWriter:
    """Writes one split as it arrives, a shard of ROWS_PER_SHARD rows at a time, so that a split larger
    than memory never has to be held whole. `add` takes columns (as `write_split`) or an Arrow table;
    leaving the `with` block writes the last, partial shard (an empty one if no row came)."""

    def __init__(self, directory: Path):
        self.directory, self.num_rows, self.shards = directory, 0, 0
        self.pending: list[pa.Table] = []
        directory.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> "SplitWriter":
        return self

    def add(self, rows: dict[str, np.ndarray] | pa.Table) -> None:
        table = rows if isinstance(rows, pa.Table) else pa.table({k: _column(v) for k, v in rows.items()})
        self.pending.append(table)
        self.num_rows += len(table)
        while sum(len(t) for t in self.pending) >= ROWS_PER_SHARD:
            self._write(ROWS_PER_SHARD)

    def _write(self, n: int) -> None:
        table = pa.concat_tables(self.pending)
        pq.write_table(table.slice(0, n), self.directory / f"part-{self.shards:05d}.parquet")
        self.shards += 1
        self.pending = [table.slice(n)] if n < len(table) else []

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and (self.pending or self.shards == 0):
            self.pending = self.pending or [pa.table({})]
            self._write(sum(len(t) for t in self.pending))
        return False


def write_batches(batches: Iterable[dict[str, np.ndarray]], directory: Path) -> int:
    """Write a split that arrives as batches of columns; returns its row count."""
    with SplitWriter(directory) as split:
        for batch in batches:
            split.add(batch)
    return split.num_rows


def split_rows(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (sorted) of the training and the held-out validation rows of a split of n rows."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * fraction)))
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def write_held_out(batches: Iterable[dict[str, np.ndarray]], out: Path, fraction: float, seed: int) -> tuple[int, int]:
    """out/train and out/val from rows that arrive as batches, `fraction` of them (chosen as `split_rows`
    chooses them) held out for validation. The rows are written once as they come, then sorted into
    the two splits shard by shard: only the row count's permutation is held in memory."""
    every = out / "rows"
    n = write_batches(batches, every)
    held = np.zeros(n, dtype=bool)
    held[split_rows(n, fraction, seed)[1]] = True
    start = 0
    with SplitWriter(out / "train") as train, SplitWriter(out / "val") as val:
        for f in sorted(every.glob("*.parquet"), key=lambda f: int(f.stem.split("-")[1])):  # written order
            table = pq.read_table(f)
            mask = pa.array(held[start:start + len(table)])
            start += len(table)
            train.add(table.filter(pc.invert(mask)))
            val.add(table.filter(mask))
    shutil.rmtree(every)
    return train.num_rows, val.num_rows


def _column(arr: np.ndarray) -> pa.Array:
    if arr.ndim == 1 and arr.dtype != object:
        return pa.array(arr)
    if arr.dtype == object:  # already bytes / strings
        return pa.array(list(arr))
    flat = np.ascontiguousarray(arr).reshape(arr.shape[0], -1)
    width = flat.shape[1] * flat.itemsize
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(flat), [None, pa.py_buffer(flat.tobytes())])


def decode(info: DatasetInfo, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """A batch of stored rows (numpy columns, as pyarrow or Ray Data give them) -> tensors."""
    if info.kind == "text":
        tokens = _frombytes(batch["tokens"], np.int32).reshape(-1, info.seq_len + 1)
        return {"tokens": torch.from_numpy(tokens)}
    if "image" not in batch:  # an index of image files (imagenet-folder) not yet decoded by Ray Data
        batch = decode_image_files(info, batch)
    images = _frombytes(batch["image"], np.uint8).reshape(-1, *info.image_shape)
    return {"image": torch.from_numpy(images), "label": torch.from_numpy(np.array(batch["label"], dtype=np.int64))}


def decode_image_files(info: DatasetInfo, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rows of (path, label) -> rows of (image bytes, label); Ray Data runs this as a map over the
    data set on a cluster so that JPEG decoding is spread over the cluster's CPUs."""
    from .images import decode_images

    pixels = decode_images(list(batch["path"]), info.image_shape[-1])
    return {"image": np.array([p.tobytes() for p in pixels], dtype=object), "label": np.asarray(batch["label"])}


def _frombytes(column, dtype) -> np.ndarray:
    if isinstance(column, np.ndarray) and column.dtype != object:
        if column.dtype.kind in ("S", "V"):
            return np.frombuffer(column.tobytes(), dtype=dtype).copy()
        return column.astype(dtype)
    return np.frombuffer(b"".join(bytes(x) for x in column), dtype=dtype).copy()


def concat(batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    parts: dict[str, list[torch.Tensor]] = {}
    for b in batches:
        for k, v in b.items():
            parts.setdefault(k, []).append(v)
    if not parts:
        raise ValueError("the split holds no rows")
    return {k: torch.cat(v) for k, v in parts.items()}


def read_split(info: DatasetInfo, path: str) -> dict[str, torch.Tensor]:
    """Read a whole split with pyarrow (no Ray): what tests and plain torchrun use."""
    return concat(iter_split(info, path))


def iter_split(info: DatasetInfo, path: str, batch_size: int = 8192) -> Iterator[dict[str, torch.Tensor]]:
    for f in sorted(Path(path).glob("*.parquet")):
        for rb in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
            yield decode(info, {name: rb.column(name).to_numpy(zero_copy_only=False) for name in rb.schema.names})


class atomic_dir:
    """Build a directory under a temporary name and move it into place only when complete, so that
    an interrupted preparation never leaves a half-written cache that looks finished."""

    def __init__(self, final: Path):
        self.final = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # another process finished the same preparation first
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def load_info(directory: Path) -> DatasetInfo | None:
    f = directory / "info.json"
    if not f.exists():
        return None
    return DatasetInfo.from_json(json.loads(f.read_text()))


def save_info(directory: Path, info: DatasetInfo) -> None:
    (directory / "info.json").write_text(json.dumps(info.to_json(), indent=1))
