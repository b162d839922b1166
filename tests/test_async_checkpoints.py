"""Checkpoints written off the training thread (raytrain_par/saving.py), through the worker's own loop in
plain gloo process groups: an async save writes the same checkpoint a sync one does, a resumed async run
ends as an uninterrupted sync run, a worker killed while a checkpoint is being written resumes from the
one before it, and a full disk stops the run with one clear message, keeping what was written."""

import errno
import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from engines import KJV, experiment, loop
from raytrain_par import checkpoints
from raytrain_par.local_group import run_ranks
from raytrain_par.metrics.records import read_records
from raytrain_par.saving import CheckpointWriteError

# zero-3 gathers its shards to write them (collectives), so that a background write that ran a collective
# on the training group would deadlock or corrupt the step it overlaps
TRAIN = {"eval_every_steps": 2, "checkpoint_every_evals": 1, "eval_at_start": False, "lr_schedule": "cosine",
         "warmup_steps": 1, "weight_decay": 0.1}


def _spec(mode: str, strategy="zero-3", steps=8) -> dict:
    spec = experiment("gpt2-tiny", KJV, strategy=strategy, workers=2, batch=8, steps=steps,
                      checkpoint_mode=mode, **TRAIN)
    spec["data"]["max_val_samples"] = 16
    return spec


def _losses(records):
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in records]


# every engine's snapshot is a host copy of each rank's own pieces: zero-3's partitions, megatron's cut, fsdp's
# shards
OTHERS = {"megatron": {"name": "megatron", "tensor_parallel": 2}, "fsdp": "fsdp"}


def _runs(rank, world, info_dict, tmp):
    """A sync run and an async run of 8 steps; then the async run's copy cut back to its step-4
    checkpoint, resumed; 4 steps of the other strategies, sync and async."""
    tmp = Path(tmp)
    out = {mode: loop(_spec(mode), info_dict, tmp / mode) for mode in ("sync", "async")}
    for name, strategy in OTHERS.items():
        for mode in ("sync", "async"):
            out[f"{name}-{mode}"] = loop(_spec(mode, strategy, steps=4), info_dict, tmp / f"{name}-{mode}")
    if rank == 0:
        shutil.copytree(tmp / "async", tmp / "resumed")
        for late in sorted((tmp / "resumed").glob("checkpoint_*"))[2:]:
            shutil.rmtree(late)
    import torch.distributed as dist

    dist.barrier()
    out["resumed"] = loop(_spec("async"), info_dict, tmp / "resumed", resume=True)
    return out


@pytest.fixture(scope="module")
def runs(info, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async")
    return run_ranks(2, _runs, info(**KJV), str(tmp))[0], tmp


@pytest.mark.parametrize("name", ["zero-3", *OTHERS])
def test_an_async_save_writes_what_a_sync_save_writes(runs, name):
    out, tmp = runs
    prefix = "" if name == "zero-3" else f"{name}-"
    assert _losses(out[f"{prefix}async"]) == _losses(out[f"{prefix}sync"])  # training is the same
    sync, background = (sorted((tmp / f"{prefix}{mode}").glob("checkpoint_*")) for mode in ("sync", "async"))
    assert [c.name for c in sync] == [c.name for c in background] and len(sync) == (4 if name == "zero-3" else 2)
    for a, b in zip(sync, background):
        names = sorted(f.name for f in a.iterdir())
        assert names == sorted(f.name for f in b.iterdir())
        kept = [f for f in names if f.startswith("pieces-rank") or f == "index.json"]
        assert len(kept) == 5  # both ranks' pieces and their index parts, rank 0's index
        for name in kept:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (a.name, name)
        loops = [json.loads((c / "loop.json").read_text())["state"] for c in (a, b)]
        assert loops[0]["step"] == loops[1]["step"] and loops[0]["samples_seen"] == loops[1]["samples_seen"]


def test_every_save_records_its_stall_and_its_write(runs):
    """Each record of an evaluation that saved carries the save's stall on the training thread and its
    write's time; under sync the write is part of the stall, under async it is not."""
    out, tmp = runs
    for mode in ("sync", "async"):
        written = read_records(tmp / mode / "metrics.parquet")
        assert [r["step"] for r in written] == [2, 4, 6, 8]
        for r in written:
            assert r["checkpoint_write_s"] > 0 and r["checkpoint_stall_s"] > 0, (mode, r["step"])
            assert r["checkpoint_time_s"] >= r["checkpoint_stall_s"]
            if mode == "sync":
                assert r["checkpoint_stall_s"] >= r["checkpoint_write_s"]
        cumulative = [r["checkpoint_time_s"] for r in written]
        assert cumulative == sorted(cumulative)


def test_a_resumed_async_run_ends_as_an_uninterrupted_sync_run(runs):
    out, _ = runs
    resumed = out["resumed"]
    assert resumed[0]["resumed_from_step"] == 4 and [r["step"] for r in resumed] == [6, 8]
    for got, want in zip(resumed, out["sync"][2:]):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-5)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)


