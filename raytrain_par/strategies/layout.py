"""The parallel layout: how num_workers ranks divide into pipeline (P), tensor (T) and data (D)
parallel ranks, computed once, and read by every engine, the data loader, `estimate` and the records.

`Layout` is the degrees alone (no processes needed), as torchtitan's `ParallelDims`: P, T, D, how the
D replicas hold model states (`sharding`), and the pipeline's schedule, microbatches and stages per
worker. A strategy name is a preset of it: each engine says the layout its name and options stand
for (`Engine.layout_for`, which `strategies.layout_of` and `ExperimentSpec.layout` ask), and
config.py, `estimate` and the per-worker batch read it. `Placement` is one rank's place in it, with
the device mesh and every process group the engines use: built once per worker (`place`), first
thing in `Engine.__init__`; no engine creates a group of its own.

Rank order: rank = (p * D + d) * T + t for pipeline rank p, data-parallel rank d and tensor rank t.
The T ranks of a tensor-parallel group are neighbours (one node: they all-reduce activations in every
layer), the D replicas of one stage follow (a gradient all-reduce per step), and pipeline ranks are
farthest apart (point to point, once per microbatch). With T = 1 that is the pipeline engines'
p * D + d, with P = 1 megatron's d * T + t.

`sharding` is how the data-parallel dimension holds model states: `none` (replicated, gradients
all-reduced), `fsdp` (FSDP2 over the replicas), or `zero-1` / `zero-2` / `zero-3` (DeepSpeed, which
runs its own data parallel over every worker, so data parallel only: see `SUPPORTED`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

DIMENSIONS = ("pp", "dp", "tp")


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
    # The pipeline's schedule (torch's gpipe, 1f1b, ... or `pipedream`), microbatches per step and
    # stages each pipeline rank holds; None / 1 without a pipeline.
    schedule: str | None = None
    microbatches: int = 1
    virtual_stages: int = 1

    @classmethod
    def of(cls, workers: int, pipeline: int = 1, tensor: int = 1, sharding: str = "none", **schedule) -> "Layout":
        """D = workers / (P x T) (at least 1; config.py rejects degrees that do not divide the workers)."""
        return cls(pipeline, tensor, max(1, workers // (pipeline * tensor)), sharding, **schedule)

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data

    @property
    def asynchronous(self) -> bool:
        """PipeDream's schedules (`pipedream`, `pipedream-2bw`): stages update on their own clocks, never flushed."""
        return (self.schedule or "").startswith("pipedream")

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(P, D, T): the shape of the device mesh."""
        return self.pipeline, self.data, self.tensor

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

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices pipeline rank `pp_rank` holds: looped (p, p + P, ...) or, for zbv, a V (p, 2P - 1 - p)."""
        P = self.pipeline
        if self.schedule == "zbv":
            return [pp_rank, 2 * P - 1 - pp_rank]
        return [pp_rank + v * P for v in range(self.virtual_stages)]

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("pipeline", self.pipeline), ("tensor", self.tensor)) if v > 1]
        data = f"data {self.data}" + (f" ({self.sharding})" if self.sharding != "none" else "")
        text = " x ".join(parts + [data])
        if self.schedule:
            stages = f", {self.virtual_stages} stages per worker" if self.virtual_stages > 1 else ""
            text += f"; {self.schedule}, {self.microbatches} microbatch{'es' if self.microbatches > 1 else ''}{stages}"
        return text


