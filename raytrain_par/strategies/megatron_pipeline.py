"""Megatron-LM's 3D layout: tensor x pipeline x data parallel (strategy megatron with `stages: P > 1`).

num_workers = P x T x D. Rank r sits at (pipeline p, data d, tensor t) with r = (p * D + d) * T + t
(layout.py): the T ranks splitting one stage's layers are neighbours, then the stage's D replicas,
then the P stages of a pipeline.

The parallelisms are applied to the plain model in one fixed order, as torchtitan does:
1. tensor parallel inside each stage: the whole model is split by its family's plan (megatron.py's
   `split_lm`: heads, MLP units and vocabulary rows over T ranks), and its LM head becomes one that
   gives the logits of this rank's vocabulary slice;
2. pipeline: the pipeline engine's split (stages.Pipeline; the split points are measured on the plain
   model, so they are those of strategy pipeline) and its schedules (torch.distributed.pipelining),
   on the pipeline group of this rank's data and tensor coordinates; the token embedding tied to the
   LM head is untied across stages as there, its copies' gradients summed per tensor rank;
3. data parallel: each stage's gradients averaged over its D replicas by an explicit all-reduce (as
   the pipeline engine does; DDP fails around torch's schedules), or, with `data_parallel_sharding:
   fsdp`, each stage's tensor-parallel shard split once more over its D replicas by FSDP2 (every layer
   a unit, then the stage; the pipeline engine's `shard`): parameters, gradients and optimizer state
   / (T x D) per worker, all-gathered for each step and reduce-scattered after its last backward pass.

The last stage's loss is the vocabulary-parallel cross-entropy of megatron, so no rank holds the full
logits. Gradient clipping takes the norm of the whole model's gradient with every parameter counted
once: split parameters' squares summed over the tensor group, replicated ones (layer norms, position
embeddings, row-parallel biases; identical on the T ranks) once, the untied copy of the embedding
not at all, then summed over the pipeline (and, under fsdp, over the replicas' slices): the shared
step's norm (base.Engine.global_grad_norm) of this engine's `counted_grads`.

Checkpoints are the one format (strategies/state.py): the stages' weights and optimizer states
whole by the plain model's names (gathered over the replicas under fsdp, joined over the tensor
group, gathered over the pipeline), cut again at load by this run's stages and T; so a run resumes
with other stages, tensor_parallel, schedule or number of workers, or as another strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import models
from . import tensor_parallel as tp_ops
from .dtensor import local_tensor
from .megatron import Options
from .pipeline import PipelineEngine
from .tensor_parallel import TPGroup
from .tensor_split import (TP_RNG_OFFSET, ShapesOnly, SplitState, gather_shards, local_logits, padding_of,
                           split_lm, vocab_parallel_sums)


class VocabParallelHead(nn.Module):
    """The LM head on the last stage: this rank's logits [b, s, vocab/T]. Holds the vocabulary rows'
    parameter itself (the token embedding's, when they are tied), so that the pipeline sees the tie."""

    def __init__(self, head: tp_ops.VocabParallelEmbedding, vocab_size: int):
        super().__init__()
        self.weight, self.start, self.tp = head.weight, head.start, head.tp
        self.register_buffer("padding", padding_of(head, vocab_size), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return local_logits(hidden, self.weight, self.padding, self.tp).view(*hidden.shape[:-1], -1)


def split_shapes(model: nn.Module, tensor_parallel: int) -> tuple[ShapesOnly, int]:
    """Split `model` in place as one of `tensor_parallel` ranks holds it, shapes only (no process group),
    its LM head the stages' vocabulary-parallel one (holding the vocabulary rows, so a tie to the
    embedding is kept): `models.pipeline_layers(model)` are then that rank's layers. Returns the group
    the split layers sum over (it sums nothing) and the first vocabulary row of the rank's slice."""
    tp = ShapesOnly(None, tensor_parallel, 0)
    split = split_lm(model, tp, tp_ops.ParallelRNG(0, torch.device("cpu")))
    model.lm_head = VocabParallelHead(split.model.head, model.config.vocab_size)
    return tp, split.model.vocab_start


class _SplitVocabularyTask:
    """The task, with evaluation's sums taken from split logits."""

    def __init__(self, task, start: int, tp: TPGroup):
        self.task, self.start, self.tp = task, start, tp

    def __getattr__(self, name):
        return getattr(self.task, name)

    def sums_from(self, logits, labels):
        return vocab_parallel_sums(logits.flatten(0, -2), labels, self.start, self.tp)


class MegatronPipelineEngine(SplitState, PipelineEngine):
    """Strategy megatron with `stages > 1` (megatron's Options choose it: `Options.engine`)."""

    Options = Options

    def __init__(self, model: nn.Module, task, train, options, ctx, total_steps: int):
        self.vocab_size = model.config.vocab_size
        self.plain_keys = list(model.state_dict())  # names (and order) of the plain model's state dict
        super().__init__(model, task, train, options, ctx, total_steps)
        self.names = {id(p): self.pipe.names[s][n] for s, m in self.pipe.modules.items()
                      for n, p in m.named_parameters()}

    @classmethod
    def schedule_options(cls, options):
        return options.pipeline_options()

    @classmethod
    def estimate_stage_inputs(cls, model, task, options):
        """The layers as one tensor-parallel rank holds them (shapes only, no process group) and the
        vocabulary-parallel loss of its logits."""
        tp, start = split_shapes(model, options.tensor_parallel)

        def loss(logits, labels):
            return tp_ops.vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), start, tp).mean()

        return models.pipeline_layers(model), loss

    def split_layers(self, lm: nn.Module) -> None:
        """Tensor parallel first, on the whole model: every layer split, the LM head made vocabulary-parallel."""
        place = self.placement
        self.tp = TPGroup(place.tp_group, self.layout.tensor, place.tp_rank)
        self.rng = tp_ops.ParallelRNG(self.train.seed + TP_RNG_OFFSET + self.tp.rank, self.device)
        split = split_lm(lm, self.tp, self.rng)
        self.splits, self.vocab_names, self.tied_head = split.cuts, split.vocab, split.tied_head
        self.head_start = split.model.vocab_start
        lm.lm_head = VocabParallelHead(split.model.head, self.vocab_size)

    def stage_loss(self, logits, labels):
        return tp_ops.vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), self.head_start,
                                                   self.tp).mean()

    @property
    def eval_task(self):
        return _SplitVocabularyTask(self.task, self.head_start, self.tp)

    def counted_grads(self):
        """Split parameters' gradients and replicated ones (layer norms, position embeddings, row-parallel
        biases; identical on the T ranks), each parameter once over the pipeline (the untied copy of the
        embedding left out)."""
        counted = [p for p in self.pipe.counted() if p.grad is not None]
        return ([local_tensor(p.grad) for p in counted if self.names[id(p)] in self.splits],
                [local_tensor(p.grad) for p in counted if self.names[id(p)] not in self.splits])

    def reduce_over_tensor(self, t):
        return self.tp.all_reduce(t)

    # -- state ------------------------------------------------------------------------------------
    def full_state_dict(self):
        """The plain model's state dict: the stages gathered over the pipeline, then the shards over the
        tensor group (every rank)."""
        return gather_shards(self.pipe.full_state_dict(), self.splits, self.vocab_names, self.vocab_size, self.tp,
                             self.tied_head, self.plain_keys)
