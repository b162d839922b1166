"""The plain model's weights in safetensors, without unpickling anything.

Every checkpoint carries the plain model's weights in one safetensors file, whatever the strategy
(written from `Engine.full_state_dict()` by rank 0), so that a sharded checkpoint can be exported
without the process group that wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """A state dict -> safetensors. Entries sharing a storage (tied weights) are written once and
    listed in the file's metadata, since safetensors refuses shared tensors."""
    from safetensors.torch import save_file

    kept, aliases, owner = {}, {}, {}
    for name, t in state.items():
        t = t.detach().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in owner:
            aliases[name] = owner[key]
        else:
            owner[key] = name
            kept[name] = t.contiguous()
    save_file(kept, str(path), metadata={"aliases": json.dumps(aliases)})


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for name, target in aliases.items():
        state[name] = state[target]
    return state


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

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
