"""The local layer spec's norm, with sequence parallelism.

Megatron's local spec builds its norms with ``WrappedTorchNorm`` (torch's LayerNorm or RMSNorm), which
refuses ``sequence_parallel``. Under sequence parallelism a norm is nothing more than the same norm run
on this rank's slice of the sequence ([s/tp, b, h]): it has no cross-token state. What it needs is that
its weight and bias, replicated on every TP rank but fed by a different slice of tokens on each, get
their gradients summed over the TP group: Megatron's ``finalize_model_grads`` does that for every
parameter marked ``sequence_parallel`` (``_allreduce_non_tensor_model_parallel_grads``, on the GPU
path), angelgpt's CPU optimizer and ZeRO-Cache through ``angelgpt.parallel.sequence``. They stay TP
duplicates: no ``tensor_model_parallel`` attribute, so a global gradient norm counts them on TP rank 0.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelNorm:
    """Megatron's WrappedTorchNorm without its sequence-parallel refusal: torch's LayerNorm (or RMSNorm,
    by ``config.normalization``) whose parameters carry ``sequence_parallel`` as the config says."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm or config.memory_efficient_layer_norm:
            raise ValueError("torch's norms support neither zero-centered gamma, persist_layer_norm nor "
                             "memory_efficient_layer_norm")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization '{config.normalization}' is not supported (LayerNorm or RMSNorm)")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
