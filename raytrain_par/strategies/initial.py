"""The weights a run starts from, as a `pieces.Source`: what an engine fills the parts of a model it holds
from, the way it resumes from a checkpoint (`Engine.load_pieces`), so that no rank holds more than its own
pieces plus one tensor.

- Random weights are drawn by name (models/initial.py): each tensor whole, one at a time, on a model of its
  own built on the meta device; a rank copies out its piece.
- Pretrained weights are read from the model's safetensors files, only the slices a rank's pieces need
  (`safe_open(...).get_slice`): one file or Hugging Face's shards with their index.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .. import models
from ..models import initial
from .pieces import Source, Stored
from .weights import DTYPES


class Drawn(Source):
    """A random model's weights, each tensor drawn whole by name when a rank first reads part of it."""

    def __init__(self, template: nn.Module, seed: int):
        super().__init__()
        self.template, self.seed, self.init = template, seed, models.initialiser(template)
        tensors, self.aliases = initial.tensor_names(template)
        for name, t in tensors.items():
            shape = tuple(t.shape)
            self.add(name, shape, t.dtype, Stored(Path(name), name, (0,) * len(shape), shape))
        self._last: tuple[str | None, torch.Tensor | None] = (None, None)

    def where(self, name: str) -> str:
        return "the model's initial weights"

    def whole(self, name: str) -> torch.Tensor:
        """Tensor `name` as drawn (the latest one kept: a rank reads each tensor's regions one after another)."""
        if self._last[0] != name:
            self._last = (None, None)  # the previous one freed before the next is drawn
            self._last = (name, initial.draw(self.template, name, self.seed, self.init))
        return self._last[1]

    def _read(self, s: Stored, lo, hi) -> torch.Tensor:
        return self.whole(s.key)[tuple(slice(a, b) for a, b in zip(lo, hi))]

    def done(self) -> None:
        super().done()
        self._last = (None, None)


def pretrained(template: nn.Module, stored: dict[str, tuple[Path, str]]) -> Source:
    """A pretrained model's files as stored pieces: each of the model's tensors, whole, under the model's name."""
    source = Source()
    for name, (file, key) in stored.items():
        sliced = source._open(file).get_slice(key)  # each file opened once, kept for the reads
        shape = tuple(sliced.get_shape())
        source.add(name, shape, DTYPES[sliced.get_dtype()], Stored(Path(file), key, (0,) * len(shape), shape))
    source.aliases.update(initial.tensor_names(template)[1])
    return source


def initial_weights(spec, info, seed: int) -> Source:
    """What a run of model `spec` (the experiment's `model:`) starts from, for every rank alike."""
    with torch.random.fork_rng(devices=[]):  # (models.build seeds the default generator: left as it was)
        template, _ = models.build(spec, info, seed, on_meta=True)
    stored = models.pretrained_tensors(spec, template)
    return Drawn(template, seed) if stored is None else pretrained(template, stored)
