"""Cluster files checked offline (`raytrain-par cluster validate`), and bad input on the way to a
cluster: an address where no cluster answers, output directories a cluster cannot use."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from conftest import REPO, experiment_file
from raytrain_par.cli import main
from raytrain_par.clusters import check_file, validate
from raytrain_par.config import load_experiment
from raytrain_par.driver import place_results, run_experiment
from raytrain_par.errors import ConfigError, UserError
from raytrain_par.local_group import free_port

CLUSTERS = sorted((REPO / "clusters").glob("*.yaml"))
PAPER = [experiment_file("paper/gpt2-medium-wikitext.yaml"), experiment_file("paper/vgg16-imagenet.yaml")]
GPU_IMAGE = f"rayproject/ray:{ray.__version__}-py311-gpu"


def test_the_cluster_files_are_all_there():
    assert {p.stem for p in CLUSTERS} == {"aws-a100", "aws-v100", "gcp-a100", "kuberay-raycluster",
                                          "kuberay-rayjob", "local-autoscale"}


@pytest.mark.parametrize("path", CLUSTERS, ids=[p.name for p in CLUSTERS])
def test_cluster_file_validates_and_autoscales(path):
    cluster = check_file(path)
    assert cluster.ok, "\n".join(map(str, cluster.problems))
    heads = [t for t in cluster.node_types if t.head]
    workers = [t for t in cluster.node_types if not t.head]
    assert len(heads) == 1 and "GPU" not in heads[0].resources  # a CPU head
    assert workers and all(t.min_workers == 0 < t.max_workers for t in workers)  # scales from zero
    raw = yaml.safe_load(path.read_text())
    if cluster.kind.startswith("KubeRay"):
        spec = raw["spec"].get("rayClusterSpec", raw["spec"])
        assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
        assert spec["rayVersion"] == ray.__version__
    else:
        assert raw["idle_timeout_minutes"] > 0
    if "local" not in path.stem:  # the GPU clusters: 8 GPUs a node, Ray's current GPU image
        assert {t.resources["GPU"] for t in workers} == {8}
        if not cluster.kind.startswith("KubeRay"):
            assert raw["docker"]["image"] == GPU_IMAGE
            assert any("torch==" in c for c in raw["setup_commands"])  # torch pinned, never resolved freely


# Where a cluster file asks for spot (preemptible) capacity, by its kind
SPOT = {"aws-a100": ("gpu_a100_spot", lambda c: c["InstanceMarketOptions"]["MarketType"] == "spot"),
        "aws-v100": ("gpu_v100_spot", lambda c: c["InstanceMarketOptions"]["MarketType"] == "spot"),
        "gcp-a100": ("gpu_a100_spot", lambda c: c["scheduling"]["provisioningModel"] == "SPOT"),
        "kuberay-raycluster": ("gpu-a100-spot", lambda c: c["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
                               and any(t["key"] == "cloud.google.com/gke-spot" for t in c["tolerations"]))}


@pytest.mark.parametrize("stem", SPOT)
def test_gpu_clusters_offer_spot_nodes_of_the_same_machine(stem):
    name, is_spot = SPOT[stem]
    path = REPO / "clusters" / f"{stem}.yaml"
    types = {t.name: t for t in check_file(path).node_types}
    on_demand = types[name.removesuffix("_spot").removesuffix("-spot")]
    assert types[name].resources == on_demand.resources and types[name].min_workers == 0
    raw = yaml.safe_load(path.read_text())
    if stem.startswith("kuberay"):
        groups = {g["groupName"]: g["template"]["spec"] for g in raw["spec"]["workerGroupSpecs"]}
        assert is_spot(groups[name]) and "nodeSelector" not in groups[on_demand.name]
    else:
        node_types = raw["available_node_types"]
        assert is_spot(node_types[name]["node_config"])
        assert set(node_types[on_demand.name]["node_config"]).isdisjoint({"InstanceMarketOptions"})
        assert "provisioningModel" not in node_types[on_demand.name]["node_config"].get("scheduling", {})


def test_kuberay_image_is_built_from_the_ray_gpu_image():
    assert f"FROM {GPU_IMAGE}" in (REPO / "clusters" / "Dockerfile").read_text()


def _broken(tmp_path, source, change):
    raw = yaml.safe_load((REPO / "clusters" / source).read_text())
    change(raw)
    path = tmp_path / source
    path.write_text(yaml.safe_dump(raw))
    return check_file(path)


def _gpu_group(raw):
    return raw["spec"]["workerGroupSpecs"][0]


def _set_type(name, **values):
    return lambda raw: raw["available_node_types"][name].update(values)


BROKEN = {
    # case: (file, change, field named, words of the message)
    "wrong type": ("aws-a100.yaml", lambda r: r.update(max_workers="eight"), "max_workers",
                   "Ray's cluster schema: 'eight' is not of type 'integer'"),
    "unknown key": ("gcp-a100.yaml", _set_type("gpu_a100", max_worker=3), "available_node_types.gpu_a100.max_worker",
                    "Additional properties are not allowed"),
    "unknown head node type": ("aws-v100.yaml", lambda r: r.update(head_node_type="gpu_h100"), "head_node_type",
                               "must be one of `available_node_types`"),
    "min > max": ("aws-a100.yaml", _set_type("gpu_a100", min_workers=3, max_workers=2),
                  "available_node_types.gpu_a100.min_workers", "larger than max_workers (2)"),
    "fake provider, min > max": ("local-autoscale.yaml", _set_type("ray.worker.cpu", min_workers=3),
                                 "available_node_types.ray.worker.cpu.min_workers", "larger than max_workers"),
    "world-open dashboard": ("aws-a100.yaml", lambda r: r["provider"].update(security_group={"IpPermissions": [
        {"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 9000, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}),
        "provider.security_group.IpPermissions[0]", "opens port 8265 (dashboard and job API) to the whole internet"),
    "token auth off": ("gcp-a100.yaml", lambda r: r["head_start_ray_commands"].append("RAY_AUTH_MODE=disabled ray start"),
                       "head_start_ray_commands[2]", "switches Ray's token auth off"),
    "credential in the file": ("aws-v100.yaml", lambda r: r["provider"].update(aws_secret_access_key="abc"),
                               "provider.aws_secret_access_key", "a credential written into the cluster file"),
    "fake provider, field left out": ("local-autoscale.yaml", lambda r: r.pop("cluster_synced_files"),
                                      "cluster_synced_files", "has no defaults to fill it in"),
    "kuberay min > max": ("kuberay-raycluster.yaml", lambda r: _gpu_group(r).update(minReplicas=9),
                          "spec.workerGroupSpecs[0].minReplicas", "larger than maxReplicas (8)"),
    "kuberay autoscaling off": ("kuberay-raycluster.yaml", lambda r: r["spec"].update(enableInTreeAutoscaling=False),
                                "spec.enableInTreeAutoscaling", "autoscaling is off"),
    "kuberay load balancer": ("kuberay-raycluster.yaml", lambda r: r["spec"]["headGroupSpec"].update(
        serviceType="LoadBalancer"), "spec.headGroupSpec.serviceType", "outside the Kubernetes cluster"),
    "kuberay token auth off": ("kuberay-rayjob.yaml", lambda r: r["spec"]["rayClusterSpec"].pop("authOptions"),
                               "spec.rayClusterSpec.authOptions.mode", "token auth is off"),
    "kuberay old api": ("kuberay-raycluster.yaml", lambda r: r.update(apiVersion="ray.io/v1alpha1"), "apiVersion",
                        "served as ray.io/v1"),
    "kuberay no cpu limit": ("kuberay-raycluster.yaml", lambda r: _gpu_group(r)["template"]["spec"]["containers"][0][
        "resources"]["limits"].pop("cpu"), "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.cpu",
        "missing"),
    "kuberay job without entrypoint": ("kuberay-rayjob.yaml", lambda r: r["spec"].pop("entrypoint"), "spec.entrypoint",
                                       "missing"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_cluster_file_is_refused_with_field_and_fix(tmp_path, case):
    source, change, field, words = BROKEN[case]
    cluster = _broken(tmp_path, source, change)
    messages = [str(p) for p in cluster.problems]
    hits = [m for m in messages if f": {field} = " in m and words in m]
    assert hits, messages
    assert hits[0].startswith(str(tmp_path / source)) and "\n  fix: " in hits[0]


def test_paper_sweeps_fit_the_gpu_clusters():
    gpu_files = [p for p in CLUSTERS if "local" not in p.stem]
    results = validate(gpu_files, PAPER)
    assert all(c.ok for c in results), [str(p) for c in results for p in c.problems]


def test_gpu_experiment_on_a_cluster_without_gpus_is_a_clear_error():
    (cluster,) = validate([REPO / "clusters" / "local-autoscale.yaml"], PAPER[:1])
    (problem,) = cluster.problems
    assert problem.field == "scaling.use_gpu" and "has no node type with GPUs" in problem.problem
    assert str(PAPER[0]) in problem.source and "clusters/aws-a100.yaml" in problem.fix


def test_capacity_names_the_largest_trial_that_does_not_fit(tmp_path):
    raw = yaml.safe_load((REPO / "clusters" / "aws-a100.yaml").read_text())
    raw["max_workers"] = raw["available_node_types"]["gpu_a100"]["max_workers"] = 4  # 32 GPUs, the sweep wants 64
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(raw))
    (cluster,) = validate([path], PAPER[:1])
    (problem,) = cluster.problems
    assert problem.field == "scaling.num_workers" and problem.value == 64 and "w64" in problem.source
    assert "holds at most 32" in problem.problem and "max_workers (and max_workers) to 8" in problem.fix
    (cluster,) = validate([path], [experiment_file("quickstart.yaml")])  # 2 CPU workers: the head holds them
    assert cluster.ok


def test_worker_larger_than_any_node(tmp_path):
    raw = yaml.safe_load(experiment_file("paper/vgg16-imagenet.yaml").read_text())
    raw.pop("sweep")
    raw["scaling"]["gpus_per_worker"] = 16
    exp = tmp_path / "big.yaml"
    exp.write_text(yaml.safe_dump(raw))
    (cluster,) = validate([REPO / "clusters" / "kuberay-raycluster.yaml"], [exp])
    (problem,) = cluster.problems
    assert problem.field == "scaling.gpus_per_worker" and "the most on one node: 8" in problem.problem


def test_cli_validates_every_file_by_default(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    assert main(["cluster", "validate"]) == 0
    out = capsys.readouterr().out
    assert all(f"{p.relative_to(REPO)}: ok" in out for p in CLUSTERS)
    broken = tmp_path / "broken.yaml"
    broken.write_text((REPO / "clusters" / "aws-a100.yaml").read_text().replace("max_workers: 8\n", "max_workers: x\n", 1))
    assert main(["cluster", "validate", str(broken), "clusters/aws-a100.yaml"]) == 2
    captured = capsys.readouterr()
    assert "clusters/aws-a100.yaml: ok" in captured.out
    assert f"{broken}: max_workers = 'x'" in captured.err and "1 of 2 cluster file(s) have problems" in captured.err
    monkeypatch.chdir(tmp_path)
    assert main(["cluster", "validate"]) == 2  # no clusters/ here
    assert "no cluster files" in capsys.readouterr().err


def test_address_without_a_cluster_fails_fast_and_leaves_results_alone(tmp_path):
    spec = load_experiment(experiment_file("quickstart.yaml"), [f"output_dir={tmp_path}"])
    earlier = tmp_path / "quickstart" / "metrics.parquet"
    earlier.parent.mkdir()
    earlier.write_bytes(b"earlier results")
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"--address 127\.0\.0\.1:\d+: no Ray cluster answered"):
        run_experiment(spec, address=f"127.0.0.1:{free_port()}", log=lambda *_: None)
    assert time.perf_counter() - t0 < 10  # ray.init alone would retry for minutes
    assert earlier.read_bytes() == b"earlier results" and sorted(tmp_path.iterdir()) == [earlier.parent]
    with pytest.raises(UserError, match="that is the dashboard's job API"):
        run_experiment(spec, address="http://127.0.0.1:8265", log=lambda *_: None)


def test_output_dir_a_cluster_cannot_use_and_a_job_default(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="output_dir = 's3://bucket/results': cloud URIs are not supported"):
        load_experiment(experiment_file("quickstart.yaml"), ["output_dir=s3://bucket/results"])
    spec = load_experiment(experiment_file("quickstart.yaml"), ["output_dir=results"])
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray sets in a job's entrypoint
    monkeypatch.setenv("RAYTRAIN_PAR_JOB_RESULTS", str(tmp_path / "job-results"))
    lines = []
    place_results(spec, log=lines.append)
    assert spec.results_dir == tmp_path / "job-results" / "results" / "quickstart"
    assert str(spec.results_dir) in lines[0] and "every node mounts" in lines[0]
    monkeypatch.delenv("RAYTRAIN_PAR_JOB_RESULTS")
    spec = load_experiment(experiment_file("quickstart.yaml"), ["output_dir=results"])
    place_results(spec, log=lines.append)
    assert spec.results_dir == Path("~/ray_results/raytrain-par/results/quickstart").expanduser()


def test_job_submit_to_an_address_without_a_cluster_says_so(tmp_path):
    """The `ray job submit` of docs/clusters.md where nothing listens: Ray's own error, and a failing exit status."""
    proc = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "submit", "--address",
                           f"http://127.0.0.1:{free_port()}", "--", "true"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "Failed to connect to Ray at address" in proc.stdout + proc.stderr


def test_a_loopback_only_cluster_is_joined_on_loopback():
    """Ray rewrites 127.0.0.1 to the machine's network address before it connects; a cluster of this
    machine that listens on loopback only (an embedded one) is joined without that rewrite."""
    import socket

    from raytrain_par.driver import _loopback_only

    with socket.socket() as only_loopback, socket.socket() as everywhere:
        only_loopback.bind(("127.0.0.1", 0))
        everywhere.bind(("0.0.0.0", 0))
        for s in (only_loopback, everywhere):
            s.listen()
        assert _loopback_only(f"127.0.0.1:{only_loopback.getsockname()[1]}")
        assert not _loopback_only(f"localhost:{everywhere.getsockname()[1]}")  # the machine's address answers
    assert not _loopback_only("10.0.0.5:6379") and not _loopback_only("ray://127.0.0.1:10001")
