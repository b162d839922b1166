"""The Engine interface every strategy implements, and what strategies share.

An engine takes a plain model (identical on every rank) and owns everything that differs between
ways of parallelising: how the model is wrapped or split, the optimizer and its state, how
gradients are reduced, what a checkpoint of this rank holds, and which slice of each global batch
this rank reads. The worker loop only calls `train_step`, `evaluate`, `memory`, `save` and `load`.

Nothing here imports Ray: an engine runs the same under Ray Train, torchrun, or a test's
torch.multiprocessing group, given an initialised default process group (or none, for one process).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..metrics.memory import model_state_census, peak_bytes


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
        local = int(__import__("os").environ.get("LOCAL_RANK", 0))
        if device is None:
            device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank, world, local, torch.device(device))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only, not on biases, norms or gains (as GPT-2 and nanoGPT train)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, train) -> torch.optim.Optimizer:
    groups = parameter_groups(model, train.weight_decay)
    if train.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), eps=train.eps)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum)
    if train.optimizer == "lamb":
        from .lamb import Lamb

        return Lamb(groups, lr=train.lr, betas=tuple(train.betas), eps=train.eps)
    raise ValueError(f"unknown optimizer {train.optimizer!r}")


def lr_factor(train, total_steps: int):
    """Multiplier of train.lr at each step: linear warm-up, then constant, cosine or linear decay."""
    warmup = train.warmup_steps

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if train.lr_schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if train.lr_schedule == "cosine":
            return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * (1 - progress)

    return factor


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    if parts == 1:
        return [batch]
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


class Engine(ABC):
    """One way of parallelising training. Subclasses set up `self.module` (what forward runs),
    `self.optimizer`, `self.scheduler`, and override what differs."""

    #: options dataclass of the strategy (the keys allowed under `strategy:` besides `name`)
    Options: type

    def __init__(self, model: nn.Module, task, train, options, ctx: DistContext, total_steps: int):
        self.task, self.train, self.options, self.ctx = task, train, options, ctx
        self.total_steps = total_steps
        self.device = ctx.device
        self._peak_state: dict[str, int] = {}

    # -- data-parallel layout: which slice of each global batch this rank reads ------------------
    @property
    def dp_rank(self) -> int:
        return self.ctx.rank

    @property
    def dp_size(self) -> int:
        return self.ctx.world_size

    @property
    def dp_group(self):
        return None  # the default group

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a metric tensor over the data-parallel ranks (every rank gets the result)."""
        if self.dp_size > 1:
            t = t.to(self.device)
            dist.all_reduce(t, group=self.dp_group)
        return t

    # -- training ------------------------------------------------------------------------------
    @abstractmethod
    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One optimizer step on this rank's part of a global batch (stored rows, on the CPU).
        Returns this rank's mean loss, detached."""

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def eval_module(self) -> nn.Module:
        return self.module

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Validation metrics over the whole split: each rank evaluates its rows, sums are reduced."""
        module = self.eval_module()
        module.eval()
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        for batch in batches:
            sums += self.task.eval_sums(module, self.task.prepare(batch, self.device)).double()
        module.train()
        sums = self.dp_sum(sums)
        return self.task.summarize(*[float(x) for x in sums])

    # -- memory --------------------------------------------------------------------------------
    def model_state(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        return model_state_census(self.module.parameters(), self.optimizer)

    def note_memory(self) -> None:
        """Called by train_step after backward and the optimizer step, before gradients are freed:
        the moment model states are largest."""
        now = self.model_state()
        if now["mem_model_state_bytes"] >= self._peak_state.get("mem_model_state_bytes", -1):
            self._peak_state = now

    def memory(self) -> dict[str, int]:
        out = dict(self._peak_state or self.model_state())
        out["mem_peak_bytes"] = peak_bytes(self.device)
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write this rank's part of a checkpoint into `directory` (a directory of its own)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restore from a checkpoint directory holding every rank's files."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict (gathered where it is sharded), on every rank."""


def load_tensors(path: Path, device: torch.device):
    """torch.load that never unpickles arbitrary objects."""
    return torch.load(path, map_location=device, weights_only=True)
