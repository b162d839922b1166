"""Megatron tensor parallel (T=2) and tensor x data parallel (2x2) against one process, in gloo groups.

Each process group is spawned once per module (spawning costs seconds) and runs every scenario;
the tests below assert on what they returned."""

import shutil
from pathlib import Path

import pytest
import torch

from raytrain_par.local_group import run_ranks
import engines
from engines import KJV, loop
from raytrain_par import config, models, strategies
from raytrain_par.models import gpt2
from raytrain_par.data.loader import MemoryLoader, eval_batches
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.errors import ConfigError
from raytrain_par.strategies import DistContext
from raytrain_par.strategies import state as one_format

STEPS = 4
CLIP = {"gradient_accumulation_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1, "warmup_steps": 2,
        "lr_schedule": "cosine"}
RESUME = {"eval_every_steps": 2, "lr_schedule": "constant"}
# Weights after a few AdamW steps (lr 1e-3): its normalised step turns rounding differences in a
# near-zero gradient into a difference of a fraction of lr in that one weight.
WEIGHT_ATOL = 1e-4


def experiment(model="gpt2-tiny", **more) -> dict:
    return engines.experiment(model, KJV, **more)


def megatron(t):
    return {"name": "megatron", "tensor_parallel": t}


# -- what each rank runs -------------------------------------------------------------------------

def _engine(spec_dict, info_dict, steps, attn_dropout=None):
    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    model, task = models.build(spec.model, info, spec.train.seed)
    if attn_dropout is not None:  # dropout on embeddings and residuals only
        model.config.attn_pdrop = attn_dropout
        for block in model.transformer.h:
            block.attn.attn_dropout.p = attn_dropout
    engine = strategies.build_engine(spec.strategy, model, task, spec.train, DistContext.current(torch.device("cpu")),
                                     total_steps=steps)
    loader = MemoryLoader(read_split(info, info.train_path), spec.train.global_batch_size, engine.dp_rank,
                          engine.dp_size, spec.train.seed)
    return spec, info, engine, loader


def _losses(engine, batches):
    return [float(engine.dp_sum(engine.train_step(b).clone())) / engine.dp_size for b in batches]


def train(spec_dict, info_dict, steps, attn_dropout=None, checkpoint=None):
    """Global loss per step, the gathered state, memory and validation metrics; with `checkpoint` (a
    directory), also the losses of the last two steps after saving at steps - 2 and loading into a
    fresh engine."""
    spec, info, engine, loader = _engine(spec_dict, info_dict, steps, attn_dropout)
    batches = [b for _, b in zip(range(steps), loader.epoch(0))]
    losses = _losses(engine, batches[:steps - 2])
    if checkpoint is not None:
        Path(checkpoint).mkdir(parents=True, exist_ok=True)
        one_format.save(engine, Path(checkpoint), steps - 2)
        rng, engine_rng = torch.get_rng_state(), engine.rng_state()
    losses += _losses(engine, batches[steps - 2:])
    out = {"losses": losses, "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
           "memory": engine.memory(),
           "val": engine.evaluate(eval_batches(read_split(info, info.val_path), 16, engine.dp_rank, engine.dp_size, 64))}
    if checkpoint is not None:
        torch.distributed.barrier()
        _, _, fresh, _ = _engine(spec_dict, info_dict, steps, attn_dropout)
        one_format.load(fresh, Path(checkpoint))
        torch.set_rng_state(rng)
        fresh.load_rng_state(engine_rng)
        out["resumed_losses"] = _losses(fresh, batches[steps - 2:])
    if hasattr(engine, "rng"):
        with engine.rng.fork():
            inside = torch.rand(4)
        out["rng"] = (inside, torch.rand(4))
    return out


def odd_vocabulary(info_dict):
    """The data set as if its tokenizer had come out at 513 tokens (every id stays below 512)."""
    return {**info_dict, "vocab_size": 513}


