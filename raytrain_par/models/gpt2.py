"""GPT-2 language models from transformers configs, randomly initialised (nothing downloads).

`model: {name: gpt2-small}` builds a preset; `n_layer`, `n_embd`, `n_head` override its sizes. The
vocabulary is the tokenizer's and the positions are `data.seq_len`. (Any other GPT-2 config.json
trains through the causal-lm family.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from . import lm
from .initial import hf_init
from .plans import TensorParallelPlan
from .task import Task

if TYPE_CHECKING:  # transformers takes seconds to import: only processes that build a GPT-2 pay for it
    from transformers import GPT2Config, GPT2LMHeadModel

# Sizes follow the GPT-2 paper for small/medium/large; tiny and mini are CPU-sized members of the
# same family for tests and quickstarts.
PRESETS: dict[str, dict[str, int]] = {
    "gpt2-tiny": dict(n_layer=2, n_embd=128, n_head=4),
    "gpt2-mini": dict(n_layer=4, n_embd=256, n_head=4),
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
}
NAMES = tuple(PRESETS)
KIND = "text"
LAYERS = "embeddings, blocks, final norm + head"


@dataclass
class Options:
    """`model:` keys of the GPT-2 presets."""

    dropout: float = 0.0
    n_layer: Optional[int] = None  # override the preset's sizes
    n_embd: Optional[int] = None
    n_head: Optional[int] = None

    def validate(self, spec, error) -> None:
        lm.check_dropout(self.dropout, error)
        s = sizes(spec.model.name, self)
        for k in ("n_layer", "n_embd", "n_head"):
            if s[k] < 1:
                error(f"model.{k}", s[k], "must be >= 1", "use a positive size")
        if s["n_embd"] % s["n_head"]:
            error("model.n_head", s["n_head"], f"n_embd {s['n_embd']} is not divisible by n_head {s['n_head']}",
                  "choose n_head dividing n_embd (e.g. 4 for n_embd 128)")

    def vocab_size(self) -> int | None:
        """The vocabulary the model asks for: none, the tokenizer's size is used."""
        return None


def sizes(name: str, options: Options) -> dict[str, int]:
    """n_layer, n_embd, n_head: the preset's, with the options' overrides."""
    out = dict(PRESETS[name])
    out.update({k: getattr(options, k) for k in ("n_layer", "n_embd", "n_head") if getattr(options, k)})
    return out


def build(name: str, options: Options, info) -> tuple[nn.Module, Task]:
    model = build_gpt2(gpt2_config(sizes(name, options), info.vocab_size, info.seq_len, options.dropout))
    return lm.finish(model, "gpt2", info)


def pipeline_layer_count(name: str, options: Options) -> int:
    return sizes(name, options)["n_layer"] + 2


def tensor_parallel_plan(name: str, options: Options) -> TensorParallelPlan:
    s = sizes(name, options)
    return plan(s["n_embd"], s["n_head"], "model.")


def plan_of(model: nn.Module) -> TensorParallelPlan:
    return plan(model.config.n_embd, model.config.n_head, "model.")


export = lm.export
initialiser = hf_init
checkpoint_units = lm.checkpoint_units
CHECKPOINTING = lm.CHECKPOINTING


def gpt2_config(sizes: dict[str, int], vocab_size: int, seq_len: int, dropout: float) -> GPT2Config:
    """`sizes`: n_layer, n_embd, n_head (a preset, possibly with some of them overridden)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        # token 0 is the tokenizer's <|endoftext|>; GPT-2's own id (50256) is outside our vocabularies
        bos_token_id=0,
        eos_token_id=0,
        # Training only: with a key/value cache every attention layer would keep copies of k and v
        # for backward (2 x batch x seq x n_embd floats per layer) instead of views of c_attn's output.
        use_cache=False,
        **sizes,
    )


def build_gpt2(config: GPT2Config) -> GPT2LMHeadModel:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(config)



def plan(n_embd: int, n_head: int, field_prefix: str) -> TensorParallelPlan:
    """How GPT-2's layers split for tensor parallel: q, k, v (fused in c_attn, cut separately) and the
    first MLP layer by output column, the attention output and the second MLP layer by input row, the
    token embedding (tied with the LM head) by vocabulary row; each rank's attention runs its own
    n_head / T heads. Position embedding and layer norms are replicated."""
    return TensorParallelPlan(
        layers={
            r"transformer\.wte": "vocab",
            r"transformer\.h\.\d+\.attn\.c_attn": "colwise_qkv",
            r"transformer\.h\.\d+\.attn\.c_proj": "rowwise",
            r"transformer\.h\.\d+\.mlp\.c_fc": "colwise",
            r"transformer\.h\.\d+\.mlp\.c_proj": "rowwise",
        },
        divisible=[(f"{field_prefix}n_embd", n_embd, "hidden size"),
                   (f"{field_prefix}n_head", n_head, "attention heads")],
        localize=_local_heads,
    )


def _local_heads(model: nn.Module, t: int) -> None:
    for block in model.transformer.h:
        attn = block.attn
        attn.num_heads, attn.split_size, attn.embed_dim = attn.num_heads // t, attn.split_size // t, attn.embed_dim // t

# -- pipeline layers -----------------------------------------------------------------------------
# A pipeline splits a GPT-2 between these layers, never inside one: the embeddings, each transformer
# block, and the final norm with the LM head. Each layer holds the model's own modules (so parameter
# names map back to the plain model's) and maps one tensor to one tensor, as pipeline stages need.

def positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


class Embeddings(nn.Module):
    """Token + position embeddings and dropout: input ids [B, T] -> hidden states [B, T, D]."""

    def __init__(self, transformer):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(input_ids) + self.wpe(positions(input_ids)))


class Block(nn.Module):
    """One transformer block, given the causal mask GPT2Model would give it (None under SDPA)."""

    def __init__(self, block, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        # Positions are always 0..T-1 here (no packed sequences), so they need not be given to the mask.
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=None)
        return self.block(hidden, None, mask)


class Head(nn.Module):
    """Final layer norm and LM head: hidden states -> logits [B, T, vocab]."""

    def __init__(self, ln_f, lm_head):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def pipeline_layers(model: GPT2LMHeadModel) -> list[nn.Module]:
    t = model.transformer
    return [Embeddings(t), *(Block(b, t.config) for b in t.h), Head(t.ln_f, model.lm_head)]
