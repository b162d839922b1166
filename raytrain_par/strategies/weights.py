"""The plain model's weights by name: made whole one tensor at a time (`one_by_one`, for an engine's
`plain_weights`), as a state dict with its tied entries; safetensors' names of torch's dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

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
