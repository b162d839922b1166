"""Adaptive batch size: the noise-scale-to-efficiency formula and the learning-rate gain against brute
force on a toy problem, and the decision rule against hand-made step times and noise scales
(metrics/adaptive.py)."""

import itertools
import math

import pytest
import torch

from raytrain_par.metrics import adaptive
from raytrain_par.metrics.adaptive import Layout, Shape, decide


def _toy(n=6, d=3, seed=0):
    """Least squares whose Hessian is the identity ((1/n) X^T X = I), at a point off its minimum: the
    per-row gradients g_i = x_i (x_i . w - y_i) and the exact B_simple = tr(Sigma) / |G|^2."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    x = q * math.sqrt(n)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.randn(d, generator=g, dtype=torch.float64)
    grads = x * (x @ w - y)[:, None]
    mean = grads.mean(0)
    trace = ((grads - mean) ** 2).sum(1).mean()  # the population covariance: rows drawn with replacement
    return grads, float(trace / mean.dot(mean))


def _expected_square(grads: torch.Tensor, batch: int) -> float:
    """E |g_B|^2 over every batch of `batch` rows drawn with replacement, enumerated."""
    n = len(grads)
    total = 0.0
    for idx in itertools.product(range(n), repeat=batch):
        g = grads[list(idx)].mean(0)
        total += float(g.dot(g))
    return total / n ** batch


def _best_gain_per_row(grads: torch.Tensor, batch: int) -> float:
    """The loss one step of `batch` rows lowers in expectation with its best learning rate, per row: on a
    loss with identity Hessian, E L(w - eps g_B) = L(w) - eps |G|^2 + eps^2 / 2 E|g_B|^2, best at
    eps = |G|^2 / E|g_B|^2, lowering it by |G|^4 / (2 E|g_B|^2)."""
    mean = grads.mean(0)
    return float(mean.dot(mean)) ** 2 / (2 * _expected_square(grads, batch)) / batch


def test_efficiency_is_the_gain_per_row_of_the_best_step_by_enumeration():
    grads, noise = _toy()
    for base, batch in [(1, 2), (1, 4), (2, 4), (2, 5), (3, 1)]:
        brute = _best_gain_per_row(grads, batch) / _best_gain_per_row(grads, base)
        assert adaptive.efficiency(noise, batch, base) == pytest.approx(brute, rel=1e-9)


def test_adascale_gain_is_the_ratio_of_expected_squared_gradients():
    """AdaScale's gain r = E|g_M0|^2 / E|g_M|^2 (its definition, in terms of variance and mean)."""
    grads, noise = _toy(seed=3)
    for base, batch in [(1, 3), (2, 4), (1, 5)]:
        brute = _expected_square(grads, base) / _expected_square(grads, batch)
        assert adaptive.gain(noise, batch, base) == pytest.approx(brute, rel=1e-9)
        assert 1 <= adaptive.gain(noise, batch, base) <= batch / base


def test_lr_rules():
    assert adaptive.lr_scale("linear", 10.0, 64, 16) == 4
    assert adaptive.lr_scale("sqrt", 10.0, 64, 16) == 2
    assert adaptive.lr_scale("adascale", 48.0, 64, 16) == pytest.approx(64 / 16 * (48 + 16) / (48 + 64))
    assert adaptive.lr_scale("adascale", None, 64, 16) == 4  # noise unknown: every row counts
    with pytest.raises(ValueError, match="lr_scaling 'cubic'"):
        adaptive.lr_scale("cubic", 1.0, 2, 1)


def test_shapes_split_over_replicas_and_accumulate_beyond_memory():
    dp = Layout(replicas=2, max_rows=8)
    assert dp.shape(7) is None  # does not split over 2 replicas
    assert dp.shape(16) == Shape(16, 1)
    assert dp.shape(20) == Shape(20, 2)  # 10 rows per replica: two accumulation steps of 5
    assert dp.shape(34) == Shape(34, 17)  # 17 rows per replica: only 17 steps of one row fit
    assert Layout(replicas=1, max_rows=4).shape(6) == Shape(6, 2)
    # a pipeline of 4 micro-batches: each accumulation step holds a multiple of 4 rows
    assert Layout(replicas=1, unit=4, max_rows=8).shape(24) == Shape(24, 3)
    assert Layout(replicas=1, unit=4).shape(6) is None
    # a schedule built for one micro-batch shape: only the accumulation changes
    fixed = Layout(replicas=2, fixed_rows=4)
    assert fixed.shape(24) == Shape(24, 3)
    assert fixed.shape(20) is None
    assert [s.batch for s in fixed.shapes(8, 32)] == [8, 16, 24, 32]
    assert Shape(24, 3).rows_per_micro_batch(2) == 4


def test_the_decision_maximises_goodput_against_the_closed_form():
    """With T(M) = a + b M and efficiency (phi + M0) / (phi + M), goodput M (phi + M0) / ((a + b M)(phi + M))
    peaks at M* = sqrt(a phi / b): a = 1 s, b = 0.01 s per row, phi = 400 rows -> 200."""
    shapes = Layout(replicas=8).shapes(16, 512)
    c = decide(shapes, base=16, current=16, noise_scale=400.0, rule="adascale",
               step_time=lambda s: 1.0 + 0.01 * s.batch)
    assert (c.batch, c.accumulation, c.reason) == (200, 1, "goodput")
    assert c.efficiency == pytest.approx(416 / 600)
    assert c.goodput == pytest.approx(200 / 3.0 * 416 / 600)
    assert c.lr_scale == pytest.approx(200 / 16 * 416 / 600)
    # no fixed cost per step: every row costs the same, so the smallest batch wastes none
    assert decide(shapes, 16, 64, 400.0, "adascale", lambda s: 0.01 * s.batch).batch == 16
    # a noise scale far above every batch: the largest
    assert decide(shapes, 16, 16, 1e9, "linear", lambda s: 1.0 + 0.01 * s.batch).batch == 512


def test_the_decision_before_two_batches_are_timed():
    shapes = Layout(replicas=2).shapes(8, 64)
    # noise unknown: stays
    assert decide(shapes, 8, 8, None, "adascale", None).batch == 8
    # noise above the batch, nothing fitted yet: doubles, to time a second batch
    c = decide(shapes, 8, 8, 20.0, "adascale", None)
    assert (c.batch, c.reason) == (16, "explore")
    assert decide(shapes, 8, 48, 500.0, "adascale", None).batch == 64  # within the largest allowed
    # noise below the batch: doubling would waste a third of its rows or more
    assert decide(shapes, 8, 16, 10.0, "adascale", None).batch == 16
