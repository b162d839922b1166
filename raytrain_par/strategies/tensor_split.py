"""Splitting a transformers causal LM for Megatron-style tensor parallel, by its family's plan
(models/plans.py), and joining the shards again: what strategy megatron applies to the plain model
before any other parallelism (tensor x data in megatron.py, tensor x pipeline x data in
megatron_pipeline.py).

Each rank keeps n_head/T attention heads (its slices of q, k and v; with grouped-query attention also
of the key/value heads), 1/T of the MLP units, and vocab/T rows of the token embedding and of the LM
head (one matrix when they are tied), padded to a multiple of T as Megatron-LM pads them. Split
parameters keep the plain model's names, so shards' state dicts do too; `gather_shards` and
`join_shards` give the plain model's tensors back.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import models
from . import tensor_parallel as tp_ops
from .pieces import Piece, Region, chunk, dtensor_piece
from .tensor_parallel import TPGroup


# How each split style cuts a layer's parameters: name -> (dim, parts). transformers' Conv1D (GPT-2)
# stores weights [in, out], nn.Linear [out, in]. A row-parallel bias is replicated: it is added once,
# after the sum. Embeddings and LM heads are [vocab, width].
SPLITS: dict[tuple[str, str], dict[str, tuple[int, int]]] = {
    ("colwise", "Conv1D"): {"weight": (1, 1), "bias": (0, 1)},
    ("colwise_qkv", "Conv1D"): {"weight": (1, 3), "bias": (0, 3)},
    ("rowwise", "Conv1D"): {"weight": (0, 1)},
    ("colwise", "Linear"): {"weight": (0, 1), "bias": (0, 1)},
    ("rowwise", "Linear"): {"weight": (1, 1)},
    ("vocab", "Embedding"): {"weight": (0, 1)},
    ("vocab", "Linear"): {"weight": (0, 1)},
}
TP_RNG_OFFSET = 2718  # Megatron-LM's: the attention-dropout seed of tensor-parallel rank r is seed + 2718 + r


class TensorParallelLM(nn.Module):
    """The backbone of a transformers causal LM with its layers split, and this rank's rows of the
    LM head; forward returns the mean LM loss. Submodules keep the plain model's names
    (`transformer.*` / `model.*`, `lm_head.*` when untied), so shards' state dicts do too.

    The LM head gives logits of this rank's vocabulary slice only, padded rows masked out."""

    def __init__(self, lm: nn.Module, head: tp_ops.VocabParallelEmbedding, tied: bool, tp: TPGroup, vocab_size: int):
        super().__init__()
        self.prefix = lm.base_model_prefix
        self._no_split_modules = lm._no_split_modules  # the blocks FSDP shards one by one
        self.add_module(self.prefix, lm.base_model)
        if not tied:
            self.lm_head = head
        object.__setattr__(self, "head", head)  # registered once, in the backbone or as lm_head
        self.tp, self.vocab_size = tp, vocab_size
        self.vocab_start = head.start
        self.register_buffer("padding", padding_of(head, vocab_size), persistent=False)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's logits [tokens, vocab/T]."""
        hidden = getattr(self, self.prefix)(input_ids=input_ids, use_cache=False).last_hidden_state
        return local_logits(hidden, self.head.weight, self.padding, self.tp)

    def token_losses(self, input_ids, labels) -> torch.Tensor:
        return tp_ops.vocab_parallel_cross_entropy(self.logits(input_ids), labels.flatten(), self.vocab_start, self.tp)

    def forward(self, input_ids, labels, sums: bool = False):
        """The mean loss; with `sums`, evaluation's sums (through forward, so that FSDP gathers the
        parameters it holds at the root)."""
        return self.eval_sums(input_ids, labels) if sums else self.token_losses(input_ids, labels).mean()

    @torch.no_grad()
    def eval_sums(self, input_ids, labels) -> torch.Tensor:
        return vocab_parallel_sums(self.logits(input_ids), labels, self.vocab_start, self.tp)


def padding_of(head: tp_ops.VocabParallelEmbedding, vocab_size: int) -> torch.Tensor | None:
    """Which of this rank's vocabulary rows are padding (Megatron pads the vocabulary to a multiple of
    T), or None where none are."""
    ids = torch.arange(head.start, head.start + head.weight.shape[0], device=head.weight.device)
    return ids >= vocab_size if head.start + head.weight.shape[0] > vocab_size else None


def local_logits(hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None, tp: TPGroup) -> torch.Tensor:
    """This rank's logits [tokens, vocab/T] of hidden states [..., h], padding rows masked out; in fp32
    also under 16-bit autocast (the softmax)."""
    logits = torch.mm(tp_ops.copy_to(hidden.flatten(0, -2), tp), weight.t()).float()
    return logits.masked_fill(padding, float("-inf")) if padding is not None else logits


