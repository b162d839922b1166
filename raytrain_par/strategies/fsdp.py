"""Fully sharded data parallel: PyTorch FSDP2 (`fully_shard`), the PyTorch-native ZeRO-3.

Each rank keeps 1/N of every parameter, gradient and optimizer state (as DTensors sharded on dim 0).
A unit -- each transformer block, or each layer that owns parameters in models without blocks -- is
all-gathered just before its forward and backward and freed after; gradients are reduce-scattered
as the backward pass leaves each unit. Units are the model's `_no_split_modules` where it declares
them (transformers' convention, the same units accelerate wraps), then the root.

Mixed precision is a MixedPrecisionPolicy: parameters stay fp32 shards (the master weights), the
all-gathered copies used for compute are bf16, gradients are reduced in fp32.

Checkpoints are the one format (strategies/state.py): every parameter and optimizer state gathered
to its whole shape by name (a DTensor's `full_tensor`), and at load each rank reads its shard's rows
only (pieces.py, no communication), so a run resumes on any number of workers and under any strategy
that shares the format. (torch.distributed.checkpoint re-shards the same way; its
metadata file is a pickle, which these checkpoints never load.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..metrics.memory import Sharding, StateBytes
from .layout import Layout
from .base import Engine
from ..models.initial import materialise
from .weights import one_by_one
from .context import DTYPES, DistContext
from .dtensor import whole_tensor
from .offload import check_host_memory
from .optim import build_optimizer, lr_factor


@dataclass
class Options:
    """`strategy:` keys for fsdp."""

    # Free each unit's gathered parameters after its forward (ZeRO-3); false keeps them until its
    # backward: fewer all-gathers, whole parameters held for the duration of a step.
    reshard_after_forward: bool = True
    # CPUOffloadPolicy: parameter shards, gradients and optimizer state in host memory and the
    # optimizer step on the CPU (GPU workers; on CPU workers they are in host memory already).
    offload: bool = False
    # Host memory one worker may fill with offloaded states; default: this machine's available
    # memory shared by the workers (set it when workers run on other machines).
    host_memory_gb: Optional[float] = None

    def validate(self, spec, error) -> None:
        if spec.train.optimizer == "lamb":
            error("train.optimizer", "lamb", "each worker holds a shard of every tensor, and LAMB scales each "
                  "tensor's step by the norm of the whole tensor", "use adamw or sgd with fsdp")
        if spec.train.precision == "fp16":
            error("train.precision", "fp16", "fsdp trains in fp32 or bf16 here (fp16 would need a sharded "
                  "gradient scaler)", "use train.precision: bf16")
        if self.offload and not spec.scaling.use_gpu:
            error("strategy.offload", True, "CPU workers keep everything in host memory already",
                  "remove it, or set scaling.use_gpu: true")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            error("strategy.host_memory_gb", self.host_memory_gb, "must be > 0", "use e.g. 64, or remove it")
        if self.offload:
            check_host_memory(spec, FSDPEngine, self, "strategy.offload", error)

    @staticmethod
    def layout(num_workers: int) -> Layout:
        return Layout.of(num_workers, sharding="fsdp")


class NormThenReduceScatter:
    """FSDP2's reduce-scatter (torch's `ReduceScatter` interface, set by `set_custom_reduce_scatter`;
    checked against torch 2.13) that first adds the squared norm of its input: this rank's whole
    unsharded gradient of one unit (summed over the micro-batches, padded with zeros), flat, in the
    reduce dtype -- where the gradient noise scale takes a worker's own gradient, as DDP's
    communication hook does (one scalar per unit, no copy)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.engine.add_local_squares([input_tensor])
        return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units (before the root): the model's declared blocks
    (`_no_split_modules`), else every module that owns parameters directly."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if blocks:
        return [m for m in model.modules() if type(m).__name__ in blocks]
    return [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]


class FSDPEngine(Engine):
    Options = Options
    sharding = Sharding(params=True, grads=True, optim=True)  # fp32 shards, also under mixed precision

    @classmethod
    def model_state_bytes(cls, options, train, dp, num_params):
        est = super().model_state_bytes(options, train, dp, num_params)
        return StateBytes(est.theory, est.expected,
                          est.expected if options.offload else 0.0)

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        # imported before the base class takes its memory baseline (imports are not model state)
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        super().__init__(model, task, train, options, ctx, total_steps)

        self.model = model
        self.sharded = ctx.distributed
        if self.sharded:
            mesh = self.placement.mesh_of("dp")  # every worker
            mp = (MixedPrecisionPolicy(param_dtype=DTYPES[train.precision], reduce_dtype=torch.float32)
                  if train.precision != "fp32" else MixedPrecisionPolicy())
            kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if options.offload else OffloadPolicy())
            for unit in shard_units(self.model):
                fully_shard(unit, reshard_after_forward=options.reshard_after_forward, **kwargs)
            fully_shard(self.model, **kwargs)
            if self.measures_noise_scale(options, train, self.layout):
                self._start_noise()
                comm = NormThenReduceScatter(self)
                for m in self.model.modules():
                    if isinstance(m, FSDPModule):
                        m.set_custom_reduce_scatter(comm)
        # storage for this rank's shards only, where the model was built on the meta device
        self.module = self.model = materialise(self.model, self.device)
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train, total_steps))

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Each worker's gradient over its whole local batch against the reduced one: 2 or more
        workers."""
        return layout.data > 1

    def autocast(self):
        # Sharded: the MixedPrecisionPolicy casts. One process (nothing to shard): plain autocast.
        return contextlib.nullcontext() if self.sharded else super().autocast()

    # -- the shared step's operations (base.Engine.train_step) -------------------------------------
    def no_sync(self, hold):
        if self.sharded:  # reduce-scatter on the last micro-batch only; the others accumulate
            self.module.set_requires_gradient_sync(not hold)
        return contextlib.nullcontext()

    # -- checkpoints ---------------------------------------------------------------------------
    def _params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _resharded(self) -> None:
        """Every unit's parameters back to their shards: after a forward pass without backward (an
        evaluation) the root, and units with reshard_after_forward off, still hold whole parameters."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def plain_weights(self, everywhere=False):
        """An all-gather per tensor (every rank goes through them)."""
        self._resharded()
        yield from one_by_one(self.module.state_dict(keep_vars=True), lambda name, t: whole_tensor(t),
                              keep=everywhere or self.ctx.rank == 0)

    # -- the one checkpoint format (strategies/state.py): each rank's shards by name ------------------
    def held_tensors(self):
        """Each tensor's shard (a DTensor), every unit resharded first."""
        self._resharded()
        return super().held_tensors()
