"""One checkpoint format under the plain model's parameter names, beside each engine's own files.

A checkpoint directory holds `model.safetensors` (the plain model's weights, gathered: weights.py) and,
for the engines that share the format (`Engine.shares_format`), these two:

    optimizer.safetensors   every optimizer state tensor of a parameter at the parameter's global shape,
                            under `<parameter name>/<state name>`, e.g. `transformer.h.0.attn.c_attn.weight/exp_avg`
    index.json              format version, step, the optimizer's class, the learning-rate schedule's and
                            the loss scaler's state (numbers), each tensor's shape and dtype

No pickle anywhere: safetensors and JSON. An engine supplies the full, name-keyed view of its
parameters' optimizer states (gathered as its weights are for model.safetensors) and, to resume, takes
whole tensors by name and cuts its own slices, as it cuts random weights: so a checkpoint resumes under
any engine that shares the format, on any number of workers (anchors: DeepSpeed's universal
checkpoints, one "atom" per parameter at its global shape; torch DCP's re-sharding by global offsets,
whose metadata is a pickle this project does not load). ddp and fsdp share it; the other engines keep
their own files until they do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.safetensors"
INDEX_FILE = "index.json"
FORMAT = 1


def write(directory: Path, states: dict[str, dict[str, torch.Tensor]], extras: dict, step: int) -> None:
    """Rank 0: the optimizer states by parameter name (whole tensors) and the index."""
    from safetensors.torch import save_file

    tensors = {f"{name}/{key}": v.detach().cpu().contiguous() for name, s in states.items()
               for key, v in s.items() if isinstance(v, torch.Tensor)}
    scalars = {f"{name}/{key}": v for name, s in states.items() for key, v in s.items()
               if not isinstance(v, torch.Tensor)}
    save_file(tensors, str(directory / OPTIMIZER_FILE))
    index = {"format": FORMAT, "step": step, **extras, "scalars": scalars,
             "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                         for k, v in tensors.items()}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1, default=_number))


def present(directory: Path) -> bool:
    return (directory / INDEX_FILE).is_file() and (directory / OPTIMIZER_FILE).is_file()


def read(directory: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The optimizer states by parameter name (whole tensors, on the CPU) and the index."""
    from safetensors.torch import load_file

    index = json.loads((directory / INDEX_FILE).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{directory / INDEX_FILE}: format {index.get('format')!r}, this release reads {FORMAT}")
    states: dict[str, dict] = {}
    for key, value in [*load_file(str(directory / OPTIMIZER_FILE)).items(), *index.get("scalars", {}).items()]:
        name, _, state = key.rpartition("/")
        states.setdefault(name, {})[state] = value
    return states, index


def _number(value):
    """JSON for what a schedule's or scaler's state holds besides numbers: a 0-dim tensor as its number."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")