@torch.no_grad()
def vocab_parallel_sums(logits: torch.Tensor, labels: torch.Tensor, start: int, tp: TPGroup) -> torch.Tensor:
    """[summed loss, tokens, correct next-token predictions] of split logits [tokens, vocab/T], as
    Task.eval_sums."""
    labels = labels.flatten()
    loss = tp_ops.vocab_parallel_cross_entropy(logits, labels, start, tp)
    correct = tp_ops.vocab_parallel_argmax(logits, start, tp) == labels
    return torch.stack([loss.sum(), torch.tensor(float(labels.numel()), device=loss.device), correct.sum().float()])


@dataclass
class Split:
    """What splitting a model left behind: every split parameter's (dim, parts) by plain name, the
    parameters cut by vocabulary row (padded to a multiple of T), and the tied LM head's name."""

    model: TensorParallelLM
    cuts: dict[str, tuple[int, int]]
    vocab: set[str]
    tied_head: str | None


def split_lm(lm: nn.Module, tp: TPGroup, rng: tp_ops.ParallelRNG) -> Split:
    """Split a plain transformers causal LM in place for tensor-parallel rank tp.rank of tp.size, by
    its family's plan."""
    plan = models.tensor_parallel_plan_of(lm)
    vocab_size, t = lm.config.vocab_size, tp.size
    input_embeddings, output_embeddings = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = output_embeddings.weight is input_embeddings.weight
    module_names = {id(m): n for n, m in lm.named_modules()}
    cuts: dict[str, tuple[int, int]] = {}
    vocab: set[str] = set()
    replaced: dict[int, nn.Module] = {}
    for name, module in list(lm.named_modules()):
        style = next((s for pattern, s in plan.layers.items() if re.fullmatch(pattern, name)), None)
        if style is None or (tied and module is output_embeddings):  # a tied head is the embedding
            continue
        layout = SPLITS[(style, type(module).__name__)]
        params = {k: cut for k, cut in layout.items() if getattr(module, k, None) is not None}
        cuts.update({f"{name}.{k}": cut for k, cut in params.items()})
        if style == "vocab":
            # Megatron pads the vocabulary to a multiple of T (the tokenizer's size is known only once
            # the data is prepared); the padding rows are zeros whose logits are masked out.
            rows = -(-vocab_size // t)
            w = module.weight.data
            full = torch.cat([w, w.new_zeros(rows * t - w.shape[0], w.shape[1])])
            new = tp_ops.VocabParallelEmbedding(full[tp.rank * rows:(tp.rank + 1) * rows].clone(), tp.rank * rows, tp)
            vocab.add(f"{name}.weight")
        else:
            local = {k: tp_ops.shard(getattr(module, k).data, *cut, tp.rank, t) for k, cut in params.items()}
            bias = local.get("bias", module.bias.data if module.bias is not None else None)
            new = tp_ops.PARALLEL_LAYERS[(style.removesuffix("_qkv"), type(module).__name__)](local["weight"], bias, tp)
        parent, _, attr = name.rpartition(".")
        setattr(lm.get_submodule(parent) if parent else lm, attr, new)
        replaced[id(module)] = new
    if plan.localize:
        plan.localize(lm, t)
    for module in lm.modules():  # attention draws its dropout from the tensor-parallel stream
        if type(module).__name__.endswith("Attention"):
            module.tp_rng = rng
    _run_attention_in_split_region(lm)
    head = replaced[id(input_embeddings if tied else output_embeddings)]
    tied_head = f"{module_names[id(output_embeddings)]}.weight" if tied else None
    return Split(TensorParallelLM(lm, head, tied, tp, vocab_size), cuts, vocab, tied_head)


def _run_attention_in_split_region(lm: nn.Module) -> None:
    """Wrap the model's attention implementation (sdpa, eager, flash...) so that attention dropout draws
    from the module's tensor-parallel stream, through transformers' AttentionInterface; its masks are
    made as for the wrapped implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    inner_name = lm.config._attn_implementation
    if inner_name.startswith("tensor_parallel_"):
        return
    if inner_name == "eager":  # each model file has its own eager attention
        inner = sys.modules[type(lm).__module__].eager_attention_forward
    else:
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.training and kwargs.get("dropout", 0.0) > 0:
            with module.tp_rng.fork():
                return inner(module, query, key, value, attention_mask, **kwargs)
        return inner(module, query, key, value, attention_mask, **kwargs)

    name = f"tensor_parallel_{inner_name}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner_name])
    lm.set_attn_implementation(name)

class ShapesOnly(TPGroup):
    """A tensor-parallel group for estimating one rank's share: shapes as with `size` ranks, no
    communication (the sums are shape-preserving)."""

    def all_reduce(self, t, op=dist.ReduceOp.SUM):
        return t


def join_shards(name: str, shards: list[torch.Tensor], splits: dict, vocab_names: set, vocab_size: int) -> torch.Tensor:
    """A parameter's whole tensor from its T shards (vocabulary padding cut off)."""
    full = tp_ops.unshard(shards, *splits[name])
    return full[:vocab_size] if name in vocab_names else full


def gather_shards(state: dict[str, torch.Tensor], splits: dict, vocab_names: set, vocab_size: int, tp: TPGroup,
                  tied_head: str | None, plain_keys: list[str]) -> dict[str, torch.Tensor]:
    """The plain model's state dict from this rank's shard of it (named as the plain model's), split
    parameters gathered over the tensor-parallel group (a collective), in the plain model's order."""
    out = {name: _whole(name, p, splits, vocab_names, vocab_size, tp) for name, p in state.items()}
    if tied_head:
        out[tied_head] = out[next(iter(vocab_names))]
    return {k: out[k] for k in plain_keys}


def _whole(name: str, t: torch.Tensor, splits: dict, vocab_names: set, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    if name in splits and tp.size > 1:
        shards = [torch.empty_like(t) for _ in range(tp.size)]
        dist.all_gather(shards, t.contiguous(), group=tp.group)
        return join_shards(name, shards, splits, vocab_names, vocab_size)
    return t[:vocab_size] if name in vocab_names else t


def split_piece(local: tuple[int, ...], split: tuple[int, int] | None, vocab: bool, vocab_size: int, rank: int,
                size: int) -> Piece:
    """The piece of the plain model's tensor that tensor-parallel rank `rank` of `size` holds as a shard of
    shape `local`: the whole where it is not `split` (dim, parts); vocabulary rows [rank x rows, ...) up to
    the vocabulary's size (the rest of the shard: padding); otherwise along `dim`, each of the `parts`
    blocks' `rank`-th chunk, side by side in the shard."""
    if split is None:
        return Piece.whole(local)
    dim, parts = split
    if vocab:
        first = rank * local[0]
        rows = max(0, min(local[0], vocab_size - first))
        shape = (vocab_size, *local[1:])
        return Piece(shape, (Region((first, *(0,) * (len(local) - 1)), (rows, *local[1:]), (0,) * len(local)),)
                     if rows else ())
    whole = local[dim] * size
    shape, regions, at = (*local[:dim], whole, *local[dim + 1:]), [], 0
    for k in range(parts):
        block, length = chunk(whole, parts, k)
        start, n = chunk(length, size, rank)
        origin = [0] * len(local)
        regions.append(Region(tuple(origin[:dim] + [block + start] + origin[dim + 1:]),
                              (*local[:dim], n, *local[dim + 1:]), tuple(origin[:dim] + [at] + origin[dim + 1:])))
        at += n
    assert at == local[dim], f"a shard of {local[dim]} along dim {dim} is not 1/{size} of {parts} blocks"
    return Piece(shape, tuple(regions))


class SplitState:
    """A tensor of the plain model from this rank's shard of it and back, by the plain model's name, and
    the attention-dropout stream, for the engines that hold a split model (megatron.py,
    megatron_pipeline.py: their `splits`, `vocab_names`, `vocab_size`, `tp` and `rng`). Used one tensor
    at a time by checkpoints (strategies/state.py): a weight or any optimizer state of it is cut as the
    weight is."""

    splits: dict
    vocab_names: set
    vocab_size: int
    tp: TPGroup
    rng: tp_ops.ParallelRNG

    def whole_of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Whole from this rank's shard (a collective over the tensor-parallel group, for a split tensor)."""
        return _whole(name, t, self.splits, self.vocab_names, self.vocab_size, self.tp)

    def piece_of(self, name: str, t: torch.Tensor) -> Piece:
        """Which part of the plain model's tensor `name` this rank's `t` holds: Megatron's cut (a box per
        fused part, each cut over the T ranks as `tensor_parallel.shard` cuts it; the vocabulary's rows of
        this rank, its padding rows in none), then, where `t` is a DTensor sharded over the data-parallel
        replicas, that DTensor's shard of the cut."""
        local = tuple(t.shape)  # a DTensor's: the whole tensor-parallel shard
        cut = split_piece(local, self.splits.get(name), name in self.vocab_names, self.vocab_size,
                          self.tp.rank, self.tp.size)
        if hasattr(t, "device_mesh"):
            shard = dtensor_piece(t).regions[0]
            cut = cut.within(shard.start, shard.size)
        return cut

    def rng_state(self):
        return {"tp_rank": self.tp.rank, "tp_size": self.tp.size, "state": self.rng.state}

    def load_rng_state(self, saved):
        """The attention-dropout stream of this tensor rank; a stream of another T has no counterpart
        (this rank keeps its fresh one)."""
        if (saved["tp_rank"], saved["tp_size"]) == (self.tp.rank, self.tp.size):
            self.rng.state = saved["state"].cpu()
