import pytest
import torch

from raytrain_par.local_group import run_ranks
from engines import experiment, train_cases, train_steps


CASES = [
    ("gpt2-tiny", "kjv", {}),
    ({"name": "vgg11", "width": 0.125, "dropout": 0.0}, "digits", {"optimizer": "sgd", "lr": 0.05}),
    ("gpt2-tiny", "kjv", {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "warmup_steps": 2,
                          "lr_schedule": "cosine", "weight_decay": 0.1}),
    ({"name": "vgg11", "width": 0.125}, "digits", {"optimizer": "lamb", "weight_decay": 0.01}),
]


def test_ddp_two_ranks_match_one_process(info):
    steps = 4
    single = run_ranks(1, train_cases, [(experiment(m, d, workers=1, **x), info(d), steps) for m, d, x in CASES])[0]
    pair = run_ranks(2, train_cases, [(experiment(m, d, workers=2, **x), info(d), steps) for m, d, x in CASES])
    for i, case in enumerate(CASES):
        one, two = single[i], [pair[0][i], pair[1][i]]
        assert two[0]["losses"] == two[1]["losses"], case  # every rank sees the global loss
        assert two[0]["losses"] == pytest.approx(one["losses"], abs=1e-5, rel=1e-5), case
        assert one["losses"][-1] < one["losses"][0], case  # and it is training
        # Two ranks sum each gradient in another order than one process (their rows apart, then averaged):
        # its last bits differ, and AdamW's step, g / (sqrt(v) + eps), turns that into up to a few percent
        # of lr (1e-3) where a gradient nearly cancels out, so weights agree to 5e-5, the losses to 1e-5.
        for name, ref in one["state"].items():
            torch.testing.assert_close(two[0]["state"][name], ref, atol=5e-5, rtol=1e-4, msg=f"{case}: {name}")


def test_ddp_memory_counts_bucketed_gradients(info):
    """Model states per worker: parameters + gradients (DDP's buckets) + two AdamW moments, ~16 B/param."""
    out = run_ranks(2, train_steps, experiment("gpt2-tiny", "kjv", workers=2), info("kjv"), 1)
    mem = out[0]["memory"]
    n_param_bytes = mem["mem_param_bytes"]
    assert mem["mem_grad_bytes"] >= n_param_bytes  # a gradient per parameter, inside the buckets
    assert mem["mem_optim_bytes"] == pytest.approx(2 * n_param_bytes, rel=0.01)
    assert mem["mem_model_state_census_bytes"] / n_param_bytes * 4 == pytest.approx(16, rel=0.05)
    assert mem["mem_model_state_theory_bytes"] == 4 * n_param_bytes
    # the allocator's count holds at least the census (and, at this tiny size, the runtime's first-step
    # allocations: see test_zero.py for the bytes-per-parameter comparison on a larger model)
    assert mem["mem_model_state_bytes"] >= mem["mem_model_state_census_bytes"]
    assert mem["mem_peak_bytes"] > mem["mem_model_state_bytes"]


def test_lamb_step_follows_the_trust_ratio():
    """One LAMB step by hand: Adam's bias-corrected direction scaled by ||w|| / ||update||."""
    from raytrain_par.strategies.lamb import Lamb

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    w0 = w.detach().clone()
    w.grad = torch.randn(5, 3)
    Lamb([w], lr=0.1, weight_decay=0.01, eps=1e-6).step()
    update = w.grad / (w.grad.abs() + 1e-6) + 0.01 * w0  # first step: m_hat = g, sqrt(v_hat) = |g|
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected)
