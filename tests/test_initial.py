"""Initial weights by name (models/initial.py, strategies/initial.py): every tensor is drawn alone, by the
model's own initialisation, from a generator seeded by the run's seed and its name, so a rank that holds
a part of a tensor gets that part of the same tensor whatever the layout; a worker builds the model with
no parameter storage and gives storage only to its own pieces; a pretrained model's shard files are read
by slices, and an index naming a missing shard is refused before anything starts."""

import json
import math

import pytest
import torch

from engines import experiment
from raytrain_par import config, models, strategies
from raytrain_par.data.shards import DatasetInfo
from raytrain_par.errors import ConfigError
from raytrain_par.local_group import run_ranks
from raytrain_par.strategies import DistContext
from raytrain_par.strategies.initial import Drawn, initial_weights
from raytrain_par.strategies.pieces import Piece, Region


def built(model="gpt2-tiny", data="kjv", info=None, seed=0, **kw):
    spec = config.from_dict(experiment(model, data, **kw))
    return spec, DatasetInfo.from_json(info(data))


def test_each_tensor_is_drawn_alone_and_any_part_of_it_is_that_part(info):
    spec, data = built(info=info)
    whole, _ = models.build(spec.model, data, seed=5)
    source = initial_weights(spec.model, data, seed=5)
    state = whole.state_dict()
    names = [n for n in state if n in source.shapes]
    assert "lm_head.weight" not in names and source.original("lm_head.weight") == "transformer.wte.weight"
    for name in reversed(names):  # another order than the whole model's: the same values
        t = state[name]
        if t.dim() == 2:  # rows 3..7 and columns 1..5 alone, as a rank holding that box reads them
            piece = Piece(tuple(t.shape), (Region((3, 1), (4, 4), (0, 0)),))
            out = source.read_into(name, piece, torch.zeros(4, 4))
            assert torch.equal(out, t[3:7, 1:5]), name
        else:
            assert torch.equal(source.read(name), t), name
    again, _ = models.build(spec.model, data, seed=5)
    other, _ = models.build(spec.model, data, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(state.values(), again.state_dict().values()))
    drawn = [n for n, t in state.items() if t.std() > 0]  # not the norms' ones and the biases' zeros
    assert drawn and all(not torch.equal(state[n], other.state_dict()[n]) for n in drawn)


def test_the_draw_is_the_models_own_initialisation(info):
    """GPT-2's scheme (transformers' _init_weights): N(0, 0.02), the residual projections N(0, 0.02/sqrt(2L)),
    norms 1 and biases 0; VGG's (torchvision's): He-normal convolutions by fan-out."""
    spec, data = built("gpt2-small", info=info)
    source = initial_weights(spec.model, data, seed=0)
    layers = 12
    assert source.read("transformer.h.3.attn.c_attn.weight").std() == pytest.approx(0.02, rel=0.02)
    assert source.read("transformer.h.3.mlp.c_proj.weight").std() == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.02)
    assert torch.equal(source.read("transformer.h.3.ln_1.weight"), torch.ones(768))
    assert torch.equal(source.read("transformer.h.3.attn.c_attn.bias"), torch.zeros(3 * 768))
    spec, data = built({"name": "vgg11", "width": 0.5}, "digits", info=info)
    source = initial_weights(spec.model, data, seed=0)
    w = source.read("features.3.weight")  # 64 -> 128 channels, 3x3
    assert w.std() == pytest.approx(math.sqrt(2 / (w.shape[0] * 9)), rel=0.05)


