"""The one checkpoint format's files (strategies/state.py), without a process group: the optimizer states
are written one parameter at a time into a file safetensors reads as its own, and read back by name."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from raytrain_par.strategies import state
from raytrain_par.strategies.weights import WeightsFile, write_weights

STATES = {
    "transformer.wte.weight": {"exp_avg": torch.randn(10, 4), "exp_avg_sq": torch.rand(10, 4),
                               "step": torch.tensor(3.0)},
    "transformer.h.0.ln_1.bias": {"exp_avg": torch.randn(4).to(torch.bfloat16), "step": torch.tensor(3.0)},
    "mask": {"kept": torch.tensor([True, False, True]), "count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
             "empty": torch.zeros(0, 5)},
    "sgd.weight": {"momentum_buffer": torch.randn(2, 2), "lr_seen": 0.5},
}
EXTRAS = {"optimizer": "AdamW", "hyperparameters": [{"lr": 1e-3, "betas": [0.9, 0.999]}],
          "scheduler": {"last_epoch": 3}}


def test_streamed_file_is_safetensors_and_reads_back_by_name(tmp_path):
    state.write(tmp_path, iter(STATES.items()), EXTRAS, step=3)
    on_disk = load_file(str(tmp_path / state.OPTIMIZER_FILE))  # safetensors' own reader, every check it makes
    with safe_open(str(tmp_path / state.OPTIMIZER_FILE), "pt") as f:
        assert f.metadata() is None
    index = json.loads((tmp_path / state.INDEX_FILE).read_text())
    assert index["step"] == 3 and index["optimizer"] == "AdamW" and index["hyperparameters"] == EXTRAS["hyperparameters"]
    assert index["scalars"] == {"sgd.weight/lr_seen": 0.5}
    read, _ = state.read(tmp_path)
    assert sorted(read) == sorted(STATES)
    for name, states in STATES.items():
        for key, value in states.items():
            if isinstance(value, torch.Tensor):
                assert on_disk[f"{name}/{key}"].dtype == value.dtype and torch.equal(on_disk[f"{name}/{key}"], value)
                assert index["tensors"][f"{name}/{key}"] == {"shape": list(value.shape),
                                                              "dtype": str(value.dtype).removeprefix("torch.")}
                assert torch.equal(read[name][key], value), (name, key)
            else:
                assert read[name][key] == value
    assert sorted(p.name for p in tmp_path.iterdir()) == [state.INDEX_FILE, state.OPTIMIZER_FILE]  # no side file


def test_each_parameter_is_written_before_the_next_is_gathered(tmp_path):
    """The rank that writes holds one parameter's whole states at a time: each parameter's bytes are in
    the file being written before the next parameter is asked for."""
    written = []

    def gathered():
        side = tmp_path / (state.OPTIMIZER_FILE + ".part")
        expected = 0
        for name, states in STATES.items():
            assert side.stat().st_size == expected, name
            expected += sum(v.numel() * v.element_size() for v in states.values() if isinstance(v, torch.Tensor))
            written.append(name)
            yield name, states
        yield "not written here", None  # another rank's part: nothing to write

    state.write(tmp_path, gathered(), EXTRAS, step=3)
    assert written == list(STATES)


def test_weights_are_read_one_at_a_time_under_every_name(tmp_path):
    wte = torch.randn(10, 4)
    write_weights({"transformer.wte.weight": wte, "lm_head.weight": wte, "ln.bias": torch.zeros(4)},
                  tmp_path / "model.safetensors")
    weights = WeightsFile(tmp_path / "model.safetensors")
    assert sorted(weights) == ["lm_head.weight", "ln.bias", "transformer.wte.weight"]
    assert torch.equal(weights["lm_head.weight"], wte) and torch.equal(weights["transformer.wte.weight"], wte)
    with pytest.raises(Exception):
        weights["missing"]
