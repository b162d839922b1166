"""Resuming on another number of workers, and under another strategy or layout: a checkpoint written by N
workers continues on M, through the worker's own training loop (save, the checkpoint directory, load),
and the steps after it train the numbers an uninterrupted run trains; `check_resumable` allows exactly
those.

Each case trains 4 steps on N workers (a checkpoint at steps 2 and 4), then a copy of that run without
its step-4 checkpoint resumes from step 2 on M workers. The global batch is fixed and the in-memory
loader draws the same global batches for any worker count, so steps 3 and 4 must match the straight
run's. One process group per phase (spawning costs seconds): N = 1 runs, N = 2 runs and the resumes
of the N = 1 runs, the resumes on 1 worker, N = 4 runs and the resumes on 4."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from engines import KJV, experiment, loop, written_checkpoint
from raytrain_par import checkpoints, config
from raytrain_par.local_group import run_ranks
from raytrain_par.strategies import state

TRAIN = {"eval_every_steps": 1, "checkpoint_every_evals": 2, "eval_at_start": False, "lr_schedule": "cosine",
         "warmup_steps": 1, "weight_decay": 0.1}
PIPELINE = {"name": "pipeline", "stages": 2, "schedule": "1f1b", "microbatches": 2}
PIPEDREAM = {"name": "pipedream", "stages": 2}
MEGATRON = {"name": "megatron", "tensor_parallel": 2}
# case: (strategy, workers that write, workers that resume, relative tolerance[, the strategy that resumes])
CASES = {
    "ddp 1->2": ("ddp", 1, 2, 1e-6),
    "fsdp 1->2": ("fsdp", 1, 2, 1e-5),
    "zero-2 2->1": ("zero-2", 2, 1, 1e-5),
    "zero-3 2->1": ("zero-3", 2, 1, 1e-5),
    "fsdp 2->1": ("fsdp", 2, 1, 1e-5),
    # offloaded states (host memory, stepped by the experiment's optimizer there) re-partition alike
    "zero-3 offloaded 2->1": ({"name": "zero-3", "offload_optimizer": True, "offload_param": True}, 2, 1, 1e-5),
    # the same count through the loop: checkpoints written right after an evaluation hold shards
    "fsdp 2->2": ("fsdp", 2, 2, 0.0),
    "pipeline 2->4": (PIPELINE, 2, 4, 1e-5),
    "megatron 2->4": (MEGATRON, 2, 4, 1e-5),
    # PipeDream restarts its pipeline empty on any resume (see pipedream.py): it continues, not identically
    # (its first step after the resume forwards the checkpoint's weights: that loss is the same)
    "pipedream 2->4": (PIPEDREAM, 2, 4, None),
    # another strategy, through the one format (strategies/state.py): by name at whole shapes
    "fsdp 2 -> ddp 1": ("fsdp", 2, 1, 1e-5, "ddp"),
    "ddp 2 -> fsdp 1": ("ddp", 2, 1, 1e-5, "fsdp"),
    "ddp 1 -> fsdp 2": ("ddp", 1, 2, 1e-5, "fsdp"),
    "zero-2 2 -> ddp 1": ("zero-2", 2, 1, 1e-5, "ddp"),
    "ddp 1 -> zero-3 2": ("ddp", 1, 2, 1e-5, "zero-3"),
    "fsdp 2 -> zero-1 4": ("fsdp", 2, 4, 1e-5, "zero-1"),
    "megatron T2 2 -> zero-3 1": (MEGATRON, 2, 1, 1e-5, "zero-3"),
    "1f1b 2 -> megatron T2 2": (PIPELINE, 2, 2, 1e-5, MEGATRON),
    "zero-2 2 -> gpipe 2": ("zero-2", 2, 2, 1e-5, {**PIPELINE, "schedule": "gpipe"}),
    "pipeline 2 stages -> 4 stages": (PIPELINE, 2, 4, 1e-5, {**PIPELINE, "stages": 4, "microbatches": 4}),
    "megatron T2 x P2 4 -> fsdp 4": ({**MEGATRON, "stages": 2}, 4, 4, 1e-5, "fsdp"),
    # PipeDream's weights and optimizer states by name, its pipeline restarting empty (as on any resume)
    "pipedream 2 -> 1f1b 2": (PIPEDREAM, 2, 2, None, PIPELINE),
}


def resumer(case: str):
    """The strategy a case resumes with: the one that wrote it, unless the case names another."""
    return CASES[case][4] if len(CASES[case]) > 4 else CASES[case][0]


def _spec(strategy, workers) -> dict:
    spec = experiment("gpt2-tiny", KJV, strategy=strategy, workers=workers, batch=8, steps=4, **TRAIN)
    spec["data"]["max_val_samples"] = 16
    return spec


def _kept(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("step", "train_loss", "val_loss", "num_workers")} for r in records]


def phase(rank, world, info_dict, tmp, straight: list[str], resume: list[str]):
    """Straight runs of the cases that write on `world` workers (and a copy of each that stops at its
    step-2 checkpoint), and resumes of the cases that continue on `world` workers."""
    tmp, out = Path(tmp), {"straight": {}, "resumed": {}}
    for case in straight:
        strategy, n = CASES[case][:2]
        root = tmp / case
        out["straight"][case] = _kept(loop(_spec(strategy, n), info_dict, root / "straight"))
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            shutil.copytree(root / "straight", root / "resumed")
            newest = sorted((root / "resumed").glob("checkpoint_*"))[-1]
            assert json.loads((newest / "loop.json").read_text())["state"]["step"] == 4
            shutil.rmtree(newest)
        if world > 1:
            torch.distributed.barrier()
    for case in resume:
        m = CASES[case][2]
        out["resumed"][case] = _kept(loop(_spec(resumer(case), m), info_dict, tmp / case / "resumed", resume=True))
    return out


@pytest.fixture(scope="module")
def runs(info, tmp_path_factory):
    tmp, kjv = str(tmp_path_factory.mktemp("resume-workers")), info(**KJV)
    writes = {w: [c for c, v in CASES.items() if v[1] == w] for w in (1, 2, 4)}
    resumes = {w: [c for c, v in CASES.items() if v[2] == w] for w in (1, 2, 4)}
    straight, resumed = {}, {}
    for world, args in ((1, (writes[1], [])), (2, (writes[2], resumes[2])), (1, ([], resumes[1])),
                        (4, (writes[4], resumes[4]))):
        out = run_ranks(world, phase, kjv, tmp, *args)[0]
        straight.update(out["straight"])
        resumed.update(out["resumed"])
    return straight, resumed, Path(tmp)


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_on_another_worker_count_trains_the_same_steps(runs, case):
    straight, resumed = runs[0][case], runs[1][case]
    n, m, rel = CASES[case][1:4]
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    assert straight[0]["num_workers"] == n and resumed[0]["num_workers"] == m
    if rel is None:  # PipeDream: its first step after the resume forwards the checkpoint's weights
        assert resumed[0]["train_loss"] == pytest.approx(straight[2]["train_loss"], rel=1e-5), case
    for was, now in zip(straight[2:], resumed):
        for key in ("train_loss", "val_loss"):
            if rel is None:
                assert now[key] == pytest.approx(was[key], rel=0.05), f"{case} step {now['step']} {key}"
            else:
                assert now[key] == pytest.approx(was[key], rel=rel, abs=0), f"{case} step {now['step']} {key}"


def test_every_engine_writes_the_plain_models_weights_and_states(runs, info):
    """The straight runs' step-2 checkpoints (each engine gathering one tensor at a time, a pipeline's
    stages sent to rank 0) hold the plain GPT-2's every weight and each parameter's AdamW states under its
    name and shape, the same numbers whichever engine wrote them (to rounding; PipeDream trains other
    numbers: its names and shapes only)."""
    model = _plain_model(info(**KJV))
    initial = model.state_dict()
    plain = {k: tuple(v.shape) for k, v in initial.items()}
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    reference = None
    for case in CASES:
        ckpt = next(c.parent for c in (runs[2] / case / "straight").glob("checkpoint_*/loop.json")
                    if json.loads(c.read_text())["state"]["step"] == 2)  # as every resume read it
        stored, index = state.source(ckpt), state.read_index(ckpt)
        weights = state.weights_of(stored)
        states = {n: {k: stored.scalars.get(f"{n}/{k}") or stored.read(f"{n}/{k}") for k in stored.state_keys(n)}
                  for n in {n.rpartition("/")[0] for n in [*stored.shapes, *stored.scalars] if "/" in n}}
        assert {k: tuple(weights[k].shape) for k in weights} == plain, case
        assert sorted(states) == sorted(params), case
        for name, shape in params.items():
            assert sorted(states[name]) == ["exp_avg", "exp_avg_sq", "step"], (case, name)
            assert tuple(states[name]["exp_avg"].shape) == shape, (case, name)
        assert index["step"] == 2 and index["optimizer"] == "AdamW", case
        if CASES[case][3] is None:  # PipeDream's earlier stages have applied fewer updates at a step's end
            continue
        assert all(float(states[name]["step"]) == 2.0 for name in params), case
        numbers = {**{k: weights[k] for k in weights}, **{f"{n}/{k}": v for n in states for k, v in states[n].items()}}
        reference = reference or numbers
        for key, value in numbers.items():
            # within 5% of what training changed (Adam's first steps turn tiny differences of the gradient,
            # reductions summed in another order, into parts of a step); a tensor cut, joined or named
            # wrongly differs by about its whole size
            changed = (reference[key] - initial.get(key, 0)).abs().max()
            assert (value - reference[key]).abs().max() <= 0.05 * changed, (case, key)


def test_a_model_change_that_keeps_every_weight_resumes_and_one_that_does_not_is_refused(runs):
    """Against a real checkpoint's weights (names and shapes from its file, the experiment's model built on
    the meta device): other dropout resumes, saying so; another size is refused naming the first tensor
    that differs."""
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError

    run_dir = runs[2] / "ddp 1->2" / "straight"
    said = []
    check_resumable(config.parse(_spec({"name": "ddp"}, 1) | {"model": {"name": "gpt2-tiny", "dropout": 0.3}}),
                    run_dir, said.append)
    assert len(said) == 1 and "the checkpoint's weights fit the experiment's model" in said[0] and "0.3" in said[0]
    with pytest.raises(UserError) as err:
        check_resumable(config.parse(_spec("ddp", 1) | {"model": {"name": "gpt2-mini"}}), run_dir)
    assert "model: checkpoint {'name': 'gpt2-tiny'" in str(err.value)
    assert "its transformer.wte.weight is [512, 128], the experiment's model's" in str(err.value)


def test_a_damaged_newest_checkpoint_is_passed_over_and_none_intact_is_refused(runs, tmp_path):
    """Before any worker starts: the newest checkpoint with a file cut short (its optimizer states) is
    passed over for the one before it, said on the console; with every checkpoint damaged the resume is
    refused, naming the newest's problem and the fix, and nothing is touched."""
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError

    run_dir = tmp_path / "train"
    shutil.copytree(runs[2] / "ddp 1->2" / "straight", run_dir)
    newest_first = sorted(run_dir.glob("checkpoint_*"), reverse=True)
    assert len(newest_first) == 2
    for ckpt in newest_first:
        with open(ckpt / "pieces-rank0.safetensors", "r+b") as f:
            f.truncate(100)
        said = []
        if ckpt == newest_first[0]:
            check_resumable(config.parse(_spec("ddp", 2)), run_dir, said.append)
            assert said == [f"--resume: {ckpt.name} is damaged (pieces-rank0.safetensors (rank 0) has 100 bytes, "
                            f"{(runs[2] / 'ddp 1->2' / 'straight' / ckpt.name / 'pieces-rank0.safetensors').stat().st_size}"
                            f" were written): the run continues from {newest_first[1].name}"]
    before = sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*"))
    with pytest.raises(UserError) as err:
        check_resumable(config.parse(_spec("ddp", 2)), run_dir)
    assert f"no checkpoint in {run_dir} is intact; the newest, {newest_first[0].name}: pieces-rank0.safetensors" \
        in str(err.value) and "fix: restore its files, or start a new run without --resume" in str(err.value)
    assert sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*")) == before