def tensor_parallel_scenarios(rank, world, info_dict, tmp):
    """T=2 on 2 ranks: parity cases, dropout, engine checkpoint, and the loop run straight / interrupted."""
    tmp = Path(tmp)
    out = {
        "plain": train(experiment(strategy=megatron(2), workers=2, steps=STEPS), info_dict, STEPS),
        "clip": train(experiment(strategy=megatron(2), workers=2, steps=STEPS, **CLIP), info_dict, STEPS),
        "dropout": train(experiment({"name": "gpt2-tiny", "dropout": 0.1}, strategy=megatron(2), workers=2),
                         info_dict, STEPS, attn_dropout=0.0),
        "attn_dropout": train(experiment({"name": "gpt2-tiny", "dropout": 0.1}, strategy=megatron(2), workers=2),
                              info_dict, STEPS, checkpoint=tmp / "engine"),
    }
    out["padded"] = train(experiment(strategy=megatron(2), workers=2, steps=STEPS), odd_vocabulary(info_dict), STEPS)
    resume_spec = experiment(strategy=megatron(2), workers=2, steps=STEPS, **RESUME)
    resume_spec["data"]["max_val_samples"] = 32
    out["straight"] = loop(resume_spec, info_dict, tmp / "straight")
    loop({**resume_spec, "train": {**resume_spec["train"], "max_steps": 2}}, info_dict, tmp / "interrupted")
    torch.distributed.barrier()
    if rank == 0:  # the step-2 checkpoint, for a run that continues with T=1
        shutil.copytree(tmp / "interrupted", tmp / "to-t1")
    torch.distributed.barrier()
    out["resumed"] = loop(resume_spec, info_dict, tmp / "interrupted", resume=True)
    return out


def reference_scenarios(rank, world, info_dict, tmp):
    """One process: the plain model (DDP on one rank) for every parity case, megatron with T=1, and a
    T=1 run continuing the T=2 checkpoint."""
    resume_spec = experiment(strategy=megatron(1), workers=1, steps=STEPS, **RESUME)
    resume_spec["data"]["max_val_samples"] = 32
    return {
        "plain": train(experiment(workers=1, steps=STEPS), info_dict, STEPS),
        "clip": train(experiment(workers=1, steps=STEPS, **CLIP), info_dict, STEPS),
        "dropout": train(experiment({"name": "gpt2-tiny", "dropout": 0.1}, workers=1), info_dict, STEPS,
                         attn_dropout=0.0),
        "t1": train(experiment(strategy=megatron(1), workers=1, steps=STEPS), info_dict, STEPS),
        "padded": train(experiment(workers=1, steps=STEPS), odd_vocabulary(info_dict), STEPS),
        "from_t2": loop(resume_spec, info_dict, Path(tmp) / "to-t1", resume=True),
    }


def hybrid_scenarios(rank, world, info_dict, tmp):
    """T2 x D2: data-parallel replicas by DDP, and sharded by FSDP2 (with an engine checkpoint and resume)."""
    sharded = {**megatron(2), "data_parallel_sharding": "fsdp"}
    return {"clip": train(experiment(strategy=megatron(2), workers=4, steps=STEPS, **CLIP), info_dict, STEPS),
            "fsdp": train(experiment(strategy=sharded, workers=4, steps=STEPS, **CLIP), info_dict, STEPS,
                          checkpoint=Path(tmp) / "fsdp")}


