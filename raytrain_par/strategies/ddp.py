"""Data parallel: PyTorch DistributedDataParallel.

Every rank holds the whole model and optimizer; gradients are averaged with bucketed all-reduces
overlapping the backward pass. Mixed precision (`train.precision` bf16 / fp16) is torch.autocast over
fp32 parameters, with a gradient scaler for fp16. The model is wrapped with torch's DDP directly rather than through
`ray.train.torch.prepare_model` (which does the same wrapping) so that this engine also runs under
torchrun and in plain process groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..metrics.memory import Sharding, StateBytes
from .layout import Layout
from .base import Engine
from ..models.initial import materialise
from .context import DistContext
from .optim import build_optimizer, lr_factor


@dataclass
class Options:
    """`strategy:` keys for ddp."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True  # gradients live inside the all-reduce buckets: one copy, not two
    find_unused_parameters: bool = False
    static_graph: bool = False

    def validate(self, spec, error) -> None:
        if self.bucket_cap_mb <= 0:
            error("strategy.bucket_cap_mb", self.bucket_cap_mb, "must be > 0", "use e.g. 25 (PyTorch's default)")

    @staticmethod
    def layout(num_workers: int) -> Layout:
        return Layout.of(num_workers, sharding="none")


def _norm_then_allreduce(engine: "DDPEngine", bucket):
    """DDP comm hook: add the squared norm of this worker's part of the gradient, then PyTorch's
    default all-reduce (mean over workers)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if bucket.buffer().is_floating_point():
        engine.add_parameter_squares(bucket.parameters(), bucket.gradients())
    return allreduce_hook(None, bucket)


class DDPEngine(Engine):
    Options = Options
    sharding = Sharding()  # nothing sharded: every rank holds every model state

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Each worker's gradient over its whole local batch against the reduced one: 2 or more
        workers, and no loss scaling (fp16)."""
        return layout.data > 1 and not cls.scaler_needed(train)

    @classmethod
    def model_state_bytes(cls, options, train, dp, num_params):
        est = super().model_state_bytes(options, train, dp, num_params)
        # Without gradient_as_bucket_view the all-reduce buckets are a second copy of the gradients.
        extra = 0 if options.gradient_as_bucket_view or dp == 1 else 4 * num_params
        return StateBytes(est.theory, est.expected + extra)

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        super().__init__(model, task, train, options, ctx, total_steps)
        self.model = materialise(model, self.device)  # storage for a model built on the meta device
        if ctx.distributed:
            self.module = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self.dp_group,
                bucket_cap_mb=options.bucket_cap_mb,
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                find_unused_parameters=options.find_unused_parameters,
                static_graph=options.static_graph,
            )
            # Each worker's own gradient is in the buckets just before they are all-reduced: the
            # gradient noise scale takes its squared norm there (no copy, one scalar per parameter).
            if self.measures_noise_scale(options, train, self.layout):
                self._start_noise(self.model.parameters())
                self.module.register_comm_hook(self, _norm_then_allreduce)
        else:
            self.module = self.model
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train, total_steps))
        self.scaler = torch.amp.GradScaler(self.device.type) if self.scaler_needed(train) else None

    @staticmethod
    def scaler_needed(train) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
        return train.precision == "fp16"

    # -- the shared step's operations (base.Engine.train_step) -------------------------------------
    def no_sync(self, hold):
        # Only the last micro-batch all-reduces; the others accumulate locally.
        return self.module.no_sync() if hold and self.ctx.distributed else contextlib.nullcontext()

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def finish_gradients(self, own):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)

    def step_optimizer(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def eval_module(self):
        return self.model

    def full_state_dict(self):
        return self.model.state_dict()
