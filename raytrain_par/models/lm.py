"""What the transformers language-model families (gpt2, causal-lm) share: the task, the example
input, which modules activation checkpointing recomputes, and export as a `save_pretrained`
directory with the run's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from . import checkpointing
from .task import LanguageModelling

CHECKPOINTING = ("full", "selective")


def finish(model: nn.Module, family: str, info) -> tuple[nn.Module, LanguageModelling]:
    """Mark a freshly built LM with its family and input (one row of data.seq_len token ids)."""
    model.family, model.input_shape, model.input_dtype = family, (info.seq_len,), torch.long
    return model, LanguageModelling()


def check_dropout(dropout, error) -> None:
    if dropout is not None and not 0.0 <= dropout < 1.0:
        error("model.dropout", dropout, "must be in [0, 1)", "use e.g. 0.1, or 0 for none")


def checkpoint_units(model: nn.Module, mode: str) -> list[nn.Module]:
    """full: every transformer block; selective: the self-attention of every block."""
    return checkpointing.transformer_units(model, mode)


def export(model: nn.Module, out: Path, spec, info, write_weights) -> None:
    """transformers' `save_pretrained` directory (AutoModelForCausalLM.from_pretrained loads it): its config
    and generation config from `model` (on the meta device), the weights by `write_weights()`, and the
    tokenizer the run trained on as tokenizer.json."""
    # what save_pretrained writes beside the weights
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    write_weights()
    if info.tokenizer_path and Path(info.tokenizer_path).exists():
        shutil.copy2(info.tokenizer_path, Path(out) / "tokenizer.json")
