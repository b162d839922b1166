"""The plain model's weights by name: made whole one tensor at a time (`one_by_one`, for an engine's
`plain_weights`), as a state dict with its tied entries, and the weights file of a format-1 checkpoint
(`model.safetensors`, every weight whole, a tied one listed in its metadata), read without unpickling
anything. safetensors' names of torch's dtypes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


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
