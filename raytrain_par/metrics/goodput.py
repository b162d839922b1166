"""Statistical efficiency measured while training: the gradient noise scale.

The simple noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A.1) says how large a batch can grow before more samples per step
stop buying fewer steps: steps to a target go as S_min (1 + B_noise / B). It is estimated from the
squared norms of the mean gradient over two batch sizes that training already has. A data-parallel
worker's own gradient, before the all-reduce, is the mean over its b rows (or, where an engine sees
one micro-batch at a time, each micro-batch's is the mean over its rows); the reduced gradient is
the mean over all B rows; in expectation

    E|G_b|^2 = |G|^2 + tr(Sigma) / b,

so two batch sizes give |G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b) and
tr(Sigma) = (|G_b|^2 - |G_B|^2) / (1/b - 1/B). The |G_b|^2 of every worker are averaged (one
all-reduce of a few scalars per step; no gradient moves twice; strategies/base.py `note_noise`). Each estimate is noisy, and the ratio of two
noisy estimates is biased, so the two are smoothed separately (exponential moving averages) and
divided only when read, as the paper and AdaptDL do.

The gradients are the raw ones (before clipping and before the optimizer's preconditioning), of
the loss as training computes it (its mean over the rows of a batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adaptive import efficiency
from .efficiency import crossing


class NoiseScale:
    """Running estimate of B_simple from (b, |G_b|^2, B, |G_B|^2) samples, one per optimizer step."""

    def __init__(self, smoothing: float = 0.95):
        self.smoothing = smoothing
        self.squared_norm: torch.Tensor | None = None  # smoothed |G|^2
        self.trace: torch.Tensor | None = None  # smoothed tr(Sigma)
        self.samples = 0

    def update(self, small_batch: int, small_sq: torch.Tensor, big_batch: int, big_sq: torch.Tensor) -> None:
        """One step's squared norms (tensors on the device: nothing waits for them here)."""
        if big_batch <= small_batch:
            raise ValueError(f"the large batch ({big_batch}) must hold more rows than the small one ({small_batch})")
        g2 = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
        trace = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
        a = self.smoothing
        self.squared_norm = g2.detach().double() if self.squared_norm is None else a * self.squared_norm + (1 - a) * g2.double()
        self.trace = trace.detach().double() if self.trace is None else a * self.trace + (1 - a) * trace.double()
        self.samples += 1

    def state(self) -> dict | None:
        """The running averages, as numbers (a checkpoint's loop state); None before any step."""
        if self.squared_norm is None:
            return None
        return {"squared_norm": float(self.squared_norm), "trace": float(self.trace), "samples": self.samples}

    def load_state(self, state: dict, device: torch.device) -> None:
        self.squared_norm = torch.tensor(state["squared_norm"], dtype=torch.float64, device=device)
        self.trace = torch.tensor(state["trace"], dtype=torch.float64, device=device)
        self.samples = int(state["samples"])

    def value(self) -> float | None:
        """B_simple in rows (samples), or None before any step or while |G|^2 is not yet positive.
        (The averages start at the first sample rather than at zero, so they need no bias correction.)"""
        if self.squared_norm is None:
            return None
        g2, trace = float(self.squared_norm), float(self.trace)
        return trace / g2 if g2 > 0 and trace > 0 else None


# -- time-to-target predicted from one reference run -------------------------------------------------

#: optimizers whose update divides the gradient by the root of its second moment (LAMB's inner update is
#: Adam's): where the learning rate limits progress, a step's progress goes as lr / sqrt(1 + B / M)
ADAPTIVE_OPTIMIZERS = ("adamw", "lamb")


