"""The one checkpoint format, under the plain model's parameter names, for every engine.

A checkpoint directory holds, beside the training loop's own state (worker.py: loop.json, each rank's
random state, the manifests):

    model.safetensors       the plain model's weights, gathered (weights.py)
    optimizer.safetensors   every optimizer state tensor of a parameter at the parameter's global shape,
                            under `<parameter name>/<state name>`, e.g. `transformer.h.0.attn.c_attn.weight/exp_avg`
    index.json              format version, step, the optimizer's class and hyper-parameters, the
                            learning-rate schedule's place and the loss scaler's state (numbers), each
                            tensor's shape and dtype

No pickle anywhere: safetensors and JSON. An engine supplies the full, name-keyed view of its
parameters' optimizer states (gathered as its weights are for model.safetensors, one tensor at a time)
and, to resume, its pieces (pieces.py: the part of each named tensor it holds), which `load` fills from
the stored pieces that overlap them (here each file's tensors whole, the one-piece case): so a
checkpoint resumes under any engine, with any options, on any number of workers, and no rank reads more
than its own pieces (anchors: DeepSpeed's universal checkpoints, one "atom" per parameter at its global
shape; torch DCP's re-sharding by global offsets, whose metadata is a pickle this project does not load).

Why not torch.distributed.checkpoint's safetensors storage (`HuggingFaceStorageWriter`) with
`get_state_dict` / `set_state_dict`: those re-shard DTensor states only (FSDP2), not DeepSpeed's flat
partitions, megatron's per-head cut or a pipeline's stages, and the storage writes each rank's shards
to files of their own, to be consolidated before a tensor is whole under its name. So each engine
gathers with its own library's accessors (DTensor's `full_tensor`, DeepSpeed's `safe_get_full_*`),
one tensor at a time, and rank 0 streams them into one file per kind (weights.StreamWriter).

`save` and `load` are an engine's whole part of a checkpoint, as the training loop writes and reads it.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from .dtensor import local_tensor
from .pieces import Piece, Source
from .weights import DTYPES, WEIGHTS_FILE, StreamWriter, WeightsFile, write_weights

OPTIMIZER_FILE = "optimizer.safetensors"
INDEX_FILE = "index.json"
FORMAT = 1


def write(directory: Path, states: Iterable[tuple[str, dict | None]], extras: dict, step: int) -> None:
    """The optimizer states by parameter name (whole tensors) and the index, one parameter at a time as
    `states` gathers them (an entry of None: one this rank does not write)."""
    tensors = StreamWriter(directory / OPTIMIZER_FILE)
    scalars = {}
    for name, held in states:
        for key, v in (held or {}).items():
            if isinstance(v, torch.Tensor):
                tensors.add(f"{name}/{key}", v)
            else:
                scalars[f"{name}/{key}"] = v
    tensors.close()
    index = {"format": FORMAT, "step": step, **extras, "scalars": scalars,
             "tensors": {k: {"shape": e["shape"], "dtype": str(DTYPES[e["dtype"]]).removeprefix("torch.")}
                         for k, e in tensors.entries.items()}}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=1, default=_number))


def read(directory: Path) -> tuple[Mapping[str, dict], dict]:
    """The optimizer states by parameter name (whole tensors, on the CPU, each read from the file when it
    is asked for) and the index."""
    index = read_index(directory)
    return _States(directory / OPTIMIZER_FILE, index.get("scalars", {})), index


def read_index(directory: Path) -> dict:
    index = json.loads((directory / INDEX_FILE).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{directory / INDEX_FILE}: format {index.get('format')!r}, this release reads {FORMAT}")
    return index


def source(directory: Path) -> tuple[Source, dict]:
    """A checkpoint's tensors by name as the pieces it stored them in (pieces.py: each tensor of
    model.safetensors and optimizer.safetensors one whole piece) and its index."""
    directory = Path(directory)
    index = read_index(directory)
    out = Source()
    out.add_whole_file(directory / WEIGHTS_FILE, WeightsFile(directory / WEIGHTS_FILE).aliases)
    out.add_whole_file(directory / OPTIMIZER_FILE)
    out.scalars = dict(index.get("scalars", {}))
    return out, index


def read_states(source: Source, name: str, piece: Piece, like: torch.Tensor) -> dict:
    """Parameter `name`'s optimizer states as this rank holds them, for the parameter `like` (a plain tensor
    or a DTensor) of which it holds `piece`: each tensor state made like the parameter (zeros where the
    piece has no region: a vocabulary's padding rows) and filled from the checkpoint's pieces; a 0-dim
    tensor (the step) whole, on the CPU, as torch's optimizers keep it; numbers as they are. Empty where
    the checkpoint holds none (the optimizer had not stepped)."""
    out = {}
    for key in source.state_keys(name):
        full = f"{name}/{key}"
        if full in source.scalars:
            out[key] = source.scalars[full]
        elif not source.shapes[full]:
            out[key] = source.read(full)
        else:
            dtype = source.dtypes[full]
            t = torch.zeros_like(like, dtype=like.dtype if dtype.is_floating_point else dtype)
            source.read_into(full, piece, local_tensor(t))
            out[key] = t
    return out


class _States(Mapping):
    """A parameter's optimizer states by its name, read from the file when asked for (one parameter's at
    a time, as an engine cuts them)."""

    def __init__(self, path: Path, scalars: dict):
        from safetensors import safe_open

        self.file = safe_open(str(path), "pt")
        self.keys: dict[str, list[str]] = {}
        for key in [*self.file.keys(), *scalars]:
            name, _, state = key.rpartition("/")
            self.keys.setdefault(name, []).append(state)
        self.scalars = scalars

    def __getitem__(self, name: str) -> dict:
        return {k: self.scalars[f"{name}/{k}"] if f"{name}/{k}" in self.scalars else self.file.get_tensor(f"{name}/{k}")
                for k in self.keys[name]}

    def __iter__(self):
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def gathered(optimizer: torch.optim.Optimizer, named, whole, keep: bool) -> Iterator[tuple[str, dict | None]]:
    """The optimizer states of `named` ((plain name, parameter) pairs) whole, by name, one parameter at a
    time: `whole(name, t)` makes one state tensor whole from this rank's piece (collectives: every rank
    calls it, in the same order); each is given where `keep` (the rank that writes it), None elsewhere."""
    return whole_states(((name, optimizer.state.get(p)) for name, p in named), whole, keep)


def whole_states(held: Iterable[tuple[str, dict | None]], whole, keep: bool) -> Iterator[tuple[str, dict | None]]:
    """`gathered` of (plain name, this rank's optimizer states) pairs (the live ones, or a snapshot's copies);
    a parameter without states is left out."""
    for name, state in held:
        if not state:
            continue
        states = {k: whole(name, v).detach().cpu() if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                  for k, v in state.items()}
        yield name, states if keep else None


def old_format(directory: str | Path) -> str | None:
    """Why a checkpoint directory is one this release does not resume (written before its optimizer
    state was kept by parameter name, strategies/state.py), or None."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():  # a file of it missing or cut short: the manifest's to say
        return None
    own = sorted(f.name for f in directory.glob("*.pt") if not f.name.startswith("rng-"))
    held = f" (its state is in files of its strategy's own: {', '.join(own)})" if own else ""
    return (f"{directory} was written by an earlier release: it has no {INDEX_FILE}, so it does not keep "
            f"the optimizer state by parameter name ({OPTIMIZER_FILE}){held}, and this release resumes only "
            "checkpoints that do")