def _plain_model(info_dict):
    from raytrain_par import models
    from raytrain_par.data.shards import DatasetInfo

    spec = config.from_dict(_spec("ddp", 1))
    return models.build(spec.model, DatasetInfo.from_json(info_dict), spec.train.seed)[0]


# -- check_resumable -----------------------------------------------------------------------------------

def _written(tmp_path, raw: dict) -> Path:
    return written_checkpoint(tmp_path / "train", config.parse(raw).to_dict())


@pytest.mark.parametrize("strategy,written,resumed", [
    ("ddp", 2, 1), ("zero-1", 2, 4), ("zero-2", 2, 1), ("zero-3", 1, 2), ("fsdp", 4, 2),
    (PIPELINE, 2, 4), (PIPEDREAM, 4, 2), (MEGATRON, 2, 4)])
def test_worker_count_may_change(tmp_path, strategy, written, resumed):
    from raytrain_par.driver import check_resumable

    run_dir = _written(tmp_path, experiment(strategy=strategy, workers=written))
    check_resumable(config.parse(experiment(strategy=strategy, workers=resumed)), run_dir)


@pytest.mark.parametrize("written,resumed", [("fsdp", "ddp"), ("ddp", "fsdp"), ("zero-2", "fsdp"),
                                             ("ddp", "zero-3"), ("zero-3", "zero-1"), (MEGATRON, "zero-3"),
                                             (PIPELINE, MEGATRON), ("zero-2", PIPELINE), (PIPEDREAM, "ddp"),
                                             ({**MEGATRON, "stages": 2}, {**PIPEDREAM, "stages": 4})])
