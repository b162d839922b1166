"""Tensors sharded by FSDP2 (DTensors) and plain ones alike: this rank's slice, the whole tensor, and a
whole tensor cut into this rank's slice (for checkpoints that do not depend on the sharding)."""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP-sharded DTensor's local slice; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole_tensor(t):
    """An FSDP-sharded DTensor gathered whole (a collective over its mesh); anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def slice_like(value, param):
    """A whole tensor cut into this rank's slice of `param`'s FSDP layout (no communication)."""
    if param is None or not hasattr(param, "device_mesh") or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def placed_like(value: torch.Tensor, param) -> torch.Tensor:
    """A whole tensor on `param`'s device, cut into this rank's slice where `param` is FSDP-sharded."""
    return slice_like(value.to(local_tensor(param).device), param)

