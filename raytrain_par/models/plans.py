"""How a family's layers split for Megatron-style tensor parallel (Shoeybi et al. 2019).

A plan names modules (regular expressions over the plain model's module paths) and how each
splits: `colwise` by output unit (q, k, v, an MLP's first layers), `colwise_qkv` the same for q, k
and v fused in one layer (GPT-2's c_attn: each of the three is cut separately), `rowwise` by input
unit (attention output, an MLP's last layer; the output is summed over ranks), `vocab` an
embedding or LM head by vocabulary row. Everything else (norms, position embeddings) is
replicated. `localize` adjusts what a module keeps about its own width (GPT-2's head counts);
Llama-style attention reshapes by head_dim and needs nothing. `divisible` lists the sizes that
must split evenly over T, as (field, value, what), for the error a user sees before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn


@dataclass
class TensorParallelPlan:
    layers: dict[str, str]
    divisible: list[tuple[str, int, str]] = field(default_factory=list)
    localize: Callable[[nn.Module, int], None] | None = None


def llama_style(config, field_prefix: str) -> TensorParallelPlan:
    """Llama, Mistral, Qwen2: q/k/v and gate/up by column, o and down by row, the token embedding
    and (untied) LM head by vocabulary row. Grouped-query attention's k/v heads split too, so T must
    divide their number."""
    return TensorParallelPlan(
        layers={
            r"model\.embed_tokens": "vocab",
            r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj": "colwise",
            r"model\.layers\.\d+\.self_attn\.o_proj": "rowwise",
            r"model\.layers\.\d+\.mlp\.(gate|up)_proj": "colwise",
            r"model\.layers\.\d+\.mlp\.down_proj": "rowwise",
            r"lm_head": "vocab",
        },
        divisible=[(f"{field_prefix}num_attention_heads", config.num_attention_heads, "attention heads"),
                   (f"{field_prefix}num_key_value_heads", config.num_key_value_heads, "key/value heads"),
                   (f"{field_prefix}intermediate_size", config.intermediate_size, "MLP units")],
    )
