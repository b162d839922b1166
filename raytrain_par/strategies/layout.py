"""The parallel layout: how num_workers ranks divide into pipeline (P), tensor (T) and data (D)
parallel ranks, computed once, and read by every engine, the data loader, `estimate` and the records.

`Layout` is the degrees alone (no processes needed): each strategy's options say theirs
(`Options.layout(num_workers)`; `ExperimentSpec.layout` asks it), and config.py, `estimate` and the
per-worker batch read it. `Placement` is one rank's place in it, with the process groups: built
once per worker (`place`), as torchtitan builds its device mesh from (pp, dp, tp) degrees.

Rank order: rank = (p * D + d) * T + t for pipeline rank p, data-parallel rank d and tensor rank t.
The T ranks of a tensor-parallel group are neighbours (one node: they all-reduce activations in every
layer), the D replicas of one stage follow (a gradient all-reduce per step), and pipeline ranks are
farthest apart (point to point, once per microbatch). With T = 1 that is the pipeline engines'
p * D + d, with P = 1 megatron's d * T + t.

`sharding` is how the data-parallel dimension holds model states: `none` (replicated, gradients
all-reduced), `fsdp` (FSDP2 over the replicas), or a ZeRO stage (DeepSpeed, data parallel only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist


class Coordinates(NamedTuple):
    pipeline: int
    data: int
    tensor: int


@dataclass(frozen=True)
class Layout:
    pipeline: int = 1  # P: pipeline ranks (each holds a run of layers)
    tensor: int = 1  # T: ranks each layer is split over
    data: int = 1  # D: replicas (or shards) of the model that read different rows
    sharding: str = "none"  # how the D replicas hold model states: none, fsdp, zero-1, zero-2, zero-3

    @classmethod
    def of(cls, workers: int, pipeline: int = 1, tensor: int = 1, sharding: str = "none") -> "Layout":
        """D = workers / (P x T) (at least 1; config.py rejects degrees that do not divide the workers)."""
        return cls(pipeline, tensor, max(1, workers // (pipeline * tensor)), sharding)

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data

    def coordinates(self, rank: int) -> Coordinates:
        rest, t = divmod(rank, self.tensor)
        p, d = divmod(rest, self.data)
        return Coordinates(p, d, t)

    def rank_of(self, pipeline: int, data: int, tensor: int) -> int:
        return (pipeline * self.data + data) * self.tensor + tensor

    def readers(self, data: int) -> list[int]:
        """The ranks that read data-parallel slice `data` of each global batch (its pipeline and tensor
        ranks)."""
        return [self.rank_of(p, data, t) for p in range(self.pipeline) for t in range(self.tensor)]

    def columns(self) -> dict:
        """The layout in a record (metrics/records.py)."""
        return {"pipeline_parallel": self.pipeline, "tensor_parallel": self.tensor, "data_parallel": self.data,
                "data_parallel_sharding": self.sharding}

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("pipeline", self.pipeline), ("tensor", self.tensor)) if v > 1]
        data = f"data {self.data}" + (f" ({self.sharding})" if self.sharding != "none" else "")
        return " x ".join(parts + [data])


@dataclass(eq=False)
class Placement:
    """One rank's place in a layout: its coordinates and the groups of its pipeline (`pp_group`: the
    ranks of other stages with its data and tensor ranks), its stage's replicas (`dp_group`) and its
    tensor-parallel group (`tp_group`). A group is None where it is the default group (data parallel
    over every worker) or where this process runs alone; `mesh` is torch's DeviceMesh (pp, dp, tp),
    for what takes one (FSDP2), or None then."""

    layout: Layout
    rank: int
    mesh: object = None
    pp_group: object = None
    dp_group: object = None
    tp_group: object = None

    @property
    def coordinates(self) -> Coordinates:
        return self.layout.coordinates(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.coordinates.pipeline

    @property
    def dp_rank(self) -> int:
        return self.coordinates.data

    @property
    def tp_rank(self) -> int:
        return self.coordinates.tensor

    @property
    def dp_size(self) -> int:
        return self.layout.data


_PLACED: dict[tuple, Placement] = {}


def place(layout: Layout, rank: int, world_size: int, device_type: str) -> Placement:
    """This rank's placement, with its process groups (collective: every rank calls it with the same
    layout). Built once per layout and process group: engines built again in one process (tests,
    benchmarks, a resumed loop) reuse the groups rather than create more."""
    if layout.world != world_size:
        raise ValueError(f"a layout of {layout.describe()} needs {layout.world} workers, not {world_size}")
    if world_size == 1 or (layout.pipeline == 1 and layout.tensor == 1):
        return Placement(layout, rank)  # the default group (or none) is the data-parallel group
    key = (layout, rank, device_type, id(dist.group.WORLD))
    if key not in _PLACED:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (layout.pipeline, layout.data, layout.tensor),
                                mesh_dim_names=("pp", "dp", "tp"))
        _PLACED[key] = Placement(layout, rank, mesh, *(mesh.get_group(n) for n in ("pp", "dp", "tp")))
    return _PLACED[key]


# Which strategy composes which dimensions; ZeRO is DeepSpeed's own data parallel and composes with none.
SUPPORTED = ("ddp, zero-1/2/3, fsdp: data parallel only; megatron: tensor x data (data_parallel_sharding none "
             "or fsdp) and tensor x pipeline x data with stages (none or fsdp); pipeline: pipeline x data (none or fsdp); "
             "pipedream: pipeline x data (none)")


def check_sharding(value: str, allowed: tuple[str, ...], field_: str, error) -> None:
    """`data_parallel_sharding` of a strategy that composes with data parallel: one of `allowed`."""
    if value in allowed:
        return
    if value.startswith("zero"):
        error(field_, value, "DeepSpeed's ZeRO is a strategy of its own and does not combine with tensor or "
              f"pipeline parallel (supported layouts: {SUPPORTED})",
              f"use {' or '.join(allowed)}, or strategy {value} for ZeRO alone")
    error(field_, value, f"not one of {', '.join(allowed)} (supported layouts: {SUPPORTED})",
          f"use {' or '.join(allowed)}")