def _killed_while_writing(rank, world, info_dict, root):
    """Rank 0 is killed (SIGKILL) half-way through copying its step-4 checkpoint into the run directory,
    as the OOM killer or a lost node would kill it."""
    import raytrain_par.worker as worker

    copy = worker._copy_dir

    def dying(source, target):
        if rank == 0 and json.loads((source / "index.json").read_text())["step"] == 4:
            target.mkdir(parents=True, exist_ok=True)
            biggest = max(source.iterdir(), key=lambda f: f.stat().st_size)
            (target / biggest.name).write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        copy(source, target)

    worker._copy_dir = dying
    return loop(_spec("async"), info_dict, root)


def _resume(rank, world, info_dict, root):
    return loop(_spec("async"), info_dict, root, resume=True)


def test_a_worker_killed_while_writing_resumes_from_the_checkpoint_before(runs, info, tmp_path):
    out, _ = runs
    with pytest.raises(AssertionError, match="rank 0: exited with code -9"):
        run_ranks(2, _killed_while_writing, info(**KJV), str(tmp_path), timeout=120)
    written = sorted(tmp_path.glob("checkpoint_*"))
    assert len(written) == 2  # step 2's, whole; step 4's, rank 0's part cut short, without its manifest
    assert checkpoints.problem(written[0]) is None
    assert "holds the manifests of ranks [1]" in checkpoints.problem(written[1])
    resumed = run_ranks(2, _resume, info(**KJV), str(tmp_path))[0]
    assert resumed[0]["resumed_from_step"] == 2
    assert [r["step"] for r in resumed] == [4, 6, 8]
    assert resumed[-1]["train_loss"] == pytest.approx(out["sync"][-1]["train_loss"], rel=1e-5)
    assert resumed[-1]["val_loss"] == pytest.approx(out["sync"][-1]["val_loss"], rel=1e-5)


def test_a_full_disk_stops_the_run_with_one_message_and_keeps_what_was_written(info, tmp_path, monkeypatch):
    """The step-4 checkpoint's write finds the disk full: the run stops with a message naming the step,
    the file, the cause and the fix; the records and checkpoint written before it are intact; once
    there is room, --resume continues from them."""
    from raytrain_par.strategies import state

    write = state.write_parts

    def full(directory, part, step, rank):
        if step == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "pieces-rank0.safetensors"))
        return write(directory, part, step, rank)

    monkeypatch.setattr(state, "write_parts", full)
    spec = experiment("gpt2-tiny", KJV, strategy="ddp", workers=1, batch=8, steps=8, **TRAIN)
    spec["data"]["max_val_samples"] = 16
    with pytest.raises(CheckpointWriteError) as raised:
        loop(spec, info(**KJV), tmp_path)
    message = str(raised.value)
    for words in ("checkpoint of step 4 could not be written", "No space left on device", "pieces-rank0.safetensors",
                  "records and the checkpoints written before it are kept", "fix: free space",
                  "train.checkpoint_every_evals"):
        assert words in message
    assert [r["step"] for r in read_records(tmp_path / "metrics.parquet")] == [2]
    written = sorted(tmp_path.glob("checkpoint_*"))
    assert len(written) == 1
    assert checkpoints.problem(written[0]) is None
    monkeypatch.setattr(state, "write_parts", write)
    resumed = loop(spec, info(**KJV), tmp_path, resume=True)
    assert resumed[0]["resumed_from_step"] == 2 and [r["step"] for r in resumed] == [4, 6, 8]
