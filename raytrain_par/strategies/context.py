"""Where a worker sits and computes: its rank among the workers, its device, and the dtypes a
`train.precision` names. Read by every engine; no process group is created here."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DistContext:
    """Where this worker sits: its rank among `world_size` and the device it computes on."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def current(cls, device: torch.device | str | None = None) -> "DistContext":
        """From the default process group (if any); device defaults to this rank's GPU or the CPU."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        local = int(os.environ.get("LOCAL_RANK", 0))
        if device is None:
            device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank, world, local, torch.device(device))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

