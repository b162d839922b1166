"""The step-time model (metrics/throughput.py): fitted on synthetic timings it recovers the times
they were drawn from and predicts points no probe measured."""

import random

import pytest

from raytrain_par.metrics.throughput import Probe, ThroughputModel

TRUE = {"ddp": (0.050, 0.0020, 0.030, 0.010), "zero-2": (0.080, 0.0025, 0.060, 0.020)}


def timings(workers, batches, accumulation=(1,), noise=0.01, seed=0):
    rng = random.Random(seed)
    out = []
    for name, (ac, bc, as_, bs) in TRUE.items():
        for w in workers:
            for b in batches:
                for s in accumulation:
                    t = s * ac + b * bc + (as_ + (w - 2) * bs if w >= 2 else 0.0)
                    out.append(Probe(name, w, b, t * (1 + rng.uniform(-noise, noise)), s))
    return out


def test_fit_recovers_the_parameters_and_extrapolates():
    model = ThroughputModel.fit(timings([1, 2, 4, 8], [8, 16, 32], accumulation=(1, 2)))
    for name, true in TRUE.items():
        m = model.models[name]
        fitted = (m.alpha_compute, m.beta_compute, m.alpha_sync, m.beta_sync)
        assert fitted == pytest.approx(true, rel=0.1), (name, fitted)
        assert m.unidentified == [] and m.probes == 24
        # a worker count and a batch size no probe measured
        ac, bc, as_, bs = true
        assert model.step_time(name, 16, 128) == pytest.approx(ac + 128 * bc + as_ + 14 * bs, rel=0.03)
    assert model.step_time("ddp", 4, 16) < model.step_time("zero-2", 4, 16)


def test_what_the_probes_cannot_tell_apart_is_left_out():
    model = ThroughputModel.fit(timings([1, 2], [8, 32], noise=0.0))
    m = model.models["ddp"]
    assert m.unidentified == ["beta_sync"] and m.beta_sync == 0.0
    # accumulation never varied: its time per micro-batch is the intercept
    assert (m.alpha_compute, m.beta_compute, m.alpha_sync) == pytest.approx(TRUE["ddp"][:3], rel=1e-6)
    with pytest.raises(ValueError, match="one per-worker batch"):
        ThroughputModel.fit(timings([1, 2], [16]))
    with pytest.raises(KeyError, match="no probes of 'fsdp'"):
        model.step_time("fsdp", 2, 16)