OLD_FORMAT_FIX = ("start a new run without --resume (the earlier results are kept aside), or keep the trained "
                  "weights: `raytrain-par export RUN_DIR --out DIR` writes them (they are in every checkpoint's "
                  "model.safetensors), and `model: {name: causal-lm, pretrained: DIR}` starts a run from them")


def refuse_old_format(directory: str | Path) -> None:
    from ..errors import UserError

    why = old_format(directory)
    if why:
        raise UserError(f"{why}.\n  fix: {OLD_FORMAT_FIX}")


def _number(value):
    """JSON for what a schedule's or scaler's state holds besides numbers: a 0-dim tensor as its number."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


class Parts(NamedTuple):
    """An engine's part of a checkpoint: the plain model's weights and the optimizer states by name (as
    `Engine.plain_weights` and `Engine.optimizer_states` give them) and the index's numbers."""

    weights: Iterable[tuple[str, torch.Tensor | str | None]]
    states: Iterable[tuple[str, dict | None]]
    extras: dict


def parts(engine) -> Parts:
    """The engine's part, gathered one tensor at a time as the files are written (the gathers are
    collectives: every rank goes through them, in the same order)."""
    return Parts(engine.plain_weights(), engine.optimizer_states(), engine.format_extras())


def snapshot(engine, buffers: dict | None = None) -> Parts | Callable[[], Parts]:
    """The engine's part taken now, for a background thread to write while training goes on (every rank
    calls it, at the same point of training). `buffers` (kept by the caller from one snapshot to the
    next): the host tensors of the previous snapshot, copied into again, so that host memory is allocated
    and paged in once per run, as torch DCP's async_save keeps its staging buffers (pinned where the
    tensors come from an accelerator, copied without waiting for each; the snapshot waits for them all
    once, at its end). A snapshot may reuse them only once the previous one has been written.

    Where the engine gathers later (`Engine.gather_later`), each rank copies only its own pieces, and a
    function is returned that makes them whole on the background thread (over process groups of their
    own). Otherwise the engine's gathers run here, on the training thread, and rank 0 holds a copy of
    every whole tensor (one an engine hands over may be the live one, which the next step changes), the
    others nothing."""
    keep, buffers = engine.ctx.rank == 0, {} if buffers is None else buffers
    extras = copy.deepcopy(engine.format_extras()) if keep else {}
    later = engine.gather_later(lambda key, value: _copied(buffers, key, value))
    if later is not None:
        _synchronize(engine)

        def whole() -> Parts:
            weights, states = later()
            return Parts(weights, states, extras)
        return whole

    def host(key, value):
        if not keep or not isinstance(value, torch.Tensor):
            return value if keep else None
        return _copied(buffers, key, value)

    weights = [(name, host(f"weights/{name}", v)) for name, v in engine.plain_weights()]
    states = [(name, {k: host(f"states/{name}/{k}", v) for k, v in held.items()} if keep and held is not None else None)
              for name, held in engine.optimizer_states()]
    _synchronize(engine)
    return Parts(weights, states, extras) if keep else Parts([], [], {})