@dataclass
class Reference:
    """What one run at global batch `batch` says about every other batch size: it reached the target
    after `steps` optimizer steps, `min_steps` (S_min) is what an infinitely large batch would need, and
    `noise_scale` (B_noise) the noise scale averaged as the steps weigh it. `lr`: the peak learning rate
    it trained with (None: not known)."""

    batch: int
    steps: float
    min_steps: float
    noise_scale: float
    # each interval between evaluations up to the target: (its S_min, the noise scale measured over it);
    # an adaptive batch is predicted interval by interval (none: one interval of the averages)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    lr: float | None = None

    def steps_to_target(self, batch: int, lr: float | None = None, optimizer: str = "adamw") -> float:
        """Steps to the target at global batch M trained with learning rate `lr` (None: one that suits M).

        At a learning rate that suits each batch, S = S_min (1 + B_noise / M) (McCandlish et al., equation
        2.11), interval by interval. That is the fewest steps any learning rate gives at M; a learning rate
        scaled by a rule (sqrt, linear) or left as it is may give more. Where the learning rate limits
        progress (small steps: the loss falls by lr times the gradient's projection on the update, the
        curvature's term negligible), each step goes as lr for SGD, and as lr / sqrt(1 + B / M) for Adam
        and LAMB: their update divides the gradient by the root of its second moment, |G|^2 + tr(Sigma) / M
        per element, so the noise a smaller batch adds shrinks the part of the update that follows G.
        Against the reference's interval (lr0, M0), the steps at (lr, M) are the larger of the two
        ratios, the noise's (1 + B/M) / (1 + B/M0) and the learning rate's (lr0 / lr) (Adam:
        x sqrt((1 + B/M) / (1 + B/M0))). docs/plan-unprobed.md checks both against runs to the target."""
        if lr is None or self.lr is None:
            return self.min_steps * (1 + self.noise_scale / batch)
        slower = self.lr / lr
        total = 0.0
        for s_min, b in self.intervals or [(self.min_steps, self.noise_scale)]:
            noise = (1 + b / batch) / (1 + b / self.batch)
            limited = slower * (noise ** 0.5 if optimizer in ADAPTIVE_OPTIMIZERS else 1.0)
            total += s_min * (1 + b / self.batch) * max(noise, limited)
        return total

    def efficiency(self, batch: int) -> float:
        """Statistical efficiency against the reference batch M0, (B_noise + M0) / (B_noise + M) (Pollux):
        the reference's rows to target over those of batch M; 1 at M0, less for larger batches."""
        return efficiency(self.noise_scale, batch, self.batch)


def fit_reference(records: list[dict], metric: str, target: float, mode: str, lr: float | None = None
                  ) -> Reference | None:
    """S_min and B_noise from one run's records (each with `step` and `grad_noise_scale`, which changes
    as training goes). Every interval between evaluations, up to where the target was reached, adds
    its steps at the batch M0 it ran at and the noise scale measured over it; S(M) = S_min (1 + B/M)
    holds per interval, so summed

        S_min = sum_i dS_i / (1 + B_i / M0),   B_noise = sum_i B_i dS_i / (1 + B_i / M0) / S_min,

    and S_min (1 + B_noise / M) is the sum of every interval's steps at batch M. None where the run
    never reached the target. An interval without a measurement takes the next one's. `lr`: the peak
    learning rate the run trained with (default: the largest `lr` its records show up to the target)."""
    records = sorted(records, key=lambda r: r["step"])
    reached = crossing(records, metric, target, mode, "step")
    if reached is None:
        return None
    batch = int(records[-1]["global_batch_size"])
    if lr is None:
        lr = max((r["lr"] for r in records if r.get("lr") and r["step"] <= reached), default=None)
    noise = [r.get("grad_noise_scale") for r in records]
    for i in range(len(noise) - 2, -1, -1):
        noise[i] = noise[i] if noise[i] is not None else noise[i + 1]
    min_steps = weighted = 0.0
    intervals = []
    for prev, r, b in zip(records, records[1:], noise[1:]):
        steps = min(r["step"], reached) - prev["step"]
        if steps <= 0:
            break
        if b is None:
            raise ValueError(f"no gradient noise scale recorded at or after step {r['step']}")
        s_min = steps / (1 + b / batch)
        min_steps += s_min
        weighted += b * s_min
        intervals.append((s_min, b))
    if min_steps == 0:  # met before the first step: nothing to scale
        return Reference(batch, reached, reached, 0.0, lr=lr)
    return Reference(batch, reached, min_steps, weighted / min_steps, intervals, lr)
