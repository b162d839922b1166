"""Time and cost to the target on a device or cluster never run on (`estimate --records`, `--cluster`):
the steps a reference run's noise scale predicts at the experiment's batch, times the predicted step."""

import pytest
import yaml

from raytrain_par import data, devices
from raytrain_par.clusters import gpu_nodes
from raytrain_par.config import load_experiment
from raytrain_par.errors import UserError
from raytrain_par.metrics import flops
from raytrain_par.metrics.records import read_records, write_table
from test_cli import REPO, in_process, json_of, raytrain_par, refused

QUICKSTART = REPO / "experiments" / "quickstart.yaml"
# (step, val_perplexity, noise scale measured over the interval before it); the target is <= 120
CURVE = [(0, 8000.0, None), (50, 300.0, 20.0), (100, 110.0, 40.0), (150, 90.0, 60.0)]


def write_reference(directory, batch=32, curve=CURVE, **extra):
    s = load_experiment(QUICKSTART, check_data=False)
    per_sample = flops.model_flops_per_step(s.model, data.shape_of(s.data), 1)
    rows = [{"trial": "run", "strategy": "ddp", "num_workers": 2, "global_batch_size": batch, "step": step,
             "val_perplexity": p, "grad_noise_scale": g, "model_flops_per_step": per_sample * batch, **extra}
            for step, p, g in curve]
    write_table(directory / "metrics.parquet", rows)
    return directory


def test_a_cluster_file_names_its_gpu_network_price_and_size():
    d, price, nodes = devices.cluster_device(str(REPO / "clusters" / "aws-a100.yaml"))
    assert (nodes.instance, nodes.gpus_per_node, nodes.max_gpus, nodes.spot_also) == ("p4d.24xlarge", 8, 64, True)
    assert d.name == "a100-40gb" and d.gpus_per_node == 8
    assert d.inter_node_bw == pytest.approx(400e9 / 8 / 8)  # 400 Gb/s EFA shared by 8 GPUs
    assert price == pytest.approx(32.7726 / 8) and "p4d.24xlarge" in d.sources["inter_node_bw"]
    v100, _, _ = devices.cluster_device(str(REPO / "clusters" / "aws-v100.yaml"))
    assert v100.name == "v100-16gb" and v100.memory_bytes == 16 * 2**30
    gcp, _, nodes = devices.cluster_device(str(REPO / "clusters" / "gcp-a100.yaml"), {"inter_node_bw": "25"})
    assert nodes.instance == "a2-highgpu-8g" and gcp.inter_node_bw == 25e9
    with pytest.raises(UserError, match="--device NAME"):  # a KubeRay group does not name its machine
        devices.cluster_device(str(REPO / "clusters" / "kuberay-raycluster.yaml"))
    assert gpu_nodes(REPO / "clusters" / "kuberay-raycluster.yaml").instance is None


def test_time_and_cost_to_target_are_the_reference_steps_times_the_predicted_step(tmp_path):
    ref = write_reference(tmp_path / "ref")
    result = raytrain_par("estimate", QUICKSTART, "--json", "--workers", "1,8,128", "--strategies", "ddp,zero-2",
                          "--cluster", REPO / "clusters" / "aws-a100.yaml", "--records", ref)
    doc = json_of(result)
    assert result.returncode == 0
    price = doc["usd_per_gpu_hour"]
    assert price == pytest.approx(32.7726 / 8) and doc["cluster"]["max_gpus"] == 64 and doc["cluster"]["spot_also"]
    # the run crossed 120 between steps 50 (300) and 100 (110), at 50 + 50 * 180 / 190, at its own batch 32
    assert doc["reference"]["steps_to_target"] == pytest.approx(50 + 50 * 180 / 190)
    rows = {(r["strategy"], r["workers"]): r for r in doc["rows"]}
    for key in [("ddp", 1), ("ddp", 8), ("zero-2", 8)]:
        r = rows[key]
        assert r["steps_to_target"] == pytest.approx(doc["reference"]["steps_to_target"])
        assert r["time_to_target_s"] == pytest.approx(r["steps_to_target"] * r["step_time_s"])
        assert r["cost_to_target_usd"] == pytest.approx(r["time_to_target_s"] * r["workers"] / 3600 * price)
    assert rows["ddp", 8]["time_to_target_s"] < rows["ddp", 1]["time_to_target_s"]
    assert not rows["ddp", 128]["possible"] and "at most 64 GPUs" in rows["ddp", 128]["note"]
    text = in_process("estimate", QUICKSTART, "--workers", "8", "--strategies", "ddp", "--cluster",
                      REPO / "clusters" / "aws-a100.yaml")
    assert "spot node type" in text.stdout and "--price" in text.stdout  # the same machines for less
    text = in_process("estimate", QUICKSTART, "--workers", "1,8", "--strategies", "ddp,pipedream", "--device",
                      "h100-sxm", "--records", ref, "--price", "2.5")
    assert text.returncode == 0, text.stderr
    assert "to target" in text.stdout and "cost" in text.stdout and "soonest to the target: ddp on 8" in text.stdout
    # PipeDream's step is predicted, its steps to the target are not: a synchronous reference cannot say them
    assert "pipedream on 8 worker(s): no time to the target: PipeDream's stale weights" in text.stdout


def test_a_larger_batch_takes_the_steps_its_noise_scale_predicts(tmp_path):
    ref = write_reference(tmp_path / "ref", batch=16)
    doc = json_of(in_process("estimate", QUICKSTART, "--json", "--workers", "2", "--strategies", "ddp",
                             "--device", "a100-80gb", "--records", ref))
    r, reference = doc["rows"][0], doc["reference"]
    b, s_min = reference["grad_noise_scale"], reference["min_steps"]
    assert reference["global_batch_size"] == 16 and doc["global_batch_size"] == 32
    assert s_min * (1 + b / 16) == pytest.approx(reference["steps_to_target"])
    assert r["steps_to_target"] == pytest.approx(s_min * (1 + b / 32)) and r["steps_to_target"] < reference["steps_to_target"]


