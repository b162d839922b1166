"""The plain model's weights in safetensors, without unpickling anything.

Every checkpoint carries the plain model's weights in one safetensors file, whatever the strategy
(written from `Engine.plain_weights()` by rank 0, one tensor at a time), so that a sharded checkpoint
can be exported without the process group that wrote it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def write_weights(weights, path: Path) -> None:
    """The plain model's weights -> safetensors, one tensor at a time: `weights` a state dict or (name,
    value) pairs, a value the tensor, None (not written here) or the name of an earlier entry it is tied
    to. Tied entries of a state dict (one storage) are found as such. safetensors refuses shared tensors,
    so a tied entry is written once and listed in the file's metadata."""
    out, aliases = StreamWriter(path), {}
    for name, value in tied(weights) if isinstance(weights, Mapping) else weights:
        if isinstance(value, str):
            aliases[name] = value
        elif value is not None:
            out.add(name, value)
    out.close({"aliases": json.dumps(aliases)})


def tied(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | str]]:
    """A state dict's entries, one that shares an earlier one's storage (a tied weight) as that one's name."""
    owner: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in owner:
            yield name, owner[key]
        else:
            owner[key] = name
            yield name, t


def one_by_one(state: Mapping[str, torch.Tensor], whole: Callable[[str, torch.Tensor], torch.Tensor],
               keep: bool) -> Iterator[tuple[str, torch.Tensor | str | None]]:
    """A state dict's entries (of the engine's own tensors: parameters, shards) made whole one at a time
    by `whole(name, t)` (a collective where it gathers: every rank goes through them), given where `keep`
    (None elsewhere); an entry holding the same tensor as an earlier one (a tied weight) by that one's name."""
    seen: dict[int, str] = {}
    for name, t in state.items():
        if id(t) in seen:
            yield name, seen[id(t)]
            continue
        seen[id(t)] = name
        value = whole(name, t).detach()
        yield name, value.cpu() if keep else None


def as_state_dict(weights: Iterable[tuple[str, torch.Tensor | str | None]]) -> dict[str, torch.Tensor]:
    """(name, tensor or the name it is tied to) pairs -> a state dict, tied entries one tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, value in weights:
        out[name] = out[value] if isinstance(value, str) else value
    return out


# safetensors' names of torch's dtypes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of a torch dtype."""
    return _NAMES[dtype]


class StreamWriter:
    """A safetensors file written one tensor at a time. safetensors' own writer takes every tensor at
    once, which would hold the whole model's weights or optimizer states in memory on the rank that
    writes, gathered from every rank's shards: here each tensor's bytes go to a side file as it comes,
    and at the end the header (which must come first and list every tensor) and the bytes into the
    file. Costs a second write of the data, not its memory."""

    def __init__(self, path: Path):
        self.path, self.side = path, path.with_name(path.name + ".part")
        self.data = open(self.side, "wb")
        self.entries: dict[str, dict] = {}
        self.offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy()
        self.data.write(memoryview(data))
        self.data.flush()  # on disk before the next tensor is gathered
        self.entries[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + data.nbytes]}
        self.offset += data.nbytes

    def close(self, metadata: dict[str, str] | None = None) -> None:
        self.data.close()
        header = json.dumps({**({"__metadata__": metadata} if metadata else {}), **self.entries},
                            separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(self.path, "wb") as out, open(self.side, "rb") as data:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            shutil.copyfileobj(data, out, 1 << 24)
        self.side.unlink()


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every weight of a `write_weights` file by name (a tied one under each of its names)."""
    return dict(WeightsFile(path))


class WeightsFile(Mapping):
    """The weights of a `write_weights` file by name, each read when it is asked for (an engine takes its
    slices one tensor at a time, never holding the whole model beyond what it keeps)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.file = safe_open(str(path), "pt")
        self.aliases = json.loads((self.file.metadata() or {}).get("aliases", "{}"))
        self.names = [*self.file.keys(), *self.aliases]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.file.get_tensor(self.aliases.get(name, name))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's shape, from the file's header (nothing read)."""
        return {name: tuple(self.file.get_slice(self.aliases.get(name, name)).get_shape()) for name in self.names}

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
