"""Hardware efficiency predicted from a few probes: the time of one optimizer step of a strategy at
any worker count and per-worker batch.

The form is Pollux's (Qiao et al., OSDI 2021, section 3.2): the time to compute a gradient is linear
in the rows a worker computes, and synchronising gradients costs a fixed time once there are two
workers or more, growing linearly with each worker beyond two:

    T_step(N, b, s) = s * alpha_compute + b * beta_compute + [N >= 2] * (alpha_sync + (N - 2) * beta_sync)

for N workers, b rows per data-parallel worker per step and s micro-batches (gradient accumulation).
Pollux also fits how much of the synchronisation hides behind the backward pass (T = (T_c^g + T_s^g)^(1/g));
that needs a non-linear fit and probes that separate the two, so here overlap is folded into the
fitted times, which keeps the fit linear, unique and cheap. Every parameter is a time, so the fit is
non-negative least squares (scipy.optimize.nnls). One model per strategy: each moves different bytes.
A parameter no probe can tell apart from the others (beta_sync when no probe has more than two
workers, the synchronisation when none has two) is 0 and listed in `unidentified`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

PARAMETERS = ("alpha_compute", "beta_compute", "alpha_sync", "beta_sync")


@dataclass(frozen=True)
class Probe:
    """A measured step time: `strategy` names what is fitted together (a strategy and its options)."""

    strategy: str
    workers: int
    local_batch: int  # rows one data-parallel worker computes per optimizer step (all micro-batches)
    step_time_s: float
    accumulation: int = 1


def _features(workers: int, local_batch: int, accumulation: int) -> list[float]:
    synced = 1.0 if workers >= 2 else 0.0
    return [float(accumulation), float(local_batch), synced, synced * (workers - 2)]


@dataclass
class StepTimeModel:
    alpha_compute: float  # s per micro-batch, whatever its size
    beta_compute: float  # s per row
    alpha_sync: float  # s per step with two workers or more
    beta_sync: float  # s per step for each worker beyond two
    unidentified: list[str] = field(default_factory=list)
    probes: int = 0
    residual_s: float = 0.0  # root mean square of the fit's residuals

    def step_time(self, workers: int, local_batch: int, accumulation: int = 1) -> float:
        coef = [self.alpha_compute, self.beta_compute, self.alpha_sync, self.beta_sync]
        return float(np.dot(coef, _features(workers, local_batch, accumulation)))


class ThroughputModel:
    """Step-time models of several strategies, fitted from their probes."""

    def __init__(self, models: dict[str, StepTimeModel]):
        self.models = models

    @classmethod
    def fit(cls, probes: list[Probe]) -> "ThroughputModel":
        by_strategy: dict[str, list[Probe]] = {}
        for p in probes:
            by_strategy.setdefault(p.strategy, []).append(p)
        return cls({name: fit_strategy(ps) for name, ps in by_strategy.items()})

    def step_time(self, strategy: str, workers: int, local_batch: int, accumulation: int = 1) -> float:
        if strategy not in self.models:
            raise KeyError(f"no probes of {strategy!r}; probed: {', '.join(self.models)}")
        return self.models[strategy].step_time(workers, local_batch, accumulation)


def fit_strategy(probes: list[Probe]) -> StepTimeModel:
    """Non-negative least squares of one strategy's step times on Pollux's terms."""
    rows = {(p.local_batch, p.accumulation) for p in probes}
    if len({b for b, _ in rows}) < 2:
        raise ValueError(f"{probes[0].strategy}: probes at one per-worker batch ({rows.pop()[0]} rows) cannot tell "
                         "the time per row from the time per step; probe two batch sizes or more")
    x = np.array([_features(p.workers, p.local_batch, p.accumulation) for p in probes])
    y = np.array([p.step_time_s for p in probes])
    # Columns no probe varies independently are left out (their parameter is 0): nnls would split a
    # time between two indistinguishable terms arbitrarily.
    keep = [0, 1]
    if x[:, 2].any():
        keep.append(2)
    if x[:, 3].any():
        keep.append(3)
    coef, _ = nnls(x[:, keep], y)
    full = np.zeros(len(PARAMETERS))
    full[keep] = coef
    residual = float(np.sqrt(np.mean((x @ full - y) ** 2)))
    return StepTimeModel(*map(float, full), unidentified=[PARAMETERS[i] for i in range(4) if i not in keep],
                         probes=len(probes), residual_s=residual)
