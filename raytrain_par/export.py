"""`raytrain-par export RUN_DIR --out DIR`: the plain model of a run's latest checkpoint.

Every checkpoint holds the plain model's weights by name, as the pieces every rank wrote
(strategies/state.py), and the experiment it belongs to (`loop.json`). Export rebuilds that
experiment's model -- the same for every strategy -- reads the weights into it (every key must match)
and writes it in the format its family's users expect:
transformers' `save_pretrained` directory for GPT-2 and causal-lm models (with the run's tokenizer),
a safetensors file and a JSON description for VGG.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import config, data, models
from .data.shards import DatasetInfo
from .errors import UserError
from .strategies import state


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


def export(run_dir: str | Path, out: str | Path, log=print) -> Path:
    checkpoint = latest_checkpoint(Path(run_dir))
    meta = json.loads((checkpoint / "loop.json").read_text())
    spec = config.from_dict(meta["experiment"])
    info = DatasetInfo.from_json(meta["data"]) if "data" in meta else data.shape_of(spec.data)
    model, _ = models.build(spec.model, info, spec.train.seed)
    stored, wanted = state.source(checkpoint), model.state_dict()
    held = state.names_and_shapes(stored)
    missing, unexpected = sorted(set(wanted) - set(held)), sorted(set(held) - set(wanted))
    if missing or unexpected:
        raise UserError(f"{checkpoint} does not fit {spec.model.name}: missing {missing[:5]}, "
                        f"unexpected {unexpected[:5]}.\n  fix: export with the code version that wrote the run")
    model.load_state_dict(state.weights_of(stored, wanted))
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    models.export(model, out, spec, info)
    step = meta["state"]["step"]
    log(f"exported {spec.model.name} ({models.parameter_count(model) / 1e6:.1f}M parameters) from {checkpoint} "
        f"(step {step}, strategy {spec.strategy.name}) to {out}")
    return out
