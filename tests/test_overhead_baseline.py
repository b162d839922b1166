"""The plain scripts benchmarks/overhead.py times our engines against (benchmarks/torchrun_plain.py,
built with the arguments the benchmark gives them) train exactly what our engines train: the same
initial model, batches and optimizer arithmetic give the same losses, step by step, in one gloo
group of 2 ranks. Otherwise the overhead ratio would compare different work."""

import sys
from pathlib import Path

import pytest
import torch

from engines import KJV, experiment
from raytrain_par import config, models, strategies
from raytrain_par.data.loader import MemoryLoader
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.local_group import run_ranks
from raytrain_par.strategies import DistContext

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
STEPS = 3
# as the benchmark sets them: no clipping, no decay, a constant learning rate
TRAIN = {"grad_clip": 0.0, "weight_decay": 0.0, "lr_schedule": "constant", "warmup_steps": 0}


def _both(rank, world, cases, info_dict, work):
    sys.path.insert(0, str(BENCHMARKS))
    import overhead
    import torchrun_plain

    info, out = DatasetInfo.from_json(info_dict), {}
    arrays = read_split(info, info.train_path)
    for spec_dict in cases:
        spec = config.from_dict(spec_dict)
        name = spec.strategy.name
        args = overhead.plain_args(spec, name, info, Path(work), world, 1, STEPS)
        _, plain_step = torchrun_plain.build(torchrun_plain.parser().parse_args([*args, "--out", "-"]))
        model, task = models.build(spec.model, info, spec.train.seed)
        engine = strategies.build_engine(spec.strategy, model, task, spec.train,
                                         DistContext.current(torch.device("cpu")), total_steps=STEPS)
        loader = MemoryLoader(arrays, spec.train.global_batch_size, engine.dp_rank, engine.dp_size, spec.train.seed)
        losses = {"ours": [], "plain": []}
        for _, batch in zip(range(STEPS), loader.epoch(0)):
            losses["ours"].append(float(engine.train_step(batch)))
            losses["plain"].append(float(plain_step(batch["tokens"])))
        out[name] = losses
    return out


def test_plain_baselines_train_what_our_engines_train(info, tmp_path):
    data = info(**KJV)
    names = ["ddp", "fsdp", "zero-1", "zero-3"]
    cases = [experiment(data=KJV, strategy=name, workers=2, batch=8, steps=STEPS, **TRAIN) for name in names]
    ranks = run_ranks(2, _both, cases, data, str(tmp_path))
    for out in ranks:
        for name in names:
            ours, plain = out[name]["ours"], out[name]["plain"]
            assert ours[-1] < ours[0], name
            assert plain == pytest.approx(ours, rel=1e-5), name


def test_the_cpu_sample_keeps_a_rank_that_ended_under_its_kind():
    """benchmarks/overhead.py's CPU-by-process sample: a rank that burns a core, then ends while the
    sample goes on and waits unreaped (its command line gone from /proc, as torchrun's ranks and Ray's
    workers are at the end of a run), counts as a training rank, not as an unknown process."""
    import subprocess
    import time

    sys.path.insert(0, str(BENCHMARKS))
    import overhead

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"

    def run():
        proc = subprocess.Popen([sys.executable, "-c", busy, "torchrun_plain.py"])
        time.sleep(2.5)  # it ends after about 1 s of CPU and stays a zombie until the wait below
        proc.wait()

    share = overhead.cpu_while(run, lambda: True, 10.0)
    assert share.get("training ranks (torchrun)", 0.0) > 0.2, share  # ~1 s of CPU in a window of ~2.5 s
