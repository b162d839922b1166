"""Failures: a lost worker, a damaged checkpoint, a resume from another setup — the run ends as if
nothing happened, or is refused before it starts."""

import json
import os
import signal
import threading
import time

import pytest
import ray
import torch
from ray.util.state import list_actors

from conftest import experiment_file
from engines import experiment, exported_val_loss, loop, written_checkpoint
from raytrain_par import checkpoints, config, models, strategies
from raytrain_par.config import load_experiment
from raytrain_par.data.loader import MemoryLoader
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.driver import check_resumable, run_experiment
from raytrain_par.errors import UserError
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics.records import read_records
from raytrain_par.strategies import DistContext
from raytrain_par.strategies import state as one_format
from raytrain_par.strategies.optim import lr_factor

COMMON = ["train.eval_every_steps=2", "train.lr_schedule=constant", "train.warmup_steps=0", "train.grad_clip=0.0",
          "data.max_val_samples=16", "scaling.num_workers=2", "train.keep_checkpoints=2"]


def _spec(out, *overrides):
    return load_experiment(experiment_file("quickstart.yaml"), [*COMMON, f"output_dir={out}", *overrides])


@pytest.fixture(scope="module")
def straight(info, tmp_path_factory):
    """The uninterrupted run every failure case must end equal to: the worker's loop on 2 ranks of a
    plain process group, as Ray Train's 2 workers run it (the same rows per rank, the same gloo
    reductions)."""
    spec = _spec(tmp_path_factory.mktemp("straight"), "train.max_steps=8")
    kjv = info("kjv", seq_len=spec.data.seq_len, vocab_size=spec.data.vocab_size)
    return run_ranks(2, _loop, spec.to_dict(), kjv, str(spec.results_dir))[0]


def _loop(rank, world, spec_dict, info_dict, root):
    return loop(spec_dict, info_dict, root)


def _assert_same_end(records, straight):
    assert [r["step"] for r in records] == [r["step"] for r in straight]  # none lost, none duplicated
    assert records[-1]["samples_seen"] == straight[-1]["samples_seen"]
    for key in ("train_loss", "val_loss"):
        assert records[-1][key] == pytest.approx(straight[-1][key], abs=1e-6, rel=0.0), key


# A worker is killed under ZeRO-3: its checkpoints are sharded, each worker's part its own, and Ray
# Train replaces a worker group and hands it the latest checkpoint the same way whatever the strategy
# (every engine's resume through the worker's loop, on the same or another worker count:
# tests/test_resume_workers.py). Without clipping, zero-3 trains DDP's numbers bit for bit
# (tests/test_zero.py), so the uninterrupted DDP run is the reference.
STRATEGY = "strategy={name: zero-3}"


