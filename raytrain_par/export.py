"""`raytrain-par export RUN_DIR --out DIR`: the plain model of a run's latest checkpoint.

Every checkpoint holds the plain model's weights by name, as the pieces every rank wrote
(strategies/state.py), and the experiment it belongs to (`loop.json`). Export rebuilds that
experiment's model on the meta device -- the same for every strategy, its names checked against the
checkpoint's (every key must match) -- and writes it in the format its family's users expect, streaming
the weights one tensor at a time from the checkpoint into Hugging Face's safetensors layout
(`model.safetensors`, or shards of at most `--max-shard-size` with `model.safetensors.index.json`):
transformers' `save_pretrained` directory for GPT-2 and causal-lm models (with the run's tokenizer),
the weights and a JSON description for VGG.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from . import config, data, models
from .data.shards import DatasetInfo
from .errors import UserError
from .models import initial
from .strategies import state
from .strategies.pieces import SafetensorsStream


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint directory of `run_dir` (a results directory, or a checkpoint itself) that
    reached the furthest step."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such directory.\n  fix: give a results directory, e.g. results/<experiment>")
    found = []
    for loop in run_dir.rglob("loop.json"):
        if (loop.parent / state.INDEX_FILE).exists() or (loop.parent / state.WEIGHTS_FILE).exists():
            step = json.loads(loop.read_text())["state"]["step"]
            found.append((step, loop.stat().st_mtime, loop.parent))
    if not found:
        raise UserError(f"{run_dir}: holds no checkpoint with model weights ({state.INDEX_FILE} beside loop.json).\n"
                        "  fix: give the results directory of a run that checkpointed "
                        "(train.checkpoint_every_evals >= 1)")
    return max(found)[2]


def export(run_dir: str | Path, out: str | Path, max_shard_size: int | str = "5GB", log=print) -> Path:
    """Write the plain model of `run_dir`'s latest checkpoint into `out`, one tensor in memory at a time:
    each read from the pieces the ranks wrote and streamed into the files (`write_weights`)."""
    from transformers.utils.hub import convert_file_size_to_int

    checkpoint = latest_checkpoint(Path(run_dir))
    meta = json.loads((checkpoint / "loop.json").read_text())
    spec = config.from_dict(meta["experiment"])
    info = DatasetInfo.from_json(meta["data"]) if "data" in meta else data.shape_of(spec.data)
    try:
        limit = convert_file_size_to_int(max_shard_size)
    except ValueError:
        raise UserError(f"--max-shard-size {max_shard_size!r}: not a size.\n  fix: give bytes or e.g. 5GB, 500MB") from None
    model, _ = models.build(spec.model, info, spec.train.seed, on_meta=True)  # names, shapes and config only
    stored, wanted = state.source(checkpoint), model.state_dict()
    held = state.names_and_shapes(stored)
    missing, unexpected = sorted(set(wanted) - set(held)), sorted(set(held) - set(wanted))
    if missing or unexpected:
        raise UserError(f"{checkpoint} does not fit {spec.model.name}: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}.\n  fix: export with the code version that wrote the run")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors, _ = initial.tensor_names(model)  # a tied tensor once, as save_pretrained keeps it
    entries = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    models.export(model, out, spec, info, lambda: write_weights(out, entries, stored.read, limit))
    stored.done()
    step = meta["state"]["step"]
    log(f"exported {spec.model.name} ({models.parameter_count(model) / 1e6:.1f}M parameters) from {checkpoint} "
        f"(step {step}, strategy {spec.strategy.name}) to {out}")
    return out


def write_weights(out: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                  read: Callable[[str], torch.Tensor], max_shard_bytes: int) -> list[Path]:
    """The tensors `entries` (name, shape, dtype) in Hugging Face's layout: `model.safetensors`, or, beyond
    `max_shard_bytes`, files of at most that size (a larger tensor alone in its own) named
    `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json` mapping each name to its file, as
    `save_pretrained` writes them. Each tensor is read (`read(name)`) when its turn comes, cast to its dtype,
    written and let go: one tensor in memory at a time."""
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        stream = SafetensorsStream(out / file, shard, metadata={"format": "pt"})
        for name, _, dtype in shard:
            stream.add(name, read(name).to(dtype))
            weight_map[name] = file
        total += stream.close()["bytes"]
    index = out / "model.safetensors.index.json"
    if len(shards) > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    elif index.exists():  # an earlier export's, into the same directory
        index.unlink()
    return [out / f for f in names]
