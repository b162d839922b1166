"""The optimizer and learning-rate schedule of an experiment (`train:`), the same for every strategy:
engines hand them the parameters they hold."""

from __future__ import annotations

import math

import torch
from torch import nn


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

