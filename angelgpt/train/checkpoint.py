"""Sharded checkpoints with Megatron dist_checkpointing.

Layout (Megatron's): ``SAVE/iter_0000020/`` holds one checkpoint, ``SAVE/latest_checkpointed_iteration.txt``
names the newest. A save goes to ``iter_N.tmp`` first and is renamed into place after every rank
has written, then the tracker file is replaced, so a crash mid-save leaves the previous one loadable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from angelgpt.config import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"


def _save_strategy(multi_slice: bool):
    """Megatron's torch_dist format, written tensor by tensor with PyTorch DCP's file writer and
    Megatron's planner: GPU tensors go to host memory one at a time and host tensors are written
    from where they are, so a save never holds a second copy of the model in host memory. Megatron's
    own torch_dist saver (multi_slice false, GPU only: its writer calls CUDA) first copies every tensor
    of the rank into host memory, and clones host tensors that are views. Megatron's loader reads both."""
    if torch.cuda.is_available() and not multi_slice:
        return None
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp_save(mcore_to_pyt_state_dict(state, False), storage_writer=FileSystemWriter(str(checkpoint_dir)),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                              flatten_state_dict=False))

    return StreamingSaveStrategy("torch_dist", 1)


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
    layer's tensor gets its own key, `<key>.layer<global layer index>`, independent of the placement."""
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


def _state(model, optimizer, scheduler, iteration: int, consumed: int, loading: bool,
           saved_layout: Optional[Tuple[int, int]] = None) -> dict:
    model_sd = model.sharded_state_dict()
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading)
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


MANIFEST = "manifest.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(16 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _write_manifest(tmp: Path, iteration: int, config: dict) -> None:
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)
        files[str(f.relative_to(tmp))] = {"size": f.stat().st_size, "crc32": _crc32(f)}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"iteration": iteration, "files": files, "config": config}, indent=1))
    _fsync(manifest)
    _fsync(tmp)


def verify(path: Path) -> Optional[str]:
    """None when every file the manifest lists is there with its size and checksum, else what is wrong."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"checkpoint {path} is incomplete: it has no {MANIFEST}"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return f"checkpoint {path} is corrupted: {MANIFEST} does not parse"
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            return f"checkpoint {path} is incomplete: {name} is missing"
        if f.stat().st_size != meta["size"]:
            return f"checkpoint {path} is corrupted: {name} has {f.stat().st_size} bytes, the manifest says {meta['size']}"
        if _crc32(f) != meta["crc32"]:
            return f"checkpoint {path} is corrupted: {name} fails its checksum"
    return None


def save(root: str, iteration: int, consumed: int, model, optimizer, scheduler, config: dict,
         keep: Optional[int] = None, multi_slice: bool = True) -> Path:
    """Writes iter_N.tmp, fsyncs it, writes its manifest, renames it into place, then moves the tracker;
    a process killed at any point leaves the previous checkpoint and tracker intact."""
    root_path = Path(root)
    final = _iter_dir(root_path, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with optimizer.materialized():
        dist_checkpointing.save(_state(model, optimizer, scheduler, iteration, consumed, loading=False), str(tmp),
                                sharded_strategy=_save_strategy(multi_slice))
    dist.barrier()
    if dist.get_rank() == 0:
        _write_manifest(tmp, iteration, config)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(root_path)
        tracker_tmp = root_path / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        _fsync(tracker_tmp)
        os.replace(tracker_tmp, root_path / TRACKER)
        _fsync(root_path)
        if keep:
            done = sorted(p for p in root_path.glob("iter_???????") if p.is_dir())
            for old in done[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _saved_layout(path: Path) -> Optional[Tuple[int, int]]:
    """(PP, TP) of the run that saved the checkpoint, from its manifest's config (None if unreadable).
    Megatron reshards the model's and the optimizer's ShardedTensors to this run's layout."""
    try:
        par = json.loads((path / MANIFEST).read_text())["config"]["parallel"]
        return int(par["pipeline_model_parallel_size"]), int(par["tensor_model_parallel_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    problem = [verify(path), _saved_layout(path)] if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(f"checkpoint.load: {problem[0]}")
    saved_layout = problem[1]
    here = (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size())
    resharding = saved_layout is not None and tuple(saved_layout) != here
    with optimizer.materialized():
        request = _state(model, optimizer, scheduler, 0, 0, loading=True, saved_layout=saved_layout)
        # another (PP, TP) layout: ranks read RNG objects some of which none of them covers, which the
        # integrity check refuses; the RNG states come in a request of their own, unchecked
        rng_request = {"rng_state": request.pop("rng_state")} if resharding else None
        state = dist_checkpointing.load(request, str(path))
        if rng_request:
            # (the answer holds the checkpoint's common state too: only the RNG is taken)
            state["rng_state"] = dist_checkpointing.load(rng_request, str(path),
                                                         validate_access_integrity=False)["rng_state"]
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])
