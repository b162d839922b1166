"""Per-worker memory predicted before anything runs (`raytrain-par estimate`).

For each strategy and worker count: the model's parameters (counted on torch's meta device, so any
size costs milliseconds), its model-state bytes per worker -- the textbook figure and what the
implementation is expected to hold (DeepSpeed's fp32 master copy, buckets; see each engine's
`model_state_bytes`) -- and the activations one micro-batch keeps for the backward pass, found by
running the forward pass on fake tensors and adding up what autograd saves (with the experiment's
activation checkpointing: the checkpointed modules' inputs instead of their intermediates). Sharded strategies
(zero-3, fsdp) also hold whole parameters of the unit being computed and the one prefetched.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from . import config, data, models, strategies
from .errors import ConfigError, UserError
from .metrics.memory import StateBytes, optimizer_state_bytes, size_text
from .strategies.context import DTYPES
from .tables import text_table

UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_size(text: str) -> int:
    """'80GiB', '80 GB', '512MiB' -> bytes (GB read as GiB, as GPU makers count)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"--device-memory {text!r}: not a size.\n  fix: write e.g. 80GiB, 40GB or 16384MiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


@dataclass
class Row:
    strategy: str
    workers: int
    params: int
    theory: float  # model-state bytes per worker, textbook
    expected: float  # model-state bytes per worker this implementation holds
    offloaded: float  # of which in host memory
    activations: float  # saved for the backward pass of one micro-batch
    gathered: float  # whole parameters of the units being computed (zero-3, fsdp)
    note: str = ""  # why the layout cannot exist: the row has no figures
    remark: str = ""  # how the row was estimated where that differs from the experiment
    speed: object = None  # metrics/steptime.StepTime on the device asked for (`estimate(..., device=)`)
    host_build: float = 0.0  # host memory to build and fill a worker's model beyond its share: one whole tensor
    host_save: float = 0.0  # host memory of an async save's snapshot: the pieces the worker writes
    tokens_per_row: int = 1  # a sample's tokens (text), else 1: what throughput counts
    spec: object = None  # the experiment this row stands for (its strategy and worker count)

    @property
    def device_bytes(self) -> float:
        return self.expected - self.offloaded + self.activations + self.gathered