def test_records_that_cannot_say_are_refused_with_the_fix(tmp_path):
    estimate = ("estimate", QUICKSTART, "--device", "a100-80gb", "--records")
    refused(in_process(*estimate, tmp_path / "none"), "no metrics.parquet")
    never = write_reference(tmp_path / "never", curve=[(0, 8000.0, None), (50, 300.0, 20.0)])
    refused(in_process(*estimate, never), "never reached val_perplexity <= 120", "max_steps")
    unmeasured = write_reference(tmp_path / "unmeasured", curve=[(0, 8000.0, None), (50, 100.0, None)])
    refused(in_process(*estimate, unmeasured), "did not measure the gradient noise scale")
    other = write_reference(tmp_path / "other")
    rows = read_records(other / "metrics.parquet")
    write_table(other / "metrics.parquet", [{**r, "model_flops_per_step": r["model_flops_per_step"] * 3}
                                            for r in rows])
    refused(in_process(*estimate, other), "another model")
    ok = write_reference(tmp_path / "ok")
    refused(in_process("estimate", QUICKSTART, "--records", ok), "--device", "--cluster")
    refused(in_process("estimate", QUICKSTART, "--device", "h200", "--price", "3"), "--records")
    refused(in_process("estimate", QUICKSTART, "--cluster", REPO / "clusters" / "aws-a100.yaml", "--device",
                       "h200"), "--device")
    refused(in_process("estimate", QUICKSTART, "--cluster", REPO / "clusters" / "kuberay-raycluster.yaml"),
            "--price")


def sweep_file(tmp_path):
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw.update(output_dir=str(tmp_path / "results"),
               sweep={"grid": {"train.global_batch_size": [16, 32], "strategy": [{"name": "ddp"}, {"name": "zero-2"}]},
                      "lr_scaling": "sqrt"})
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_ranks_a_cluster_it_never_ran_on_without_starting_ray(tmp_path, monkeypatch):
    from raytrain_par import estimate, goodput

    def no_ray(*a, **k):
        raise AssertionError("a plan given --records and a device started Ray")

    monkeypatch.setattr(goodput, "ray_cluster", no_ray)
    spec = load_experiment(sweep_file(tmp_path), check_data=False)
    ref = write_reference(tmp_path / "ref")
    device, price, nodes = devices.cluster_device(str(REPO / "clusters" / "aws-a100.yaml"))
    result = goodput.cluster_plan(spec, device, nodes, price, goodput.worker_counts("1..128"), str(ref),
                                  log=lambda *_: None)
    possible = [r for r in result.rows if r["possible"]]
    impossible = {r["trial"]: r["note"] for r in result.rows if not r["possible"]}
    assert "at most 64 GPUs" in impossible["w128-strategy=ddp-b16"]
    assert "does not split evenly" in impossible["w32-strategy=ddp-b16"]
    assert {(r["num_workers"], r["global_batch_size"]) for r in possible} == {
        (w, b) for w in (1, 2, 4, 8, 16, 32, 64) for b in (16, 32) if b % w == 0}
    times = [r["predicted_time_to_target_s"] for r in possible]
    assert times == sorted(times) and [r["rank"] for r in possible] == list(range(1, len(possible) + 1))
    for r in possible:
        s = load_experiment(sweep_file(tmp_path), [
            f"scaling.num_workers={r['num_workers']}", f"train.global_batch_size={r['global_batch_size']}",
            f"strategy={{name: {r['strategy']}}}", f"train.lr={r['lr']}", "sweep=null"], check_data=False)
        step = estimate.step_time(s, device).step_s
        assert r["step_time_from"] == "model" and r["predicted_step_time_s"] == pytest.approx(step)
        steps = result.reference.steps_to_target(s.train.global_batch_size)
        assert r["predicted_steps_to_target"] == pytest.approx(steps)
        seconds = r["predicted_time_to_target_s"]
        assert seconds == pytest.approx(steps * step) and r["predicted_cost_usd"] == pytest.approx(
            seconds * r["num_workers"] / 3600 * price)
        assert r["fits"] is True
        # estimate's names for the same figures
        assert (r["workers"], r["step_time_s"], r["time_to_target_s"], r["mem_per_worker_bytes"]) == (
            r["num_workers"], r["predicted_step_time_s"], seconds, r["memory_per_worker_bytes"])
    text = in_process("plan", sweep_file(tmp_path), "--device", "h100-sxm", "--workers", "1,2", "--records", ref,
                      "--price", "3")
    assert text.returncode == 0, text.stderr
    assert "predicted fastest to val_perplexity <= 120: w2-" in text.stdout and "predicted cheapest" in text.stdout


def test_plan_on_a_device_refuses_what_it_cannot_use(tmp_path):
    path, ref = sweep_file(tmp_path), write_reference(tmp_path / "ref")
    refused(in_process("plan", path, "--workers", "8..64"), "--cluster FILE or --device NAME")
    refused(in_process("plan", path, "--device", "h100-sxm", "--probe-workers", "1"), "--probe-workers")
    refused(in_process("plan", path, "--device", "h100-sxm", "--workers", "64..8"), "8..256")
    refused(in_process("plan", path, "--device", "h100-sxm", "--records", tmp_path / "none"), "no metrics.parquet")
    refused(in_process("plan", path, "--device", "v100-32gb", "--records", ref, "--set", "train.precision=bf16"),
            "no bf16 peak")