def test_any_strategy_resumes_any_other(tmp_path, written, resumed):
    """Every strategy reads every other's checkpoints through the one format, with any options and on any
    worker count."""
    from raytrain_par.driver import check_resumable

    run_dir = _written(tmp_path, experiment(strategy=written, workers=4))
    check_resumable(config.parse(experiment(strategy=resumed, workers=4)), run_dir)


@pytest.mark.parametrize("strategy", ["ddp", "zero-2", "fsdp"])
def test_a_checkpoint_of_an_earlier_release_is_refused_with_how_to_continue(tmp_path, strategy):
    """A checkpoint in the engine's own files of an earlier release (no index.json) is refused before any
    worker starts, by the driver and by the engine alike: start again, or export its weights."""
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError

    run_dir = _written(tmp_path, experiment(strategy=strategy, workers=2))
    ckpt = next(run_dir.glob("checkpoint_*"))
    for f in [state.INDEX_FILE, *(p.name for p in ckpt.glob("pieces-rank*"))]:
        (ckpt / f).unlink()
    (ckpt / "ddp.pt").write_bytes(b"")
    checkpoints.write_manifest(ckpt, 0, 1, 2)  # intact, as an earlier release wrote it
    for check in (lambda: check_resumable(config.parse(experiment(strategy=strategy, workers=2)), run_dir),
                  lambda: state.refuse_old_format(ckpt)):
        with pytest.raises(UserError) as err:
            check()
        for words in ("earlier release", "own: ddp.pt)", "no index.json", "fix: start a new run without --resume",
                      "raytrain-par export RUN_DIR --out DIR", "pretrained: DIR"):
            assert words in str(err.value)


