"""Experiment tracking against the trackers themselves: a real MLflow server on loopback (SQLite
store), TensorBoard's own event reader and W&B in offline mode. Every evaluation logged equals
metrics.parquet; parameters and tags are there; a resumed run appends to its own tracker run; a
tracker that is down costs one warning and nothing else. The records first, pushed as the driver
pushes them; then a run and a 2-trial sweep through Ray."""

import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raytrain_par import cli, config, tracking
from raytrain_par.metrics.records import read_records, write_table
from test_config import BASE

REPO = Path(__file__).resolve().parent.parent

import mlflow  # noqa: E402  (the dev extras install every tracker: pip install -e '.[dev]')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    # `make mlflow-server` installs the server apart from the project's environment, which has MLflow's client only
    found = [p for p in (REPO / ".mlflow-server" / "bin" / "mlflow", Path(sys.executable).parent / "mlflow") if p.exists()]
    assert found, "no MLflow server to start: run `make mlflow-server` (make test does)"
    exe = found[0]
    proc = subprocess.Popen([str(exe), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    client = mlflow.MlflowClient(uri)
    deadline = time.time() + 120
    while True:
        try:
            client.search_experiments()
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("mlflow server did not start: " + (root / "server.log").read_text()[-2000:])
            time.sleep(1)
    yield uri
    proc.terminate()
    proc.wait(30)


def records_of(trial: str, steps, seed: float = 0.0) -> list[dict]:
    return [{"experiment": "t", "trial": trial, "strategy": "ddp", "num_workers": 2, "global_batch_size": 32,
             "step": s, "epoch": s / 10, "samples_seen": 32 * s, "wall_time_s": 1.5 * s + seed,
             "train_loss": None if s == 0 else 6 - s / 10 + seed, "val_loss": 6.5 - s / 20 + seed,
             "val_perplexity": 600 - s + seed, "lr": 1e-3, "target_met": s >= 20, "timestamp": 1.7e9 + s + seed,
             "mem_peak_bytes": 2**20 * (100 + s), "mem_peak_bytes_per_worker": [1, 2], "peak_source": "x"}
            for s in steps]


def spec_with(trackers: dict, tmp_path) -> config.ExperimentSpec:
    return config.parse({**BASE, "output_dir": str(tmp_path), "tracking": trackers})


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted({p.parent for p in directory.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file: LevelDB's log format behind W&B's 7-byte file header (":W&B",
    magic, version), 32 KiB blocks of records, each a 7-byte header (checksum, length, type: full,
    first, middle, last) and its data; W&B 0.31 reads it in Go only, so the test reads it here."""
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    out, pending = [], b""
    while pos + 7 <= len(data):
        space = block - pos % block
        if space < 7:
            pos += space
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # the rest of the block is padding
            pos += space
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        else:
            out.append(pending + chunk)
    return out


def wandb_logged(directory: Path, run_id: str = "*") -> tuple[list[dict], dict]:
    """The history rows and the config W&B offline runs (of one id, or all) logged, parsed with W&B's
    own record type."""
    from wandb.proto import wandb_internal_pb2

    rows, config_ = [], {}
    for f in sorted(directory.rglob(f"run-{run_id}.wandb")):
        for data in wandb_records(f):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
            elif kind in ("config", "run"):  # the config comes with the run record, and later updates
                items = rec.config.update if kind == "config" else rec.run.config.update
                config_.update({item.key: json.loads(item.value_json) for item in items})
    return rows, config_


def wandb_history(directory: Path, run_id: str = "*") -> list[dict]:
    return wandb_logged(directory, run_id)[0]


def mlflow_history(uri: str, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in mlflow.MlflowClient(uri).get_metric_history(run_id, key)}


def test_every_record_reaches_every_tracker_and_a_resume_appends(mlflow_server, tmp_path):
    spec = spec_with({"mlflow": {"tracking_uri": mlflow_server, "experiment_name": "records", "tags": {"team": "a"}},
                      "tensorboard": {}, "wandb": {"mode": "offline", "project": "t"}}, tmp_path)
    results = tmp_path / "t"
    results.mkdir()
    warnings = []
    first = records_of("run", [0, 10, 20])
    t = tracking.for_run(spec, results, warn=warnings.append)
    t.push(first)
    t.close({"run": {"time_to_target_s": 30.0, "samples_to_target": 640, "status": "completed"}}, [])
    state = json.loads((results / "tracking.json").read_text())
    run_id = state["mlflow"]["run"]
    # resumed: the same tracker runs, continued from the checkpoint's step
    again = records_of("run", [20, 30], seed=0.01)
    t = tracking.for_run(spec, results, warn=warnings.append)
    t.push(again)
    t.close({"run": {"status": "completed"}}, [])
    after = json.loads((results / "tracking.json").read_text())
    assert {k: after[k] for k in ("mlflow", "tensorboard", "wandb")} == {k: state[k] for k in ("mlflow", "tensorboard", "wandb")}
    assert warnings == []

    expected = {r["step"]: r for r in first + again}  # the resumed evaluation replaces the one it repeats
    client = mlflow.MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.global_batch_size"] == "32"
    assert run.data.params["strategy.name"] == "ddp" and run.data.tags["team"] == "a"
    assert {"command", "commit", "machine"} <= set(run.data.tags)
    for key in ("val_loss", "val_perplexity", "mem_peak_bytes", "target_met"):
        assert mlflow_history(mlflow_server, run_id, key) == {s: float(r[key]) for s, r in expected.items()}
    assert mlflow_history(mlflow_server, run_id, "train_loss") == {s: r["train_loss"] for s, r in expected.items() if s}
    assert run.data.metrics["summary.time_to_target_s"] == 30.0
    assert len(client.search_runs([run.info.experiment_id])) == 1  # resumed, not a second run

    scalars = tensorboard_scalars(results / "tensorboard")
    assert scalars["val_loss"] == pytest.approx({s: r["val_loss"] for s, r in expected.items()})

    history = wandb_history(results / "wandb")
    logged = {row["_step"]: row for row in history}
    assert set(logged) == {0, 10, 20, 30}
    for s in (0, 10, 20):  # W&B keeps a step once: the first run's, up to where it got
        assert logged[s]["val_loss"] == pytest.approx(first[s // 10]["val_loss"])
    assert logged[30]["val_loss"] == pytest.approx(again[1]["val_loss"])


def test_a_sweep_is_a_parent_run_with_a_run_per_trial(mlflow_server, tmp_path):
    raw = {**BASE, "output_dir": str(tmp_path), "sweep": {"grid": {"train.global_batch_size": [16, 32]}},
           "tracking": {"mlflow": {"tracking_uri": mlflow_server, "experiment_name": "sweep"}, "tensorboard": {}}}
    spec = config.parse(raw)
    from raytrain_par.sweep import describe, plan

    p = plan(spec)
    names = {f"0000{i}-{describe(pt)}": pt for i, pt in enumerate(p.points)}
    results = tmp_path / "t"
    results.mkdir()
    t = tracking.for_sweep(spec, p, results, names.__getitem__)
    records = [r for i, name in enumerate(names) for r in records_of(name, [0, 10], seed=i)]
    t.push(records)
    t.close({name: {"status": "completed", "best_metric": 1.0} for name in names}, [])
    state = json.loads((results / "tracking.json").read_text())
    client = mlflow.MlflowClient(mlflow_server)
    parent = state["mlflow"]["__sweep__"]
    for name, point in names.items():
        run = client.get_run(state["mlflow"][name])
        assert run.data.tags["mlflow.parentRunId"] == parent and run.info.run_name == name
        assert run.data.params["train.global_batch_size"] == str(point["train.global_batch_size"])
        assert mlflow_history(mlflow_server, run.info.run_id, "val_loss") == {
            r["step"]: r["val_loss"] for r in records if r["trial"] == name}
    assert client.get_run(parent).info.status == "FINISHED"
    assert {p.name for p in (results / "tensorboard").iterdir() if p.is_dir()} == set(names)


def test_a_tracker_that_is_down_costs_one_warning(tmp_path):
    spec = spec_with({"mlflow": {"tracking_uri": f"http://127.0.0.1:{free_port()}"}, "tensorboard": {}}, tmp_path)
    results = tmp_path / "t"
    results.mkdir()
    warnings = []
    t0 = time.perf_counter()
    t = tracking.for_run(spec, results, warn=warnings.append)
    for step in (0, 10, 20):
        t.push(records_of("run", [step]))
    t.close({}, [])
    assert len(warnings) == 1 and "tracking to mlflow failed" in warnings[0] and "metrics.parquet" in warnings[0]
    assert time.perf_counter() - t0 < 60
    assert tensorboard_scalars(results / "tensorboard")["val_loss"].keys() == {0, 10, 20}  # the others go on


def test_a_tracker_not_installed_is_refused_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(tracking, "missing_package", lambda name: name if name == "wandb" else None)
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump({**BASE, "tracking": {"wandb": {"project": "p"}}}))
    with pytest.raises(config.ConfigError, match=r"raytrain-par\[wandb\]"):
        config.load_experiment(f, check_data=False)


def test_report_pushes_an_earlier_run_to_mlflow(mlflow_server, tmp_path, capsys):
    results = tmp_path / "earlier"
    records = records_of("run", [0, 10, 20])
    write_table(results / "metrics.parquet", records)
    assert cli.main(["report", str(results), "--to-mlflow", mlflow_server]) == 0
    client = mlflow.MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert mlflow_history(mlflow_server, run.info.run_id, "val_perplexity") == {
        r["step"]: r["val_perplexity"] for r in records}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"convergence_wall_time.png"}
    assert cli.main(["report", str(results), "--to-mlflow", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "fix: start the server" in capsys.readouterr().err
    assert read_records(results / "metrics.parquet") == records  # nothing of the run is touched


TINY = {"name": "tracked", "model": {"name": "gpt2-tiny"}, "data": {"name": "kjv", "max_val_samples": 16},
        "scaling": {"num_workers": 1},
        "train": {"global_batch_size": 8, "max_steps": 6, "eval_every_steps": 3, "lr": 3e-3}}


@pytest.mark.ray
def test_a_run_and_a_sweep_through_ray_reach_their_trackers(ray_cluster, mlflow_server, tmp_path, capsys):
    """`raytrain-par run` and `sweep` as typed, with every tracker: each evaluation of the run and of
    both trials equals metrics.parquet; the run's figures are the MLflow run's artifacts."""
    f = tmp_path / "tracked.yaml"
    trackers = {"mlflow": {"tracking_uri": mlflow_server, "experiment_name": "e2e"}, "tensorboard": {},
                "wandb": {"mode": "offline"}}
    f.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path), "tracking": trackers}))
    assert cli.main(["run", str(f)]) == 0
    results = tmp_path / "tracked"
    records = read_records(results / "metrics.parquet")
    state = json.loads((results / "tracking.json").read_text())
    client = mlflow.MlflowClient(mlflow_server)
    run = client.get_run(state["mlflow"]["run"])
    assert run.info.status == "FINISHED" and run.data.params["model.name"] == "gpt2-tiny"
    for key in ("val_loss", "train_loss", "throughput", "mem_peak_bytes", "lr"):
        assert mlflow_history(mlflow_server, run.info.run_id, key) == {
            r["step"]: pytest.approx(r[key]) for r in records if r.get(key) is not None}
    assert "convergence_wall_time.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert tensorboard_scalars(results / "tensorboard")["val_loss"] == pytest.approx(
        {r["step"]: r["val_loss"] for r in records})
    history, logged_config = wandb_logged(results / "wandb")  # the evaluations, then a row of the figures
    assert logged_config["train.lr"] == "0.003" and logged_config["model.name"] == "gpt2-tiny"
    assert any(k.startswith("figures/convergence_wall_time/") for k in history[-1])
    assert {row["_step"]: row["val_loss"] for row in history if "val_loss" in row} == pytest.approx(
        {r["step"]: r["val_loss"] for r in records})
    assert "warning" not in capsys.readouterr().err

    f.write_text(yaml.safe_dump({**TINY, "name": "tracked-sweep", "output_dir": str(tmp_path), "tracking": trackers,
                                 "sweep": {"grid": {"train.global_batch_size": [4, 8]}, "max_concurrent_trials": 1}}))
    assert cli.main(["sweep", str(f)]) == 0
    results = tmp_path / "tracked-sweep"
    records = read_records(results / "metrics.parquet")
    state = json.loads((results / "tracking.json").read_text())
    trials = sorted({r["trial"] for r in records})
    assert len(trials) == 2 and set(state["mlflow"]) == {"__sweep__", *trials}
    for trial in trials:
        run = client.get_run(state["mlflow"][trial])
        assert run.data.tags["mlflow.parentRunId"] == state["mlflow"]["__sweep__"]
        assert mlflow_history(mlflow_server, run.info.run_id, "val_loss") == {
            r["step"]: pytest.approx(r["val_loss"]) for r in records if r["trial"] == trial}
        assert tensorboard_scalars(results / "tensorboard" / trial)["val_loss"] == pytest.approx(
            {r["step"]: r["val_loss"] for r in records if r["trial"] == trial})
        history, logged_config = wandb_logged(results / "wandb", state["wandb"][trial])
        assert {row["_step"]: row["val_loss"] for row in history if "val_loss" in row} == pytest.approx(
            {r["step"]: r["val_loss"] for r in records if r["trial"] == trial})
        assert logged_config["train.global_batch_size"] == str(run.data.params["train.global_batch_size"])
    assert "warning" not in capsys.readouterr().err


@pytest.mark.ray
def test_a_resumed_run_continues_its_tracker_run_and_a_dead_server_costs_one_line(ray_cluster, mlflow_server,
                                                                                  tmp_path, capsys):
    """`run --resume` appends to the MLflow run it started; a run whose MLflow server is down ends with
    all its records, one warning line, and its other trackers complete."""
    f = tmp_path / "tracked.yaml"
    f.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path),
                                 "tracking": {"mlflow": {"tracking_uri": mlflow_server, "experiment_name": "resume"}}}))
    assert cli.main(["run", str(f)]) == 0
    results = tmp_path / "tracked"
    run_id = json.loads((results / "tracking.json").read_text())["mlflow"]["run"]
    assert cli.main(["run", str(f), "--resume", "--set", "train.max_steps=9"]) == 0
    assert json.loads((results / "tracking.json").read_text())["mlflow"]["run"] == run_id
    records = read_records(results / "metrics.parquet")
    assert [r["step"] for r in records] == [0, 3, 6, 9]
    assert mlflow_history(mlflow_server, run_id, "val_loss") == {r["step"]: pytest.approx(r["val_loss"])
                                                                 for r in records}
    client = mlflow.MlflowClient(mlflow_server)
    assert len(client.search_runs([client.get_experiment_by_name("resume").experiment_id])) == 1
    capsys.readouterr()

    f.write_text(yaml.safe_dump({**TINY, "name": "down", "output_dir": str(tmp_path), "tracking": {
        "mlflow": {"tracking_uri": f"http://127.0.0.1:{free_port()}"}, "tensorboard": {}}}))
    assert cli.main(["run", str(f)]) == 0
    err = capsys.readouterr().err
    assert err.count("tracking to mlflow failed") == 1, err
    records = read_records(tmp_path / "down" / "metrics.parquet")
    assert [r["step"] for r in records] == [0, 3, 6]
    assert tensorboard_scalars(tmp_path / "down" / "tensorboard")["val_loss"].keys() == {0, 3, 6}
