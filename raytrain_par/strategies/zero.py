"""ZeRO stages 1, 2 and 3 through DeepSpeed (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", 2020).

Each data-parallel rank keeps 1/N of the optimizer state (stage 1), also of the gradients (stage 2),
also of the parameters (stage 3). `deepspeed.initialize` runs on the process group that already
exists (Ray Train's, torchrun's or a test's); the experiment's own optimizer and learning-rate
schedule are handed to it, so every stage trains the same numbers as DDP.

The DeepSpeed config is derived from the experiment -- batch sizes, gradient accumulation,
clipping (set explicitly: DeepSpeed's default of 1.0 would clip where the experiment does not),
bf16 / fp16, bucket sizes sized from the model (the defaults, 5e8 elements, are fp32 buffers of
2 GB) -- and `strategy.deepspeed` overrides any key of it.

Checkpoints are the one format (strategies/state.py): the fp32 master weights and every optimizer
state by the plain model's parameter names at their whole shapes, gathered one parameter at a time
with DeepSpeed's own per-parameter accessors (`safe_get_full_fp32_param`,
`safe_get_full_optimizer_state`), and at load each rank reads the flat ranges its partitions hold
(pieces.py, where DeepSpeed maps each parameter into them); so a ZeRO run resumes under any stage, ddp or
fsdp, on any number of workers, and they under it. DeepSpeed's universal checkpoint (`ds_to_universal`, `load_universal_checkpoint`) does the same
job from the files `engine.save_checkpoint` writes, but reads them, and its converted files, with
`torch.load(weights_only=False)`: unpickling arbitrary objects, which these checkpoints never do.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..metrics.memory import Sharding, StateBytes, model_state_census, optimizer_state_bytes, optimizer_tensors
from ..models.initial import materialise
from .layout import Layout
from .base import Engine, optimizer_description, split_batch
from .context import DTYPES, DistContext
from .offload import check_host_memory
from .pieces import Piece
from .weights import one_by_one
from .optim import build_optimizer, lr_factor


@dataclass
class Options:
    """`strategy:` keys for zero-1, zero-2 and zero-3."""

    # ZeRO-Offload: fp32 master weights and optimizer state live in host memory and the optimizer
    # steps on the CPU (with the experiment's own optimizer).
    offload_optimizer: bool = False
    # zero-3 only: parameters live in host memory too, fetched to the device layer by layer.
    offload_param: bool = False
    # Host memory one worker may fill with offloaded states; default: this machine's available
    # memory shared by the workers (set it when workers run on other machines).
    host_memory_gb: Optional[float] = None
    # Any DeepSpeed config key, overriding the derived config (e.g. {zero_optimization:
    # {reduce_bucket_size: 2.0e+7}}); DeepSpeed's own config classes check it.
    deepspeed: dict = field(default_factory=dict)

    def validate(self, spec, error) -> None:
        stage = STAGES[spec.strategy.name]
        if spec.train.optimizer == "lamb":
            error("train.optimizer", "lamb", "DeepSpeed hands the optimizer flat partitions of many tensors, and "
                  "LAMB scales each tensor's step by that tensor's own norm", "use adamw or sgd with zero-1/2/3")
        if self.offload_param and stage != 3:
            error("strategy.offload_param", True, f"ZeRO stage {stage} keeps whole parameters on every worker, "
                  "so there is nothing to offload", "use strategy zero-3, or offload_optimizer only")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            error("strategy.host_memory_gb", self.host_memory_gb, "must be > 0", "use e.g. 64, or remove it")
        check_deepspeed_keys(self.deepspeed, stage, error)
        if self.offload_optimizer or self.offload_param:
            self._check_host_memory(spec, error)

    def _check_host_memory(self, spec, error) -> None:
        field_ = "strategy.offload_param" if self.offload_param else "strategy.offload_optimizer"
        check_host_memory(spec, ZeroEngine.for_stage(STAGES[spec.strategy.name]), self, field_, error)


STAGES = {"zero-1": 1, "zero-2": 2, "zero-3": 3}
# Modules `deepspeed.initialize` imports on first use (its optimizer check pulls in a
# torch.compile'd optimizer, hence torch._inductor): imported before memory is measured.
LAZY_IMPORTS = ("deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer")


# -- the DeepSpeed config ------------------------------------------------------------------------

def bucket_elements(num_params: int) -> int:
    """Elements of one communication bucket: 1/32 of the model (a few percent of its states, so
    that buffers do not swamp what ZeRO saves), at least 1M, at most DeepSpeed's default 5e8.
    Smaller buckets mean more, smaller collectives; larger ones, more memory."""
    return int(min(5e8, max(1 << 20, num_params // 32)))


def deepspeed_config(stage: int, options: Options, train, global_batch: int, dp: int, num_params: int,
                     device_type: str) -> dict:
    """The DeepSpeed config of an experiment (before `options.deepspeed` is merged over it)."""
    micro = global_batch // dp // train.gradient_accumulation_steps
    bucket = bucket_elements(num_params)
    zero: dict = {
        "stage": stage,
        "contiguous_gradients": True,
        # Overlap needs a second stream and a second set of buckets; a CPU has neither stream.
        "overlap_comm": device_type == "cuda",
        "reduce_bucket_size": bucket,
    }
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    else:
        zero.update({
            "stage3_prefetch_bucket_size": bucket,
            # Parameters below this many elements stay whole on every rank (biases, norms).
            "stage3_param_persistence_threshold": min(100_000, num_params // 1000),
            "stage3_max_live_parameters": 2 * bucket,
            "stage3_max_reuse_distance": bucket,
        })
    pin = device_type == "cuda"
    if options.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if options.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": float(train.grad_clip),
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16", "initial_scale_power": 16},
        "zero_optimization": zero,
        # The experiment's torch optimizer (AdamW, SGD) steps the partitions, also when offloaded
        # (DeepSpeed would otherwise insist on its CPU Adam, a JIT-compiled op).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def merged(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


class _KeyLog(dict):
    """A dict that records which keys are looked up: DeepSpeedConfig reads every top-level key it
    knows, so the keys of an override it never looked at are keys DeepSpeed does not have."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.looked_up: set = set()

    def _log(self, key):
        self.looked_up.add(key)
        return key

    def get(self, key, default=None):
        return super().get(self._log(key), default)

    def __getitem__(self, key):
        return super().__getitem__(self._log(key))

    def __contains__(self, key):
        return super().__contains__(self._log(key))

    def pop(self, key, *default):
        return super().pop(self._log(key), *default)

    def setdefault(self, key, default=None):
        return super().setdefault(self._log(key), default)


