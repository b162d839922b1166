"""Any transformers decoder-only causal LM, randomly initialised from its config.json.

    model: {name: causal-lm, config: configs/llama-tiny.json}           # or the directory holding it
    model: {name: causal-lm, config: llama/, overrides: {num_hidden_layers: 4}}

The config is read with transformers' AutoConfig (model_type decides the class) and the model built
with AutoModelForCausalLM.from_config: nothing is downloaded, weights are random. `overrides`
changes config fields (a sweep can vary them: `model.overrides.num_hidden_layers`).

Every strategy that treats the model as a whole (ddp, zero-1/2/3, fsdp) trains any such model.
Tensor parallel and pipeline splitting need to know its layers: GPT-2 configs use GPT-2's (see
gpt2.py), and the Llama-style families (LLAMA_STYLE: same module names, rotary position
embeddings, SwiGLU MLP, grouped-query attention) are split here; another model_type under
megatron or a pipeline is an error that names these families.

The vocabulary is the config's `vocab_size`: a BPE trained on the corpus gets `data.vocab_size`
tokens (by default the config's), a user's tokenizer must fit in it; rows the tokenizer does not
use are never predicted as labels. The config's maximum positions must cover `data.seq_len`.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError
from . import gpt2, lm
from .initial import hf_init
from .plans import TensorParallelPlan, llama_style
from .task import Task

NAMES = ("causal-lm",)
KIND = "text"
LAYERS = "embeddings, decoder layers, final norm + head"
LLAMA_STYLE = ("llama", "mistral", "qwen2")
SPLIT_FAMILIES = ("gpt2",) + LLAMA_STYLE  # model_types megatron and the pipelines can split


@dataclass
class Options:
    """`model:` keys of causal-lm."""

    config: Optional[str] = None  # a transformers config.json, or the directory holding one: random weights
    # a save_pretrained directory, or a Hugging Face hub id found in the local cache: its config and weights
    pretrained: Optional[str] = None
    overrides: Optional[dict] = None  # config fields to change, e.g. {num_hidden_layers: 2}

    def validate(self, spec, error) -> None:
        if (self.config is None) == (self.pretrained is None):
            error("model.config" if self.config else "model", self.config,
                  "a causal-lm starts from random weights (model.config) or from a checkpoint's (model.pretrained): "
                  "give one of them" + (", not both" if self.config else ""),
                  "e.g. `model: {name: causal-lm, config: llama/config.json}` or "
                  "`model: {name: causal-lm, pretrained: ~/models/llama-1b}`")
        # Workers start in another directory: they are given the absolute path (the same file).
        if self.pretrained is not None:
            self.pretrained = str(pretrained_dir(self.pretrained))
        else:
            self.config = str(Path(self.config).expanduser().resolve())
        config = load(self)
        if self.pretrained is not None:
            check_weights(self, config)
        given = self.pretrained or self.config
        positions = max_positions(config)
        if positions is not None and positions < spec.data.seq_len:
            error("data.seq_len", spec.data.seq_len, f"longer than the {positions} positions of {given}",
                  f"use data.seq_len <= {positions}, or raise max_position_embeddings in model.overrides")
        if spec.data.vocab_size is not None and spec.data.vocab_size > config.vocab_size:
            error("data.vocab_size", spec.data.vocab_size,
                  f"more tokens than the model's vocab_size {config.vocab_size} ({given})",
                  f"use data.vocab_size <= {config.vocab_size}, or remove it to take the config's")
        if spec.train.activation_checkpointing != "none":  # its blocks and their attention can be found
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                lm.checkpoint_units(AutoModelForCausalLM.from_config(config), spec.train.activation_checkpointing)

    def vocab_size(self) -> int | None:
        return load(self).vocab_size if (self.config or self.pretrained) else None  # else validate() says


def _path(options: Options) -> Path:
    if options.pretrained is not None:
        return pretrained_dir(options.pretrained) / "config.json"
    path = Path(options.config).expanduser()
    return path / "config.json" if path.is_dir() else path


def load(options: Options):
    """The transformers config (a fresh copy), checked to be a decoder-only causal LM."""
    path = _path(options)
    stamp = path.stat().st_mtime_ns if path.is_file() else None
    field = "model.pretrained" if options.pretrained is not None else "model.config"
    return copy.deepcopy(_load(str(path), stamp, json.dumps(options.overrides or {}, sort_keys=True),
                               options.pretrained or options.config, field))


@functools.lru_cache(maxsize=64)
def pretrained_dir(given: str) -> Path:
    """model.pretrained -> the directory holding its config.json and weights: a directory as given, else
    a hub id (`org/name`) looked up in the local Hugging Face cache. Nothing is downloaded while a run
    starts: on a cluster every node would fetch it, and a missing file should fail before any worker."""
    path = Path(given).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("model.pretrained", given, "the directory holds no config.json",
                              "give the directory `save_pretrained` wrote (config.json and model.safetensors)")
        return path.resolve()
    if path.exists():
        raise ConfigError("model.pretrained", given, "a file, not a directory",
                          "give the directory `save_pretrained` wrote (config.json and model.safetensors)")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", given):
        raise ConfigError("model.pretrained", given, "no such directory", "give the directory `save_pretrained` "
                          "wrote, or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B")
    from huggingface_hub import snapshot_download

    try:
        found = Path(snapshot_download(given, local_files_only=True))
    except Exception:
        raise ConfigError("model.pretrained", given, "no such directory, and no model of that id in the Hugging Face "
                          "cache (nothing is downloaded while a run starts)",
                          f"download it once: `hf download {given}` (on shared storage for a cluster: set HF_HOME), "
                          "or give the directory `save_pretrained` wrote") from None
    if not (found / "config.json").is_file():
        raise ConfigError("model.pretrained", given, f"the cached snapshot {found} holds no config.json",
                          f"download it again: `hf download {given}`")
    return found


def weight_files(directory: Path) -> list[Path]:
    """A save_pretrained directory's safetensors files: those its sharded index names, else model.safetensors.
    Pickled weights (pytorch_model.bin) are refused: loading a pickle runs code from the file. A file the
    index names that is not there is refused, naming it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError("model.pretrained", str(directory), f"its {index.name} is not a weight index ({e!r})",
                              "save the model again with save_pretrained(dir)") from None
        gone = [f.name for f in files if not f.is_file()]
        if gone:
            raise ConfigError("model.pretrained", str(directory),
                              f"its {index.name} names {len(gone)} file(s) that are not there: {', '.join(gone[:3])}",
                              "copy the missing shard files beside the index (or download the model again)")
        return files
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    pickled = [f.name for f in directory.glob("*.bin")]
    raise ConfigError("model.pretrained", str(directory), "holds no safetensors weights" +
                      (f" ({', '.join(pickled)} is a pickle, which is not loaded: loading it runs code from the "
                       "file)" if pickled else ""),
                      "save the model with save_pretrained(dir) (safetensors, transformers' default), or convert "
                      "it once where you trust the file")


