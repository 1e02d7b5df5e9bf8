"""Tied word embeddings across pipeline stages.

With one stage the output layer uses the input embedding's weight itself. With several, Megatron keeps
a copy on the last stage (``output_layer.weight``, marked ``shared``) that starts equal to the first
stage's ``embedding.word_embeddings.weight`` (an all-reduce when the model is built) and stays equal only
if both apply the same update: before the data-parallel step, each adds the other's gradient, an
all-reduce over Megatron's embedding group (first and last stage of one TP/DP position), as Megatron's
``finalize_model_grads`` does for its own optimizer (``_allreduce_word_embedding_grads``). The global
gradient norm counts the copy once (Megatron's ``param_is_not_shared`` leaves the last stage's out).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def _inner(model):
    while hasattr(model, "module") and not hasattr(model, "shared_embedding_or_output_weight"):
        model = model.module  # Float16Module, DistributedDataParallel
    return model


def tied_embedding_weight(model) -> Optional[torch.nn.Parameter]:
    """This rank's copy of word embeddings tied across stages (the first stage's embedding or the last
    stage's output weight), or None: untied, one stage, a middle stage, or not in the embedding group."""
    inner = _inner(model)
    if not getattr(inner, "share_embeddings_and_output_weights", False):
        return None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if not (getattr(inner, "pre_process", False) or getattr(inner, "post_process", False)):
        return None
    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is None or dist.get_rank() not in dist.get_process_group_ranks(group):
        return None
    return inner.shared_embedding_or_output_weight()


def allreduce_tied_embedding_grad(grad: torch.Tensor) -> None:
    """Sums, in place, the tied embedding's gradient of the first and the last stage (a no-op with one)."""
    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is not None and group.size() > 1:
        dist.all_reduce(grad, group=group)


def sync_tied_embedding_grads(model) -> None:
    """Megatron's _allreduce_word_embedding_grads for optimizers that keep gradients in ``param.grad``
    (a stage whose copy got no gradient contributes zeros)."""
    weight = tied_embedding_weight(model)
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    allreduce_tied_embedding_grad(weight.grad)
