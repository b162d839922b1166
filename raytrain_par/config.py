"""Experiment spec: YAML -> typed, validated dataclasses.

Every mistake is found here, before Ray starts, and reported with the field, the value found and
the fix. Unknown keys are errors. `--set a.b=value` overrides any field (the value is read as YAML).

    name: quickstart
    model: {name: gpt2-tiny, dropout: 0.0}
    data: {name: kjv, seq_len: 128}
    strategy: {name: ddp}
    scaling: {num_workers: 2}
    train: {global_batch_size: 32, max_steps: 200, lr: 1.0e-3, eval_every_steps: 50}
    target: {metric: val_perplexity, value: 400}
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from . import data as data_sets
from . import models, strategies
from .errors import ConfigError
from .tracking import TrackingSpec

DEFAULT_VOCAB_SIZE = 8192
TOP_LEVEL = ("name", "model", "data", "strategy", "scaling", "train", "target", "output_dir", "sweep", "tracking")
# Fields that name files a run reads. A relative one is resolved against the directory of the
# experiment file that holds it (as a `model.config` beside the file is meant), one given by `--set`
# against the current directory (as a path typed in a shell is meant); workers are given absolute paths.
# Where a run writes (output_dir, a tracker's log_dir) stays relative to the directory the command runs
# in, as Ray Train's storage path: inside a Ray job, place_results moves a relative output_dir out of the
# job's temporary working directory.
PATH_FIELDS = ("model.config", "data.path", "data.tokenizer", "data.cache_dir")
# A directory or a Hugging Face hub id ("org/name"): a path where one exists there, else left as given.
PATH_OR_NAME_FIELDS = ("model.pretrained",)


@dataclass
class ModelSpec:
    """`model: {name: ..., <the family's options>}`; the options are the family's `Options` (models/)."""

    name: str
    options: Any = None

    @classmethod
    def from_raw(cls, raw, path: str = "model") -> "ModelSpec":
        if isinstance(raw, str):  # `model: gpt2-tiny` is short for `model: {name: gpt2-tiny}`
            raw = {"name": raw}
        if not isinstance(raw, dict) or "name" not in raw:
            raise ConfigError(path, raw, "expected a mapping with a `name`",
                              f"write e.g. `model: {{name: gpt2-tiny}}`; models: {', '.join(models.NAMES)}")
        name = raw["name"]
        if name not in models.NAMES:
            close = difflib.get_close_matches(str(name), models.NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}.name", name, f"unknown model{hint}", f"use one of: {', '.join(models.NAMES)}")
        family = models.family_of(name)
        own = {f.name for f in dataclasses.fields(family.Options)}
        for key in raw:
            others = [n for f in models.FAMILIES.values() if f is not family and key in
                      {x.name for x in dataclasses.fields(f.Options)} for n in f.NAMES]
            if key != "name" and key not in own and others:
                raise ConfigError(f"{path}.{key}", raw[key], f"only {', '.join(others)} models have {key}",
                                  f"remove it; {name} takes {', '.join(sorted(own)) or 'no other keys'}")
        options = _from_mapping(family.Options, {k: v for k, v in raw.items() if k != "name"}, path)
        return cls(name, options)

    @classmethod
    def of(cls, name: str, **options) -> "ModelSpec":
        """A model spec from Python, e.g. ModelSpec.of("gpt2-mini", n_layer=3)."""
        return cls.from_raw({"name": name, **options})

    def to_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self.options)}


@dataclass
class DataSpec:
    name: str
    path: Optional[str] = None  # wikitext-103 and imagenet-folder: where the files are; text: a glob of files
    # text: how the files are read (default: from their suffix), and the JSON key or Parquet column of the text
    format: Optional[Literal["txt", "jsonl", "parquet"]] = None
    field: str = "text"
    tokenizer: Optional[str] = None  # text, wikitext-103: a directory holding tokenizer.json (default: train a BPE)
    seq_len: int = 128  # text: tokens per training row
    # text: size of the byte-level BPE trained on the corpus; default: the model's vocab_size (a
    # causal-lm config's), else DEFAULT_VOCAB_SIZE
    vocab_size: Optional[int] = None
    val_fraction: Optional[float] = None  # None: the set's own validation split, else 5% held out
    seed: int = 0  # seed of the train/validation split
    image_size: Optional[int] = None  # imagenet-folder: size the images are decoded at (224)
    loader: Optional[Literal["memory", "stream"]] = None  # default: memory, stream for path-based sets
    max_val_samples: Optional[int] = None  # evaluate on the first N validation rows only
    cache_dir: Optional[str] = None  # default $RAYTRAIN_PAR_CACHE or ~/.cache/raytrain-par

    @property
    def effective_loader(self) -> str:
        return data_sets.loader_of(self.name, self.loader)


