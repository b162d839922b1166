"""Megatron-style tensor parallel for GPT-2, alone or combined with data parallel (T x D workers).

`tensor_parallel: T` splits transformers' GPT2LMHeadModel over T ranks the way Megatron-LM does
(models/gpt2.py TENSOR_PARALLEL_PLAN): each rank holds n_head/T attention heads (its slices of q,
k and v, cut separately out of the fused c_attn), 4*n_embd/T MLP units, and vocab/T rows of the
token embedding, which is also the LM head; the loss is a vocabulary-parallel cross-entropy, so no
rank holds the full logits. Per layer that costs two all-reduces of the activations [b, s, h]
forward and two backward (see tensor_parallel.py for the operators).

With num_workers = T x D, rank r sits at (dp = r // T, tp = r % T): the T ranks of a
tensor-parallel group are adjacent (within a node first, where links are fastest) and read the
same data-parallel slice; each tensor-parallel shard is wrapped in DDP over its D replicas, so
gradients are averaged only within the data-parallel group.

Randomness: the default generator is seeded identically on every rank (models.build), so dropout
of replicated activations (embedding, residual) draws the same mask on all ranks of a group and
the same as a single process would; attention dropout, on each rank's own heads, draws from a
per-rank stream (seed + 2718 + tp rank, as Megatron-LM) forked out of the default one, so heads
on different ranks get independent masks and the default stream advances exactly as with T = 1.

Checkpoints: the first data-parallel replica's T ranks each write their shard (model, optimizer,
scheduler, attention-dropout stream) with the parameter names of the plain model. A checkpoint
written with one T loads with another: shards are joined and re-split, parameter by parameter.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..metrics.memory import SavedActivations
from . import tensor_parallel as tp_ops
from .base import DistContext, Engine, build_optimizer, load_tensors, lr_factor, split_batch
from .tensor_parallel import TPGroup

# How each split style cuts a Conv1D's (or the embedding's) parameters: name -> (dim, parts).
# Conv1D weights are [in, out]. A row-parallel bias is replicated: it is added once, after the sum.
SPLITS: dict[str, dict[str, tuple[int, int]]] = {
    "colwise": {"weight": (1, 1), "bias": (0, 1)},
    "colwise_qkv": {"weight": (1, 3), "bias": (0, 3)},
    "rowwise": {"weight": (0, 1)},
    "vocab": {"weight": (0, 1)},
}
TP_RNG_OFFSET = 2718  # Megatron-LM's: the attention-dropout seed of tensor-parallel rank r is seed + 2718 + r


@dataclass
class Options:
    """`strategy:` keys for megatron."""

    tensor_parallel: int  # T: ranks each layer is split over; num_workers = T x data-parallel replicas
    bucket_cap_mb: float = 25.0  # DDP buckets of the data-parallel gradient all-reduce

    #: a checkpoint loads with another tensor_parallel and worker count (shards are joined and re-cut)
    checkpoints_reshard = True

    def validate(self, spec, error) -> None:
        from .. import models  # config imports strategies: import the model registry lazily

        t = self.tensor_parallel
        if t < 1:
            error("strategy.tensor_parallel", t, "must be >= 1", "use e.g. 2")
        if self.bucket_cap_mb <= 0:
            error("strategy.bucket_cap_mb", self.bucket_cap_mb, "must be > 0", "use e.g. 25 (PyTorch's default)")
        m = spec.model
        if m.name not in models.GPT2_NAMES:
            error("model.name", m.name, "megatron splits transformer layers (attention heads, MLP units, vocabulary); "
                  f"{m.name} has none", f"use a GPT-2 model ({', '.join(models.GPT2_NAMES)}), or strategy ddp for "
                  f"{m.name}")
        sizes = models.gpt2_sizes(m)
        if sizes["n_embd"] % t:
            error("model.n_embd", sizes["n_embd"], f"the hidden size does not split over tensor_parallel {t}",
                  f"use a multiple of {t} (e.g. {_next_multiple(sizes['n_embd'], t)}), or a tensor_parallel dividing it")
        if sizes["n_head"] % t:
            error("model.n_head", sizes["n_head"], f"the attention heads do not split over tensor_parallel {t}",
                  f"use a multiple of {t} heads dividing n_embd {sizes['n_embd']}, or a tensor_parallel dividing "
                  f"{sizes['n_head']}")
        if spec.data.vocab_size % t:
            error("data.vocab_size", spec.data.vocab_size, f"the vocabulary does not split over tensor_parallel {t}",
                  f"use a multiple of {t}, e.g. {_next_multiple(spec.data.vocab_size, t)}")
        if spec.train.optimizer == "lamb" and t > 1:
            error("train.optimizer", "lamb", "LAMB scales each tensor's step by the norm of the whole tensor, and "
                  "tensor parallel holds slices of them", "use adamw or sgd with megatron, or tensor_parallel: 1")
        if spec.train.precision == "fp16":
            error("train.precision", "fp16", "megatron computes in 16 bits by autocast and has no loss scaler",
                  "use bf16 (autocast, no scaling needed) or fp32")
        n = spec.scaling.num_workers
        if n % t:
            error("scaling.num_workers", n, f"not a multiple of tensor_parallel {t} (workers = tensor x data parallel)",
                  f"use {_next_multiple(n, t)} workers ({_next_multiple(n, t) // t} data-parallel replicas of {t}), "
                  f"or a tensor_parallel dividing {n}")

    def data_parallel_size(self, num_workers: int) -> int:
        return num_workers // self.tensor_parallel


def _next_multiple(n: int, k: int) -> int:
    return max(k, -(-n // k) * k)


class TensorParallelGPT2(nn.Module):
    """The transformer of a GPT2LMHeadModel with its layers split; forward returns the mean LM loss.

    The LM head is the (tied, vocabulary-parallel) token embedding: logits of this rank's vocabulary
    slice only, padded rows masked out."""

    def __init__(self, lm: nn.Module, tp: TPGroup, vocab_size: int):
        super().__init__()
        self.transformer, self.tp, self.vocab_size = lm.transformer, tp, vocab_size
        wte = self.transformer.wte
        self.vocab_start = wte.start
        ids = torch.arange(wte.start, wte.start + wte.weight.shape[0])
        self.register_buffer("padding", ids >= vocab_size, persistent=False)
        self.padded = bool(self.padding.any())

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's logits [tokens, vocab/T]."""
        hidden = self.transformer(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = torch.mm(tp_ops.copy_to(hidden.flatten(0, 1), self.tp), self.transformer.wte.weight.t())
        logits = logits.float()  # the softmax in fp32 also under 16-bit autocast
        return logits.masked_fill(self.padding, float("-inf")) if self.padded else logits

    def token_losses(self, input_ids, labels) -> torch.Tensor:
        return tp_ops.vocab_parallel_cross_entropy(self.logits(input_ids), labels.flatten(), self.vocab_start, self.tp)

    def forward(self, input_ids, labels):
        return self.token_losses(input_ids, labels).mean()

    @torch.no_grad()
    def eval_sums(self, input_ids, labels) -> torch.Tensor:
        """[summed loss, tokens, correct next-token predictions], as Task.eval_sums."""
        logits = self.logits(input_ids)
        labels = labels.flatten()
        loss = tp_ops.vocab_parallel_cross_entropy(logits, labels, self.vocab_start, self.tp)
        correct = tp_ops.vocab_parallel_argmax(logits, self.vocab_start, self.tp) == labels
        return torch.stack([loss.sum(), torch.tensor(float(labels.numel()), device=loss.device), correct.sum().float()])


def split_gpt2(lm: nn.Module, tp: TPGroup, rng: tp_ops.ParallelRNG) -> tuple[TensorParallelGPT2, dict[str, tuple]]:
    """Split a plain GPT2LMHeadModel in place for tensor-parallel rank tp.rank of tp.size.
    Returns the split model and, for every split parameter (plain names), its (dim, parts)."""
    from ..models.gpt2 import TENSOR_PARALLEL_PLAN

    if lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
        raise ValueError("megatron needs GPT-2's LM head tied to the token embedding (tie_word_embeddings)")
    vocab_size, t = lm.config.vocab_size, tp.size
    splits: dict[str, tuple[int, int]] = {}
    for name, module in list(lm.named_modules()):
        style = next((s for pattern, s in TENSOR_PARALLEL_PLAN.items() if re.fullmatch(pattern, name)), None)
        if style is None:
            continue
        cuts = {k: SPLITS[style][k] for k in ("weight", "bias") if k in SPLITS[style]}
        splits.update({f"{name}.{k}": cut for k, cut in cuts.items()})
        if style == "vocab":
            # Megatron pads the vocabulary to a multiple of T (the tokenizer's size is known only once
            # the data is prepared); the padding rows are zeros whose logits are masked out.
            rows = -(-vocab_size // t)
            full = torch.cat([module.weight.data, module.weight.new_zeros(rows * t - vocab_size, module.weight.shape[1])])
            new = tp_ops.VocabParallelEmbedding(full[tp.rank * rows:(tp.rank + 1) * rows].clone(), tp.rank * rows, tp)
        else:
            local = {k: tp_ops.shard(getattr(module, k).data, *cut, tp.rank, t) for k, cut in cuts.items()}
            if style.startswith("colwise"):
                new = tp_ops.ColumnParallelConv1D(local["weight"], local["bias"], tp)
            else:
                new = tp_ops.RowParallelConv1D(local["weight"], module.bias.data, tp)
        parent, _, attr = name.rpartition(".")
        setattr(lm.get_submodule(parent), attr, new)
    for block in lm.transformer.h:  # attention over this rank's heads only
        attn = block.attn
        attn.num_heads, attn.split_size, attn.embed_dim = attn.num_heads // t, attn.split_size // t, attn.embed_dim // t
        attn.tp_rng = rng
    _run_attention_in_split_region(lm)
    return TensorParallelGPT2(lm, tp, vocab_size), splits


def _run_attention_in_split_region(lm: nn.Module) -> None:
    """Wrap the model's attention implementation (sdpa, eager, flash...) so that attention dropout draws
    from the module's tensor-parallel stream, through transformers' AttentionInterface; its masks are
    made as for the wrapped implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    inner_name = lm.config._attn_implementation
    if inner_name.startswith("tensor_parallel_"):
        return
    inner = eager_attention_forward if inner_name == "eager" else ALL_ATTENTION_FUNCTIONS[inner_name]

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.training and kwargs.get("dropout", 0.0) > 0:
            with module.tp_rng.fork():
                return inner(module, query, key, value, attention_mask, **kwargs)
        return inner(module, query, key, value, attention_mask, **kwargs)

    name = f"tensor_parallel_{inner_name}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    lm.set_attn_implementation(name)


def _count_ddp_allreduce(engine: "MegatronEngine", bucket):
    """DDP comm hook: PyTorch's default all-reduce, counting the bytes it sends."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    engine.dp_bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(engine.dp_group, bucket)


class MegatronEngine(Engine):
    Options = Options

    def __init__(self, model: nn.Module, task, train, options: Options, ctx: DistContext, total_steps: int):
        t = options.tensor_parallel
        if ctx.world_size % t:
            raise ValueError(f"world size {ctx.world_size} is not a multiple of tensor_parallel {t}")
        self._dp_size, self._dp_rank = ctx.world_size // t, ctx.rank // t
        tp_group = self._dp_group = None
        if ctx.distributed:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(ctx.device.type, (self._dp_size, t), mesh_dim_names=("dp", "tp"))
            tp_group, self._dp_group = mesh.get_group("tp"), mesh.get_group("dp")
        # After the process groups: their communication buffers are not model state.
        super().__init__(model, task, train, options, ctx, total_steps)
        self.tp = TPGroup(tp_group, t, ctx.rank % t)
        self.vocab_size = model.config.vocab_size
        self.rng = tp_ops.ParallelRNG(train.seed + TP_RNG_OFFSET + self.tp.rank, self.device)
        self.plain_keys = list(model.state_dict())  # names (and order) of the plain model's state dict
        self.model, self.splits = split_gpt2(model, self.tp, self.rng)
        self.model.to(self.device)
        self.dp_bytes = 0
        if self._dp_size > 1:
            self.module = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                process_group=self._dp_group, bucket_cap_mb=options.bucket_cap_mb, gradient_as_bucket_view=True)
            self.module.register_comm_hook(self, _count_ddp_allreduce)
        else:
            self.module = self.model
        self.optimizer = build_optimizer(self.model, train)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(train, total_steps))
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.activation_bytes: int | None = None
        self.step_comm = {"comm_tp_allreduce_bytes_per_step": 0, "comm_dp_allreduce_bytes_per_step": 0}

    # -- layout ------------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self._dp_size

    @property
    def dp_group(self):
        return self._dp_group

    # -- training ----------------------------------------------------------------------------------
    def train_step(self, batch):
        self.tp.bytes_reduced, self.dp_bytes = 0, 0
        micro = split_batch(batch, self.train.gradient_accumulation_steps)
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            sync = self.module.no_sync() if self.dp_size > 1 and not last else contextlib.nullcontext()
            # Activations: what autograd keeps for backward in one micro-batch's forward (measured once).
            saved = SavedActivations() if self.activation_bytes is None else None
            with sync:
                with saved.track(self.model.parameters()) if saved else contextlib.nullcontext():
                    prepared = self.task.prepare(mb, self.device)
                    with self.autocast():
                        loss = self.module(prepared["input_ids"], prepared["labels"]) / len(micro)
                if saved is not None:
                    self.activation_bytes = saved.peak
                loss.backward()
            total += loss.detach()
        if self.train.grad_clip:
            self.clip_grad_norm(self.train.grad_clip)
        self.optimizer_step()
        self.step_comm = {"comm_tp_allreduce_bytes_per_step": self.tp.bytes_reduced,
                          "comm_dp_allreduce_bytes_per_step": self.dp_bytes}
        return total

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: split parameters' squares summed over the
        tensor-parallel group, replicated ones (identical on every rank) counted once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        split = [p.grad for p in params if self.names[p] in self.splits]
        replicated = [p.grad for p in params if self.names[p] not in self.splits]
        norm = torch.nn.utils.get_total_norm
        split_sq = (norm(split) ** 2 if split else torch.zeros(())).to(self.device).reshape(1)
        total = (self.tp.all_reduce(split_sq) + norm(replicated) ** 2).sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.reshape(()))
        return total

    @torch.no_grad()
    def evaluate(self, batches):
        self.model.eval()
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)
        for batch in batches:
            prepared = self.task.prepare(batch, self.device)
            with self.autocast():
                sums += self.model.eval_sums(prepared["input_ids"], prepared["labels"]).double()
        self.model.train()
        sums = self.dp_sum(sums)
        return self.task.summarize(*[float(x) for x in sums])

    def memory(self) -> dict[str, int | None]:
        # Every key from the first record on (None until measured): records.parquet takes its columns
        # from the first record.
        return {**super().memory(), "mem_activation_bytes": self.activation_bytes, **self.step_comm}

    # -- gathering and re-splitting ----------------------------------------------------------------
    def _join(self, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        full = tp_ops.unshard(shards, *self.splits[name])
        return full[:self.vocab_size] if name == "transformer.wte.weight" else full

    def _cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name == "transformer.wte.weight":
            padded = -(-self.vocab_size // self.tp.size) * self.tp.size
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
        return tp_ops.shard(full, *self.splits[name], self.tp.rank, self.tp.size)

    def full_state_dict(self):
        """The plain GPT2LMHeadModel's state dict (transformers' names, lm_head tied), on every rank."""
        out = {}
        for name, p in self.model.state_dict().items():
            if name in self.splits and self.tp.size > 1:
                shards = [torch.empty_like(p) for _ in range(self.tp.size)]
                dist.all_gather(shards, p.contiguous(), group=self.tp.group)
                out[name] = self._join(name, shards)
            elif name == "transformer.wte.weight":
                out[name] = p[:self.vocab_size]
            else:
                out[name] = p
        out["lm_head.weight"] = out["transformer.wte.weight"]
        return {k: out[k] for k in self.plain_keys}

    # -- checkpoints -------------------------------------------------------------------------------
    def _file(self, rank: int, size: int) -> str:
        return f"megatron-tp{rank}-of-{size}.pt"

    def save(self, directory: Path) -> None:
        if self.dp_rank != 0:
            return  # every data-parallel replica holds the same shards
        optimizer = self.optimizer.state_dict()
        order = [self.names[p] for g in self.optimizer.param_groups for p in g["params"]]
        torch.save({"model": self.model.state_dict(), "optimizer": optimizer, "optimizer_names": order,
                    "scheduler": self.scheduler.state_dict(), "rng": self.rng.state, "vocab_size": self.vocab_size},
                   directory / self._file(self.tp.rank, self.tp.size))

    def load(self, directory: Path) -> None:
        files = sorted(directory.glob("megatron-tp*-of-*.pt"))
        if not files:
            raise FileNotFoundError(f"no megatron checkpoint files in {directory}")
        saved_size = int(re.search(r"-of-(\d+)\.pt$", files[0].name).group(1))
        if saved_size == self.tp.size:
            state = load_tensors(directory / self._file(self.tp.rank, saved_size), self.device)
            self.rng.state = state["rng"].cpu()
        else:  # written with another T: join every parameter's shards and cut this rank's
            shards = [load_tensors(directory / self._file(r, saved_size), torch.device("cpu")) for r in range(saved_size)]
            state = self._resplit(shards)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _resplit(self, shards: list[dict]) -> dict:
        first = shards[0]

        def resplit(name, pieces):
            return self._cut(name, self._join(name, pieces)) if name in self.splits else pieces[0]

        model = {k: resplit(k, [s["model"][k] for s in shards]) for k in first["model"]}
        names = first["optimizer_names"]
        optimizer = {"param_groups": first["optimizer"]["param_groups"], "state": {}}
        for i, per_param in first["optimizer"]["state"].items():
            optimizer["state"][i] = {
                k: resplit(names[i], [s["optimizer"]["state"][i][k] for s in shards])
                if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in per_param.items()}
        # The attention-dropout streams of another T have no counterpart: this rank keeps its fresh one.
        return {"model": model, "optimizer": optimizer, "scheduler": first["scheduler"]}
