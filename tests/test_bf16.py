"""bf16 against fp32 for the engines that hold whole layers: ddp (one process and two), ZeRO stages
1-3, FSDP2, megatron T=2, and megatron T=2 sharded over two replicas by FSDP2. Each trains 8 steps
from the same seed and batches in both precisions, in gloo groups. (The pipeline engines:
tests/test_pipeline.py; megatron T x P: tests/test_layout_3d.py.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raytrain_par.local_group import run_ranks
from engines import KJV, experiment, train_steps

STEPS = 8
BATCH = 8  # bf16 matmuls are emulated on CPUs without bf16 units (~4x fp32's time)
MEGATRON = {"name": "megatron", "tensor_parallel": 2}
# name -> (strategy, workers). Each runs in a group of max(workers, 2) ranks (one spawn per size);
# the one-process ddp on rank 0, outside the group.
CASES = {
    "ddp-1": ("ddp", 1),
    "ddp": ("ddp", 2),
    "zero-1": ("zero-1", 2),
    "zero-2": ("zero-2", 2),
    "zero-3": ("zero-3", 2),
    "fsdp": ("fsdp", 2),
    "megatron-t2": (MEGATRON, 2),
    "megatron-t2-fsdp": ({**MEGATRON, "data_parallel_sharding": "fsdp"}, 4),
}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


class MatmulDtypes(TorchDispatchMode):
    """The dtypes the matrix products of a region computed in, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.seen.add(out.dtype)
        return out


def _world(workers: int) -> int:
    return max(workers, 2)


def _train(rank, world, info_dict):
    """This group's cases in bf16 and in fp32: global losses, the dtypes the matrix products computed
    in, and (rank 0) those of the trained weights."""
    out = {}
    for name, (strategy, workers) in CASES.items():
        if _world(workers) != world or (workers < world and rank > 0):
            continue
        for precision in ("bf16", "fp32"):
            spec = experiment(data=KJV, strategy=strategy, workers=workers, batch=BATCH, steps=STEPS,
                              precision=precision)
            with MatmulDtypes() as matmuls:
                run = train_steps(rank, world, spec, info_dict, STEPS, distributed=workers == world)
            out[name, precision] = {"losses": run["losses"], "matmuls": matmuls.seen,
                                    "weights": run["state"] and {t.dtype for t in run["state"].values()
                                                                 if t.is_floating_point()}}
    return out


@pytest.fixture(scope="module")
def runs(info):
    kjv = info(**KJV)
    return {world: run_ranks(world, _train, kjv) for world in sorted({_world(w) for _, w in CASES.values()})}


@pytest.mark.parametrize("name", CASES)
def test_bf16_trains_like_fp32(runs, name):
    """Every matrix product in bf16 (autocast, FSDP's MixedPrecisionPolicy or DeepSpeed's bf16
    parameters), weights kept in fp32; each step's loss within 3e-2 relative of the fp32 run's (bf16's
    8-bit mantissa moves a GPT-2 loss of ~6 by ~2e-4 relative here), the first one already not equal
    to it; and it falls as fp32's does."""
    ranks = runs[_world(CASES[name][1])]
    bf16, fp32 = ranks[0][name, "bf16"], ranks[0][name, "fp32"]
    assert bf16["matmuls"] == {torch.bfloat16} and fp32["matmuls"] == {torch.float32}
    assert bf16["weights"] == fp32["weights"] == {torch.float32}
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=3e-2)
    assert bf16["losses"][0] != fp32["losses"][0]
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.2
    for r in ranks[1:]:  # every rank reports the global loss
        assert (name, "bf16") not in r or r[name, "bf16"]["losses"] == bf16["losses"]
