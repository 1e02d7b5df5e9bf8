"""Sharded checkpoints with Megatron dist_checkpointing.

Layout (Megatron's): ``SAVE/iter_0000020/`` holds one checkpoint, ``SAVE/latest_checkpointed_iteration.txt``
names the newest. A save goes to ``iter_N.tmp`` first and is renamed into place after every rank
has written, then the tracker file is replaced, so a crash mid-save leaves the previous one loadable.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from angelgpt.config import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"


def _save_strategy():
    """Megatron's torch_dist saver runs its writes through an async path that calls CUDA; on a
    CPU-only torch the same format is written synchronously with PyTorch DCP and Megatron's planner,
    and Megatron's loader reads it back unchanged."""
    if torch.cuda.is_available():
        return None
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class CPUSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(state, False), storage_writer=FileSystemWriter(str(checkpoint_dir)),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return CPUSaveStrategy("torch_dist", 1)


def _iter_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _rng_state() -> dict:
    state = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["rng_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


def _rng_sharded_object(state) -> ShardedObject:
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", state, shape, (pp, tp), replica_id=parallel_state.get_data_parallel_rank())


def _state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool) -> dict:
    model_sd = model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_samples": consumed,
        "rng_state": _rng_sharded_object(None if loading else _rng_state()),
    }


def save(root: str, iteration: int, consumed: int, model, optimizer, scheduler) -> Path:
    root_path = Path(root)
    final = _iter_dir(root_path, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_state(model, optimizer, scheduler, iteration, consumed, loading=False), str(tmp),
                            sharded_strategy=_save_strategy())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = root_path / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        with open(tracker_tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(tracker_tmp, root_path / TRACKER)
    dist.barrier()
    return final


def latest_iteration(root: str) -> Optional[int]:
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"checkpoint tracker {tracker} is corrupt: expected an iteration, got '{text[:40]}'")
    return int(text)


def load(root: str, model, optimizer, scheduler) -> Tuple[int, int]:
    """Loads the latest checkpoint under root into model/optimizer/scheduler; returns (iteration, consumed)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise ConfigError(f"checkpoint.load: no {TRACKER} in {root}")
    path = _iter_dir(Path(root), iteration)
    if not path.is_dir():
        raise ConfigError(f"checkpoint.load: {TRACKER} names iteration {iteration} but {path} is missing")
    state = dist_checkpointing.load(_state(model, optimizer, scheduler, 0, 0, loading=True), str(path))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])
