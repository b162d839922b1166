"""Pieces: which part of each of the plain model's tensors a rank holds, and the one function that fills a
rank's pieces from the pieces a checkpoint stored, whatever layout wrote them.

A piece is a tensor's global shape and the regions of it one rank holds, each region a box of the global
tensor (its offsets and lengths) and where that box lies in the rank's own tensor:
- a whole tensor (data parallel, a pipeline stage's layers): one region, the whole box;
- an n-dimensional slice (FSDP's rows, a DTensor's local shard): one box;
- Megatron's cut: a box per fused part (q, k and v each cut over the tensor ranks, laid side by side in the
  rank's tensor); the vocabulary's padding rows lie in no region;
- a flat range of the flattened tensor (DeepSpeed's partitions): the boxes that range is made of, each
  contiguous in the rank's 1-D tensor.

`Source.read_into` fills a rank's tensor from the stored pieces that overlap each of its regions, reading
only those parts of the files (`safetensors.safe_open(...).get_slice`): so any layout resumes any other's
checkpoint, the re-sharding written once (anchors: torch DCP's planner, which matches chunks by global
offsets; DeepSpeed's universal checkpoints, one atom per parameter re-sliced for any layout; Megatron-Core's
`dist_checkpointing`). A checkpoint whose tensor is missing, of another shape, or whose stored pieces
leave part of a rank's region uncovered is refused, naming the tensor and the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .weights import DTYPES, dtype_name


@dataclass(frozen=True)
class Region:
    """A box of the global tensor (`start`, `size` per dimension) and where it lies in the rank's tensor:
    at the offsets `at` of a box of the same size, or, an int, at that flat offset of a 1-D tensor."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    at: tuple[int, ...] | int

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The part of the rank's tensor this region fills (a view: writing it writes the tensor)."""
        if isinstance(self.at, int):
            return local.view(-1).narrow(0, self.at, self.numel).view(self.size)
        return local[tuple(slice(a, a + n) for a, n in zip(self.at, self.size))]


@dataclass(frozen=True)
class Piece:
    """The regions of a tensor of global `shape` that one rank holds."""

    shape: tuple[int, ...]
    regions: tuple[Region, ...]

    @classmethod
    def whole(cls, shape) -> "Piece":
        shape = tuple(shape)
        return cls(shape, (Region((0,) * len(shape), shape, (0,) * len(shape)),))

    @classmethod
    def box(cls, shape, start, size) -> "Piece":
        """The slice [start, start + size) of every dimension, the rank's whole tensor."""
        return cls(tuple(shape), (Region(tuple(start), tuple(size), (0,) * len(size)),))

    @classmethod
    def flat(cls, shape, start: int, numel: int) -> "Piece":
        """Elements [start, start + numel) of the tensor flattened in row-major order, held as the first
        `numel` elements of a 1-D tensor."""
        shape = tuple(shape)
        return cls(shape, tuple(Region(s, n, at - start) for s, n, at in _flat_boxes(shape, start, start + numel)))

    @property
    def numel(self) -> int:
        return sum(r.numel for r in self.regions)

    def within(self, start, size) -> "Piece":
        """The piece held by a rank whose tensor is the box [start, start + size) of this piece's rank's
        tensor (FSDP's rows of a Megatron shard): each region cut to that box, placed in it."""
        out = []
        for r in self.regions:
            assert not isinstance(r.at, int), "a flat piece is not cut further"
            lo = tuple(max(a, s) for a, s in zip(r.at, start))
            hi = tuple(min(a + n, s + m) for a, n, s, m in zip(r.at, r.size, start, size))
            if all(h > l for l, h in zip(lo, hi)):
                out.append(Region(tuple(g + l - a for g, l, a in zip(r.start, lo, r.at)),
                                  tuple(h - l for l, h in zip(lo, hi)), tuple(l - s for l, s in zip(lo, start))))
        return Piece(self.shape, tuple(out))


