"""Core attention on torch's scaled_dot_product_attention.

Megatron's local ``DotProductAttention`` allocates on CUDA and cannot run on CPU; this module is a
drop-in ``core_attention`` for Megatron's layer spec that runs anywhere and picks the flash or cuDNN
backend on GPU. Causal masking only (GPT pretraining).
"""

from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """Causal self-attention core: softmax(q k^T / sqrt(d)) v, per tensor-parallel partition."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=self.groups_per_partition != self.heads_per_partition,
        )
        # [b, heads, s, d] -> [s, b, heads * d]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)