def check_deepspeed_keys(override: dict, stage: int, error) -> None:
    """Run DeepSpeed's own config parsing on the override (with placeholders for what the
    experiment derives) and report unknown keys and bad values by their path."""
    if not override:
        return
    zero = override.get("zero_optimization")
    if isinstance(zero, dict) and "stage" in zero and zero["stage"] != stage:
        error("strategy.deepspeed.zero_optimization.stage", zero["stage"],
              f"the strategy zero-{stage} sets the stage", "choose the stage by the strategy name (zero-1, zero-2 or "
              "zero-3) and remove zero_optimization.stage")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in override:
            error(f"strategy.deepspeed.{key}", override[key], "batch sizes come from the experiment",
                  "set train.global_batch_size / train.gradient_accumulation_steps instead")
    if "gradient_clipping" in override:
        error("strategy.deepspeed.gradient_clipping", override["gradient_clipping"],
              "clipping comes from the experiment (train.grad_clip), the same for every strategy",
              "set train.grad_clip instead")
    for key in ("optimizer", "scheduler"):
        if key in override:
            error(f"strategy.deepspeed.{key}", override[key], "the optimizer and its schedule come from the "
                  "experiment (train.optimizer, train.lr, train.lr_schedule ...), the same for every strategy",
                  f"remove strategy.deepspeed.{key}")

    _quiet_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    # DeepSpeedConfig checks the batch against the world size of DeepSpeed's communication backend once
    # one is up (workers parse the experiment too): the placeholders follow it
    from deepspeed import comm as ds_comm

    try:
        world = ds_comm.get_world_size()
    except (RuntimeError, AssertionError, AttributeError):
        world = 1
    base = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}}
    cfg = _KeyLog(merged(base, override))
    try:
        DeepSpeedConfig(cfg)
    except ValidationError as e:
        first = e.errors()[0]
        section = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
                   "DeepSpeedFP16Config": "fp16"}.get(e.title)
        path = ".".join(str(p) for p in ((section,) if section else ()) + tuple(first["loc"]))
        problem = "not a DeepSpeed config key" if first["type"] == "extra_forbidden" else first["msg"]
        error(f"strategy.deepspeed.{path}", first.get("input"), f"{problem} ({e.title})",
              "see https://www.deepspeed.ai/docs/config-json/ for the keys and values DeepSpeed takes")
    except Exception as e:  # noqa: BLE001 - DeepSpeed signals a bad config with asserts and errors of its own
        error("strategy.deepspeed", override, f"DeepSpeed rejects the config: {e}",
              "see https://www.deepspeed.ai/docs/config-json/")
    unknown = [k for k in override if k not in cfg.looked_up]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(cfg.looked_up), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        error(f"strategy.deepspeed.{unknown[0]}", override[unknown[0]], "not a DeepSpeed config key",
              f"{hint}remove it; see https://www.deepspeed.ai/docs/config-json/")