def _flat_boxes(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple = ()) -> Iterator[tuple[tuple, tuple, int]]:
    """The boxes (start, size, flat offset of their first element) that elements [lo, hi) of a row-major
    tensor of `shape` are made of: whole rows of the first dimension, and a part row at either end."""
    if hi <= lo:
        return
    if not shape:
        yield prefix, (), 0
        return
    if len(shape) == 1:
        yield (*prefix, lo), (*(1,) * len(prefix), hi - lo), lo
        return
    inner, depth = math.prod(shape[1:]), len(shape) - 1

    def rows(a, b):  # whole rows [a, b) of the first dimension
        return (*prefix, a, *(0,) * depth), (*(1,) * len(prefix), b - a, *shape[1:]), a * inner

    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi % inner):
        for s, n, at in _flat_boxes(shape[1:], lo - first * inner, hi - first * inner, (*prefix, first)):
            yield s, n, first * inner + at
        return
    if lo % inner:
        yield from _flat_boxes(shape, lo, (first + 1) * inner, prefix)
        first += 1
    end = hi // inner
    if end > first:
        yield rows(first, end)
    if hi % inner:
        yield from _flat_boxes(shape, end * inner, hi, prefix)


def dtensor_piece(t: torch.Tensor) -> Piece:
    """The piece a tensor is of its global tensor: a DTensor's local shard (its offsets from torch's own
    arithmetic, uneven shards included), or a plain tensor whole."""
    if not hasattr(t, "device_mesh"):
        return Piece.whole(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, start = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return Piece.box(t.shape, start, size)


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, length) of part i of `torch.chunk`ing n elements into `parts`."""
    size = -(-n // parts) if n else 0
    start = min(i * size, n)
    return start, min(size, n - start)


class PieceError(ValueError):
    """A checkpoint's stored pieces do not give a rank's piece: missing, of another shape, not covering it."""


@dataclass(frozen=True)
class Stored:
    """A stored piece: a tensor `key` of a safetensors `file`, the box [start, start + its shape) of the
    global tensor."""

    file: Path
    key: str
    start: tuple[int, ...]
    size: tuple[int, ...]


class Source:
    """The tensors of a checkpoint by name, as the pieces they were stored in (a file of whole tensors is
    the one-piece case), read piece by piece."""

    def __init__(self):
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.stored: dict[str, list[Stored]] = {}
        self.scalars: dict[str, object] = {}  # states that are numbers, not tensors (`<name>/<state>`)
        self.aliases: dict[str, str] = {}  # a name the model ties to another tensor's -> that tensor's name
        self._files: dict[Path, object] = {}
        self._states: dict[str, list[str]] | None = None

    def add_whole_file(self, path: Path) -> None:
        """Every tensor of a safetensors file of whole tensors (format 1's), under its key, and the names tied
        to them that its metadata lists ("aliases")."""
        handle = self._open(path)
        for key in handle.keys():
            sliced = handle.get_slice(key)
            shape = tuple(sliced.get_shape())
            self.add(key, shape, DTYPES[sliced.get_dtype()], Stored(Path(path), key, (0,) * len(shape), shape))
        self.aliases.update(json.loads((handle.metadata() or {}).get("aliases", "{}")))

    def add(self, name: str, shape, dtype: torch.dtype, piece: Stored) -> None:
        self.shapes[name], self.dtypes[name] = tuple(shape), dtype
        self.stored.setdefault(name, []).append(piece)

    def __contains__(self, name: str) -> bool:
        return self.original(name) in self.stored

    def original(self, name: str) -> str:
        """The name a tensor is stored under: `name`, or the tensor's it is tied to."""
        return name if name in self.stored else self.aliases.get(name, name)

    def state_keys(self, name: str) -> list[str]:
        """The names of parameter `name`'s optimizer states (stored as `<name>/<state>`), none if it has none."""
        if self._states is None:
            self._states = {}
            for key in [*self.stored, *self.scalars]:
                parameter, slash, state = key.rpartition("/")
                if slash:
                    self._states.setdefault(parameter, []).append(state)
        return self._states.get(name, [])

    def where(self, name: str) -> str:
        files = sorted({p.file.name for p in self.stored.get(name, [])})
        return ", ".join(files) or "the checkpoint"

    def read_into(self, name: str, piece: Piece, out: torch.Tensor) -> torch.Tensor:
        """Fill `out`, this rank's tensor of `name`, in each of `piece`'s regions from the stored pieces that
        overlap it (cast to `out`'s dtype, onto its device); parts of `out` in no region are left as they
        are. Returns `out`."""
        name = self.original(name)
        if name not in self.stored:
            raise PieceError(f"{name}: not in the checkpoint ({self.where(name)} has no such tensor)")
        if self.shapes[name] != tuple(piece.shape):
            raise PieceError(f"{name}: the checkpoint's {self.where(name)} holds it at shape {list(self.shapes[name])}, "
                             f"this model's is {list(piece.shape)}")
        for region in piece.regions:
            if region.numel == 0:
                continue
            target, covered = region.view(out), 0
            for s in self.stored[name]:
                lo = [max(a, b) for a, b in zip(region.start, s.start)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(region.start, region.size, s.start, s.size)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                data = self._read(s, lo, hi)
                part = target[tuple(slice(l - r, h - r) for l, h, r in zip(lo, hi, region.start))]
                part.copy_(data.view(part.shape))
                covered += data.numel()
            if covered != region.numel:
                raise PieceError(f"{name}: the checkpoint's pieces in {self.where(name)} cover {covered} of the "
                                 f"{region.numel} elements of [{_span(region.start, region.size)}] that this rank needs")
        return out

    def done(self) -> None:
        """Every piece read: what the source keeps to read more is let go (its open files)."""
        self._files.clear()

    def read(self, name: str) -> torch.Tensor:
        """A stored tensor whole (a scalar state, a small tensor every rank holds)."""
        name = self.original(name)
        out = torch.empty(self.shapes.get(name, ()), dtype=self.dtypes.get(name, torch.float32))
        return self.read_into(name, Piece.whole(out.shape), out)

    def _open(self, path: Path):
        path = Path(path)
        if path not in self._files:
            from safetensors import safe_open

            self._files[path] = safe_open(str(path), "pt")
        return self._files[path]

    def _read(self, s: Stored, lo, hi) -> torch.Tensor:
        handle = self._open(s.file)
        if not s.size:
            return handle.get_tensor(s.key)
        return handle.get_slice(s.key)[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, s.start))]


