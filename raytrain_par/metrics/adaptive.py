"""The batch an adaptive run trains with next: goodput from the measured noise scale and step times.

Goodput (Pollux, Qiao et al. OSDI 2021) is throughput times statistical efficiency. For a global
batch M against the batch M0 the run started with, and the gradient noise scale phi measured so far
(metrics/goodput.py),

    efficiency(M) = (phi + M0) / (phi + M)

is the progress one row buys at M over what it buys at M0: with the step that best lowers a
quadratic loss, one step of a batch of M rows gains 1 / (1 + phi / M) of what the whole gradient
would (McCandlish et al. 2018, equation 2.7), so per row (phi + M0) / (phi + M) of what M0's rows
gain. Goodput, in rows of M0 per second, is M / step_time(M) x efficiency(M).

The learning rate follows the batch by one of three rules, and the schedule runs on *progress*, not
steps: a step at batch M advances it by the same factor its rate was scaled by, so that the rate at
any point of the run means the same thing whatever batches took it there (AdaScale SGD, Johnson et
al. 2020: the gain r = (phi / M0 + 1) / (phi / M + 1) = M / M0 x efficiency(M); "scale-invariant
iterations"). `adascale` scales by that gain, `linear` by M / M0 (Goyal et al. 2017), `sqrt` by its
square root (Krizhevsky 2014; Hoffer et al. 2017).

Nothing here imports Ray or touches a process group: the worker loop feeds it (worker.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

LR_SCALING = ("adascale", "sqrt", "linear")


def efficiency(noise_scale: float | None, batch: int, base: int) -> float:
    """(phi + M0) / (phi + M): 1 at the base batch M0, less above it; 1 everywhere before the noise
    scale is known (nothing says that a larger batch wastes rows yet, nor that it does not)."""
    if noise_scale is None:
        return 1.0
    return (noise_scale + base) / (noise_scale + batch)


def gain(noise_scale: float | None, batch: int, base: int) -> float:
    """AdaScale's gain (phi / M0 + 1) / (phi / M + 1): how many steps of M0 one step of M is worth,
    between 1 (phi = 0: every row adds nothing new) and M / M0 (phi infinite: every row counts)."""
    return batch / base * efficiency(noise_scale, batch, base)


def lr_scale(rule: str, noise_scale: float | None, batch: int, base: int) -> float:
    """The factor on the learning rate at batch M, and the progress one step of M makes (in steps of M0)."""
    if rule == "adascale":
        return gain(noise_scale, batch, base)
    if rule == "linear":
        return batch / base
    if rule == "sqrt":
        return math.sqrt(batch / base)
    raise ValueError(f"unknown lr_scaling {rule!r}; one of {', '.join(LR_SCALING)}")


@dataclass(frozen=True)
class Shape:
    """How one global batch is cut: `batch` rows over `replicas` data-parallel replicas, each
    replica's rows in `accumulation` micro-batches (each of them, for a pipeline, split again into its
    schedule's micro-batches)."""

    batch: int
    accumulation: int

    def rows_per_micro_batch(self, replicas: int) -> int:
        return self.batch // replicas // self.accumulation


@dataclass(frozen=True)
class Layout:
    """What a batch must suit. `replicas`: data-parallel replicas. `unit`: rows one accumulation step of
    one replica must be a multiple of (a pipeline's micro-batch count). `max_rows`: the most rows one
    accumulation step of one replica may hold (what fits in memory); more rows than that are
    accumulated. `fixed_rows`: where the engine cannot change how many rows an accumulation step holds
    (a pipeline's schedule is built for one micro-batch shape), that number: only the accumulation
    changes."""

    replicas: int
    unit: int = 1
    max_rows: int | None = None
    fixed_rows: int | None = None

    def shape(self, batch: int) -> Shape | None:
        """The fewest accumulation steps that cut `batch` as the layout needs, or None where none does."""
        if batch < 1 or batch % self.replicas:
            return None
        rows = batch // self.replicas
        if self.fixed_rows is not None:
            return Shape(batch, rows // self.fixed_rows) if rows % self.fixed_rows == 0 else None
        for accumulation in range(1, rows + 1):
            if rows % accumulation:
                continue
            micro = rows // accumulation
            if micro % self.unit == 0 and (self.max_rows is None or micro <= self.max_rows):
                return Shape(batch, accumulation)
            if micro < self.unit:
                break
        return None

    def shapes(self, smallest: int, largest: int) -> list[Shape]:
        """Every batch from `smallest` to `largest` that the layout can cut, smallest first."""
        return [s for s in map(self.shape, range(smallest, largest + 1)) if s is not None]


@dataclass(frozen=True)
class Choice:
    """The batch picked for the next interval, with what the decision saw."""

    batch: int
    accumulation: int
    efficiency: float
    step_time_s: float | None  # predicted; None while the run has timed one batch only
    goodput: float | None  # rows of the base batch per second, predicted
    lr_scale: float
    reason: str  # 'goodput', 'explore' (a second batch to time), 'start'

    def as_dict(self) -> dict:
        return asdict(self)


def decide(shapes: list[Shape], base: int, current: int, noise_scale: float | None, rule: str,
           step_time: Callable[[Shape], float] | None) -> Choice:
    """The shape of greatest goodput among `shapes`, for a run that started at batch `base` and trains
    at `current` now. `step_time` predicts a shape's seconds per step from the run's own timings
    (metrics/throughput.py fitted to them); None where the run has timed one batch size only, which
    cannot tell the time per row from the time per step: the batch then doubles (within `shapes`), so
    that the next decision has two to fit, and only where the noise scale is known and says a larger
    batch would still use its rows (efficiency at double at least 2/3: phi >= M). Ties go to the smaller
    batch."""
    if not shapes:
        raise ValueError("no batch size to choose from")
    by_batch = {s.batch: s for s in shapes}
    now = by_batch.get(current) or min(shapes, key=lambda s: abs(s.batch - current))

    def choice(s: Shape, time_s: float | None, reason: str) -> Choice:
        eff = efficiency(noise_scale, s.batch, base)
        goodput = None if time_s is None else s.batch / time_s * eff
        return Choice(s.batch, s.accumulation, eff, time_s, goodput, lr_scale(rule, noise_scale, s.batch, base), reason)

    if noise_scale is None:
        return choice(now, None if step_time is None else step_time(now), "start")
    if step_time is None:
        larger = [s for s in shapes if now.batch < s.batch <= 2 * now.batch]
        if larger and noise_scale >= now.batch:
            return choice(max(larger, key=lambda s: s.batch), None, "explore")
        return choice(now, None, "start")
    scored = [choice(s, step_time(s), "goodput") for s in shapes]
    return max(scored, key=lambda c: (c.goodput, -c.batch))
