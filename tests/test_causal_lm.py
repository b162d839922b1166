"""Any transformers causal LM from a config.json: a tiny Llama (grouped-query attention, SwiGLU,
rotary embeddings, untied embeddings) trains under ddp, zero-3, fsdp, megatron T=2 and a 2-stage
pipeline with the losses of one process; bad configs are refused before anything starts."""

import json

import pytest
import torch

from engines import experiment, exported_val_loss, train_cases
from raytrain_par import config, models
from raytrain_par.errors import ConfigError
from raytrain_par.local_group import run_ranks

SEQ, VOCAB = 32, 512
LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
             hidden_act="silu", rms_norm_eps=1e-6)
# Qwen2: biases on q, k, v and a tied LM head; Mistral: a sliding window shorter than the rows.
OTHERS = {"qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
          "mistral": dict(model_type="mistral", sliding_window=8)}
STRATEGIES = {
    "ddp": "ddp",
    "zero-3": "zero-3",
    "fsdp": "fsdp",
    "megatron": {"name": "megatron", "tensor_parallel": 2},
    "pipeline": {"name": "pipeline", "schedule": "1f1b", "stages": 2},
}


def write_config(directory, **changes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return str(directory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("llama"))


def spec_of(path, **kw):
    return experiment({"name": "causal-lm", "config": path}, {"name": "kjv", "seq_len": SEQ}, **kw)


@pytest.fixture(scope="module")
def runs(llama, info, tmp_path_factory):
    info_dict = info("kjv", seq_len=SEQ, vocab_size=VOCAB)
    others = {name: write_config(tmp_path_factory.mktemp(name), **changes) for name, changes in OTHERS.items()}
    refs = run_ranks(1, train_cases, [(spec_of(p), info_dict, 4) for p in (llama, *others.values())],
                     group_of_one=True)[0]
    cases = [(spec_of(llama, strategy=s, workers=2), info_dict, 4) for s in STRATEGIES.values()]
    split = [(name, s) for name in others for s in ("megatron", "pipeline")]
    cases += [(spec_of(others[name], strategy=STRATEGIES[s], workers=2), info_dict, 4) for name, s in split]
    two = run_ranks(2, train_cases, cases)[0]
    by_case = dict(zip(split, two[len(STRATEGIES):]))
    return {"ref": refs[0], "info": info_dict, "two": dict(zip(STRATEGIES, two)),
            "others": {name: (ref, {s: by_case[name, s] for s in ("megatron", "pipeline")})
                       for name, ref in zip(others, refs[1:])}}


def test_the_config_builds_a_llama_with_its_own_vocabulary(llama):
    spec = config.parse(spec_of(llama))
    assert spec.data.vocab_size == VOCAB  # the BPE's size defaults to the config's
    model, _ = models.build_on_meta(spec.model, models_info(spec))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * 16  # 2 key/value heads of 16
    assert models.pipeline_layer_count(spec.model) == 4


def models_info(spec):
    from raytrain_par import data

    return data.shape_of(spec.data)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_trains_the_llama_like_one_process(runs, strategy):
    assert runs["two"][strategy]["losses"] == pytest.approx(runs["ref"]["losses"], rel=1e-5)


@pytest.mark.parametrize("family", list(OTHERS))
def test_qwen2_and_mistral_split_like_one_process(runs, family):
    ref, split = runs["others"][family]
    for strategy, out in split.items():
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), strategy
        assert set(out["state"]) == set(ref["state"]), strategy


def test_split_models_gather_to_the_plain_model(runs):
    ref = runs["ref"]["state"]
    for strategy in ("megatron", "pipeline", "fsdp"):
        state = runs["two"][strategy]["state"]
        assert set(state) == set(ref), strategy
        for k in ref:
            assert torch.allclose(state[k], ref[k], atol=1e-4), (strategy, k)


def test_megatron_through_ray_exports_a_model_transformers_loads(ray_cluster, llama, runs, tmp_path):
    from raytrain_par.driver import run_experiment

    spec = config.parse({**spec_of(llama, strategy=STRATEGIES["megatron"], workers=2, steps=3),
                         "output_dir": str(tmp_path)})
    spec.train.eval_every_steps = 1
    spec.data.max_val_samples = 16
    result = run_experiment(spec, log=lambda *_: None)
    assert result.error is None, result.error
    losses = [r["train_loss"] for r in result.records if r["step"] > 0]
    assert losses == pytest.approx(runs["ref"]["losses"][:3], rel=1e-5)
    last = result.records[-1]
    assert exported_val_loss(result.results_dir, runs["info"], 16, spec.model) == pytest.approx(last["val_loss"],
                                                                                              abs=1e-5)


