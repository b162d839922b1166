"""The one checkpoint format, under the plain model's parameter names, for every engine.

A checkpoint directory holds, beside the training loop's own state (worker.py: loop.json, each rank's
random state, the manifests), what every rank wrote of the model at once, each its own pieces
(pieces.py: the part of each named tensor a rank holds):

    pieces-rank<r>.safetensors  rank r's pieces: the plain model's weights under their names and each
                                parameter's optimizer states under `<parameter name>/<state name>` (e.g.
                                `transformer.h.0.attn.c_attn.weight/exp_avg`), a region of a tensor an entry
                                `<name>#<k>`; a tensor that several ranks hold alike (replicated) written by
                                one of them, its owners spread over the ranks
    pieces-rank<r>.json         rank r's part of the index: each tensor's global shape and dtype and the box
                                of it each entry is, the states that are numbers, the names a tensor is tied
                                under
    index.json                  (rank 0) format version, step, the optimizer's class and hyper-parameters,
                                the learning-rate schedule's place and the loss scaler's state

No rank gathers anything, and each byte is written once (pieces.PieceWriter: its hash taken as it is
written, for the manifest). No pickle anywhere: safetensors and JSON. To resume, each engine's pieces
are filled from the stored pieces that overlap them (pieces.Source), so a checkpoint resumes under any
engine, with any options, on any number of workers, and no rank reads more than its own pieces (anchors:
torch DCP, every rank writing its shards with their global offsets and reading only the pieces it needs;
DeepSpeed's universal checkpoints, one "atom" per parameter at its global shape; Megatron-Core's
`dist_checkpointing`). Checkpoints of format 1 (`model.safetensors` and `optimizer.safetensors`, every
tensor whole, written by rank 0) are read as the one-piece case.

Why not torch.distributed.checkpoint's safetensors storage (`HuggingFaceStorageWriter`) with
`get_state_dict` / `set_state_dict`: those re-shard DTensor states only (FSDP2), not DeepSpeed's flat
partitions, megatron's per-head cut or a pipeline's stages, and DCP's own metadata is a pickle, which this
project does not load.

`save`, `snapshot` + `write_parts` and `load` are an engine's whole part of a checkpoint, as the training
loop writes and reads it.
"""

from __future__ import annotations

import copy
import json
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from .dtensor import local_tensor
from .pieces import PIECES_INDEX, Piece, PieceWriter, Source, read_pieces
from .weights import WEIGHTS_FILE

OPTIMIZER_FILE = "optimizer.safetensors"  # format 1's
INDEX_FILE = "index.json"
FORMAT = 2
READS = (1, 2)


def read_index(directory: Path) -> dict:
    index = json.loads((Path(directory) / INDEX_FILE).read_text())
    if index.get("format") not in READS:
        raise ValueError(f"{Path(directory) / INDEX_FILE}: format {index.get('format')!r}, this release reads "
                         f"{' and '.join(map(str, READS))}")
    return index


def source(directory: Path) -> Source:
    """A checkpoint's tensors by name as the pieces it stored them in (every rank's pieces; format 1's
    model.safetensors and optimizer.safetensors, each tensor one whole piece), checked before anything is
    read (pieces.read_pieces)."""
    directory = Path(directory)
    if any(directory.glob(PIECES_INDEX.format(rank="*"))):
        return read_pieces(directory)
    out = Source()
    out.add_whole_file(directory / WEIGHTS_FILE)
    if (directory / OPTIMIZER_FILE).is_file():
        out.add_whole_file(directory / OPTIMIZER_FILE)
    if (directory / INDEX_FILE).is_file():
        out.scalars.update(read_index(directory).get("scalars", {}))
    return out


def read_states(source: Source, name: str, piece: Piece, like: torch.Tensor) -> dict:
    """Parameter `name`'s (or the parameter's it is tied to) optimizer states as this rank holds them, for the parameter `like` (a plain tensor
    or a DTensor) of which it holds `piece`: each tensor state made like the parameter (zeros where the
    piece has no region: a vocabulary's padding rows) and filled from the checkpoint's pieces; a 0-dim
    tensor (the step) whole, on the CPU, as torch's optimizers keep it; numbers as they are. Empty where
    the checkpoint holds none (the optimizer had not stepped)."""
    out, name = {}, source.original(name)
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


def old_format(directory: str | Path) -> str | None:
    """Why a checkpoint directory is one this release does not resume (written before its optimizer
    state was kept by parameter name, strategies/state.py), or None."""
    directory = Path(directory)
    if (directory / INDEX_FILE).is_file():  # a file of it missing or cut short: the manifest's to say
        return None
    own = sorted(f.name for f in directory.glob("*.pt") if not f.name.startswith("rng-"))
    held = f" (its state is in files of its strategy's own: {', '.join(own)})" if own else ""
    return (f"{directory} was written by an earlier release: it has no {INDEX_FILE}, so it does not keep "
            f"the optimizer state by parameter name{held}, and this release resumes only checkpoints that do")


OLD_FORMAT_FIX = ("start a new run without --resume (the earlier results are kept aside), or keep the trained "
                  "weights: `raytrain-par export RUN_DIR --out DIR` writes them (they are in every checkpoint), "
                  "and `model: {name: causal-lm, pretrained: DIR}` starts a run from them")


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
    """A rank's part of a checkpoint: the pieces it writes ((name, piece, tensor), the tensors live or a
    snapshot's copies), the states that are numbers, the names tied to another, and (rank 0) the index's
    numbers."""

    pieces: list[tuple[str, Piece, torch.Tensor]]
    scalars: dict
    aliases: dict[str, str]
    extras: dict | None


