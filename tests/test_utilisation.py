"""The training loop's hardware-efficiency figures: model FLOPs, MFU against the probe, and model
states measured on chosen steps only (so that measuring does not tax training)."""

import pytest
import torch

from engines import experiment
from raytrain_par import config
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics import timeline
from raytrain_par.strategies import DistContext
from raytrain_par.strategies.base import Engine
from raytrain_par.worker import LocalReporter, Trainer, memory_train_loader


def run_loop(info_dict, tmp_path, monkeypatch, steps=9, every=4):
    raw = experiment("gpt2-tiny", "kjv", batch=8, steps=steps, eval_every_steps=every, eval_at_start=False)
    raw["data"]["max_val_samples"] = 64  # what is measured here does not depend on the validation rows
    spec = config.from_dict(raw)
    info = DatasetInfo.from_json(info_dict)
    measured = []
    original = Engine.model_state

    def counting(engine):
        measured.append(trainer.state.step)  # the step count before the step that measures
        return original(engine)

    monkeypatch.setattr(Engine, "model_state", counting)
    ctx = DistContext.current(torch.device("cpu"))
    reporter = LocalReporter(tmp_path, 0, 1, log=lambda *_: None)
    trainer = Trainer(spec, info, ctx, reporter, memory_train_loader(spec, read_split(info, info.train_path)),
                      read_split(info, info.val_path), log=lambda *_: None)
    return spec, info, trainer.run(), measured


def _nine_steps(rank, world, info_dict, tmp_path):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _, _, records, measured = run_loop(info_dict, tmp_path, monkeypatch, steps=9, every=4)
    return records, measured


@pytest.fixture(scope="module")
def nine_steps(info, tmp_path_factory):
    """One process trains 9 steps, evaluating every 4: (spec, data info, records, the steps before
    each model-state measurement). A process of its own, as a worker is: the allocator's count of what
    the model states hold would also see what the test session's other threads allocate and free."""
    info_dict = info("kjv")
    records, measured = run_ranks(1, _nine_steps, info_dict, tmp_path_factory.mktemp("loop"))[0]
    raw = experiment("gpt2-tiny", "kjv", batch=8, steps=9, eval_every_steps=4, eval_at_start=False)
    return config.from_dict(raw), DatasetInfo.from_json(info_dict), records, measured


def test_records_carry_model_flops_and_mfu_against_the_probe(nine_steps):
    spec, data_info, records, _ = nine_steps
    L, d, T, V = 2, 128, data_info.seq_len, data_info.vocab_size
    per_token = 6 * (12 * L * d * d + V * d) + 12 * L * d * T  # the transformer formula (tests/test_flops.py)
    for r in records:
        assert r["model_flops_per_step"] == per_token * T * spec.train.global_batch_size
        assert r["peak_source"].startswith("matmul probe") and r["peak_tflops"] == r["probe_tflops"] > 0
        assert 0 < r["mfu"] <= 1
        step_s = r["step_time_s"]
        assert r["achieved_tflops"] == pytest.approx(r["model_flops_per_step"] / step_s / 1e12)
        assert r["mfu"] == pytest.approx(r["achieved_tflops"] / r["peak_tflops"])
        assert r["comm_fraction"] == 0  # one worker: its profiled step (the fourth) ran no collective


def test_model_states_are_measured_on_the_first_steps_and_before_each_evaluation(nine_steps):
    _, _, records, measured = nine_steps
    # Twice per measured step (before and after the optimizer step), on steps 1-3, on the steps that
    # end with an evaluation (4 and 8) and on the last (9); `measured` holds the step count before each.
    assert sorted(set(measured)) == [0, 1, 2, 3, 7, 8]
    assert all(measured.count(s) == 2 for s in set(measured))
    assert [r["step"] for r in records] == [4, 8, 9]
    assert all(r["mem_model_state_bytes"] > 0 and r["mem_model_state_theory_bytes"] > 0 for r in records)


def test_exposed_communication_is_what_computation_does_not_cover():
    # communication in flight 0-10 and 20-30; computing 2-8 and 12-25 (with a short gap 5.0-5.0001)
    comm = timeline.union([(0, 10), (20, 30)])
    compute = timeline.union([(2, 5), (5.0001, 8), (12, 25)], gap=0.001)
    assert compute == [(2, 8), (12, 25)]
    assert timeline.uncovered(comm, compute) == pytest.approx(2 + 2 + 5)  # 0-2, 8-10, 25-30
    assert timeline.uncovered(comm, []) == 20 and timeline.uncovered([], compute) == 0


def _ddp_profiled(rank, world, info_dict):
    from raytrain_par import models, strategies
    from raytrain_par.data.loader import MemoryLoader

    spec = config.from_dict(experiment("gpt2-tiny", "kjv", workers=world, batch=16, steps=4))
    data_info = DatasetInfo.from_json(info_dict)
    arrays = read_split(data_info, data_info.train_path)
    model, task = models.build(spec.model, data_info, 0)
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")), 4)
    batches = MemoryLoader(arrays, 16, engine.dp_rank, engine.dp_size, 0).epoch(0)
    engine.train_step(next(batches))
    with timeline.profiled_step(engine.device) as sample:
        engine.train_step(next(batches))
    return sample


def test_a_profiled_ddp_step_finds_its_gradient_all_reduce(info):
    for sample in run_ranks(2, _ddp_profiled, info("kjv")):
        # gloo all-reduced the gradients while the step ran; at least the last bucket waits exposed
        assert 0 < sample["exposed_comm_s"] <= sample["comm_s"] < sample["step_s"]
        assert 0 < sample["comm_fraction"] < 1


def _heap_kept_by_a_profiled_step(rank, world, warm):
    from raytrain_par.metrics.memory import heap_in_use_bytes

    if warm:
        timeline.warm_up_profiler(torch.device("cpu"))
    layer, x = torch.nn.Linear(256, 256), torch.randn(64, 256)
    layer(x).sum().backward()
    before = heap_in_use_bytes()
    with timeline.profiled_step(torch.device("cpu")):
        layer(x).sum().backward()
    return heap_in_use_bytes() - before


def test_the_profiler_keeps_nothing_mid_training_once_warmed_up():
    # A fresh process each: the profiler's first use keeps memory for good, which the training loop
    # takes at start-up (before the engine's memory baseline) so that it never counts as model state.
    cold, warm = (run_ranks(1, _heap_kept_by_a_profiled_step, w, fresh=True)[0] for w in (False, True))
    assert cold > 4 * 2**20 and warm < 2**20