# -- bad input ---------------------------------------------------------------------------------------

def test_a_config_that_is_not_a_decoder_only_causal_lm_is_refused(tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 512}))
    with pytest.raises(ConfigError) as e:
        config.parse(spec_of(str(bert)))
    assert e.value.field == "model.config" and "not a decoder-only causal LM" in e.value.problem


@pytest.mark.parametrize("changes,strategy,field,words", [
    ({"num_key_value_heads": 1}, STRATEGIES["megatron"], "model.overrides.num_key_value_heads", "key/value heads"),
    ({"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 64}, {"name": "megatron",
     "tensor_parallel": 4}, "model.overrides.num_attention_heads", "attention heads"),
    ({"model_type": "gpt_neox", "num_attention_heads": 4}, STRATEGIES["megatron"], "model.name", "gpt2, llama"),
    ({"model_type": "gpt_neox", "num_attention_heads": 4}, STRATEGIES["pipeline"], "model.config", "llama, mistral"),
    ({"max_position_embeddings": 16}, "ddp", "data.seq_len", "positions"),
    ({"vocab_size": 100}, "ddp", "data.vocab_size", "more tokens"),
    ({"model_type": "lama"}, "ddp", "model.config", "did you mean 'llama'"),
])
def test_bad_configs_are_refused_before_start(tmp_path, changes, strategy, field, words):
    path = write_config(tmp_path / "model", **changes)
    raw = {"name": "bad", "model": {"name": "causal-lm", "config": path},
           "data": {"name": "kjv", "seq_len": SEQ, **({"vocab_size": 512} if "vocab_size" in changes else {})},
           "strategy": strategy if isinstance(strategy, dict) else {"name": strategy},
           "scaling": {"num_workers": 4}, "train": {"global_batch_size": 16}}
    with pytest.raises(ConfigError) as e:
        config.parse(raw)
    assert e.value.field == field and words in str(e.value) and e.value.fix, str(e.value)


def test_a_missing_config_and_an_unknown_override_are_refused(tmp_path, llama):
    with pytest.raises(ConfigError, match="no such file"):
        config.parse(spec_of(str(tmp_path / "nowhere")))
    raw = spec_of(llama)
    raw["model"]["overrides"] = {"num_hiden_layers": 1}
    with pytest.raises(ConfigError) as e:
        config.parse(raw)
    assert e.value.field == "model.overrides.num_hiden_layers" and "num_hidden_layers" in e.value.fix


def test_a_user_tokenizer_larger_than_the_config_vocabulary_is_refused(tmp_path, llama):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    (tmp_path / "tok").mkdir()
    Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB + 10)}, unk_token="w0")).save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text("w1 w2 w3\n" * 100)
    raw = spec_of(llama)
    raw["data"] = {"name": "text", "path": str(tmp_path / "corpus.txt"), "tokenizer": str(tmp_path / "tok"),
                   "seq_len": SEQ}
    spec = config.parse(raw)
    with pytest.raises(ConfigError) as e:
        config.check_tokenizer_fits(spec)
    assert e.value.field == "data.tokenizer" and f"{VOCAB + 10} tokens" in e.value.problem
    assert "model.overrides.vocab_size" in e.value.fix


def test_a_relative_config_path_reaches_workers_absolute_and_errors_survive_pickling(llama, monkeypatch):
    import pickle
    from pathlib import Path

    monkeypatch.chdir(Path(llama).parent)
    spec = config.parse(spec_of(Path(llama).name))
    assert spec.model.options.config == str(Path(llama).resolve())
    err = pickle.loads(pickle.dumps(ConfigError("model.config", "x", "no such file", "give a path")))
    assert err.field == "model.config" and "fix: give a path" in str(err)


def test_a_sweep_varies_config_fields_and_strategies_of_a_causal_lm(llama):
    from raytrain_par import sweep

    raw = spec_of(llama)
    raw["sweep"] = {"grid": {"model.overrides.num_hidden_layers": [1, 2],
                             "strategy": [{"name": "ddp"}, STRATEGIES["megatron"]]}}
    raw["scaling"]["num_workers"] = 2
    p = sweep.plan(config.parse(raw))
    trials = [p.trial_spec(point) for point in p.points]
    assert sorted((t.model.options.overrides["num_hidden_layers"], t.strategy.name) for t in trials) == [
        (1, "ddp"), (1, "megatron"), (2, "ddp"), (2, "megatron")]
    assert {models.pipeline_layer_count(t.model) for t in trials} == {3, 4}
