"""Step times predicted on a named device (metrics/steptime.py, devices.py, `raytrain-par estimate --device`):
the ring costs against hand computation, which link a group crosses, what computation hides, the
bubble, the catalogue's sources, and bad input refused with the fix."""

import json
from dataclasses import replace

import pytest

from raytrain_par import devices
from raytrain_par.errors import UserError
from raytrain_par.metrics.comm import Collective, Step
from raytrain_par.metrics.steptime import Link, collective_seconds, group_crosses_nodes, step_time
from raytrain_par.strategies.layout import Layout
from test_cli import REPO, json_of, raytrain_par, refused

GB, US = 1e9, 1e-6


def test_ring_costs_are_the_alpha_beta_formulas():
    link = Link(bandwidth=100 * GB, latency_s=5 * US)
    b = 800e6
    # all-reduce: 2 (n - 1) / n of the buffer through each rank, in 2 (n - 1) steps
    assert collective_seconds(Collective("all_reduce", b, 8), link) == pytest.approx(2 * 7 / 8 * 8e-3 + 14 * 5e-6)
    assert collective_seconds(Collective("all_gather", b, 4), link) == pytest.approx(3 / 4 * 8e-3 + 3 * 5e-6)
    assert collective_seconds(Collective("reduce_scatter", b, 4), link) == pytest.approx(3 / 4 * 8e-3 + 3 * 5e-6)
    assert collective_seconds(Collective("send", b, 2), link) == pytest.approx(8e-3 + 5e-6)
    assert collective_seconds(Collective("recv", b, 2), link) == 0.0  # the other end of a send
    assert collective_seconds(Collective("all_reduce", b, 1), link) == 0.0


def test_the_tensor_group_stays_in_a_node_and_the_replicas_cross_them():
    layout = Layout.of(64, pipeline=2, tensor=8)  # D = 4; rank = (p D + d) T + t
    assert not group_crosses_nodes(layout, "tp", gpus_per_node=8)
    assert group_crosses_nodes(layout, "dp", gpus_per_node=8) and group_crosses_nodes(layout, "pp", 8)
    assert not group_crosses_nodes(Layout.of(8, tensor=2), "dp", gpus_per_node=8)  # all 8 in one node


DEVICE = replace(devices.CATALOGUE["a100-80gb"], peak_tflops={"fp32": 10.0}, achievable=1.0,
                 intra_node_bw=1 * GB, inter_node_bw=0.1 * GB, intra_node_latency_s=0.0, inter_node_latency_s=0.0)


@pytest.fixture(scope="module")
def tiny():
    from raytrain_par import config, data, models

    info = data.shape_of(config.DataSpec(name="kjv", seq_len=32, vocab_size=512))
    return models.build_on_meta(config.ModelSpec.of("gpt2-tiny"), info)[0]


def test_ddp_hides_its_all_reduce_behind_the_backward_pass_until_it_is_longer(tiny):
    """gpt2-tiny's 466,432 fp32 gradients all-reduced over 2 ranks in a node at 1 GB/s: 1.87 MB x 2 x 1/2
    = 1.87 ms. Behind a backward pass of 2/3 of 3 ms it is hidden; behind 2/3 of 1.5 ms, 0.87 ms shows."""
    layout, step = Layout.of(2), Step(rows=8)
    params = sum(p.numel() for p in tiny.parameters())
    assert params == 466_432
    t = step_time(layout, tiny, step, flops_per_step=2 * 3e-3 * 10e12, device=DEVICE, precision="fp32")
    assert t.compute_s == pytest.approx(3e-3) and t.comm_s == pytest.approx(params * 4 / GB)
    assert t.exposed_comm_s == 0.0 and t.bubble_s == 0.0 and t.step_s == pytest.approx(3e-3)
    t = step_time(layout, tiny, step, flops_per_step=2 * 1.5e-3 * 10e12, device=DEVICE, precision="fp32")
    assert t.exposed_comm_s == pytest.approx(params * 4 / GB - 1e-3)
    # across nodes (one GPU a node) the same bytes take ten times as long
    far = step_time(layout, tiny, step, 2 * 3e-3 * 10e12, replace(DEVICE, gpus_per_node=1), "fp32")
    assert far.comm_s == pytest.approx(10 * t.comm_s)
    # the per-step overhead (the optimizer's update) adds to the computation and hides nothing
    slow = step_time(layout, tiny, step, 2 * 1.5e-3 * 10e12, replace(DEVICE, step_overhead_s=2e-3), "fp32")
    assert slow.compute_s == pytest.approx(1.5e-3 + 2e-3) and slow.exposed_comm_s == pytest.approx(t.exposed_comm_s)