@pytest.mark.parametrize("rows,shapes,words", [
    ((0, 2), ((6, 4), (6, 4)), "the pieces h.w#0 of pieces-rank0.safetensors and h.w#0 of pieces-rank1.safetensors "
                               "overlap ([0:3, 0:4] and [2:5, 0:4])"),
    ((0, 4), ((6, 4), (6, 4)), "its pieces in pieces-rank0.safetensors, pieces-rank1.safetensors cover 20 of its 24 "
                               "elements"),
    ((0, 3), ((6, 4), (7, 4)), "pieces-rank1.safetensors holds it at shape [7, 4] F32, pieces-rank0.safetensors at [6, 4]"),
])
def test_a_checkpoint_whose_pieces_do_not_make_a_tensor_is_refused_before_any_worker_starts(tmp_path, rows, shapes,
                                                                                           words):
    """Two ranks' pieces of a tensor that overlap, leave part of it out, or disagree on its shape: the resume
    is refused before any worker starts, naming the tensor, the files and the fix; nothing is touched."""
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError
    from raytrain_par.strategies.pieces import Piece

    run_dir = _written(tmp_path, experiment(strategy="fsdp", workers=2))
    ckpt = next(run_dir.glob("checkpoint_*"))
    for rank, (start, shape) in enumerate(zip(rows, shapes)):
        rows_of = torch.randn(2 if start == 4 else 3, 4)
        piece = Piece.box(shape, (start, 0), tuple(rows_of.shape))
        extras = {"optimizer": "AdamW", "scheduler": {}} if rank == 0 else None
        state.write_parts(ckpt, state.Parts([("h.w", piece, rows_of)], {}, {}, extras), 2, rank)
    checkpoints.write_manifest(ckpt, 0, 1, 2)
    before = sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*"))
    with pytest.raises(UserError) as err:
        check_resumable(config.parse(experiment(strategy="fsdp", workers=2)), run_dir)
    assert f"{ckpt} cannot be resumed: h.w: {words}" in str(err.value), str(err.value)
    assert "fix: restore the files every rank wrote into it" in str(err.value)
    assert sorted((p.name, p.stat().st_size) for p in run_dir.rglob("*")) == before


