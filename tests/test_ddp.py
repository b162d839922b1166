import pytest
import torch

from dist import run_ranks
from engines import experiment, train_steps


@pytest.mark.parametrize("model,data,extra", [
    ("gpt2-tiny", "kjv", {}),
    ({"name": "vgg11", "width": 0.125, "dropout": 0.0}, "digits", {"optimizer": "sgd", "lr": 0.05}),
    ("gpt2-tiny", "kjv", {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "warmup_steps": 2,
                          "lr_schedule": "cosine", "weight_decay": 0.1}),
])
def test_ddp_two_ranks_match_one_process(model, data, extra, info):
    steps = 4
    single = run_ranks(1, train_steps, experiment(model, data, workers=1, **extra), info(data), steps)[0]
    pair = run_ranks(2, train_steps, experiment(model, data, workers=2, **extra), info(data), steps)
    assert pair[0]["losses"] == pytest.approx(pair[1]["losses"], abs=0)  # every rank sees the global loss
    assert pair[0]["losses"] == pytest.approx(single["losses"], abs=1e-5, rel=1e-5)
    assert single["losses"][-1] < single["losses"][0]  # and it is training
    for name, ref in single["state"].items():
        torch.testing.assert_close(pair[0]["state"][name], ref, atol=1e-5, rtol=1e-4, msg=name)


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