def _quiet_deepspeed() -> None:
    """DeepSpeed logs its whole config at INFO and warns about torch APIs it calls; keep runs readable."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _skip_shm_comm_op() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce (37-140 s) the first time
    its communication backend starts. Training never uses it -- only inference's all-reduce does;
    gradients go through the torch process group -- so it is marked unavailable rather than built.
    (DeepSpeed keeps the probed set in this module attribute and rereads it there.)"""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


# -- the engine ----------------------------------------------------------------------------------

class ZeroEngine(Engine):
    Options = Options
    stage: int = 0

    @staticmethod
    def for_stage(stage: int) -> type["ZeroEngine"]:
        return {1: Zero1Engine, 2: Zero2Engine, 3: Zero3Engine}[stage]

    @classmethod
    def layout_for(cls, options, workers):
        """Data parallel over every worker, the stage's partitions over all of them (DeepSpeed's own
        data-parallel group)."""
        return Layout.of(workers, sharding=f"zero-{cls.stage}")

    @classmethod
    def model_state_bytes(cls, options, train, dp, num_params):
        est = super().model_state_bytes(options, train, dp, num_params)
        # DeepSpeed keeps an fp32 master copy of its partition even when the model is fp32 (the
        # textbook fp32 figure has none), and per-rank gradient buckets.
        master = 4 * num_params / dp if train.precision == "fp32" else 0.0
        buckets = 4 * bucket_elements(num_params) if dp > 1 else 0
        expected = est.expected + master + buckets
        offloaded = 0.0
        if options.offload_optimizer:
            offloaded += (optimizer_state_bytes(train) + 4) * num_params / dp  # master + optimizer state
        if options.offload_param:
            offloaded += (4 if train.precision == "fp32" else 2) * num_params / dp
        return StateBytes(est.theory, expected, offloaded)

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        # Imported before the base class takes its memory baseline: what importing DeepSpeed
        # allocates (tens of MB, once per process) is not model state.
        _quiet_deepspeed()
        if ctx.device.type == "cpu":
            _skip_shm_comm_op()
        import deepspeed

        for name in LAZY_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)

        if not dist.is_initialized():  # one process without a group: DeepSpeed still wants one
            dist.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        deepspeed.init_distributed(dist_init_required=False)
        super().__init__(model, task, train, options, ctx, total_steps)
        config = merged(deepspeed_config(self.stage, options, train, train.global_batch_size, self.dp_size,
                                         self.num_params, self.device.type), options.deepspeed)
        self.deepspeed_config = config  # (as DeepSpeed was given it: what metrics/comm.py predicts from)
        if self.stage == 3 and any(p.device.type == "meta" for p in model.parameters()):
            # the optimizer first: it groups parameters by their shapes (no weight decay on vectors), which
            # partitioning empties
            optimizer = build_optimizer(model, train)
            self.model = _partitioned(model, config, self.device, DTYPES[train.precision])
        else:
            self.model = materialise(model, self.device)  # storage for a model built on the meta device
            optimizer = build_optimizer(self.model, train)
        self.module, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(train, total_steps)),
            dist_init_required=False)
        self.compute_dtype = DTYPES[train.precision]
        self.offloaded = options.offload_optimizer or options.offload_param
        if self.measures_noise_scale(options, train, self.layout):
            # Stages 2 and 3 reduce each parameter's gradient in a hook as soon as the backward pass
            # has computed it, micro-batch by micro-batch: a worker's gradient is whole only there.
            # Tensor hooks see it first (before accumulation and DeepSpeed's hooks); the small batch
            # is one micro-batch of one worker, at every stage alike.
            self._start_noise()
            self.watch_local_gradients(self.model.parameters())

    @classmethod
    def measures_noise_scale(cls, options, train, layout):
        """Each micro-batch's gradient on each worker against the reduced one: 2 or more workers or
        gradient accumulation, and no loss scaling (fp16)."""
        return (layout.data > 1 or train.gradient_accumulation_steps > 1) and train.precision != "fp16"

    def autocast(self):
        return contextlib.nullcontext()  # parameters are already 16-bit (DeepSpeed casts the model)

    def resize_batch(self, shape):
        """DeepSpeed's engine counts micro-batches to the accumulation boundary and scales each loss by
        their number: its micro-batch size first, then the global batch (which sets the accumulation)."""
        super().resize_batch(shape)
        self.module.set_train_micro_batch_size(shape.rows_per_micro_batch(self.dp_size))
        self.module.set_train_batch_size(shape.batch)
        # the boundary falls where micro_steps + 1 is a multiple of the accumulation steps
        self.module.micro_steps = self.module.global_steps * shape.accumulation

    def prepare(self, batch):
        out = self.task.prepare(batch, self.device)
        return {k: v.to(self.compute_dtype) if v.is_floating_point() else v for k, v in out.items()}

    def train_step(self, batch):
        """DeepSpeed's engine owns the step: it scales each micro-batch's loss, reduces (stages 2 and 3:
        partitions) gradients as the backward pass goes, clips by train.grad_clip (its config's
        gradient_clipping) and steps at the accumulation boundary, so this engine does not run the
        shared step (base.Engine.train_step)."""
        micro = split_batch(batch, self.train.gradient_accumulation_steps)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            loss = self.task.loss(self.module, self.prepare(mb))
            last = i == len(micro) - 1
            if last and self.stage == 1 and self.measure_memory:
                # ZeRO-1 holds whole gradients until the end of the last backward pass, where
                # DeepSpeed reduce-scatters them and drops all but its partition: count them then,
                # from a callback the autograd engine runs once the pass is done (as FSDP does).
                # Stages 2 and 3 reduce gradients bucket by bucket during the pass.
                loss.register_hook(_at_end_of_backward(self.note_memory))
            self.module.backward(loss)  # scales by 1/accumulation steps; reduces at the boundary
            if last and self.stage > 1:
                self.note_memory()
            self.module.step()  # the optimizer steps at the accumulation boundary only
            total += loss.detach() / len(micro)
        if self.measures_noise:
            # The reduced gradient's norm is DeepSpeed's, taken at the step before clipping (unscaled).
            reduced = torch.as_tensor(self.module.get_global_grad_norm(), device=self.device)
            self.note_noise(self.task.samples_of(batch), reduced ** 2, small_batches=len(micro))
        self.note_memory()
        return total

    # -- memory --------------------------------------------------------------------------------
    def census(self):
        opt = self.optimizer
        params = list(self.model.parameters())
        ds_params = [getattr(p, "ds_tensor", None) for p in params]  # zero-3: this rank's partition
        extra_params = [*ds_params, *getattr(opt, "bit16_groups_flat", []), *getattr(opt, "fp16_partitioned_groups_flat", [])]
        masters = [*getattr(opt, "single_partition_of_fp32_groups", []), *getattr(opt, "fp32_partitioned_groups_flat", [])]
        grads = [m.grad for m in masters]
        averaged = getattr(opt, "averaged_gradients", None) or {}
        for g in (averaged.values() if isinstance(averaged, dict) else averaged):
            grads.extend(g or [])
        grads.extend(getattr(opt, "ipg_buffer", None) or [])
        for bucket in (getattr(opt, "ipg_buckets", None) or {}).values():
            buffer = getattr(bucket, "buffer", None)
            grads.extend([buffer] if isinstance(buffer, torch.Tensor) else buffer or [])
        if isinstance(getattr(opt, "grads_in_partition", None), torch.Tensor):
            grads.append(opt.grads_in_partition)
        for name in ("grad_partitions_flat_buffer", "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer"):
            if isinstance(getattr(opt, name, None), torch.Tensor):
                grads.append(getattr(opt, name))
        base = getattr(opt, "optimizer", None)
        return model_state_census(params, None, extra_grads=grads, extra_params=extra_params,
                                  extra_optim=[*masters, *(optimizer_tensors(base) if base is not None else [])])

    # -- the one checkpoint format (strategies/state.py): one parameter gathered or cut at a time ----
    def _masters(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions: what the experiment's optimizer steps (its state's keys)."""
        opt = self.optimizer
        return list(opt.fp32_partitioned_groups_flat if self.stage == 3 else opt.single_partition_of_fp32_groups)

    def saved_pieces(self):
        """This rank's partitions by name, nothing gathered: each trainable parameter's fp32 master weight and
        optimizer states where DeepSpeed keeps them (`_fragments`: flat ranges of the parameter), the step
        (the same for every partition) whole; any other tensor of the model (buffers, frozen parameters,
        whole on every rank under stages 1 and 2) whole."""
        first = self.optimizer.optimizer.state.get(self._masters()[0], {})
        keys = sorted(k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        if first:
            self._link_optimizer_state()
        aliases, trainable = self.aliases(), dict(self.model.named_parameters())
        for name, t in self.held_tensors():
            p = trainable.get(name)
            if name in aliases:
                continue
            if p is None or not p.requires_grad:
                if self.stage == 3 and isinstance(t, nn.Parameter):
                    start, count = self._share(t, t.ds_tensor.numel())
                    yield name, Piece.flat(_shape(t), start, count), t.ds_tensor
                else:
                    yield name, Piece.whole(t.shape), t
                continue
            for key in (None, *keys):
                for piece, target in self._fragments(p, key):
                    yield name if key is None else f"{name}/{key}", piece, target
            for key, v in first.items():
                if key not in keys:
                    yield f"{name}/{key}", Piece.whole(()) if isinstance(v, torch.Tensor) else None, v

    def _link_optimizer_state(self) -> None:
        """Stages 1 and 2: point each parameter at its piece of the optimizer's state, which the
        accessors read. DeepSpeed links them once, right after stepping the first parameter group,
        before the other groups' state exists (their pieces stay unlinked): link them again.
        (DeepSpeed's private flag and method, as of DeepSpeed 0.19.8.)"""
        if self.stage < 3:
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def load_pieces(self, source):
        """This rank's partitions read from the checkpoint's pieces, one parameter at a time: its fp32 master
        weight and each optimizer state are a flat range of the parameter (pieces.Piece.flat) where DeepSpeed
        keeps them (`_fragments`), in optimizer states created empty as its first step would create them;
        then the weights the model computes with (16-bit under mixed precision): whole on every rank
        (stages 1 and 2), this rank's partition of each (stage 3)."""
        base = self.optimizer.optimizer
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        sample = next((n for n, _ in named if source.state_keys(n)), None)
        keys = []
        if sample is not None:  # the optimizer's state, created empty as its first step would, then filled
            full = {k: f"{sample}/{k}" for k in source.state_keys(sample)}
            keys = sorted(k for k, f in full.items() if f not in source.scalars and source.shapes[f])
            scalars = {k: source.scalars[f] if f in source.scalars else source.read(f)
                       for k, f in full.items() if k not in keys}
            for flat in self._masters():
                base.state[flat] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()},
                                    **{k: torch.zeros_like(flat) for k in keys}}
            self._link_optimizer_state()
        with torch.no_grad():
            for name, p in named:
                for key in (None, *keys):
                    for piece, target in self._fragments(p, key):
                        source.read_into(name if key is None else f"{name}/{key}", piece, target)
            self._load_model_weights(named, source)

    def _fragments(self, p: nn.Parameter, key: str | None = None) -> list[tuple[Piece, torch.Tensor]]:
        """Where this rank keeps its part of `p`'s fp32 master weight (`key` None) or optimizer state `key`:
        (the flat range of the parameter it is, the 1-D tensor holding it). Stages 1 and 2: the fragment
        DeepSpeed maps into this rank's flat partition (`_hp_mapping`, none where the partition holds none
        of `p`). Stage 3: `p`'s place in the flat partition (`grad_position`, DeepSpeed's private layout as
        of DeepSpeed 0.19.8), the rank's share of `p` flattened and padded to a multiple of the ranks."""
        opt, shape = self.optimizer, _shape(p)
        if self.stage < 3:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                return []
            where = mapping.lp_fragment_address
            return [(Piece.flat(shape, where.start, where.numel), mapping.get_hp_fragment(key))]
        group, offset, numel = opt.grad_position[opt.get_param_id(p)]
        flat = opt.fp32_partitioned_groups_flat[group]
        start, count = self._share(p, numel)
        return [(Piece.flat(shape, start, count), (flat if key is None else opt.optimizer.state[flat][key])
                 .narrow(0, offset, count))]

    def _share(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        """Stage 3: (first element, elements) of `p` flattened that this rank's partition of `numel` holds."""
        start = numel * self.dp_rank
        return start, max(0, min(numel, p.ds_numel - start))

    def format_extras(self):
        """The experiment's optimizer (DeepSpeed wraps it), the schedule, and under fp16 DeepSpeed's
        loss scale under the names torch's GradScaler gives it (so ddp resumes it, and it resumes ddp's)."""
        out = {**optimizer_description(self.optimizer.optimizer), "scheduler": self.scheduler.state_dict()}
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if self.train.precision == "fp16" and scaler is not None:
            factor = float(getattr(scaler, "scale_factor", 2.0))
            out["scaler"] = {"scale": float(scaler.cur_scale), "growth_factor": factor, "backoff_factor": 1 / factor,
                             "growth_interval": int(getattr(scaler, "scale_window", 1000)), "_growth_tracker": 0}
        return out

    def load_format_extras(self, index):
        self.load_scheduler(index["scheduler"])
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None and "scaler" in index:
            scaler.cur_scale = index["scaler"]["scale"]
        # DeepSpeed's step counters, as its engine counts them: accumulation boundaries fall where
        # micro_steps says, whoever wrote the checkpoint
        step, accumulation = int(index["step"]), self.train.gradient_accumulation_steps
        self.module.global_steps, self.module.micro_steps = step, step * accumulation
        self.module.global_samples = step * self.train.global_batch_size

    def _load_model_weights(self, named: list, source) -> None:
        """The weights the model computes with, cast from the checkpoint's: stages 1 and 2 hold them whole on
        every rank; stage 3 this rank's partition of each (`ds_tensor`, the range its fp32 master holds),
        and a parameter it keeps gathered between steps (DeepSpeed's persistent ones) also whole."""
        for name, p in named:
            if self.stage < 3:
                source.read_into(name, Piece.whole(p.shape), p.data)
                continue
            start, count = self._share(p, p.ds_tensor.numel())
            source.read_into(name, Piece.flat(_shape(p), start, count), p.ds_tensor.data)
            if p.data.numel() == p.ds_numel:  # gathered now (a persistent parameter)
                source.read_into(name, Piece.whole(_shape(p)), p.data)

    def plain_weights(self, everywhere=False):
        """fp32 master weights, one parameter gathered at a time (a collective: every rank goes through them)."""
        from deepspeed.utils import safe_get_full_fp32_param

        def whole(name, t):
            return safe_get_full_fp32_param(t).reshape(_shape(t)) if isinstance(t, nn.Parameter) else t

        yield from one_by_one(self.model.state_dict(keep_vars=True), whole, keep=everywhere or self.ctx.rank == 0)


def _partitioned(model: nn.Module, config: dict, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """ZeRO-3's partitions of a model built on the meta device, made one parameter at a time: each is given
    storage (values undefined: the engine fills its partition from the run's initial weights or checkpoint)
    and handed to DeepSpeed's `zero.Init`, which partitions it and frees the whole tensor before the next is
    made, so a rank never holds more than one whole parameter beside its partitions. `zero.Init(module=model)`
    alone would want every parameter's storage at once (the whole model on every rank), and as a context
    around the model's construction it needs the model built inside it, where here it is built before the
    engine. The first parameter goes through `zero.Init(module=...)`, the rest through the converter it
    attaches to every parameter it makes (`convert_to_zero_parameters`, which DeepSpeed's own engine uses
    to convert parameters added later), consumed lazily; a last `zero.Init(module=model)` finds every
    parameter converted and does the rest of what it does to a model (the buffers it keeps in fp32), as
    `deepspeed.initialize` would have. zero.Init broadcasts each tensor from the first rank as it
    partitions it, undefined values included: one model's worth of traffic, once, at the start."""
    import deepspeed

    from ..models.initial import given_storage

    stream = given_storage(model, device, dtype)  # in the dtype DeepSpeed computes in, as under zero.Init
    holder = nn.Module()
    holder.register_parameter("first", next(stream))
    deepspeed.zero.Init(module=holder, config_dict_or_path=config)
    holder.first.convert_to_zero_parameters(stream)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    return model


def _at_end_of_backward(fn):
    """A tensor hook that queues `fn` to run once the current backward pass has finished."""
    def hook(grad):
        torch.autograd.Variable._execution_engine.queue_callback(fn)
        return grad
    return hook


def _shape(p: nn.Parameter):
    return getattr(p, "ds_shape", p.shape)


class Zero1Engine(ZeroEngine):
    stage = 1
    sharding = Sharding(optim=True, low_precision_states=True)


class Zero2Engine(ZeroEngine):
    stage = 2
    sharding = Sharding(grads=True, optim=True, low_precision_states=True)


class Zero3Engine(ZeroEngine):
    stage = 3
    sharding = Sharding(params=True, grads=True, optim=True, low_precision_states=True)