@pytest.fixture(scope="module")
def killed(ray_cluster, tmp_path_factory):
    """The zero-3 run of 8 steps whose worker is killed once it has recorded step 2 or later (a run's
    start-up costs ~30 s on 2 cores: test_resume_skips_a_damaged_checkpoint_and_ends_equal resumes this
    same run again)."""
    tmp_path = tmp_path_factory.mktemp("zero-3")
    spec = _spec(tmp_path, "train.max_steps=8", "train.max_failures=1", STRATEGY)
    done = {}
    thread = threading.Thread(target=lambda: done.update(result=run_experiment(spec, log=lambda *_: None)))
    thread.start()
    metrics = tmp_path / "quickstart" / "metrics.parquet"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and any(r["step"] >= 2 for r in read_records(metrics))):
        time.sleep(0.2)
    workers = list_actors(address=ray.get_runtime_context().gcs_address,
                          filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
    assert len(workers) == 2
    os.kill(workers[1]["pid"], signal.SIGKILL)  # from outside, as the OOM killer or a lost node would
    thread.join(600)
    return spec, done["result"]


@pytest.mark.ray
def test_killed_worker_is_replaced_and_the_run_ends_equal(killed, straight, info):
    """The run ends as the uninterrupted one does, and `raytrain-par export` joins its latest
    checkpoint (sharded by ZeRO-3) into a GPT-2 that transformers loads with every key and that scores
    the run's last validation loss."""
    spec, result = killed
    assert result.error is None
    assert any(r.get("resumed_from_step") is not None for r in result.records)  # it did lose the worker
    assert result.records[-1]["strategy"] == "zero-3"
    _assert_same_end(result.records, straight)
    kjv = info("kjv", seq_len=spec.data.seq_len, vocab_size=spec.data.vocab_size)
    exported = exported_val_loss(result.results_dir, kjv, spec.data.max_val_samples)
    assert exported == pytest.approx(result.records[-1]["val_loss"], abs=1e-5)


@pytest.mark.ray
def test_resume_skips_a_damaged_checkpoint_and_ends_equal(killed, straight, capfd):
    """`--resume` of the finished zero-3 run (checkpoints at steps 6 and 8 kept) once a file of its
    latest checkpoint is cut short, as by a full disk: the checkpoint is found damaged, the run resumes
    from the one before it and ends as the uninterrupted run does, no record lost or repeated."""
    spec, result = killed
    ckpts = sorted((result.results_dir / "train").glob("checkpoint_*/"))
    assert len(ckpts) == 2
    files = json.loads((ckpts[-1] / "manifest-rank0.json").read_text())["files"]
    name = max(files, key=lambda f: files[f]["bytes"])  # rank 0's largest file of the step-8 checkpoint
    latest = ckpts[-1] / name
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    capfd.readouterr()
    resumed = run_experiment(spec, resume=True, log=lambda *_: None)
    assert resumed.error is None
    out = capfd.readouterr()
    assert f"is damaged: {name} (rank 0) has" in out.out + out.err
    assert "at step 6" in out.out + out.err  # the one before it
    _assert_same_end(resumed.records, straight)


def _checkpoint(tmp_path, world=2):
    d = tmp_path / "ckpt"
    d.mkdir()
    for rank in range(world):
        (d / f"state-rank{rank}.pt").write_bytes(os.urandom(1000))
        part = tmp_path / f"part{rank}"
        part.mkdir()
        (part / f"state-rank{rank}.pt").write_bytes((d / f"state-rank{rank}.pt").read_bytes())
        checkpoints.write_manifest(part, rank, world, step=10)
        (d / f"manifest-rank{rank}.json").write_text((part / f"manifest-rank{rank}.json").read_text())
    return d


@pytest.mark.parametrize("damage,words", [
    (lambda d: None, None),
    (lambda d: (d / "state-rank1.pt").unlink(), "state-rank1.pt (rank 1) is missing"),
    (lambda d: (d / "state-rank0.pt").write_bytes(b"x" * 10), "has 10 bytes, 1000 were written"),
    (lambda d: (d / "state-rank0.pt").write_bytes(os.urandom(1000)), "does not match its checksum"),
    (lambda d: (d / "manifest-rank1.json").unlink(), "ranks [0], but was written by 2 ranks"),
    (lambda d: [m.unlink() for m in d.glob("manifest-*")], "has no manifest"),
])
def test_damaged_checkpoints_are_found(tmp_path, damage, words):
    d = _checkpoint(tmp_path)
    damage(d)
    found = checkpoints.problem(d)
    assert found is None if words is None else words in found


def test_resume_from_another_model_is_refused_before_start(tmp_path):
    written = _spec(tmp_path)
    written_checkpoint(tmp_path / "train", written.to_dict())
    check_resumable(written, tmp_path / "train")  # the same setup resumes
    other = _spec(tmp_path, "model.name=gpt2-mini", "scaling.num_workers=1", "train.global_batch_size=32")
    with pytest.raises(UserError) as err:
        check_resumable(other, tmp_path / "train")
    assert "model: checkpoint" in str(err.value) and "gpt2-mini" in str(err.value) and "fix:" in str(err.value)
    # the worker count may change (ddp's state is replicated): it is not among the differences
    assert "num_workers" not in str(err.value)


def test_resume_with_other_optimizer_settings_is_refused_and_a_new_schedule_is_said(tmp_path):
    """The optimizer state restores the learning rate and settings it was written with: a changed one
    would not take effect, and is refused; a longer run continues on the experiment's new schedule."""
    written = _spec(tmp_path, "train.max_steps=10", "train.lr_schedule=cosine")
    written_checkpoint(tmp_path / "train", written.to_dict())
    for override, shown in [("train.lr=0.01", "train.lr: checkpoint 0.002, experiment 0.01"),
                            ("train.weight_decay=0.1", "train.weight_decay: checkpoint 0.01, experiment 0.1")]:
        with pytest.raises(UserError) as err:
            check_resumable(_spec(tmp_path, "train.max_steps=10", "train.lr_schedule=cosine", override),
                            tmp_path / "train")
        assert shown in str(err.value) and "would not take effect" in str(err.value) and "fix:" in str(err.value)
    said = []
    check_resumable(_spec(tmp_path, "train.max_steps=20", "train.lr_schedule=cosine"), tmp_path / "train", said.append)
    assert said == ["--resume: train.max_steps 10 -> 20: the learning-rate schedule is the experiment's new one, "
                    "continued from the checkpoint's step"]


def _rates_after_resume(rank, world, info_dict, directory):
    """Per strategy: (the first step's rate after resuming a 2-step cosine run's checkpoint as a 6-step
    one, the rate that checkpoint's own schedule left in the optimizer)."""
    info, out = DatasetInfo.from_json(info_dict), {}
    arrays = read_split(info, info.train_path)

    def engine(strategy, steps):
        spec = config.from_dict(experiment(strategy=strategy, steps=steps, lr_schedule="cosine", min_lr_ratio=0.1))
        model, task = models.build(spec.model, info, spec.train.seed)
        return strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")),
                                       total_steps=steps), spec

    for strategy in ("ddp", "zero-1"):
        written, spec = engine(strategy, 2)
        loader = MemoryLoader(arrays, spec.train.global_batch_size, 0, 1, spec.train.seed)
        for _, batch in zip(range(2), loader.epoch(0)):
            written.train_step(batch)
        (directory / strategy).mkdir()
        one_format.save(written, directory / strategy, 2)
        resumed, _ = engine(strategy, 6)
        one_format.load(resumed, directory / strategy)
        out[strategy] = (resumed.lr, written.lr)
    return out


def test_a_resume_trains_its_first_step_at_the_new_schedules_rate(info, tmp_path):
    """A 2-step cosine run ends at its lowest rate; resumed as a 6-step run, step 3 trains at the 6-step
    schedule's rate for it, not at the rate the checkpoint's optimizer state holds (ddp, and ZeRO, whose
    scheduler DeepSpeed holds)."""
    kjv = info("kjv", seq_len=32, vocab_size=512)
    (rates,) = run_ranks(1, _rates_after_resume, kjv, tmp_path, group_of_one=True)
    six = config.from_dict(experiment(steps=6, lr_schedule="cosine", min_lr_ratio=0.1)).train
    for strategy, (resumed, written) in rates.items():
        assert written == pytest.approx(1e-3 * 0.1), strategy  # the 2-step schedule's end
        assert resumed == pytest.approx(1e-3 * lr_factor(six, 6)(2)) and resumed > 2 * written, strategy