def weight_shapes(directory: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of a save_pretrained directory's safetensors weights: its file and shape, read from the
    files' headers (nothing loaded)."""
    from safetensors import safe_open

    shapes = {}
    for f in weight_files(directory):
        with safe_open(str(f), "pt") as weights:
            for key in weights.keys():
                shapes[key] = (f, tuple(weights.get_slice(key).get_shape()))
    return shapes


def _stored_as(directory: Path, wanted: dict[str, tuple[int, ...]], prefix: str) -> dict[str, tuple[Path, str, tuple]]:
    """Each of the model's tensors `wanted` (name -> shape) -> (file, stored key, shape) in a pretrained
    directory: a key as the model names it, or with the base model's prefix added or taken off (how
    transformers matches them). A tensor at another shape, or missing, is refused naming it."""
    found: dict[str, tuple[Path, str, tuple]] = {}
    for key, (file, shape) in weight_shapes(directory).items():
        names = [key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")]
        name = next((n for n in names if n in wanted), None)
        if name is None:
            continue  # a tensor the model does not hold (a saved buffer): transformers leaves it out too
        if shape != wanted[name]:
            raise ConfigError("model.pretrained", str(directory),
                              f"its {key} is {list(shape)}, the model's {list(wanted[name])}",
                              "use the config the weights were saved with: remove model.overrides that change sizes")
        found[name] = (file, key, shape)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ConfigError("model.pretrained", str(directory),
                          f"its weights lack {len(missing)} of the model's {len(wanted)} tensors, e.g. {missing[0]}",
                          "give a checkpoint of this model (the config.json beside the weights decides the model)")
    return found


def check_weights(options: Options, config) -> None:
    """The checkpoint's tensors are the model's, at the model's shapes (model.overrides may change a
    size): refused before anything starts, naming the first that differs."""
    from transformers import AutoModelForCausalLM

    from .initial import tensor_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    wanted, _ = tensor_names(model)
    _stored_as(Path(options.pretrained), {k: tuple(v.shape) for k, v in wanted.items()}, model.base_model_prefix)


@functools.lru_cache(maxsize=16)
def _load(path: str, stamp, overrides_json: str, given: str, field: str = "model.config"):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    if stamp is None:
        raise ConfigError(field, given, "no such file",
                          "give the path of a transformers config.json, or of the directory holding one")
    try:
        raw = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(field, given, f"not a JSON file ({e})", "give a transformers config.json") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(field, given, f"model_type {model_type!r} is not one transformers knows{hint}",
                          "give a transformers config.json with its model_type, e.g. 'llama', 'gpt2', 'qwen2'")
    if (model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or raw.get("is_encoder_decoder")
            or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        raise ConfigError(field, given, f"model_type {model_type!r} is not a decoder-only causal LM",
                          "give the config of a decoder-only causal LM (gpt2, llama, mistral, qwen2, ...)")
    overrides = json.loads(overrides_json)
    known = AutoConfig.for_model(model_type).to_dict()
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            raise ConfigError(f"model.overrides.{key}", overrides[key], f"{model_type} configs have no such field",
                              f"{'did you mean ' + repr(close[0]) + '? ' if close else ''}use a field of config.json")
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    fields.update(overrides)
    # Training only: with a key/value cache every attention layer would keep copies of k and v.
    fields["use_cache"] = False
    return AutoConfig.for_model(model_type, **fields)


def max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def build(name: str, options: Options, info) -> tuple[nn.Module, Task]:
    """The model of the config (a pretrained model's weights are read into it by models.build: `pretrained_tensors`)."""
    from transformers import AutoModelForCausalLM

    return lm.finish(AutoModelForCausalLM.from_config(load(options)), "causal-lm", info)


def pretrained_tensors(options: Options, model: nn.Module) -> dict[str, tuple[Path, str]] | None:
    """model.pretrained: where each of the model's tensors is stored, (file, key), a tied tensor under the
    name it is kept by (models/initial.py `tensor_names`); None for random weights."""
    if options.pretrained is None:
        return None
    from .initial import tensor_names

    wanted, _ = tensor_names(model)
    stored = _stored_as(Path(options.pretrained), {k: tuple(v.shape) for k, v in wanted.items()},
                        model.base_model_prefix)
    return {name: stored[name][:2] for name in wanted}


def _layers_count(config) -> int:
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def pipeline_layer_count(name: str, options: Options) -> int | None:
    config = load(options)
    return _layers_count(config) + 2 if config.model_type in SPLIT_FAMILIES else None


def tensor_parallel_plan(name: str, options: Options) -> TensorParallelPlan | None:
    return plan_of_config(load(options))


def plan_of(model: nn.Module) -> TensorParallelPlan | None:
    return plan_of_config(model.config)


def plan_of_config(config) -> TensorParallelPlan | None:
    if config.model_type == "gpt2":
        return gpt2.plan(config.n_embd, config.n_head, "model.overrides.")
    if config.model_type in LLAMA_STYLE:
        return llama_style(config, "model.overrides.")
    return None


export = lm.export
initialiser = hf_init
checkpoint_units = lm.checkpoint_units
CHECKPOINTING = lm.CHECKPOINTING


# -- pipeline layers ---------------------------------------------------------------------------------
# Llama-style models split between the token embedding, each decoder layer, and the final norm with
# the LM head. A decoder layer needs the rotary position embeddings and the causal mask the model
# would give it: each rebuilds them from its input (positions 0..T-1; no packed sequences).

class Embeddings(nn.Module):
    def __init__(self, embed_tokens):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class DecoderLayer(nn.Module):
    def __init__(self, layer, rotary_emb, config, index: int):
        super().__init__()
        self.layer, self.rotary_emb, self.config = layer, rotary_emb, config
        types = getattr(config, "layer_types", None)
        # Qwen2 names each layer's attention; Mistral slides its window whenever one is set.
        self.sliding = (types[index] == "sliding_attention" if types
                        else getattr(config, "sliding_window", None) is not None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = gpt2.positions(hidden)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        # Positions are 0..T-1 (no packed sequences): the mask need not look for them.
        mask = make_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=None)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        return self.layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    if model.config.model_type == "gpt2":
        return gpt2.pipeline_layers(model)
    base = model.model
    return [Embeddings(base.embed_tokens),
            *(DecoderLayer(layer, base.rotary_emb, model.config, i) for i, layer in enumerate(base.layers)),
            gpt2.Head(base.norm, model.lm_head)]  # final norm + LM head, as GPT-2's