@dataclass(eq=False)
class Placement:
    """One rank's place in a layout: its coordinates, the device mesh and the groups of its pipeline
    (`pp_group`: the ranks of other stages with its data and tensor ranks), its stage's replicas
    (`dp_group`) and its tensor-parallel group (`tp_group`).

    With more than one worker the mesh always exists: (pp, dp, tp) where P or T > 1, else one
    dimension (dp) over every worker (torch reuses the default group for it, except for gloo on a
    machine with CUDA, where it makes a group of the same ranks). A group is None where its
    dimension has one rank in a data-parallel-only layout, and everything is None on one worker.
    Further groups (the ranks holding a weight tied across stages, a communicator of its own for a
    pipeline's loss) come from `group_along`, so that every rank creates them in the same order."""

    layout: Layout
    rank: int
    mesh: object = None
    pp_group: object = None
    dp_group: object = None
    tp_group: object = None

    def __post_init__(self):
        self._extra: dict[tuple, object] = {}

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

    def mesh_of(self, dim: str):
        """The one-dimensional mesh along `dim` through this rank (what FSDP2 shards over), or None
        where this process runs alone."""
        if self.mesh is None:
            return None
        return self.mesh if self.mesh.mesh_dim_names == (dim,) else self.mesh[dim]

    def group_along(self, dim: str, members: list[int] | None = None, tag: str = "", backend: str | None = None):
        """A process group of its own along `dim` ("pp", "dp" or "tp"): the ranks that share this rank's
        other coordinates and whose coordinate along `dim` is in `members` (default: all of them). A
        collective: every rank calls it with the same arguments, and each gets its own group, or None
        where its coordinate is not in `members`. Made once per (dim, members, tag); `tag` tells
        groups of the same ranks apart (NCCL orders the operations of one communicator); `backend`: the
        group's (default: the default group's; "gloo" for host tensors beside an NCCL run)."""
        axis = DIMENSIONS.index(dim)
        members = tuple(range(self.layout.degrees[axis]) if members is None else members)
        key = (dim, members, tag, backend)
        if key not in self._extra:
            # rank = (p * D + d) * T + t: the ranks laid out (P, D, T), one row per group along `dim`,
            # the rows in (p, d, t) order of the other coordinates
            grid = torch.arange(self.layout.world).reshape(self.layout.degrees).movedim(axis, -1)
            mine = None
            for row in grid.reshape(-1, grid.shape[-1]).tolist():
                ranks = [row[m] for m in members]
                group = dist.new_group(ranks, backend=backend)
                if self.rank in ranks:
                    mine = group
            self._extra[key] = mine
        return self._extra[key]

    def group_of_all(self, tag: str = "", backend: str | None = None):
        """A process group of every rank, of its own (`tag`, `backend` as `group_along`'s; a collective, made
        once per tag and backend)."""
        key = ("all", tag, backend)
        if key not in self._extra:
            self._extra[key] = dist.new_group(list(range(self.layout.world)), backend=backend)
        return self._extra[key]


_PLACED: dict[tuple, Placement] = {}


def place(layout: Layout, rank: int, world_size: int, device_type: str) -> Placement:
    """This rank's placement, with its device mesh and process groups (collective: every rank calls it
    with the same layout). Built once per layout and process group: engines built again in one
    process (tests, benchmarks, a resumed loop) reuse the groups rather than create more."""
    if layout.world != world_size:
        raise ValueError(f"a layout of {layout.describe()} needs {layout.world} workers, not {world_size}")
    if world_size == 1:
        return Placement(layout, rank)
    key = (layout.degrees, rank, device_type, id(dist.group.WORLD))
    if key not in _PLACED:
        from torch.distributed.device_mesh import init_device_mesh

        if layout.pipeline == 1 and layout.tensor == 1:
            # Data parallel only: a one-dimensional mesh over every worker, the ranks DDP, DeepSpeed and
            # FSDP2 use by default (torch reuses the default group for it where it can).
            mesh = init_device_mesh(device_type, (layout.data,), mesh_dim_names=("dp",))
            placement = Placement(layout, rank, mesh, dp_group=mesh.get_group("dp"))
        else:
            mesh = init_device_mesh(device_type, layout.degrees, mesh_dim_names=DIMENSIONS)
            placement = Placement(layout, rank, mesh, *(mesh.get_group(n) for n in DIMENSIONS))
        _PLACED[key] = placement
    cached = _PLACED[key]
    if cached.layout != layout:  # the same degrees and groups, another schedule or sharding
        cached = Placement(layout, rank, cached.mesh, cached.pp_group, cached.dp_group, cached.tp_group)
        cached._extra = _PLACED[key]._extra
    return cached


# Which strategy composes which dimensions; ZeRO is DeepSpeed's own data parallel and composes with none.
SUPPORTED = ("ddp, zero-1/2/3, fsdp: data parallel only; megatron: tensor x data (data_parallel_sharding none "
             "or fsdp) and tensor x pipeline x data with stages (none or fsdp); pipeline: pipeline x data (none or fsdp); "
             "pipedream: pipeline x data (none)")


def check_sharding(value: str, allowed: tuple[str, ...], field_: str, error) -> None:
    """`data_parallel_sharding` of a strategy that composes with data parallel: one of `allowed`."""
    if value in allowed:
        return
    if value.startswith("zero"):
        error(field_, value, "DeepSpeed's ZeRO is a strategy of its own: its engine runs data parallel over every "
              "worker and has no tensor or pipeline dimension to combine with (supported layouts: "
              f"{SUPPORTED})", f"use {' or '.join(allowed)} (fsdp shards parameters, gradients and optimizer state "
              f"as zero-3 does), or strategy {value} for ZeRO alone")
    error(field_, value, f"not one of {', '.join(allowed)} (supported layouts: {SUPPORTED})",
          f"use {' or '.join(allowed)}")