@pytest.fixture(scope="module")
def runs(info, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    kjv = info(**KJV)
    t2 = run_ranks(2, tensor_parallel_scenarios, kjv, str(tmp))
    ref = run_ranks(1, reference_scenarios, kjv, str(tmp))[0]
    return {"t2": t2, "ref": ref, "info": kjv}


@pytest.fixture(scope="module")
def hybrid(info, tmp_path_factory):
    return run_ranks(4, hybrid_scenarios, info(**KJV), str(tmp_path_factory.mktemp("hybrid")))


# -- parity --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "clip", "dropout", "padded"])
def test_tensor_parallel_matches_single_process(runs, case):
    """Same global losses and final weights as one process from the same initial weights. `clip` adds
    accumulation, clipping (a norm over split and replicated parameters), decay and a schedule;
    `dropout` drops embeddings and residuals, which must draw the same masks as one process; `padded`
    has a vocabulary of 513, padded to 514 for T=2 (and cut back in the gathered state)."""
    t2, ref = runs["t2"], runs["ref"][case]
    assert t2[0][case]["losses"] == t2[1][case]["losses"]
    assert t2[0][case]["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]
    assert list(t2[0][case]["state"]) == list(ref["state"])  # transformers' names, in order
    for name, want in ref["state"].items():
        torch.testing.assert_close(t2[0][case]["state"][name], want, atol=WEIGHT_ATOL, rtol=1e-4, msg=name)
    assert t2[0][case]["val"] == pytest.approx(ref["val"], rel=1e-5)


@pytest.mark.parametrize("case", ["clip", "fsdp"])
def test_tensor_by_data_parallel_matches_single_process(runs, hybrid, case):
    """T2 x D2 with accumulation, clipping (one norm over tensor, data and replicated parameters),
    decay and a schedule; `fsdp` shards each tensor-parallel shard over the replicas (torchtitan's 2D)."""
    ref = runs["ref"]["clip"]
    for r in range(4):
        assert hybrid[r][case]["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5)
    for name, want in ref["state"].items():
        torch.testing.assert_close(hybrid[0][case]["state"][name], want, atol=WEIGHT_ATOL, rtol=1e-4, msg=name)
    assert hybrid[0][case]["val"] == pytest.approx(ref["val"], rel=1e-5)


def test_sharded_tensor_parallel_resumes_bit_exactly(hybrid):
    for r in range(4):
        assert hybrid[r]["fsdp"]["resumed_losses"] == hybrid[r]["fsdp"]["losses"][-2:]


def test_megatron_with_one_rank_is_the_plain_model(runs):
    assert runs["ref"]["t1"]["losses"] == pytest.approx(runs["ref"]["plain"]["losses"], abs=1e-5, rel=1e-5)


def test_attention_dropout_streams_differ_per_rank_and_replicated_ones_agree(runs):
    a, b = (runs["t2"][r]["attn_dropout"] for r in range(2))
    assert not torch.equal(a["rng"][0], b["rng"][0])  # split region: an independent stream per rank
    assert torch.equal(a["rng"][1], b["rng"][1])  # default stream: identical on the group
    assert a["losses"] == b["losses"]
    for name in ("transformer.ln_f.weight", "transformer.wpe.weight", "transformer.h.1.ln_2.bias"):
        assert torch.equal(a["state"][name], b["state"][name]), name


# -- checkpoints and export ------------------------------------------------------------------------

def test_engine_resume_restores_attention_dropout_stream(runs):
    for r in range(2):
        out = runs["t2"][r]["attn_dropout"]
        assert out["resumed_losses"] == out["losses"][-2:]


def test_resumed_loop_equals_uninterrupted(runs):
    straight, resumed = runs["t2"][0]["straight"], runs["t2"][0]["resumed"]
    assert [r["step"] for r in straight] == [0, 2, 4] and [r["step"] for r in resumed] == [4]
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert resumed[-1][key] == pytest.approx(straight[-1][key], abs=1e-6), key


def test_tensor_parallel_checkpoint_continues_with_one_rank(runs):
    straight, continued = runs["t2"][0]["straight"][-1], runs["ref"]["from_t2"][-1]
    assert continued["step"] == 4
    for key in ("train_loss", "val_loss"):
        assert continued[key] == pytest.approx(straight[key], abs=1e-5), key


def test_gathered_state_loads_into_transformers_gpt2(runs):
    from transformers import GPT2LMHeadModel

    info = DatasetInfo.from_json(runs["info"])
    spec = config.from_dict(experiment())
    plain, task = models.build(spec.model, info, seed=123)  # other weights, replaced below
    assert isinstance(plain, GPT2LMHeadModel)
    result = plain.load_state_dict(runs["t2"][0]["plain"]["state"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert plain.lm_head.weight is plain.transformer.wte.weight
    plain.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for batch in eval_batches(read_split(info, info.val_path), 16, 0, 1, 64):
            sums += task.eval_sums(plain, task.prepare(batch, torch.device("cpu"))).double()
    val = task.summarize(*[float(x) for x in sums])
    assert val["val_loss"] == pytest.approx(runs["t2"][0]["plain"]["val"]["val_loss"], rel=1e-5)
    assert val["val_accuracy"] == pytest.approx(runs["t2"][0]["plain"]["val"]["val_accuracy"], abs=1e-9)


# -- memory and communication ------------------------------------------------------------------------

def _sizes(info, batch):
    sizes = gpt2.sizes("gpt2-tiny", gpt2.Options())
    return sizes["n_layer"], batch, info["seq_len"], sizes["n_embd"]


def test_parameter_bytes_split_and_activations_keep_a_replicated_part(runs):
    state, t1, t2 = runs["ref"]["plain"]["state"], runs["ref"]["t1"]["memory"], runs["t2"][0]["plain"]["memory"]
    split = {k for k in state if ".attn.c_attn." in k or ".mlp.c_fc." in k or k.endswith("c_proj.weight")} | {
        "transformer.wte.weight"}
    replicated = [v for k, v in state.items() if k not in split and k != "lm_head.weight"]
    theory = sum(state[k].numel() for k in split) // 2 * 4 + sum(v.numel() for v in replicated) * 4
    assert t1["mem_param_bytes"] == sum(v.numel() for k, v in state.items() if k != "lm_head.weight") * 4
    assert t2["mem_param_bytes"] == theory
    steps = 4 * sum(1 for k in state if k != "lm_head.weight")  # AdamW's step counter of each tensor
    # parameters, gradients, two AdamW moments: the census of live tensors (the allocator's count,
    # mem_model_state_bytes, also holds the batches this test keeps after building the engine)
    assert t2["mem_model_state_census_bytes"] == 4 * theory + steps
    # Activations kept for backward: A(T) = R + S/T. The replicated part R is what Megatron leaves
    # whole: the inputs and outputs of the 2L + 1 layer norms, (4L + 2) x b x s x h floats.
    n_layer, b, s, h = _sizes(runs["info"], 16)
    replicated_acts = 2 * t2["mem_activation_bytes"] - t1["mem_activation_bytes"]
    assert replicated_acts == pytest.approx((4 * n_layer + 2) * b * s * h * 4, rel=0.02)
    assert t2["mem_activation_bytes"] > t1["mem_activation_bytes"] / 2


def test_allreduce_bytes_follow_the_megatron_formula(runs, hybrid):
    """Per layer two all-reduces of [b, s, h] forward and two backward (Shoeybi et al. 2019), plus the
    embedding's forward and the LM head's backward, plus three floats per token in the cross-entropy;
    the data-parallel all-reduce sends each local gradient once."""
    for mem, batch, clipped in ((runs["t2"][0]["plain"]["memory"], 16, False), (hybrid[0]["clip"]["memory"], 8, True)):
        n_layer, b, s, h = _sizes(runs["info"], batch)  # b: rows of the data-parallel slice, all micro-batches
        tp_floats = 4 * n_layer * b * s * h + 2 * b * s * h + 3 * b * s
        tp_floats += 1 if clipped else 0  # the split gradients' squared norm
        assert mem["comm_tp_allreduce_bytes_per_step"] == 4 * tp_floats
    assert runs["t2"][0]["plain"]["memory"]["comm_dp_allreduce_bytes_per_step"] == 0
    assert hybrid[0]["clip"]["memory"]["comm_dp_allreduce_bytes_per_step"] == hybrid[0]["clip"]["memory"]["mem_param_bytes"]


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes,field,words", [
    ({"model": {"name": "gpt2-tiny", "n_head": 4}, "strategy": megatron(8), "scaling": {"num_workers": 8}},
     "model.n_head", "attention heads"),
    ({"model": {"name": "gpt2-tiny", "n_embd": 120, "n_head": 4}, "strategy": megatron(16),
      "scaling": {"num_workers": 16}}, "model.n_embd", "hidden size"),
    ({"scaling": {"num_workers": 3}}, "scaling.num_workers", "not a multiple of tensor_parallel 2"),
    ({"model": {"name": "vgg11"}, "data": {"name": "digits"}}, "model.name", "transformer"),
    ({"strategy": megatron(0)}, "strategy.tensor_parallel", "must be >= 1"),
    ({"strategy": {"name": "megatron"}}, "strategy.tensor_parallel", "required"),
    ({"train": {"global_batch_size": 16, "max_steps": 4, "optimizer": "lamb"}}, "train.optimizer", "slices"),
    ({"train": {"global_batch_size": 16, "max_steps": 4, "precision": "fp16"}, "scaling": {"num_workers": 2,
      "use_gpu": True}}, "train.precision", "no loss scaler"),
])
def test_bad_layouts_are_rejected_before_start(changes, field, words):
    raw = {**experiment(strategy=megatron(2), workers=2), **changes}
    with pytest.raises(ConfigError) as e:
        config.parse(raw)
    assert e.value.field == field and words in e.value.problem and e.value.fix


def test_hybrid_layout_reads_one_slice_per_tensor_parallel_group():
    spec = config.parse(experiment(strategy=megatron(2), workers=4, batch=16))
    assert spec.data_parallel_size == 2 and spec.per_worker_batch == 8


def test_resume_may_change_the_layout_but_not_the_model(tmp_path):
    from raytrain_par.driver import check_resumable
    from raytrain_par.errors import UserError

    engines.written_checkpoint(tmp_path / "train", experiment(strategy=megatron(2), workers=4))
    for resumed in (experiment(strategy=megatron(1), workers=1), experiment(strategy="zero-3", workers=1),
                    experiment(strategy={"name": "pipeline", "stages": 2}, workers=2),
                    experiment(strategy={"name": "pipedream", "stages": 2}, workers=2)):
        check_resumable(config.parse(resumed), tmp_path / "train")
    for other in (experiment("gpt2-mini", strategy=megatron(2), workers=4),
                  experiment(strategy={"name": "pipedream", "stages": 2}, workers=4, optimizer="sgd")):
        with pytest.raises(UserError, match="another setup"):
            check_resumable(config.parse(other), tmp_path / "train")


def test_estimate_predicts_what_a_tensor_parallel_worker_holds(runs):
    """`raytrain-par estimate` for megatron: one rank's shard of the model states (the census of its
    live tensors) and the activations it saves for backward (the engine's tracker), within 15%."""
    from raytrain_par import data as data_sets, estimate

    spec = config.from_dict(experiment(strategy=megatron(2), workers=2, steps=STEPS))
    (row,) = estimate.estimate(spec, ["megatron"], [2])
    measured = runs["t2"][0]["plain"]["memory"]
    assert row.theory == pytest.approx(measured["mem_model_state_census_bytes"], rel=0.15)
    info = DatasetInfo.from_json(runs["info"])
    predicted = estimate.activation_bytes(spec.model, info, spec.per_worker_batch, "fp32", "none", spec.strategy)
    assert predicted == pytest.approx(measured["mem_activation_bytes"], rel=0.15)
    assert predicted < estimate.activation_bytes(spec.model, data_sets.shape_of(spec.data), spec.per_worker_batch,
                                                 "fp32")  # less than the whole model saves