@pytest.mark.parametrize("strategy,written,resumed", [("zero-3", 2, 1), (MEGATRON, 2, 4), (PIPELINE, 4, 2)])
def test_a_streamed_run_may_change_its_worker_count(tmp_path, strategy, written, resumed):
    """The stream loader's rows of a step depend on the seed, the step and the global batch only
    (data/loader.py), so its checkpoints continue the same batches on another number of workers."""
    from raytrain_par.driver import check_resumable

    stream = {"name": "kjv", "loader": "stream"}
    run_dir = _written(tmp_path, {**experiment(strategy=strategy, workers=written), "data": stream})
    check_resumable(config.parse({**experiment(strategy=strategy, workers=resumed), "data": stream}), run_dir)


@pytest.mark.parametrize("written,resumed,words", [
    (experiment(strategy=PIPEDREAM, workers=2), experiment(strategy={**PIPEDREAM, "stages": 4}, workers=4, batch=32),
     ["train.global_batch_size: checkpoint 16, experiment 32"]),
    (experiment(strategy="zero-2", workers=2), experiment("gpt2-mini", strategy=PIPEDREAM, workers=2),
     ["model: checkpoint {'name': 'gpt2-tiny'"]),
    (experiment(strategy="zero-2", workers=2), experiment(strategy="zero-3", workers=2, optimizer="sgd"),
     ["train.optimizer: checkpoint 'adamw', experiment 'sgd'"]),
    (experiment(workers=2), {**experiment(workers=2), "data": {"name": "kjv", "loader": "stream"}},
     ["data.loader: checkpoint 'memory', experiment 'stream'"]),
])
def test_resume_that_cannot_continue_is_refused_naming_what_differs(tmp_path, written, resumed, words):
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError

    run_dir = _written(tmp_path, written)
    before = sorted(p.name for p in run_dir.rglob("*"))
    with pytest.raises(UserError) as err:
        check_resumable(config.parse(resumed), run_dir)
    for w in words:
        assert w in str(err.value)
    assert "fix:" in str(err.value)
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # checkpoints untouched


@pytest.mark.ray
def test_a_run_resumes_under_another_strategy_as_a_user_types_it(ray_cluster, tmp_path):
    """`raytrain-par run --resume --set strategy=zero-3 --set scaling.num_workers=1` on a run trained with
    megatron T=2 on 2 workers ends with the losses of the run that trained straight through (constant
    learning rate, no dropout: only the strategy and the worker count differ). The run it resumes wrote
    its checkpoint sync, the others async: each record of a save carries its stall and its write, through
    Ray Train's SYNC and ASYNC reports alike."""
    import yaml

    from raytrain_par import cli
    from raytrain_par.metrics.records import read_records

    raw = {"name": "straight", "model": {"name": "gpt2-tiny", "dropout": 0.0}, "data": {**KJV, "max_val_samples": 16},
           "strategy": {"name": "megatron", "tensor_parallel": 2}, "scaling": {"num_workers": 2},
           "train": {"global_batch_size": 8, "max_steps": 6, "eval_every_steps": 3, "lr": 3e-3},
           "output_dir": str(tmp_path)}
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(raw))
    assert cli.main(["run", str(f)]) == 0
    f.write_text(yaml.safe_dump({**raw, "name": "resumed",
                                 "train": {**raw["train"], "max_steps": 3, "checkpoint_mode": "sync"}}))
    assert cli.main(["run", str(f)]) == 0
    assert cli.main(["run", str(f), "--resume", "--set", "strategy=zero-3", "--set", "scaling.num_workers=1",
                     "--set", "train.max_steps=6", "--set", "train.checkpoint_mode=async"]) == 0
    straight = read_records(tmp_path / "straight" / "metrics.parquet")
    resumed = read_records(tmp_path / "resumed" / "metrics.parquet")
    assert [r["step"] for r in resumed] == [0, 3, 6] and resumed[-1]["strategy"] == "zero-3"
    assert resumed[-1]["num_workers"] == 1 and straight[-1]["num_workers"] == 2
    for key in ("train_loss", "val_loss"):
        assert resumed[-1][key] == pytest.approx(straight[-1][key], rel=1e-5, abs=0)
    for r in straight[1:] + resumed[1:]:
        assert r["checkpoint_write_s"] > 0 and r["checkpoint_stall_s"] > 0, r["step"]
    assert straight[0]["checkpoint_write_s"] is None  # the evaluation before training saves nothing
    assert resumed[1]["checkpoint_stall_s"] >= resumed[1]["checkpoint_write_s"]  # sync: the write is the stall