def test_where_collectives_share_the_computing_cores_nothing_hides_them(tiny):
    """gloo on a CPU runs its collectives on the cores that compute: the all-reduce DDP hides behind the
    backward pass on a GPU is all exposed."""
    t = step_time(Layout.of(2), tiny, Step(rows=8), 2 * 3e-3 * 10e12, replace(DEVICE, overlaps_communication=False),
                  "fp32")
    assert t.exposed_comm_s == pytest.approx(t.comm_s) and t.comm_s > 0
    assert t.step_s == pytest.approx(3e-3 + t.comm_s)


def test_a_pipeline_pays_its_bubble_and_its_fill_and_drain(tiny):
    """GPipe over 2 stages, 4 microbatches: bubble (P - 1) / M of the computation; the tied embedding's
    gradient (512 x 128 fp32) and the loss are exposed, and one microbatch's message each way."""
    layout = Layout.of(2, pipeline=2, schedule="gpipe", microbatches=4)
    t = step_time(layout, tiny, Step(rows=8), flops_per_step=2 * 4e-3 * 10e12, device=DEVICE, precision="fp32")
    assert t.compute_s == pytest.approx(4e-3) and t.bubble_s == pytest.approx(1e-3)
    message = 2 * 32 * 128 * 4 / GB  # 2 rows of 32 tokens x 128 hidden
    assert t.exposed_comm_s == pytest.approx(2 * 512 * 128 * 4 / GB / 2 + 4 / GB + 2 * message)


def test_where_workers_share_cores_the_bubble_runs_on_the_waiting_ranks_cores(tiny):
    """Four ranks on two cores compute at half a core each, but in the fill and drain half of them wait and
    leave their cores to the others: the bubble's computation runs at a whole core, half the time it
    would take at the shared rate; two ranks on two cores keep the whole bubble."""
    layout = Layout.of(4, pipeline=2, schedule="gpipe", microbatches=4)
    flops = 2 * 4e-3 * 10e12
    own = step_time(layout, tiny, Step(rows=8), flops, DEVICE, "fp32")
    shared = step_time(layout, tiny, Step(rows=8), flops, replace(DEVICE, cores_share=0.5), "fp32")
    assert own.bubble_s == pytest.approx(own.compute_s / 4) and shared.compute_s == own.compute_s
    assert shared.bubble_s == pytest.approx(own.bubble_s / 2)
    quarter = step_time(layout, tiny, Step(rows=8), flops, replace(DEVICE, cores_share=0.25), "fp32")
    assert quarter.bubble_s == pytest.approx(own.bubble_s / 2)  # half the ranks on the cores: half a core each