@dataclass
class StrategySpec:
    name: str
    options: Any = None

    def to_dict(self) -> dict:
        return {"name": self.name, **dataclasses.asdict(self.options)}


@dataclass
class ScalingSpec:
    """`scaling:`. `num_workers: N` is a fixed group of N workers; `num_workers: [MIN, MAX]` an elastic
    one, as large as the cluster allows within the range (Ray Train's elastic scaling). `num_workers`
    holds MAX either way, `min_workers` MIN (None: fixed)."""

    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    backend: Optional[Literal["gloo", "nccl"]] = None  # default: nccl with GPUs, gloo without
    # elastic runs: seconds between two looks at the cluster for a larger (or smaller) worker group
    resize_interval_s: float = 60.0
    # CPU workers (use_gpu false) -- caching: each worker's C heap keeps what a step frees for the next
    # step (no page faults on reused memory; see metrics/memory.py); system: glibc's defaults;
    # returning: every block of 64 KiB or more mapped on its own and returned to the system when freed,
    # so a worker's resident memory follows what it uses (page faults every step). It is the Ray job's
    # environment: one value for a whole sweep.
    host_allocator: Literal["caching", "system", "returning"] = "caching"
    min_workers: Optional[int] = field(default=None, init=False)

    @classmethod
    def from_raw(cls, raw, path: str = "scaling") -> "ScalingSpec":
        workers = raw.get("num_workers") if isinstance(raw, dict) else None
        if not isinstance(workers, list):
            return _from_mapping(cls, raw, path)
        ok = len(workers) == 2 and all(isinstance(w, int) and not isinstance(w, bool) for w in workers)
        _check(ok, f"{path}.num_workers", workers, "an elastic range is two integers [MIN, MAX]",
               "write e.g. [1, 4], or one integer for a fixed number of workers")
        spec = _from_mapping(cls, {**raw, "num_workers": workers[1]}, path)
        spec.min_workers = workers[0]
        return spec

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    @property
    def worker_counts(self) -> range:
        """Every number of workers the run may train on."""
        return range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1)

    def at(self, num_workers: int) -> "ScalingSpec":
        """A fixed group of `num_workers` (what an elastic run's worker group is at a given time)."""
        return dataclasses.replace(self, num_workers=num_workers)

    @property
    def effective_backend(self) -> str:
        return self.backend or ("nccl" if self.use_gpu else "gloo")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        if self.elastic:
            d["num_workers"] = [self.min_workers, self.num_workers]
        return d


@dataclass
class AdaptiveBatchSpec:
    """`train.adaptive_batch`: the global batch changes while training, to the one of greatest goodput
    (metrics/adaptive.py); train.global_batch_size is where it starts."""

    max_global_batch_size: int
    min_global_batch_size: Optional[int] = None  # default: train.global_batch_size
    # the learning rate at batch M: AdaScale's gain, sqrt(M / M0) or M / M0 times the schedule's, which
    # runs on progress (steps of the starting batch M0), each step advancing it by the same factor
    lr_scaling: Literal["adascale", "sqrt", "linear"] = "adascale"
    every_evals: int = 1  # evaluations between two decisions
    # The most rows one data-parallel replica computes at once (one accumulation step); more are
    # accumulated. Default: on GPUs, what `raytrain-par estimate` says fits in the device's memory; no
    # limit on CPUs. (A pipeline keeps the micro-batch shape its schedule was built for.)
    max_micro_batch_rows: Optional[int] = None


@dataclass
class TrainSpec:
    global_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    epochs: Optional[int] = None  # with neither epochs nor max_steps: 1 epoch
    max_steps: Optional[int] = None  # with both: whichever ends first
    optimizer: Literal["adamw", "sgd", "lamb"] = "adamw"
    lr: float = 3.0e-4
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw, lamb
    eps: float = 1.0e-8  # adamw, lamb
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.1  # cosine / linear decay ends at lr * min_lr_ratio
    grad_clip: float = 0.0  # max gradient norm; 0: no clipping
    # fp32, or mixed precision: bf16 / fp16 compute (how depends on the strategy: autocast for ddp,
    # megatron and the pipelines (per stage), 16-bit parameters with fp32 master weights for zero-N, a
    # MixedPrecisionPolicy for fsdp)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Recompute activations in backward instead of keeping them: none; full (every transformer block /
    # VGG convolution stage keeps only its input: about one more forward pass); selective (the
    # self-attention of each block only, transformer models)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    seed: int = 0
    eval_every_steps: Optional[int] = None  # default: at the end of every epoch
    eval_at_start: bool = True  # a record before the first step: where every curve starts
    checkpoint_every_evals: int = 1  # 0: no checkpoints
    keep_checkpoints: int = 2
    # async: a save takes a snapshot of the state in host memory and training goes on while a background
    # thread writes and reports it; sync: training waits until the checkpoint is written and reported
    checkpoint_mode: Literal["async", "sync"] = "async"
    stop_at_target: bool = False  # end the run when the target is met
    max_failures: int = 0  # worker failures to recover from (from the latest checkpoint)
    # nodes lost to preemption (drained by the cloud or Kubernetes before they go) to recover from,
    # counted apart from max_failures; -1: any number
    max_preemptions: int = -1
    adaptive_batch: Optional[AdaptiveBatchSpec] = None


