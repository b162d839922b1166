"""The one checkpoint format's files (strategies/state.py), without a process group: each rank's pieces in a
file safetensors reads as its own, beside its part of the index, read back by name under any layout; a
checkpoint of format 1 (every tensor whole, written by rank 0) read as the one-piece case."""

import hashlib
import json

import torch
from safetensors.torch import load_file, save_file

from raytrain_par import checkpoints
from raytrain_par.strategies import state
from raytrain_par.strategies.pieces import Piece

EXTRAS = {"optimizer": "AdamW", "hyperparameters": [{"lr": 1e-3, "betas": [0.9, 0.999]}],
          "scheduler": {"last_epoch": 3}}


def test_each_rank_writes_its_pieces_and_any_layout_reads_them(tmp_path):
    """Two ranks, each holding rows of a weight and of its Adam moment, the step whole (written by one of
    them), a tied name and a state that is a number: read back whole, and as another layout's columns;
    every file is safetensors and its manifest's hash is the one taken while it was written."""
    wte, moment = torch.randn(10, 4), torch.rand(10, 4)
    step = torch.tensor(3.0)
    for rank, rows in enumerate((slice(0, 6), slice(6, 10))):
        piece = Piece.box((10, 4), (rows.start, 0), (rows.stop - rows.start, 4))
        mine = [("transformer.wte.weight", piece, wte[rows]), ("transformer.wte.weight/exp_avg", piece, moment[rows])]
        if rank == 1:
            mine.append(("transformer.wte.weight/step", Piece.whole(()), step))
        part = state.Parts(mine, {"transformer.wte.weight/lr_seen": 0.5}, {"lm_head.weight": "transformer.wte.weight"},
                           EXTRAS if rank == 0 else None)
        written = state.write_parts(tmp_path, part, 3, rank)
        path = tmp_path / f"pieces-rank{rank}.safetensors"
        assert written == {path.name: {"bytes": path.stat().st_size,
                                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}}
        assert sorted(load_file(str(path))) == sorted(f"{name}#0" for name, _, _ in mine)  # safetensors' own reader
        checkpoints.write_manifest(tmp_path, rank, 2, 3, written)
    assert checkpoints.problem(tmp_path) is None  # the hashes taken while writing match the files
    index = state.read_index(tmp_path)
    assert index["format"] == state.FORMAT and index["step"] == 3 and index["hyperparameters"] == EXTRAS["hyperparameters"]
    stored = state.source(tmp_path)
    assert torch.equal(stored.read("transformer.wte.weight"), wte) and torch.equal(stored.read("lm_head.weight"), wte)
    assert state.names_and_shapes(stored) == {"transformer.wte.weight": (10, 4), "lm_head.weight": (10, 4)}
    like = torch.empty(10, 2)  # a rank of another layout: columns 2:4
    states = state.read_states(stored, "transformer.wte.weight", Piece.box((10, 4), (0, 2), (10, 2)), like)
    assert sorted(states) == ["exp_avg", "lr_seen", "step"]
    assert torch.equal(states["exp_avg"], moment[:, 2:]) and states["lr_seen"] == 0.5
    assert torch.equal(states["step"], step)


def test_a_checkpoint_of_format_1_is_read_as_one_piece_per_tensor(tmp_path):
    """model.safetensors (a tied weight as an alias) and optimizer.safetensors, every tensor whole, as rank 0
    wrote them before each rank wrote its own pieces."""
    wte, moment = torch.randn(10, 4), torch.rand(10, 4)
    save_file({"transformer.wte.weight": wte, "ln.bias": torch.zeros(4)}, str(tmp_path / "model.safetensors"),
              metadata={"aliases": json.dumps({"lm_head.weight": "transformer.wte.weight"})})
    save_file({"transformer.wte.weight/exp_avg": moment, "transformer.wte.weight/step": torch.tensor(2.0)},
              str(tmp_path / state.OPTIMIZER_FILE))
    (tmp_path / state.INDEX_FILE).write_text(json.dumps({"format": 1, "step": 2, **EXTRAS, "scalars": {}}))
    stored = state.source(tmp_path)
    assert state.names_and_shapes(stored) == {"transformer.wte.weight": (10, 4), "lm_head.weight": (10, 4),
                                                "ln.bias": (4,)}
    assert torch.equal(stored.read("lm_head.weight"), wte)
    states = state.read_states(stored, "lm_head.weight", Piece.box((10, 4), (5, 0), (5, 4)), torch.empty(5, 4))
    assert torch.equal(states["exp_avg"], moment[5:]) and float(states["step"]) == 2.0
    assert state.read_index(tmp_path)["step"] == 2