def activation_bytes(model_spec, info, rows: int, precision: str, checkpointing: str = "none",
                     strategy=None) -> int:
    """Bytes autograd saves for the backward pass of `rows` rows: the model's forward pass on fake
    tensors (shapes and dtypes, no memory). Fake CPU tensors take the same attention kernels as real
    ones (fused scaled-dot-product attention keeps no seq x seq matrices), unlike the meta device.
    With activation checkpointing (train.activation_checkpointing) the checkpointed modules save
    their inputs only, through the same hooks, and that is what is counted. `strategy` (a StrategySpec)
    counts what one of its workers saves, for engines that split the model themselves (megatron)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: dict[int, int] = {}
    with FakeTensorMode():
        model, task = models.build(model_spec, info, seed=0)
        models.checkpoint_activations(model, checkpointing)
        engine = strategies.engine_class(strategy.name, strategy.options) if strategy else strategies.engine_class("ddp")
        loss, held = engine.estimate_inputs(model, task, strategy.options if strategy else None)
        params = {p.untyped_storage()._cdata for p in held}

        def pack(t):
            s = t.untyped_storage()
            if s._cdata not in params:
                saved[s._cdata] = s.nbytes()
            return t

        batch = _fake_batch(info, rows)
        # 16-bit compute, as autocast (ddp) or 16-bit parameters (zero-N, fsdp) give
        mixed = torch.autocast("cpu", dtype=DTYPES[precision]) if precision != "fp32" else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
            loss(task.prepare(batch, torch.device("cpu")))
    return sum(saved.values())


@dataclass
class RankEstimate:
    """What one pipeline rank is predicted to hold."""

    states: StateBytes
    activations: float
    gathered: float
    params: int = 0  # of its stages (several where interleaved)

    @property
    def device_bytes(self) -> float:
        return self.states.expected - self.states.offloaded + self.activations + self.gathered


def _stage_activations(s: config.ExperimentSpec, info, cls, ranges, outputs,
                       rows: int) -> tuple[dict[int, float], float]:
    """Bytes autograd saves in each stage for one microbatch of `rows` rows, and of those the bytes the
    last stage's loss saves (above the stage's own graph: a split backward's input half frees them).
    The stages' layers run one after the other on fake tensors (as `activation_bytes`), each storage
    counted in the stage that saves it first; between stages the output is copied into a tensor of its
    own, as the receiving stage's buffer is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved: dict[int, float] = dict.fromkeys(range(len(ranges) + 1), 0.0)  # the last key: the loss
    seen: set[int] = set()
    stage = 0
    with FakeTensorMode():
        model, task = models.build(s.model, info, seed=0)
        models.checkpoint_activations(model, s.train.activation_checkpointing)
        layers, loss = cls.estimate_stage_inputs(model, task, s.strategy.options)
        seen.update(p.untyped_storage()._cdata for p in model.parameters())

        kept = []  # every saved tensor alive to the end: a freed storage's key could be handed to a new one

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                saved[stage] += t.untyped_storage().nbytes()
            kept.append(t)
            return t

        prepared = task.prepare(_fake_batch(info, rows), torch.device("cpu"))
        x = prepared[task.input_key]
        mixed = (torch.autocast("cpu", dtype=DTYPES[s.train.precision]) if s.train.precision != "fp32"
                 else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
            for stage, (a, b) in enumerate(ranges):
                if stage:
                    x = x.detach().clone().requires_grad_(x.is_floating_point())
                for layer in layers[a:b]:
                    x = layer(x)
                x = x.to(outputs[stage][1]) if x.is_floating_point() else x
            stage = len(ranges)
            loss(x, prepared[task.label_key])
    lost = saved.pop(len(ranges))
    saved[len(ranges) - 1] += lost
    return saved, lost


def pipeline_ranks(s: config.ExperimentSpec, info) -> list[RankEstimate]:
    """Per pipeline rank, what a worker of a pipeline engine holds (`Engine.estimate_pipeline`): the
    model split into stages as the engine splits it (the split measured on the plain model), each
    stage's parameters and the activations one microbatch saves in it, then the engine's schedule says
    how many microbatches each rank keeps in flight. Under mixed precision, what one microbatch saves
    is told apart from what a step saves once (autocast's 16-bit weight copies) by counting two sizes
    of microbatch: the saved bytes grow linearly in the rows."""
    cls, pipe, ranges, outputs, params = _stages(s, info)
    rows = max(1, s.per_worker_batch // s.train.gradient_accumulation_steps // pipe.num_microbatches)
    one, loss_one = _stage_activations(s, info, cls, ranges, outputs, rows)
    if s.train.precision == "fp32":
        micro, fixed, loss = one, dict.fromkeys(one, 0.0), loss_one
    else:
        two, loss_two = _stage_activations(s, info, cls, ranges, outputs, 2 * rows)
        micro = {i: two[i] - one[i] for i in one}
        fixed = {i: max(0.0, 2 * one[i] - two[i]) for i in one}
        loss = loss_two - loss_one
    of = getattr(pipe, "stages_of", lambda rank: [rank])  # a rank's stages (several where interleaved)
    return [RankEstimate(*cls.estimate_rank(pipe, s.train, s.layout.data, p, params, micro, fixed, loss),
                         params=sum(params[i] for i in of(p)))
            for p in range(pipe.stages)]


def saved_bytes(s: config.ExperimentSpec, held: int) -> float:
    """What one worker writes of a checkpoint, and so what an async save copies to its host memory (its
    snapshot, strategies/state.py): the fp32 weight and optimizer states of each parameter it holds (`held`:
    its tensor-parallel shard or its pipeline stage; the whole model otherwise), divided among the
    data-parallel ranks, which shard them (fsdp, zero-3; zero-1/2's states) or, holding them alike,
    write each tensor once, spread by name (a replicated tensor is written by one rank: the share is an
    average there, uneven by whole tensors)."""
    return (4 + optimizer_state_bytes(s.train)) * held / s.layout.data


def _stages(s: config.ExperimentSpec, info):
    """The pipeline engine's class and options, the model's stages as it splits them (layer ranges, and the
    outputs of the split model) and each stage's parameter count (the later stage's copy of a tied weight
    counted there)."""
    from .strategies.stages import split_model

    cls, pipe = strategies.engine_class(s.strategy.name, s.strategy.options).estimate_pipeline(s.strategy.options)
    _, ranges, outputs = split_model(models.build_on_meta(s.model, info)[0], pipe.stages * pipe.stages_per_worker,
                                     pipe.split_points, pipe.balance)
    layers, _ = cls.estimate_stage_inputs(*models.build_on_meta(s.model, info), s.strategy.options)
    params = {i: models.parameter_count_of(p for layer in layers[a:b] for p in layer.parameters())
              for i, (a, b) in enumerate(ranges)}
    return cls, pipe, ranges, outputs, params


def _fake_batch(info, rows: int) -> dict[str, torch.Tensor]:
    if info.kind == "text":
        return {"tokens": torch.zeros(rows, info.seq_len + 1, dtype=torch.int32)}
    return {"image": torch.zeros(rows, *info.image_shape, dtype=torch.uint8),
            "label": torch.zeros(rows, dtype=torch.int64)}


def largest_unit_bytes(model: torch.nn.Module, precision: str) -> int:
    from .strategies.fsdp import shard_units

    width = 4 if precision == "fp32" else 2
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in shard_units(model)] or [0]
    return max(sizes) * width


def estimate(spec: config.ExperimentSpec, names: Iterable[str], workers: Iterable[int], device=None) -> list[Row]:
    """A row per strategy and worker count: memory per worker, and with `device` (devices.Device) the
    step's time on it (`step_time`)."""
    rows = _memory(spec, names, workers)
    if device is not None:
        for r in rows:
            if not r.note:
                _add_speed(r, device)
    return rows


def _memory(spec: config.ExperimentSpec, names: Iterable[str], workers: Iterable[int]) -> list[Row]:
    info = data.shape_of(spec.data)
    model, _ = models.build_on_meta(spec.model, info)
    n = models.parameter_count(model)
    unit = largest_unit_bytes(model, spec.train.precision)
    largest = 4 * max((p.numel() for p in model.parameters()), default=0)  # drawn whole, in fp32
    act_cache: dict[tuple[int, int], int] = {}
    # the options a sweep gives a strategy (e.g. megatron's tensor_parallel), else its defaults
    swept = {s["name"]: s for s in (spec.sweep or {}).get("grid", {}).get("strategy", [])
             if isinstance(s, dict) and "name" in s}
    rows = []
    for name in names:
        for w in workers:
            raw = spec.to_dict()
            raw["sweep"] = None
            raw["scaling"]["num_workers"] = w
            remarks = []
            if name != spec.strategy.name:
                raw["strategy"] = dict(swept.get(name, {"name": name}))
                if name == "megatron" and "tensor_parallel" not in raw["strategy"]:
                    # megatron has no default degree: every worker in the tensor-parallel group
                    raw["strategy"]["tensor_parallel"] = w
                    remarks.append(f"strategy.tensor_parallel = {w}")
            try:
                s = _parse_for_memory(raw, remarks)
            except ConfigError as e:
                rows.append(Row(name, w, n, 0, 0, 0, 0, 0, note=f"not possible: {e.field} ({e.problem})"))
                continue
            remark = "; ".join(remarks)
            cls = strategies.engine_class(name, s.strategy.options)
            if cls.estimate_pipeline(s.strategy.options) is not None:
                # the pipeline rank that holds the most, of its model states and activations together
                ranks = pipeline_ranks(s, info)
                r = max(ranks, key=lambda r: r.device_bytes)
                rows.append(Row(name, w, n, r.states.theory, r.states.expected, r.states.offloaded, r.activations,
                                r.gathered, remark=remark, spec=s, host_build=largest,
                                host_save=saved_bytes(s, max(r.params for r in ranks))))
                continue
            # one worker's parameters before data-parallel sharding (its tensor-parallel shard)
            local = models.parameter_count_of(cls.estimate_inputs(*models.build_on_meta(spec.model, info),
                                                                  s.strategy.options)[1])
            est = cls.model_state_bytes(s.strategy.options, s.train, s.layout.data, local)
            if est is None:
                rows.append(Row(name, w, n, 0, 0, 0, 0, 0, note="this strategy gives no estimate"))
                continue
            micro = s.per_worker_batch // s.train.gradient_accumulation_steps
            key = (micro, local)  # engines that split the model save less per worker
            if key not in act_cache:
                act_cache[key] = activation_bytes(spec.model, info, micro, s.train.precision,
                                                  s.train.activation_checkpointing, s.strategy)
            gathered = 2 * unit if name in ("zero-3", "fsdp") and s.layout.data > 1 else 0
            rows.append(Row(name, w, n, est.theory, est.expected, est.offloaded, act_cache[key], gathered,
                            remark=remark, spec=s, host_build=largest, host_save=saved_bytes(s, local)))
    return rows


def step_time(s: config.ExperimentSpec, device):
    """One step of `s` on `device` (metrics/steptime.py): the layout's collectives as our engines run
    them, costed on the device's links, its FLOPs at the device's achievable rate."""
    return StepParts.of(s).on(device)


@dataclass
class StepParts:
    """What a step's prediction is made of before a device costs it: each pipeline rank's collectives
    (seconds to derive for a model of many ranks) and the FLOPs; `on(device)` is cheap."""

    spec: config.ExperimentSpec
    by_rank: list
    flops: float
    recomputed: float = 0.0  # FLOPs activation checkpointing runs again (metrics/flops.py counts them)

    @classmethod
    def of(cls, s: config.ExperimentSpec) -> "StepParts":
        from .metrics import flops
        from .metrics.steptime import rank_collectives
        from .strategies.zero import ZeroEngine, deepspeed_config, merged

        info = data.shape_of(s.data)
        model, _ = models.build_on_meta(s.model, info)
        options = s.strategy.options
        engine = strategies.engine_class(s.strategy.name, options)
        layout = s.layout
        zero = None
        if issubclass(engine, ZeroEngine):
            zero = merged(deepspeed_config(int(layout.sharding[-1]), options, s.train, s.train.global_batch_size,
                                           layout.data, models.parameter_count(model), "cuda"),
                          getattr(options, "deepspeed", None) or {})["zero_optimization"]
        total = flops.model_flops_per_step(s.model, info, s.train.global_batch_size)
        by_rank = rank_collectives(layout, model, collective_step(s), zero, getattr(options, "split_points", None),
                                   getattr(options, "balance", "flops"))
        recomputed = flops.recomputed_flops_per_sample(s.model, info, s.train.activation_checkpointing)
        return cls(s, by_rank, total, recomputed * s.train.global_batch_size)

    def on(self, device):
        from .metrics.steptime import timed

        s = self.spec
        return timed(s.layout, self.by_rank, self.flops, device, s.train.precision, self.recomputed)


def collective_step(s: config.ExperimentSpec):
    """What the collectives of one step of `s` depend on (metrics/comm.py Step): its rows, accumulation,
    clipping, whether its engine measures the noise scale, and the widths its engine sends. Under 16-bit
    precision DeepSpeed holds 16-bit parameters and gradients; FSDP's mixed-precision policy gathers
    16-bit parameters and reduces fp32 gradients; the other engines keep fp32 parameters under autocast
    and reduce fp32 gradients; every engine's matmuls output 16 bits."""
    from .metrics.comm import Step
    from .strategies.fsdp import FSDPEngine
    from .strategies.zero import ZeroEngine

    cls = strategies.engine_class(s.strategy.name, s.strategy.options)
    half = s.train.precision != "fp32"
    return Step(rows=s.train.global_batch_size, accumulation=s.train.gradient_accumulation_steps,
                dtype_bytes=2 if half and issubclass(cls, ZeroEngine) else 4, compute_bytes=2 if half else 4,
                gather_bytes=2 if half and issubclass(cls, FSDPEngine) else None,
                measures_noise=cls.measures_noise_scale(s.strategy.options, s.train, s.layout),
                grad_clip=s.train.grad_clip > 0)


def _add_speed(r: Row, device) -> None:
    r.speed = step_time(r.spec, device)
    info = data.shape_of(r.spec.data)
    r.tokens_per_row = info.seq_len if info.kind == "text" else 1


#: share of a device's memory the model states, activations and gathered units may take: the rest is
#: left to the CUDA context, the allocator's fragmentation and communication buffers
HEADROOM = 0.85


def rows_that_fit(spec: config.ExperimentSpec, device_memory: int) -> int | None:
    """The most rows one data-parallel replica of `spec` can compute at once (one accumulation step) within
    HEADROOM of `device_memory`: the model states and gathered units it holds whatever the rows, and the
    activations, which grow in proportion to the rows (estimated at the experiment's own). None where
    `estimate` cannot say."""
    row = estimate(spec, [spec.strategy.name], [spec.scaling.num_workers])[0]
    micro = spec.per_worker_batch // spec.train.gradient_accumulation_steps
    if row.note or not row.activations:
        return None
    free = HEADROOM * device_memory - (row.expected - row.offloaded) - row.gathered
    return max(1, int(free // (row.activations / micro)))


# -- time and cost to the target ----------------------------------------------------------------------

@dataclass(frozen=True)
class ToTarget:
    """What `estimate --records DIR` adds: the steps to the experiment's target at its global batch, from a
    reference run's noise scale (metrics/goodput.py: S = S_min (1 + B_noise / M)), and the price of a GPU-hour."""

    reference: object  # metrics.goodput.Reference
    source: str  # the records it was fitted from
    usd_per_gpu_hour: float | None = None


def reference_records(path: str) -> tuple[list[dict], str]:
    """The records of one run: DIR/metrics.parquet, or a plan's reference (DIR/plan/reference/)."""
    from pathlib import Path

    from .metrics.records import read_records

    root = Path(path)
    for candidate in (root / "metrics.parquet", root / "plan" / "reference" / "metrics.parquet"):
        if candidate.is_file():
            try:
                return read_records(candidate), str(candidate)
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise UserError(f"--records {path}: {candidate} is not a records file raytrain-par can read "
                                f"({type(e).__name__}: {e}).\n  fix: give the directory of a finished run") from None
    raise UserError(f"--records {path}: no metrics.parquet there, nor a plan's reference under plan/reference/.\n"
                    "  fix: give the directory of a run that reached the target (results/<experiment>, written by "
                    "`raytrain-par run`) or of a plan (`raytrain-par plan` writes its reference there)")


def to_target(spec: config.ExperimentSpec, path: str, usd_per_gpu_hour: float | None = None) -> ToTarget:
    """Fit the reference (S_min, B_noise) to the records under `path`, after checking that they are one
    run of this experiment's model and data, measured the noise scale and reached `spec.target`."""
    from .metrics import flops
    from .metrics.goodput import fit_reference

    if spec.target is None:
        raise UserError(f"--records {path}: {spec.name} has no target to predict the time to.\n  fix: add "
                        "`target: {metric: val_loss, value: 4.5}` (or val_perplexity, val_accuracy) to the experiment")
    records, source = reference_records(path)
    trials = sorted({str(r.get("trial")) for r in records})
    if len(trials) > 1:
        raise UserError(f"--records {path}: {source} holds {len(trials)} runs ({', '.join(trials[:4])}"
                        f"{', ...' if len(trials) > 4 else ''}).\n  fix: give one run's directory")
    metric = spec.target.metric
    if not any(r.get(metric) is not None for r in records):
        raise UserError(f"--records {path}: no {metric} in {source} (the target's metric).\n  fix: records of a "
                        "run that evaluates it (train.eval_every), or a target on a metric it has")
    info = data.shape_of(spec.data)
    mine = flops.model_flops_per_step(spec.model, info, 1)
    theirs = [r["model_flops_per_step"] / r["global_batch_size"] for r in records
              if r.get("model_flops_per_step") and r.get("global_batch_size")]
    if theirs and abs(theirs[-1] / mine - 1) > 0.01:
        raise UserError(f"--records {path}: those records are of another model or sequence length "
                        f"({theirs[-1]:.4g} FLOPs per sample; {spec.name}'s {spec.model.name} on {spec.data.name} "
                        f"takes {mine:.4g}).\n  fix: records of a run of this experiment's model and data")
    if not any(r.get("grad_noise_scale") for r in records):
        last = records[-1]
        raise UserError(f"--records {path}: the run did not measure the gradient noise scale ({last.get('strategy')} "
                        f"on {last.get('num_workers')} worker(s)), which the steps at other batches come from.\n  fix: "
                        "records of a run with two data-parallel replicas or more (ddp, fsdp, zero-1/2/3; not "
                        "pipedream, nor fp16), e.g. `raytrain-par run X.yaml --set scaling.num_workers=2`, or a "
                        "`raytrain-par plan` directory")
    try:
        reference = fit_reference(records, metric, spec.target.value, spec.target.mode)
    except ValueError as e:
        raise UserError(f"--records {path}: {e}.\n  fix: records of a run that measured it every evaluation") from None
    if reference is None:
        best = [r[metric] for r in records if r.get(metric) is not None]
        raise UserError(f"--records {path}: the run never reached {spec.target} (best {metric} "
                        f"{(max if spec.target.mode == 'max' else min)(best):.4g} in {records[-1]['step']} steps).\n"
                        "  fix: records of a run trained to the target (raise train.max_steps), or an easier target")
    return ToTarget(reference, source, usd_per_gpu_hour)


#: why an asynchronous pipeline's row has no time to the target
STALE = ("PipeDream's stale weights change the steps to the target (the study's finding), which a synchronous "
         "reference's noise scale does not predict")


def target_document(r: Row, target: ToTarget | None) -> dict:
    """The time-to-target columns of a row: the steps at the row's global batch, times its predicted step."""
    keys = ("steps_to_target", "time_to_target_s", "gpu_hours_to_target", "cost_to_target_usd")
    if target is None or r.note or r.speed is None or r.spec.layout.asynchronous:
        return dict.fromkeys(keys) if target is not None else {}
    t = r.spec.train
    steps = target.reference.steps_to_target(t.global_batch_size, t.lr, t.optimizer)
    seconds = steps * r.speed.step_s
    gpu_hours = seconds * r.workers / 3600
    price = target.usd_per_gpu_hour
    return dict(zip(keys, (steps, seconds, gpu_hours, None if price is None else gpu_hours * price)))


def best_to_target(rows: list[Row], device_memory: int | None, target: ToTarget) -> str:
    """The layouts that fit and reach the target soonest and, priced, cheapest."""
    known = [(r, t) for r in rows if not r.note and (device_memory is None or r.device_bytes <= device_memory)
             and (t := target_document(r, target))["time_to_target_s"] is not None]
    if not known:
        return "no layout that fits has a predicted time to the target"

    def what(r: Row, t: dict) -> str:
        cost = "" if t["cost_to_target_usd"] is None else f", {usd_text(t['cost_to_target_usd'])}"
        return f"{r.strategy} on {r.workers} GPU(s) ({duration_text(t['time_to_target_s'])}{cost})"

    lines = ["soonest to the target: " + what(*min(known, key=lambda rt: rt[1]["time_to_target_s"]))]
    if target.usd_per_gpu_hour is not None:
        lines.append("cheapest to the target: " + what(*min(known, key=lambda rt: rt[1]["cost_to_target_usd"])))
    return "\n".join(lines)


# Settings a strategy may refuse that change nothing it holds in memory: a row is estimated with the
# default instead, and says so (pipedream clips no gradient, but would hold the same bytes).
MEMORY_NEUTRAL = ("train.grad_clip",)


def _parse_for_memory(raw: dict, remarks: list[str]) -> config.ExperimentSpec:
    for _ in MEMORY_NEUTRAL:
        try:
            return config.parse(raw)
        except ConfigError as e:
            if e.field not in MEMORY_NEUTRAL:
                raise
            section, key = e.field.split(".")
            default = getattr(config.TrainSpec(), key)
            raw[section][key] = default
            remarks.append(f"as with {e.field} = {default!r}: {e.problem}")
    return config.parse(raw)


def row_document(r: Row, device_memory: int | None, device=None, target: ToTarget | None = None) -> dict:
    """One row of `estimate --json`: bytes per worker and, on a device, the step's time, or why the layout
    cannot exist (`note`)."""
    possible = not r.note
    doc = {"strategy": r.strategy, "workers": r.workers, "possible": possible, "note": r.note or None,
           "remark": r.remark or None,
           **({"states_theory_bytes": r.theory, "states_expected_bytes": r.expected, "in_host_bytes": r.offloaded,
               "activation_bytes": r.activations, "gathered_bytes": r.gathered, "per_worker_bytes": r.device_bytes,
               "host_build_bytes": r.host_build, "host_async_save_bytes": r.host_save,
               "mem_per_worker_bytes": r.device_bytes,
               "bytes_per_parameter": r.expected / r.params if r.params else None,
               "fits": None if device_memory is None else r.device_bytes <= device_memory} if possible else {})}
    if possible and device is not None:
        doc.update(speed_document(r, device))
    doc.update(target_document(r, target))
    return doc


def speed_document(r: Row, device) -> dict:
    """The step-time columns of a row (None where the step is not predicted)."""
    from .metrics import steptime

    t = r.speed
    if t is None:
        return dict.fromkeys(("step_time_s", "compute_s", "exposed_comm_s", "comm_s", "bubble_s", "tokens_per_s",
                              "samples_per_s", "tflops_per_gpu", "mfu", "comm_bytes_per_step"))
    rows = r.spec.train.global_batch_size
    return {"step_time_s": t.step_s, "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s, "comm_s": t.comm_s,
            "bubble_s": t.bubble_s, "tokens_per_s": steptime.tokens_per_second(rows, r.tokens_per_row, t),
            "samples_per_s": rows / t.step_s, "tflops_per_gpu": steptime.tflops_per_gpu(t, r.workers),
            "mfu": steptime.mfu(t, r.workers, device.peak(r.spec.train.precision)),
            "comm_bytes_per_step": t.bytes_per_step}


def table(rows: list[Row], device_memory: int | None, device=None, target: ToTarget | None = None) -> str:
    """Model states ("theory": the textbook bytes; "expected": what the implementation holds), the part
    of them in host memory (offload), activations, gathered whole units, and their device total; on a
    device, the step's time, split into computation, exposed communication and bubble, and what it
    achieves."""
    head = ["strategy", "workers", "states theory", "states expected", "in host", "activations", "gathered",
            "per worker", "B/param", "fits", "host: build", "host: async save"]
    if device is not None:
        head += ["step (s)", "compute", "comm", "bubble", "tokens/s", "TFLOP/s/GPU", "MFU"]
        if target is not None:
            head += ["to target"] + (["cost"] if target.usd_per_gpu_hour is not None else [])
    out, notes = [], []
    for r in rows:
        if r.note or r.remark:
            notes.append(f"{r.strategy} on {r.workers} worker(s): {r.note or r.remark}")
        if r.note:
            continue
        if device is not None and target is not None and r.spec.layout.asynchronous:
            notes.append(f"{r.strategy} on {r.workers} worker(s): no time to the target: {STALE}")
        fits = "-" if device_memory is None else ("yes" if r.device_bytes <= device_memory else "NO")
        out.append([r.strategy, str(r.workers), size_text(r.theory), size_text(r.expected),
                    size_text(r.offloaded) if r.offloaded else "-", size_text(r.activations),
                    size_text(r.gathered) if r.gathered else "-", size_text(r.device_bytes),
                    f"{r.expected / r.params:.2f}", fits, size_text(r.host_build), size_text(r.host_save)])
        if device is not None:
            d = speed_document(r, device)
            out[-1] += (["-"] * 7 if d["step_time_s"] is None else
                        [f"{d['step_time_s']:.3g}", f"{d['compute_s']:.3g}", f"{d['exposed_comm_s']:.3g}",
                         f"{d['bubble_s']:.3g}", f"{d['tokens_per_s']:.4g}", f"{d['tflops_per_gpu']:.3g}",
                         f"{d['mfu']:.1%}"])
            if target is not None:
                t = target_document(r, target)
                out[-1].append("-" if t["time_to_target_s"] is None else duration_text(t["time_to_target_s"]))
                if target.usd_per_gpu_hour is not None:
                    out[-1].append("-" if t["cost_to_target_usd"] is None else usd_text(t["cost_to_target_usd"]))
    return "\n".join([text_table(head, out), *notes])


def duration_text(seconds: float) -> str:
    """A duration as people read one: 42 s, 12.5 min, 3.2 h, 4.1 d."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def usd_text(usd: float) -> str:
    return f"${usd:,.0f}" if usd >= 100 else f"${usd:.3g}"