PIECES_FILE = "pieces-rank{rank}.safetensors"
PIECES_INDEX = "pieces-rank{rank}.json"


class SafetensorsStream:
    """A safetensors file written as its tensors come, each byte once: the header (every entry's dtype, shape
    and offsets, known before any data) first, then each tensor's bytes in the order the entries were given,
    hashed as they are written. (safetensors' own writer takes every tensor at once.)"""

    def __init__(self, path: Path, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, self.order, offset = {}, [], 0
        if metadata:
            header["__metadata__"] = metadata
        for key, shape, dtype in entries:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.order.append((key, nbytes))
            offset += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        self.file = open(self.path, "wb")
        self.hash = hashlib.sha256()
        self._write(struct.pack("<Q", len(head)) + head)
        self._next = 0

    def _write(self, data) -> None:
        self.file.write(data)
        self.hash.update(data)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """The next entry's bytes, from `tensor` (any device, any layout, of the entry's shape and dtype)."""
        expected, nbytes = self.order[self._next]
        assert key == expected, f"{key} written out of order ({expected} next)"
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == nbytes, (key, data.nbytes, nbytes)
        self._write(memoryview(data))
        self._next += 1

    def close(self) -> dict:
        """The file closed, every entry written; its size and SHA-256."""
        assert self._next == len(self.order), f"{len(self.order) - self._next} entries not written"
        self.file.close()
        return {"bytes": self.path.stat().st_size, "sha256": self.hash.hexdigest()}


class PieceWriter:
    """One rank's pieces in one safetensors file (`SafetensorsStream`: each byte written once, hashed as it is
    written). Beside it, the rank's part of the index: each entry's tensor name, global shape and box."""

    def __init__(self, directory: Path, rank: int, entries: Iterable[tuple[str, Piece, torch.dtype]]):
        """`entries`: (tensor name, piece, dtype) of each tensor this rank writes, in the order `add` will
        be called; each region of a piece is an entry of its own (`<name>#<k>`)."""
        self.index_path = Path(directory) / PIECES_INDEX.format(rank=rank)
        stream, tensors = [], {}
        for name, piece, dtype in entries:
            stored = tensors.setdefault(name, {"shape": list(piece.shape), "dtype": dtype_name(dtype), "pieces": []})
            for k, region in enumerate(piece.regions):
                stream.append((f"{name}#{k}", tuple(region.size), dtype))
                stored["pieces"].append({"key": f"{name}#{k}", "start": list(region.start)})
        self.tensors = tensors
        self.stream = SafetensorsStream(Path(directory) / PIECES_FILE.format(rank=rank), stream)
        self.path = self.stream.path

    def add(self, name: str, piece: Piece, local: torch.Tensor) -> None:
        """The regions of `piece` from this rank's tensor `local`, in the order the entries were given."""
        for k, region in enumerate(piece.regions):
            self.stream.add(f"{name}#{k}", region.view(local.detach()))

    def close(self, scalars: dict | None = None, aliases: dict[str, str] | None = None) -> dict:
        """The file closed (every entry written) and the rank's index part written, with the states that are
        numbers and the names tied to another tensor's; the file's size and SHA-256."""
        done = self.stream.close()
        self.index_path.write_text(json.dumps({"file": self.path.name, "tensors": self.tensors,
                                               "scalars": scalars or {}, "aliases": aliases or {}}, indent=1))
        return done


def read_pieces(directory: Path) -> Source:
    """Every rank's pieces of a checkpoint (`PieceWriter`'s files), checked before anything is read: each
    tensor's pieces lie inside its shape, none overlaps another, together they cover it, every file the
    index names is there; else a PieceError naming the tensor and the files."""
    directory = Path(directory)
    source = Source()
    for part in sorted(directory.glob(PIECES_INDEX.format(rank="*"))):
        index = json.loads(part.read_text())
        path = directory / index["file"]
        if not path.is_file():
            raise PieceError(f"{part.name} names {index['file']}, which is not in {directory}")
        for name, entry in index["tensors"].items():
            shape, dtype = tuple(entry["shape"]), DTYPES[entry["dtype"]]
            if name in source.shapes and (source.shapes[name], source.dtypes[name]) != (shape, dtype):
                raise PieceError(f"{name}: {index['file']} holds it at shape {list(shape)} {entry['dtype']}, "
                                 f"{source.where(name)} at {list(source.shapes[name])}")
            sizes = source._open(path).get_slice
            for p in entry["pieces"]:
                size = tuple(sizes(p["key"]).get_shape())
                source.add(name, shape, dtype, Stored(path, p["key"], tuple(p["start"]), size))
        source.scalars.update(index.get("scalars", {}))
        source.aliases.update(index.get("aliases", {}))
    for name in source.stored:
        check_cover(source, name)
    return source


def check_cover(source: Source, name: str) -> None:
    """`name`'s stored pieces lie inside its shape, do not overlap, and cover it; else a PieceError."""
    shape, stored = source.shapes[name], source.stored[name]
    for i, s in enumerate(stored):
        if len(s.start) != len(shape) or any(a < 0 or a + n > m for a, n, m in zip(s.start, s.size, shape)):
            raise PieceError(f"{name}: the piece {s.key} of {s.file.name} ([{_span(s.start, s.size)}]) lies outside "
                             f"its shape {list(shape)}")
        for t in stored[:i]:
            if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(s.start, s.size, t.start, t.size)):
                raise PieceError(f"{name}: the pieces {t.key} of {t.file.name} and {s.key} of {s.file.name} overlap "
                                 f"([{_span(t.start, t.size)}] and [{_span(s.start, s.size)}])")
    covered = sum(math.prod(s.size) for s in stored)
    if covered != math.prod(shape):
        raise PieceError(f"{name}: its pieces in {source.where(name)} cover {covered} of its {math.prod(shape)} "
                         "elements (a rank's files are missing or cut short)")


def _span(start, size) -> str:
    return ", ".join(f"{a}:{a + n}" for a, n in zip(start, size))