def test_a_worker_builds_no_parameter_storage_and_keeps_real_buffers(llama_info, info):
    spec, data = built(info=info)
    model, _ = models.build(spec.model, data, seed=0, on_meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    spec, data = llama_info
    model, _ = models.build(spec.model, data, seed=0, on_meta=True)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    frequencies = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    assert frequencies.device.type == "cpu" and frequencies[0] == 1.0 and torch.all(frequencies > 0)


def held_bytes(rank, world, spec_dict, info_dict):
    """What each rank's engine gives storage to, as it starts: the bytes of the tensors it holds, a tensor it
    holds under two names (a tied or copied LM head) once. Every one of them has storage."""
    from raytrain_par.strategies.dtensor import local_tensor

    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    engine, _ = strategies.start_engine(spec, info, DistContext.current(torch.device("cpu")), 4)
    aliases, total = engine.aliases(), 0
    for name, t in engine.held_tensors():
        local = local_tensor(t)
        assert local.device.type != "meta", name
        if name not in aliases:
            total += local.numel() * local.element_size()
    return total


@pytest.mark.parametrize("strategy, most", [
    ("fsdp", 0.5), ({"name": "megatron", "tensor_parallel": 2}, 0.55),
    ({"name": "pipeline", "stages": 2, "schedule": "1f1b"}, 0.9)])
def test_each_rank_starts_with_its_share_only(info, strategy, most):
    """gpt2-mini on 2 ranks: a rank's parameters hold at most `most` of the model's bytes (fsdp: half of
    every tensor; megatron: half of the split layers, the norms and position embedding whole; a pipeline:
    its stages, split by their cost, so the first holds the token embedding and three of the four blocks,
    and the last a copy of the embedding as its LM head)."""
    spec = experiment("gpt2-mini", "kjv", strategy=strategy, workers=2)
    whole, _ = models.build(config.from_dict(spec).model, DatasetInfo.from_json(info("kjv")), seed=0)
    total = sum(p.numel() * 4 for p in whole.parameters())
    held = run_ranks(2, held_bytes, spec, info("kjv"))
    assert max(held) <= most * total + 4 * 256, (held, total)
    if strategy == "fsdp":  # each element on one rank
        assert sum(held) == total
    assert min(held) > 0, held


def whole_parameters_while_zero3_builds(rank, world, spec_dict, info_dict):
    """zero-3's engine started on a model built on the meta device, watching each parameter as it is given
    storage: the elements of the other parameters then held whole (DeepSpeed's persistent ones, kept
    gathered by design, excepted), the most at any time; and how many parameters were given storage."""
    from raytrain_par.models import initial

    given, most, count = initial.given_storage, [0], [0]

    def watched(module, device, dtype=None):
        params = list({id(p): p for p in module.parameters()}.values())
        for p in given(module, device, dtype):
            whole = sum(q.data.numel() for q in params if q is not p and q.device.type != "meta"
                        and q.data.numel() > 0 and not getattr(q, "ds_persist", False))
            most[0], count[0] = max(most[0], whole), count[0] + 1
            yield p

    initial.given_storage = watched
    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    engine, _ = strategies.start_engine(spec, info, DistContext.current(torch.device("cpu")), 4)
    partitions = sum(p.ds_tensor.numel() for p in engine.model.parameters())
    return most[0], count[0], partitions


def test_zero3_partitions_each_parameter_before_the_next_is_given_storage(info):
    """gpt2-mini on 2 ranks: DeepSpeed's zero.Init partitions every parameter as soon as it has storage, so a
    rank never holds one parameter whole beside another (the whole model, as `deepspeed.initialize` would
    partition it, never exists), and ends with half of every tensor."""
    spec = experiment("gpt2-mini", "kjv", strategy="zero-3", workers=2)
    whole, _ = models.build(config.from_dict(spec).model, DatasetInfo.from_json(info("kjv")), seed=0)
    params = list({id(p): p for p in whole.parameters()}.values())
    out = run_ranks(2, whole_parameters_while_zero3_builds, spec, info("kjv"))
    for most, count, partitions in out:
        assert count == len(params)  # every parameter (the tied LM head once) went through it
        assert most == 0, most
        assert partitions == sum(math.ceil(p.numel() / 2) for p in params)


def test_a_sharded_checkpoint_is_read_by_slices_and_a_missing_shard_refused(tmp_path, info):
    """A pretrained directory in Hugging Face's sharded layout (model-0000k-of-0000n.safetensors and its
    index): every strategy reads its pieces from the shards (test_pretrained checks the loss); a shard the
    index names that is gone is refused before anything starts, naming the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from test_causal_lm import LLAMA, SEQ, VOCAB

    fields = {k: v for k, v in LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields)).save_pretrained(
        tmp_path, max_shard_size="200KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    spec = config.from_dict(experiment({"name": "causal-lm", "pretrained": str(tmp_path)}, {"name": "kjv", "seq_len": SEQ}))
    source = initial_weights(spec.model, DatasetInfo.from_json(info("kjv", seq_len=SEQ, vocab_size=VOCAB)), seed=0)
    assert {p.file.name for s in source.stored.values() for p in s} == set(shards)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, t in loaded.state_dict().items():
        assert torch.equal(source.read(name), t), name
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(ConfigError) as e:
        config.from_dict(experiment({"name": "causal-lm", "pretrained": str(tmp_path)}, {"name": "kjv", "seq_len": SEQ}))
    assert shards[-1] in str(e.value) and "model.pretrained" in str(e.value)


@pytest.fixture
def llama_info(info, tmp_path):
    from test_causal_lm import LLAMA, SEQ, VOCAB

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    spec = config.from_dict(experiment({"name": "causal-lm", "config": str(tmp_path / "config.json")},
                                       {"name": "kjv", "seq_len": SEQ}))
    return spec, DatasetInfo.from_json(info("kjv", seq_len=SEQ, vocab_size=VOCAB))


def test_drawn_values_do_not_depend_on_the_process(info):
    """The seed of a tensor is a function of the run's seed and its name (no Python hash, which differs
    between processes): two processes draw the same."""
    spec_dict = experiment("gpt2-tiny", "kjv")
    sums = run_ranks(2, _sum_of_draws, spec_dict, info("kjv"), fresh=True)
    assert sums[0] == sums[1]


def _sum_of_draws(rank, world, spec_dict, info_dict):
    spec, info = config.from_dict(spec_dict), DatasetInfo.from_json(info_dict)
    source = initial_weights(spec.model, info, seed=3)
    assert isinstance(source, Drawn)
    return [float(source.read(n).double().sum()) for n in sorted(source.shapes)]