def test_every_figure_of_the_catalogue_says_where_it_comes_from():
    for d in devices.CATALOGUE.values():
        for field in ("peak_tflops", "memory_bytes", "intra_node_bw", "inter_node_bw", "intra_node_latency_s",
                      "inter_node_latency_s", "gpus_per_node", "achievable"):
            assert d.sources.get(field), (d.name, field)
        assert 0 < d.achievable <= 1
    assert set(devices.NAMES) >= {"v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "cpu"}


def test_a_measured_achievable_fraction_replaces_the_fitted_one_which_replaces_the_assumed_one(tmp_path, monkeypatch):
    path, fitted = tmp_path / "achievable.json", tmp_path / "fitted.json"
    path.write_text(json.dumps({"h200": {"achievable": 0.61, "source": "benchmarks/gpu_check.py on an H200"}}))
    monkeypatch.setattr(devices, "ACHIEVABLE_FILE", path)
    monkeypatch.setattr(devices, "FITTED_FILE", fitted)
    devices.record_fitted({name: {"achievable": 0.7, "source": "fitted to published runs"}
                           for name in ("h100-sxm", "h200")})
    d = devices.device("h200")
    assert d.achievable == 0.61 and "gpu_check" in d.sources["achievable"]
    assert devices.device("h100-sxm").achievable == 0.7
    assert "published" in devices.device("h100-sxm").sources["achievable"]
    assert devices.device("v100-32gb").achievable == devices.CATALOGUE["v100-32gb"].achievable


def test_the_command_line_overrides_a_figure_and_refuses_a_bad_one():
    d = devices.device("a100-80gb", {"inter_node_bw": "12.5", "achievable": "0.4"}, gpus_per_node=4)
    assert d.inter_node_bw == 12.5 * GB and d.achievable == 0.4 and d.gpus_per_node == 4
    assert d.sources["inter_node_bw"] == "given on the command line"
    with pytest.raises(UserError, match="v100-32gb"):
        devices.device("a200")
    with pytest.raises(UserError, match="no such field"):
        devices.device("h200", {"nvlink": "900"})
    with pytest.raises(UserError, match="fraction"):
        devices.device("h200", {"achievable": "1.5"})
    assert devices.device("h200", {"step_overhead_s": "2"}).step_overhead_s == pytest.approx(2e-3)  # ms
    assert devices.device("h200", {"step_overhead_s": "0"}).step_overhead_s == 0.0
    with pytest.raises(UserError, match="milliseconds, 0 or more"):
        devices.device("h200", {"step_overhead_s": "-1"})
    with pytest.raises(UserError, match="no bf16 peak"):
        devices.device("v100-32gb").peak("bf16")


def test_estimate_on_a_device_gives_step_time_and_mfu_per_row():
    result = raytrain_par("estimate", REPO / "experiments" / "quickstart.yaml", "--json", "--workers", "2,3,16",
                          "--strategies", "ddp,zero-3,pipeline,megatron,pipedream", "--device", "h100-sxm",
                          "--gpus-per-node", "8")
    doc = json_of(result)
    assert result.returncode == 0 and doc["device"]["name"] == "h100-sxm" and doc["device"]["sources"]
    rows = {(r["strategy"], r["workers"]): r for r in doc["rows"]}
    for key in [("ddp", 2), ("zero-3", 16), ("pipeline", 2), ("megatron", 2)]:
        r = rows[key]
        for field in ("strategy", "workers", "step_time_s", "tflops_per_gpu", "mfu", "mem_per_worker_bytes", "fits"):
            assert r[field] is not None, (key, field)
        assert r["step_time_s"] == pytest.approx(r["compute_s"] + r["exposed_comm_s"] + r["bubble_s"])
        assert 0 < r["mfu"] <= doc["device"]["achievable"] + 1e-9 and r["fits"] is True
    assert rows["pipeline", 2]["bubble_s"] > 0 and rows["ddp", 2]["bubble_s"] == 0
    # 16 workers span two nodes: zero-3's gathers cross them
    assert rows["zero-3", 16]["comm_s"] > rows["zero-3", 2]["comm_s"]
    assert not rows["ddp", 3]["possible"] and rows["ddp", 3]["note"]  # one row saying why
    # PipeDream's bubble: the forward passes' refill after each step's loss, a third of what 1F1B's flush
    # costs at quickstart's one microbatch (P - 1 = 1 of them), and its messages
    pd = rows["pipedream", 2]
    assert pd["step_time_s"] == pytest.approx(pd["compute_s"] + pd["exposed_comm_s"] + pd["bubble_s"])
    assert pd["bubble_s"] == pytest.approx(pd["compute_s"] / 3) and pd["exposed_comm_s"] > 0
    assert 0 < pd["mfu"] < doc["device"]["achievable"] and "no step time" not in pd["remark"]


def test_estimate_refuses_an_unknown_device_with_the_catalogue():
    refused(raytrain_par("estimate", REPO / "experiments" / "quickstart.yaml", "--device", "tpu-v5"),
            "tpu-v5", "a100-80gb", "h200")
    refused(raytrain_par("estimate", REPO / "experiments" / "quickstart.yaml", "--gpus-per-node", "4"), "--device")


def test_workers_beyond_the_cores_left_to_them_share_them():
    """On this machine's CPU: each worker computes at (cores - the other processes' cores) / workers of
    its peak once they outnumber what is left, never faster than alone. gloo moves the bytes on those
    cores, so the link shares them too: half a core each, half the bandwidth and each ring step twice
    as long; workers with a core each keep the link as measured. So does the step's overhead."""
    import os

    base = devices.Device("cpu", {"fp32": 1.0}, 0, 0, 0, 0, 0, 1, 1.0, overlaps_communication=False,
                          step_overhead_s=0.01)
    cores = os.cpu_count()
    link = (1e9, 1e-4)
    alone, over = devices.cpu_workers(base, link, cores), devices.cpu_workers(base, link, 2 * cores)
    assert devices.cpu_workers(base, link, 1).peak_tflops["fp32"] == 1.0
    assert (alone.intra_node_bw, alone.intra_node_latency_s, alone.peak_tflops["fp32"]) == (1e9, 1e-4, 1.0)
    assert over.peak_tflops["fp32"] == pytest.approx(0.5)
    assert over.intra_node_bw == over.inter_node_bw == pytest.approx(0.5e9)
    assert over.intra_node_latency_s == pytest.approx(2e-4)
    assert (alone.cores_share, over.cores_share) == (1.0, 0.5)
    assert (alone.step_overhead_s, over.step_overhead_s) == (0.01, pytest.approx(0.02))
    busy = devices.cpu_workers(base, link, cores, background_cores=0.5)
    assert busy.peak_tflops["fp32"] == pytest.approx((cores - 0.5) / cores)
    assert busy.intra_node_bw == pytest.approx(1e9 * (cores - 0.5) / cores)  # the link too
    assert busy.gpus_per_node == cores


def test_checkpointing_adds_the_forward_pass_of_the_modules_it_recomputes():
    """Counted, not assumed: `full` runs every block's forward again, `selective` each self-attention's;
    neither the embeddings nor the LM head are recomputed, so both cost less than a third of the step."""
    from raytrain_par import config, data, estimate
    from raytrain_par.metrics import flops

    def spec(mode):
        return config.parse({"name": "c", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "seq_len": 128},
                             "scaling": {"num_workers": 2}, "train": {"global_batch_size": 8,
                                                                      "activation_checkpointing": mode}})

    info = data.shape_of(spec("none").data)
    step = flops.model_flops_per_step(spec("none").model, info, 8)
    parts = {mode: estimate.StepParts.of(spec(mode)) for mode in ("none", "selective", "full")}
    assert parts["none"].recomputed == 0
    assert 0 < parts["selective"].recomputed < parts["full"].recomputed < step / 3
    assert parts["full"].recomputed == 8 * (flops.count_flops(spec("full").model, info, 1, "full")
                                            - flops.model_flops_per_sample(spec("full").model, info))
    device = devices.device("h100-sxm")
    rate = device.peak("fp32") * device.achievable
    for mode, p in parts.items():
        assert p.on(device).compute_s == pytest.approx((step + p.recomputed) / 2 / rate)


