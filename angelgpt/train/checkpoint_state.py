"""What a checkpoint holds besides its files' layout: the model's and optimizer's sharded states (one
key per layer where the optimizer asks), the learning-rate schedule, the counters and every rank's RNG
states, and how a load at another (PP, TP) layout finds the RNG state of its position.

Owns: the checkpoint's state dict, its RNG part, per-layer keys.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Optional, Tuple

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory


def _rng_state() -> dict:
    state = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["rng_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


def _rng_sharded_object(state, saved_layout: Optional[Tuple[int, int]] = None) -> ShardedObject:
    """The RNG states, one per (PP rank, TP rank). Loading a checkpoint saved with another (PP, TP)
    layout (saved_layout), a rank takes the saved state of its own position where the saved layout has
    it, else of stage 0 / TP rank 0 (on CPU every rank's RNG starts alike after the model is built)."""
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    if saved_layout is not None and tuple(saved_layout) != shape:
        shape = tuple(saved_layout)
        pp, tp = (pp if pp < shape[0] else 0), (tp if tp < shape[1] else 0)
    return ShardedObject("rng_state", state, shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank())


def per_layer_keys(sharded):
    """The same sharded state with one key per layer: Megatron stacks a parameter of every layer of a
    pipeline stage under one key (the layer axis prepended), and a key's local shards must share device
    and pinning. ZeRO-Cache keeps layers in different tiers (GPU, pinned host, NVMe files), so each
    layer's tensor gets its own key, `<key>.layer<global layer index>`, independent of the placement; so
    do the tensors a factory builds (SwiGLU's linear_fc1, saved as its gate and up halves)."""
    if isinstance(sharded, ShardedTensorFactory):
        build = sharded.build_fn
        return replace(sharded, build_fn=lambda *args: per_layer_keys(build(*args)))
    if isinstance(sharded, dict):
        return {k: per_layer_keys(v) for k, v in sharded.items()}
    if isinstance(sharded, list):
        return [per_layer_keys(v) for v in sharded]
    if isinstance(sharded, ShardedTensor) and sharded.prepend_axis_num:
        n = sharded.prepend_axis_num
        return replace(sharded, key=sharded.key + "".join(f".layer{i}" for i in sharded.global_offset[:n]),
                       prepend_axis_num=0, global_shape=sharded.global_shape[n:],
                       global_offset=sharded.global_offset[n:],
                       axis_fragmentations=sharded.axis_fragmentations and sharded.axis_fragmentations[n:])
    return sharded


def module_of(model):
    """The model whose state is saved: inside Megatron's DDP wrapper (which would prefix every key with
    `module.` on save but load its module's keys), so that every optimizer's checkpoint has the same
    model keys (`embedding.`, `decoder.`, `output_layer.`)."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def checkpoint_state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool,
           saved_layout: Optional[Tuple[int, int]] = None, metadata: Optional[dict] = None) -> dict:
    model_sd = module_of(model).sharded_state_dict()
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)
    if optimizer.per_layer_checkpoint_keys:
        model_sd, optimizer_sd = per_layer_keys(model_sd), per_layer_keys(optimizer_sd)
    return {
        "model": model_sd,
        "optimizer": optimizer_sd,
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng_state": _rng_sharded_object(None if loading else _rng_state(), saved_layout),
    }