@dataclass
class TargetSpec:
    metric: str
    value: float

    @property
    def mode(self) -> str:
        return "max" if self.metric == "val_accuracy" else "min"

    def met(self, value: float) -> bool:
        return value >= self.value if self.mode == "max" else value <= self.value

    def __str__(self) -> str:
        return f"{self.metric} {'>=' if self.mode == 'max' else '<='} {self.value:g}"


@dataclass
class ExperimentSpec:
    name: str
    model: ModelSpec
    data: DataSpec
    strategy: StrategySpec = field(default_factory=lambda: StrategySpec("ddp"))
    scaling: ScalingSpec = field(default_factory=ScalingSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    target: Optional[TargetSpec] = None
    output_dir: str = "results"
    # Search space of `raytrain-par sweep` (field path -> values); `run` trains the file's own values.
    sweep: Optional[dict] = None
    # Trackers every evaluation is logged to (tracking.py): mlflow, tensorboard, wandb
    tracking: Optional[TrackingSpec] = None

    # -- derived quantities --------------------------------------------------------------------
    @property
    def layout(self):
        """The parallel layout (strategies/layout.py): pipeline, tensor and data-parallel degrees."""
        return strategies.layout_of(self.strategy, self.scaling.num_workers)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data

    @property
    def per_worker_batch(self) -> int:
        """Rows each data-parallel rank reads per optimizer step (all micro-batches together)."""
        return self.train.global_batch_size // self.data_parallel_size

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of the whole run: epochs x steps per epoch, capped by max_steps."""
        t = self.train
        by_epochs = (t.epochs if t.epochs is not None else (1 if t.max_steps is None else None))
        candidates = [n for n in (by_epochs and by_epochs * steps_per_epoch, t.max_steps) if n]
        return min(candidates)

    @property
    def results_dir(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() / self.name

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["strategy"] = self.strategy.to_dict()
        d["model"] = self.model.to_dict()
        d["scaling"] = self.scaling.to_dict()
        return d


# -- parsing ------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(tp, str(tp))


def _convert(value, tp, path: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(path, value, f"not one of {', '.join(map(repr, choices))}{hint}",
                              f"set {path} to one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, value, f"expected {_type_name(tp)}", f"write {path} as a YAML list, e.g. [0.9, 0.999]")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if hasattr(tp, "from_raw"):  # a spec that parses itself (its keys depend on its name)
        return tp.from_raw(value, path)
    if dataclasses.is_dataclass(tp):
        return _from_mapping(tp, value, path)
    if tp is dict or origin is dict:  # a free-form mapping, checked by whoever reads it
        if not isinstance(value, dict):
            raise ConfigError(path, value, "expected a mapping", f"write {path} as `key: value` lines")
        return value
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        if tp is float and isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?e[-+]?\d+", value.strip(), re.I):
            return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        raise ConfigError(path, value, f"expected {_type_name(tp)}, got {type(value).__name__}",
                          f"write {path} as {_type_name(tp)}")
    return float(value) if tp is float else value


def _from_mapping(cls, raw, path: str):
    if not isinstance(raw, dict):
        raise ConfigError(path or "experiment", raw, "expected a mapping of keys to values",
                          f"write {path or 'the experiment'} as `key: value` lines")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in raw if k not in names]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), names, n=1)
        fix = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(_join(path, k), raw[k], "unknown key",
                          f"{fix}remove it; known keys of {path or 'the experiment'}: {', '.join(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], _join(path, f.name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, f.name), None, "required key is missing",
                              f"add `{f.name}:` under {path or 'the top level'}")
    return cls(**kwargs)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def parse(raw: dict) -> ExperimentSpec:
    """A raw mapping (from YAML, after overrides) -> a validated ExperimentSpec."""
    if not isinstance(raw, dict):
        raise ConfigError("experiment", raw, "the file does not hold a mapping", "start the file with `name: ...`")
    raw = dict(raw)
    strategy_raw = raw.pop("strategy", {"name": "ddp"})
    if isinstance(strategy_raw, str):
        strategy_raw = {"name": strategy_raw}
    if isinstance(raw.get("data"), str):  # `data: kjv` is short for `data: {name: kjv}`
        raw["data"] = {"name": raw["data"]}
    if isinstance(raw.get("target"), str):
        raw["target"] = _parse_target_string(raw["target"])
    spec = _from_mapping(ExperimentSpec, raw, "")
    spec.strategy = _parse_strategy(strategy_raw)
    validate(spec)
    return spec


def _parse_target_string(text: str) -> dict:
    m = re.fullmatch(r"\s*(\w+)\s*(<=|>=)\s*([-+0-9.eE]+)\s*", text)
    if not m:
        raise ConfigError("target", text, "cannot read the target", "write it as `val_perplexity <= 200` or "
                          "as a mapping {metric: val_perplexity, value: 200}")
    metric, op = m.group(1), m.group(2)
    try:
        value = float(m.group(3))
    except ValueError:
        raise ConfigError("target", text, f"{m.group(3)!r} is not a number", f"write e.g. `{metric} {op} 200`") from None
    known = set(models.LanguageModelling.metrics) | set(models.ImageClassification.metrics)
    want = ">=" if TargetSpec(metric, 0.0).mode == "max" else "<="
    if metric in known and op != want:  # an unknown metric is named as such by validate()
        kind, moves = ("higher", "rises") if want == ">=" else ("lower", "falls")
        raise ConfigError("target", text, f"the operator points the wrong way: {metric} is better {kind}, so the "
                          f"target is the value it {moves} to ({want})",
                          f"write `{metric} {want} {m.group(3)}`")
    return {"metric": metric, "value": value}


def _parse_strategy(raw) -> StrategySpec:
    if not isinstance(raw, dict) or "name" not in raw:
        raise ConfigError("strategy", raw, "expected a mapping with a `name`",
                          f"write e.g. `strategy: {{name: ddp}}`; strategies: {', '.join(strategies.NAMES)}")
    name = raw["name"]
    if name not in strategies.NAMES:
        close = difflib.get_close_matches(str(name), strategies.NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError("strategy.name", name, f"unknown strategy{hint}",
                          f"use one of: {', '.join(strategies.NAMES)}")
    options_cls = strategies.engine_class(name).Options
    options = _from_mapping(options_cls, {k: v for k, v in raw.items() if k != "name"}, "strategy")
    return StrategySpec(name, options)


def _check(cond: bool, field_: str, value, problem: str, fix: str) -> None:
    if not cond:
        raise ConfigError(field_, value, problem, fix)


def validate(spec: ExperimentSpec) -> None:
    """Cross-field checks: names exist, numbers are in range, the parallel layout is possible."""
    _check(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.name)), "name", spec.name,
           "must be letters, digits, '.', '_' or '-' (it names the results directory)", "rename it, e.g. my-experiment")
    # Ray Train's storage_path would take a URI, but metrics.parquet and the moving aside of earlier
    # results use local file operations: a bucket is used through a mount.
    _check("://" not in spec.output_dir, "output_dir", spec.output_dir,
           "cloud URIs are not supported: results are written with local file operations",
           "mount the bucket or file share on every node (EFS, Filestore, s3fs, gcsfuse) and give its path, "
           "e.g. /mnt/shared/results")
    m, d, s, t = spec.model, spec.data, spec.scaling, spec.train

    _check(d.name in data_sets.NAMES, "data.name", d.name, "unknown data set", f"use one of: {', '.join(data_sets.NAMES)}")
    model_kind, data_kind = models.data_kind(m.name), data_sets.kind_of(d.name)
    fitting = [n for n in data_sets.NAMES if data_sets.kind_of(n) == model_kind]
    _check(model_kind == data_kind, "data.name", d.name, f"{m.name} trains on {model_kind} data, {d.name} is {data_kind}",
           f"use {' or '.join(fitting)}, or another model")
    if d.vocab_size is None:
        d.vocab_size = m.options.vocab_size() or DEFAULT_VOCAB_SIZE
    m.options.validate(spec, lambda *a: _check(False, *a))
    pretrained = getattr(m.options, "pretrained", None)
    if (pretrained and d.tokenizer is None and "tokenizer" in data_sets.SETS[d.name].takes
            and (Path(pretrained) / "tokenizer.json").is_file()):
        d.tokenizer = pretrained  # the checkpoint's own tokenizer, unless the experiment names one

    if d.name in data_sets.NEEDS_PATH:
        _check(bool(d.path), "data.path", d.path, f"{d.name} is read from {data_sets.SETS[d.name].path}",
               "set data.path to where they are (on shared storage on a multi-node cluster)")
    for key in data_sets.OPTIONAL_KEYS:
        value, default = getattr(d, key), DataSpec.__dataclass_fields__[key].default
        readers = [n for n, ds in data_sets.SETS.items() if key in ds.takes]
        _check(value == default or key in data_sets.SETS[d.name].takes, f"data.{key}", value,
               f"{d.name} does not read it; sets that do: {', '.join(readers)}",
               "remove it, or train on your own files with data.name: text")
    _check(bool(d.field.strip()), "data.field", d.field, "must name the JSON key or Parquet column of the text",
           "use e.g. text (the default)")
    if d.tokenizer is not None:
        _check(bool(d.tokenizer.strip()), "data.tokenizer", d.tokenizer, "is empty",
               "give the directory holding tokenizer.json, or remove it to train a BPE on the corpus")
    if data_kind == "text":
        _check(d.seq_len >= 2, "data.seq_len", d.seq_len, "must be >= 2", "use e.g. 128")
        if d.tokenizer is None:  # a BPE of vocab_size tokens is trained on the corpus
            _check(d.vocab_size >= 260, "data.vocab_size", d.vocab_size,
                   "must be >= 260 (256 bytes + special tokens)", "use e.g. 8192")
    if d.image_size is not None:
        _check(d.name == "imagenet-folder", "data.image_size", d.image_size,
               "only imagenet-folder images are decoded at a chosen size", "remove it; use model.image_size to resize")
    if d.val_fraction is not None:
        _check(0.0 < d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in (0, 1)", "use e.g. 0.05")
    if d.max_val_samples is not None:
        _check(d.max_val_samples >= 1, "data.max_val_samples", d.max_val_samples, "must be >= 1", "remove it for all rows")

    if s.elastic:  # checked first: everything else depends on the counts being a range
        _check(s.min_workers <= s.num_workers, "scaling.num_workers", [s.min_workers, s.num_workers],
               f"MIN {s.min_workers} is greater than MAX {s.num_workers}", f"write [{max(s.num_workers, 1)}, {s.min_workers}]")
        _check(s.min_workers >= 1, "scaling.num_workers", [s.min_workers, s.num_workers], "MIN must be >= 1",
               f"use e.g. [1, {s.num_workers}]")
    _check(s.num_workers >= 1, "scaling.num_workers", s.num_workers, "must be >= 1", "use e.g. 2")
    _check(s.cpus_per_worker > 0, "scaling.cpus_per_worker", s.cpus_per_worker, "must be > 0", "use e.g. 1")
    if s.use_gpu:
        _check(s.gpus_per_worker > 0, "scaling.gpus_per_worker", s.gpus_per_worker, "must be > 0 with use_gpu",
               "use 1 (one GPU per worker)")
    _check(not (s.backend == "nccl" and not s.use_gpu), "scaling.backend", s.backend,
           "NCCL needs GPUs but scaling.use_gpu is false", "set scaling.use_gpu: true, or backend: gloo")

    _check(t.lr > 0, "train.lr", t.lr, "must be > 0", "use e.g. 3.0e-4 for AdamW, 0.01 for SGD")
    _check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0", "use e.g. 0.01, or 0")
    _check(t.global_batch_size >= 1, "train.global_batch_size", t.global_batch_size, "must be >= 1", "use e.g. 32")
    _check(t.gradient_accumulation_steps >= 1, "train.gradient_accumulation_steps", t.gradient_accumulation_steps,
           "must be >= 1", "use 1 for no accumulation")
    if t.epochs is not None:
        _check(t.epochs >= 1, "train.epochs", t.epochs, "must be >= 1", "use e.g. 1")
    if t.max_steps is not None:
        _check(t.max_steps >= 1, "train.max_steps", t.max_steps, "must be >= 1", "use e.g. 100")
    if t.eval_every_steps is not None:
        _check(t.eval_every_steps >= 1, "train.eval_every_steps", t.eval_every_steps, "must be >= 1",
               "use e.g. 50, or remove it to evaluate once per epoch")
    _check(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0", "use 0 for no warm-up")
    _check(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0", "use 1.0, or 0 for no clipping")
    _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]", "use e.g. 0.1")
    _check(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", t.betas,
           "must be two numbers in [0, 1)", "use [0.9, 0.999]")
    _check(t.momentum >= 0, "train.momentum", t.momentum, "must be >= 0", "use e.g. 0.9")
    _check(t.checkpoint_every_evals >= 0, "train.checkpoint_every_evals", t.checkpoint_every_evals, "must be >= 0",
           "use 1 to checkpoint at every evaluation, 0 never")
    _check(t.keep_checkpoints >= 1, "train.keep_checkpoints", t.keep_checkpoints, "must be >= 1", "use e.g. 2")
    _check(not (t.precision == "fp16" and not s.use_gpu), "train.precision", t.precision,
           "fp16 training needs GPUs (loss scaling and fp16 kernels are CUDA features)",
           "use bf16 on CPU, or set scaling.use_gpu: true")
    modes = models.family_of(m.name).CHECKPOINTING
    _check(t.activation_checkpointing in ("none", *modes), "train.activation_checkpointing",
           t.activation_checkpointing, f"{m.name} has no self-attention to recompute alone",
           f"use {' or '.join(modes)} (recomputes whole layers in backward), or none")
    _check(t.max_preemptions >= -1, "train.max_preemptions", t.max_preemptions,
           "must be >= 0 (or -1: recover from any number)", "use -1, or e.g. 10")
    _check(t.max_failures >= -1, "train.max_failures", t.max_failures, "must be >= 0 (or -1: retry forever)", "use e.g. 3")

    if s.elastic:
        _validate_elastic(spec)
    else:
        _validate_layout(spec)

    if spec.tracking is not None:
        from .tracking import missing_package

        for name in spec.tracking.configured():
            missing = missing_package(name)
            _check(missing is None, f"tracking.{name}", dataclasses.asdict(getattr(spec.tracking, name)),
                   f"the {missing} package is not installed", f"pip install 'raytrain-par[{name}]' (or pip install "
                   f"{missing}), or remove tracking.{name}")
    if spec.target is not None:
        metrics = models.task_metrics(m.name)
        _check(spec.target.metric in metrics, "target.metric", spec.target.metric,
               f"{m.name} does not produce it", f"use one of: {', '.join(metrics)}")
        if spec.target.metric == "val_accuracy":
            _check(0 < spec.target.value <= 1, "target.value", spec.target.value, "an accuracy is in (0, 1]",
                   "use e.g. 0.85")
        else:
            _check(spec.target.value > 0, "target.value", spec.target.value, "must be > 0", "use e.g. 200")


def _validate_layout(spec: ExperimentSpec) -> None:
    """What depends on the number of workers: the strategy's layout and the global batch's split."""
    t = spec.train
    spec.strategy.options.validate(spec, lambda *a: _check(False, *a))
    dp = spec.data_parallel_size
    per_step = dp * t.gradient_accumulation_steps
    if t.global_batch_size % per_step:
        lo = max(per_step, t.global_batch_size // per_step * per_step)
        raise ConfigError("train.global_batch_size", t.global_batch_size,
                          f"does not split evenly over {dp} data-parallel workers x {t.gradient_accumulation_steps} "
                          "accumulation steps",
                          f"use a multiple of {per_step}, e.g. {lo} or {lo + per_step}")
    if t.adaptive_batch is not None:
        _validate_adaptive(spec)


def _validate_adaptive(spec: ExperimentSpec) -> None:
    """An adaptive batch: bounds that hold the start, that the layout can cut, and a strategy that measures
    the gradient noise scale the decision needs."""
    t, a = spec.train, spec.train.adaptive_batch
    lo = a.min_global_batch_size or t.global_batch_size
    _check(a.every_evals >= 1, "train.adaptive_batch.every_evals", a.every_evals, "must be >= 1",
           "use 1 (a decision at every evaluation)")
    _check(lo >= 1, "train.adaptive_batch.min_global_batch_size", a.min_global_batch_size, "must be >= 1",
           f"use e.g. {t.global_batch_size} (the starting batch)")
    _check(a.max_global_batch_size >= lo, "train.adaptive_batch.max_global_batch_size", a.max_global_batch_size,
           f"is below the smallest batch the run may train with ({lo})",
           f"use a maximum of at least {lo}, e.g. {8 * lo}")
    _check(lo <= t.global_batch_size <= a.max_global_batch_size, "train.global_batch_size", t.global_batch_size,
           f"the starting batch is outside train.adaptive_batch's range [{lo}, {a.max_global_batch_size}]",
           "start within the range, or widen it")
    cls = strategies.engine_class(spec.strategy.name, spec.strategy.options)
    layout = spec.layout
    _check(cls.measures_noise_scale(spec.strategy.options, t, layout), "train.adaptive_batch",
           dataclasses.asdict(a), f"{spec.strategy.name} on {spec.scaling.num_workers} workers does not measure the "
           "gradient noise scale the decision needs (it needs two data-parallel replicas or more, or gradient "
           "accumulation for zero, without fp16 loss scaling; pipedream never measures it)",
           "use ddp, fsdp, zero-N, megatron or a pipeline with 2 data-parallel replicas or more, or remove "
           "train.adaptive_batch")
    if a.max_micro_batch_rows is not None:
        _check(layout.pipeline == 1, "train.adaptive_batch.max_micro_batch_rows", a.max_micro_batch_rows,
               "a pipeline keeps the rows of one accumulation step its schedule was built for, and accumulates more",
               "remove it")
        start = spec.per_worker_batch // t.gradient_accumulation_steps
        _check(a.max_micro_batch_rows >= start, "train.adaptive_batch.max_micro_batch_rows", a.max_micro_batch_rows,
               f"the starting batch already computes {start} rows at once per replica",
               f"use at least {start}, or raise train.gradient_accumulation_steps")
    shapes = cls.batch_layout(t, layout, a.max_micro_batch_rows)
    for field_, value in (("max_global_batch_size", a.max_global_batch_size), ("min_global_batch_size", lo)):
        if shapes.shape(value) is None:
            step = shapes.replicas * (shapes.fixed_rows or shapes.unit)
            raise ConfigError(f"train.adaptive_batch.{field_}", value,
                              f"{spec.strategy.name} on {spec.scaling.num_workers} workers cannot cut it: a batch "
                              f"is a multiple of {step} rows ({shapes.replicas} data-parallel replicas"
                              + (f" x {shapes.fixed_rows} rows per accumulation step, which its pipeline schedule "
                                 "keeps" if shapes.fixed_rows else "") + ")",
                              f"use a multiple of {step}, e.g. {max(step, value // step * step)}")


def _validate_elastic(spec: ExperimentSpec) -> None:
    """An elastic range: Ray Train may run it on any count in [MIN, MAX] (as many workers as the cluster
    has room for), and each resize resumes the latest checkpoint on the new count."""
    s, t = spec.scaling, spec.train
    text = [s.min_workers, s.num_workers]
    _check(s.resize_interval_s >= 0, "scaling.resize_interval_s", s.resize_interval_s, "must be >= 0",
           "use e.g. 60 (Ray Train's default)")
    _check(t.checkpoint_every_evals >= 1, "train.checkpoint_every_evals", t.checkpoint_every_evals,
           "an elastic run resizes by restarting from its latest checkpoint, and this run writes none",
           "use 1 (a checkpoint at every evaluation)")
    problems: dict[int, ConfigError] = {}
    for n in s.worker_counts:
        try:
            _validate_layout(dataclasses.replace(spec, scaling=s.at(n)))
        except ConfigError as e:
            problems[n] = e
    if problems:
        valid = [n for n in s.worker_counts if n not in problems]
        runs, run = [], []  # the ranges of consecutive valid counts, longest first
        for n in valid:
            run = run + [n] if run and run[-1] == n - 1 else [n]
            runs.append(run)
        best = max(runs, key=len, default=None)
        first, e = next(iter(problems.items()))
        counts = ", ".join(map(str, problems))
        why = f"on {first} workers" + ("" if e.field == "scaling.num_workers" else f", {e.field} = {e.value!r}")
        why += f": {e.problem}"
        fields = {p.field for p in problems.values()}
        if fields == {"train.global_batch_size"}:  # the layout suits every count; the batch does not split
            per_step = math.lcm(*(strategies.layout_of(spec.strategy, n).data for n in s.worker_counts))
            per_step *= t.gradient_accumulation_steps
            fix = (f"use a global batch every count splits, a multiple of {per_step} (e.g. "
                   f"{-(-t.global_batch_size // per_step) * per_step})")
            if best and len(best) > 1:
                fix += f", or a range whose every count works, e.g. [{best[0]}, {best[-1]}]"
        elif best and len(best) > 1:
            fix = f"use a range whose every count works, e.g. [{best[0]}, {best[-1]}]"
        elif valid:
            fix = (f"only {', '.join(map(str, valid))} of these work, and Ray Train may choose any count in the "
                   f"range: use a fixed number of workers (e.g. {valid[-1]})")
            if e.field != "scaling.num_workers":
                fix += f", or change {e.field} ({e.fix})"
        else:
            fix = e.fix
        raise ConfigError("scaling.num_workers", text, f"Ray Train may run it on any count in the range, and "
                          f"{counts} cannot ({why})", fix)


def apply_overrides(raw: dict, overrides: list[str], base: Path | None = None) -> dict:
    """Apply `a.b=value` overrides (value read as YAML) to a raw experiment mapping, in order; with
    `base`, a relative path they set is taken from that directory."""
    raw = yaml.safe_load(yaml.safe_dump(raw)) if raw else {}
    for item in overrides or ():
        if "=" not in item:
            raise ConfigError("--set", item, "expected KEY=VALUE", "write e.g. --set train.epochs=3")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts) or parts[0] not in TOP_LEVEL:
            raise ConfigError("--set", item, f"{parts[0]!r} is not a top-level key",
                              f"start the key with one of: {', '.join(TOP_LEVEL)}")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}", text, f"not valid YAML ({e.problem})", "quote strings, e.g. 'a b'")
        node = raw
        for i, p in enumerate(parts[:-1]):
            child = node.get(p)
            if child is None or isinstance(child, str) and p in ("model", "data", "strategy"):
                child = {"name": child} if isinstance(child, str) else {}
                node[p] = child
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}", text, f"{'.'.join(parts[:i + 1])} is not a mapping",
                                  "set the parent key as a whole instead")
            node = child
        node[parts[-1]] = resolve_paths(value, base, key.strip()) if base is not None else value
    return raw


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("experiment file", str(path), "no such file", "give the path of an experiment YAML, "
                          "e.g. experiments/quickstart.yaml")
    try:
        text = p.read_text()
    except (UnicodeDecodeError, OSError) as e:
        raise ConfigError("experiment file", str(path), f"cannot be read as text ({e.__class__.__name__})",
                          "give the path of an experiment YAML (a UTF-8 text file)") from None
    return yaml_mapping(text, str(path))


def yaml_mapping(text: str, source: str = "experiment file"):
    """YAML text -> its value, refusing what PyYAML accepts silently: a key given twice in one mapping
    (YAML's spec forbids it; PyYAML keeps the last, so a second `train:` block would drop the first's keys)."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _refuse_duplicate_keys(node, "")
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        raise ConfigError("experiment file", source, f"not valid YAML at {where}: {getattr(e, 'problem', e)}",
                          "fix the YAML syntax there (indentation, a missing ':' or quote)") from None
    return raw if raw is not None else {}


def _refuse_duplicate_keys(node, path: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]")
    elif isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            where = _join(path, name)
            if name is not None and name != "<<":
                if name in seen:
                    raise ConfigError(where, name, f"given twice in one mapping (lines {seen[name] + 1} and "
                                      f"{key.start_mark.line + 1}); YAML keeps only the second",
                                      f"merge the two into one `{name}:`")
                seen[name] = key.start_mark.line
            _refuse_duplicate_keys(value, where)


def resolve_paths(raw, base: Path, prefix: str = ""):
    """`raw` (the value at field path `prefix`) with every relative path field (PATH_FIELDS) under it
    made absolute against `base`."""
    if prefix in PATH_FIELDS:
        return _absolute(raw, base)
    if prefix in PATH_OR_NAME_FIELDS:
        found = _absolute(raw, base)
        return found if isinstance(found, str) and os.path.exists(found) else raw
    if not isinstance(raw, dict) or prefix and not any(f.startswith(prefix + ".")
                                                      for f in PATH_FIELDS + PATH_OR_NAME_FIELDS):
        return raw
    out = dict(raw)
    for key, value in raw.items():
        out[key] = resolve_paths(value, base, _join(prefix, key))
    if not prefix and isinstance(raw.get("sweep"), dict):  # a sweep's values are fields too
        out["sweep"] = _resolve_sweep(raw["sweep"], base)
    return out


def _resolve_sweep(sweep: dict, base: Path) -> dict:
    out = dict(sweep)
    if isinstance(sweep.get("grid"), dict):
        out["grid"] = {k: [resolve_paths(v, base, k) for v in vs] if isinstance(vs, list) else vs
                       for k, vs in sweep["grid"].items()}
    if isinstance(sweep.get("random"), dict):
        out["random"] = {k: [resolve_paths(v, base, k) for v in vs] if isinstance(vs, list) else vs
                         for k, vs in sweep["random"].items()}
    if isinstance(sweep.get("cases"), list):
        out["cases"] = [{k: resolve_paths(v, base, k) for k, v in case.items()} if isinstance(case, dict) else case
                        for case in sweep["cases"]]
    return out


def _absolute(value, base: Path):
    if not isinstance(value, str) or not value.strip() or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", value):
        return value  # not a path (or a URI: sqlite:///x.db, http://host): validate() names what is wrong
    path = os.path.expanduser(value)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def load_experiment(path: str | Path, overrides: list[str] | None = None, check_data: bool = True) -> ExperimentSpec:
    """Read, override and validate an experiment; with `check_data`, also check its data is here.
    Relative paths in the file are taken from the file's directory, those of `overrides` from the
    current directory."""
    try:
        raw = resolve_paths(read_yaml(path), Path(path).expanduser().absolute().parent)
        spec = parse(apply_overrides(raw, overrides or [], base=Path.cwd()))
    except ConfigError as e:
        raise e.with_source(str(path)) from None
    if check_data:
        data_sets.check_available(spec.data)
        check_tokenizer_fits(spec)
    return spec


def check_tokenizer_fits(spec: ExperimentSpec) -> None:
    """A user's tokenizer (data.tokenizer) must fit the vocabulary a model config fixes (causal-lm);
    models sized by the data (gpt2) take the tokenizer's size."""
    tokens, vocab = data_sets.tokenizer_vocab_size(spec.data), spec.model.options.vocab_size()
    if tokens and vocab and tokens > vocab:
        raise ConfigError("data.tokenizer", spec.data.tokenizer,
                          f"its {tokens} tokens do not fit the model's vocab_size {vocab}",
                          f"use a tokenizer of at most {vocab} tokens, or set model.overrides.vocab_size to at "
                          f"least {tokens}")


def from_dict(d: dict) -> ExperimentSpec:
    """The inverse of ExperimentSpec.to_dict (how workers receive the experiment)."""
    return parse(d)
