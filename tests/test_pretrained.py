"""Starting from pretrained weights (`model: {name: causal-lm, pretrained: DIR_OR_HUB_ID}`): a
save_pretrained directory trains under ddp, zero-3, megatron T=2 and a 2-stage pipeline, and the loss
of its first step (the weights as loaded) equals transformers' own loss of that model on the same rows;
the checkpoint's tokenizer is the default; a hub id is found in the local Hugging Face cache; what does
not match is refused before anything starts."""

import json

import pytest
import torch

from engines import experiment, train_cases
from raytrain_par import config
from raytrain_par.data.loader import MemoryLoader
from raytrain_par.data.shards import DatasetInfo, read_split
from raytrain_par.errors import ConfigError
from raytrain_par.local_group import run_ranks
from raytrain_par.models import causal_lm
from test_causal_lm import LLAMA, SEQ, VOCAB

STRATEGIES = {"ddp": "ddp", "zero-3": "zero-3", "megatron": {"name": "megatron", "tensor_parallel": 2},
              "pipeline": {"name": "pipeline", "schedule": "1f1b", "stages": 2}}
BATCH = 16


def save_llama(directory, seed: int = 123, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in {**LLAMA, **changes}.items() if k != "model_type"}
    torch.manual_seed(seed)  # other weights than any run's own initialisation
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **fields))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pretrained")
    save_llama(directory)
    return str(directory)


def spec_of(path, **kw):
    return experiment({"name": "causal-lm", "pretrained": path}, {"name": "kjv", "seq_len": SEQ}, batch=BATCH, **kw)


def transformers_loss(directory, info_dict) -> float:
    """transformers' own loss of the saved model on the rows of the first global batch."""
    from transformers import AutoModelForCausalLM

    info = DatasetInfo.from_json(info_dict)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    batch = next(iter(MemoryLoader(read_split(info, info.train_path), BATCH, 0, 1, 0).epoch(0)))
    tokens = batch["tokens"].long()
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


def test_every_strategy_starts_from_the_weights_as_loaded(pretrained, info):
    info_dict = info("kjv", seq_len=SEQ, vocab_size=VOCAB)
    expected = transformers_loss(pretrained, info_dict)
    cases = [(spec_of(pretrained, strategy=s, workers=2), info_dict, 2) for s in STRATEGIES.values()]
    runs = dict(zip(STRATEGIES, run_ranks(2, train_cases, cases)[0]))
    for name, run in runs.items():
        assert run["losses"][0] == pytest.approx(expected, rel=1e-5), name
        assert run["losses"][1] < run["losses"][0], name  # and trains from there
    # not the random weights a run would start from
    random = run_ranks(1, train_cases, [(experiment({"name": "causal-lm", "config": pretrained},
                                                    {"name": "kjv", "seq_len": SEQ}, batch=BATCH), info_dict, 1)],
                       group_of_one=True)[0][0]
    assert abs(random["losses"][0] - expected) > 1e-3


def test_the_checkpoints_tokenizer_is_the_default(pretrained, tmp_path):
    from tokenizers import Tokenizer, models as tokenizer_models

    directory = tmp_path / "with-tokenizer"
    save_llama(directory)
    Tokenizer(tokenizer_models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(directory / "tokenizer.json"))
    raw = {"name": "t", "model": {"name": "causal-lm", "pretrained": str(directory)},
           "data": {"name": "text", "path": str(tmp_path / "*.jsonl"), "seq_len": SEQ}}
    assert config.parse(raw).data.tokenizer == str(directory)
    mine = tmp_path / "mine"
    mine.mkdir()
    assert config.parse({**raw, "data": {**raw["data"], "tokenizer": str(mine)}}).data.tokenizer == str(mine)


def test_a_hub_id_is_found_in_the_local_cache_and_nothing_downloads(pretrained, tmp_path, monkeypatch):
    import shutil

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    causal_lm.pretrained_dir.cache_clear()
    with pytest.raises(ConfigError, match="hf download org/tiny-llama"):
        config.parse(spec_of("org/tiny-llama"))
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    shutil.copytree(pretrained, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    causal_lm.pretrained_dir.cache_clear()
    spec = config.parse(spec_of("org/tiny-llama"))
    assert spec.model.options.pretrained == str(repo / "snapshots" / "abc123")
    causal_lm.pretrained_dir.cache_clear()


@pytest.mark.parametrize("change,words", [
    ({"overrides": {"hidden_size": 32, "intermediate_size": 64}}, "weight is [512, 64], the model's [512, 32]"),
    ({"config": "x"}, "not both"),
])
def test_what_does_not_match_is_refused(pretrained, change, words):
    raw = spec_of(pretrained)
    raw["model"] = {**raw["model"], **change}
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        config.parse(raw)


def test_checkpoints_that_cannot_be_used_are_refused(pretrained, tmp_path):
    other = tmp_path / "other"
    save_llama(other, num_hidden_layers=1)  # one layer: the config says two
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="lack .* tensors, e.g. model.layers.1"):
        config.parse(spec_of(str(other)))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((other / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ConfigError, match="pytorch_model.bin is a pickle"):
        config.parse(spec_of(str(pickled)))
    with pytest.raises(ConfigError, match="no such directory"):
        config.parse(spec_of(str(tmp_path / "missing" / "dir")))