def _copied(buffers: dict, key: str, value: torch.Tensor) -> torch.Tensor:
    """`value` copied into host memory: into `buffers[key]` where an earlier snapshot left one of its
    shape and dtype (a 0-dim tensor, the step, cloned)."""
    value = value.detach()
    if value.dim() == 0:
        return value.clone().cpu()
    held = buffers.get(key)
    if held is None or held.shape != value.shape or held.dtype != value.dtype:
        held = buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
    return held.copy_(value, non_blocking=value.device.type == "cuda")


def _synchronize(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def write_parts(directory: Path, part: Parts, step: int, writes: bool) -> None:
    """`part` into `directory` where this rank `writes` (rank 0: the weights, the optimizer states, the
    index); elsewhere its iterators are only run through, for the collectives they make. `part` may be a
    snapshot's function that gives it (gathering as its iterators go)."""
    if callable(part):
        part = part()
    if writes:
        write_weights(part.weights, directory / WEIGHTS_FILE)
        write(directory, part.states, part.extras, step)
    else:
        for _ in itertools.chain(part.weights, part.states):
            pass


def save(engine, directory: Path, step: int) -> None:
    """An engine's part of a checkpoint, written now (every rank calls it)."""
    write_parts(directory, parts(engine), step, engine.ctx.rank == 0)


def load(engine, directory: Path) -> None:
    """Resume an engine from a checkpoint directory by name at whole shapes (written by any engine, on
    any number of workers); one written by an earlier release is refused, saying how to continue."""
    refuse_old_format(directory)
    stored, index = source(directory)
    engine.load_pieces(stored)
    engine.load_format_extras(index)