def parts(engine) -> Parts:
    """The pieces this rank writes (of those it holds, `Engine.saved_pieces`, the ones no other rank
    writes; a collective of their names: every rank calls it, at the same point of training)."""
    held, scalars = [], {}
    for name, piece, value in engine.saved_pieces():
        if isinstance(value, torch.Tensor):
            held.append((name, piece, value))
        else:
            scalars[name] = value
    rank = engine.ctx.rank
    mine = [entry for entry, keep in zip(held, _owned(engine, held)) if keep]
    extras = engine.format_extras() if rank == 0 else None
    return Parts(mine, scalars, engine.aliases(), extras)


def _owned(engine, held: list[tuple[str, Piece, torch.Tensor]]) -> list[bool]:
    """Which of this rank's pieces it writes: a piece that several ranks hold alike (the same regions of the
    same tensor: replicated over data-parallel replicas, or over the tensor ranks) is written by one of
    them, chosen by its name so that the writes spread over the ranks; every other piece by its holder.
    One gather of every rank's pieces' names and boxes (a group of its own, on the host: a pipeline's
    sends may be in flight on the training group)."""
    world = engine.ctx.world_size
    if world == 1 or not dist.is_initialized():
        return [True] * len(held)
    mine = [(name, tuple((r.start, r.size) for r in piece.regions)) for name, piece, _ in held]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=engine.placement.group_of_all(tag="checkpoint", backend="gloo"))
    holders: dict[tuple, list[int]] = {}
    for rank, pieces in enumerate(everyone):
        for key in pieces:
            holders.setdefault(key, []).append(rank)
    return [holders[key][zlib.crc32(key[0].encode()) % len(holders[key])] == engine.ctx.rank for key in mine]


def snapshot(engine, buffers: dict | None = None) -> Parts:
    """The rank's part taken now, for a background thread to write while training goes on (every rank calls
    it, at the same point of training): a host copy of each piece it writes, nothing gathered. `buffers`
    (kept by the caller from one snapshot to the next): the host tensors of the previous snapshot, copied
    into again, so that host memory is allocated and paged in once per run, as torch DCP's async_save keeps
    its staging buffers (pinned where the tensors come from an accelerator, copied without waiting for
    each; the snapshot waits for them all once, at its end). A snapshot may reuse them only once the
    previous one has been written."""
    buffers = {} if buffers is None else buffers
    part = parts(engine)
    pieces = [(name, piece, _copied(buffers, name, value)) for name, piece, value in part.pieces]
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return Parts(pieces, copy.deepcopy(part.scalars), dict(part.aliases), copy.deepcopy(part.extras))


def stage_buffers(engine, buffers: dict) -> threading.Thread:
    """The host memory of this rank's snapshots, allocated and paged in on a background thread ahead of the
    first one (every rank calls it, at the same point of training, once the optimizer holds its states), so
    that the first async save, like the later ones, costs the training thread a copy only. `snapshot` may
    use `buffers` once the returned thread has ended."""
    wanted = [(name, tuple(local_tensor(value).shape), value.dtype, value.device.type == "cuda")
              for name, _, value in parts(engine).pieces if value.dim() > 0]

    def allocate():
        for name, shape, dtype, pin in wanted:
            if name not in buffers:
                buffers[name] = torch.zeros(shape, dtype=dtype, pin_memory=pin)  # written: its pages are in

    thread = threading.Thread(target=allocate, name="checkpoint-buffers", daemon=True)
    thread.start()
    return thread


def _copied(buffers: dict, key: str, value: torch.Tensor) -> torch.Tensor:
    """`value` (a piece's tensor) copied into host memory: into `buffers[key]` where an earlier snapshot left
    one of its shape and dtype (a 0-dim tensor, the step, cloned)."""
    value = local_tensor(value).detach()
    if value.dim() == 0:
        return value.clone().cpu()
    held = buffers.get(key)
    if held is None or held.shape != value.shape or held.dtype != value.dtype:
        held = buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
    return held.copy_(value, non_blocking=value.device.type == "cuda")


def write_parts(directory: Path, part: Parts, step: int, rank: int) -> dict[str, dict]:
    """This rank's part into `directory` (rank 0 also the index); the size and SHA-256 of each file written,
    taken as it was written."""
    writer = PieceWriter(directory, rank, [(name, piece, value.dtype) for name, piece, value in part.pieces])
    for name, piece, value in part.pieces:
        writer.add(name, piece, value)
    written = {writer.path.name: writer.close(part.scalars, part.aliases)}
    if part.extras is not None:
        index = {"format": FORMAT, "step": step, **part.extras}
        (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=1, default=_number))
    return written


def save(engine, directory: Path, step: int) -> dict[str, dict]:
    """An engine's part of a checkpoint, written now (every rank calls it)."""
    return write_parts(directory, parts(engine), step, engine.ctx.rank)


def load(engine, directory: Path) -> None:
    """Resume an engine from a checkpoint directory (written by any engine, on any number of workers): each
    of its pieces read from the stored pieces that overlap it; one written by an earlier release is
    refused, saying how to continue."""
    refuse_old_format(directory)
    engine.load_pieces(source(directory))
    engine.load_format_extras(read_index(directory))


def names_and_shapes(stored: Source) -> dict[str, tuple[int, ...]]:
    """The plain model's tensors a checkpoint (`source`) holds (its weights, not optimizer states), with
    their shapes, a tied name with its original's: from the files' headers and the index, nothing read."""
    shapes = {n: s for n, s in stored.shapes.items() if "/" not in n}
    return {**shapes, **{a: shapes[o] for a, o in stored.aliases.items() if o in shapes}}


def weights_of(stored: Source, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The plain model's weights of a checkpoint (`source`), whole, by name (`names`: these only)."""
    return {name: stored.read(name) for name in (names_and_shapes(stored) if names is None else names)}
