"""Tensors sharded by FSDP2 (DTensors) and plain ones alike: this rank's slice, and the whole tensor (which
part of the whole a slice is: pieces.dtensor_piece)."""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (an FSDP-sharded DTensor's local slice; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def whole_tensor(t):
    """An FSDP-sharded DTensor gathered whole (a collective over its mesh); anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