def test_a_measured_factor_scales_its_op_and_no_other():
    """gloo's all-gathers and reduce-scatters run slower than its all-reduce: a device's factor for an op
    multiplies that op's ring time, and the catalogue's GPUs have none."""
    link = Link(bandwidth=1 * GB, latency_s=0.0, factors={"all_gather": 1.5})
    plain = Link(bandwidth=1 * GB, latency_s=0.0)
    gather, reduce = Collective("all_gather", 1e9, 2), Collective("all_reduce", 1e9, 2)
    assert collective_seconds(gather, link) == pytest.approx(1.5 * collective_seconds(gather, plain))
    assert collective_seconds(reduce, link) == collective_seconds(reduce, plain)
    assert all(not d.collective_factors for d in devices.CATALOGUE.values())
    loopback = devices.Loopback(1e9, 1e-4, {"reduce_scatter": 3.0})
    base = devices.Device("cpu", {"fp32": 1.0}, 0, 0, 0, 0, 0, 1, 1.0, overlaps_communication=False)
    assert devices.cpu_workers(base, loopback, 2).collective_factors == {"reduce_scatter": 3.0}


def test_the_loopback_is_measured_per_op():
    """Two gloo processes: the all-reduce's line, and each other op's time over the ring model's, positive."""
    link = devices.measure_loopback(repeats=3)
    assert link.bandwidth > 0 and link.latency_s >= 0
    assert set(link.factors) == {"all_gather", "reduce_scatter"} and all(f > 0 for f in link.factors.values())
