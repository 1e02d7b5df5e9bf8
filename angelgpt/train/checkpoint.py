"""Sharded checkpoints with Megatron dist_checkpointing.

Layout (Megatron's): ``SAVE/iter_0000020/`` holds one checkpoint, ``SAVE/latest_checkpointed_iteration.txt``
names the newest. A save goes to ``iter_N.tmp`` first and is renamed into place after every rank
has written, then the tracker file is replaced, so a crash mid-save leaves the previous one loadable.
With checkpoint.async_save the tensors are copied into host memory at the save and written by a
background thread while training goes on; a later iteration boundary, once every rank has written,
finalizes the save (manifest, rename, tracker), as Megatron's ``maybe_finalize_async_save`` does.

Owns: the checkpoint layout, the save in flight (`Saver`), manifests, verified loads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import CheckpointException

from angelgpt import parallel
from angelgpt.config import ConfigError
from angelgpt.parallel.log import get_logger
from angelgpt.system import GIB
from angelgpt.train.checkpoint_check import MANIFEST, TRACKER, find_checkpoint, latest_iteration  # noqa: F401
from angelgpt.train.checkpoint_check import manifest as read_manifest
from angelgpt.train.checkpoint_check import iter_dir as _iter_dir
from angelgpt.train.checkpoint_state import checkpoint_state, module_of, set_rng_state
from angelgpt.train.checkpoint_writer import HostStaging, ShardsStrategy, WriteJob, host_memory_available

log = get_logger(__name__)


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


def _write_manifest(tmp: Path, iteration: int, config: dict, written: dict) -> None:
    """Sizes and CRC32s of every file: the data files' as the writer computed them while writing them
    (`written`: name -> (size, crc32)), the few small metadata files' read back."""
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)
        size, crc = written.get(f.name) if f.parent == tmp and f.name in written else (f.stat().st_size, _crc32(f))
        files[str(f.relative_to(tmp))] = {"size": size, "crc32": crc}
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


class Saver:
    """Saves checkpoints under `root`, at most one in flight. save() writes iter_N.tmp (or, asynchronous,
    stages what this rank writes into host memory and starts a writer thread); finalize() then, on
    every rank together, finishes the write, writes the manifest, renames iter_N.tmp into place and
    moves the tracker. A process killed at any point leaves the previous checkpoint and tracker intact.

    `events` collects, per save, the seconds the training loop was blocked (stall_s: waiting for the
    previous save, planning, staging, and for a synchronous save the write and finalize), and once
    finalized the write's seconds (write_s, slowest rank) and the finalize's (finalize_s)."""

    def __init__(self, root: str, config: dict, keep: Optional[int], multi_slice: bool, device,
                 timeout_minutes: Optional[float] = None):
        """timeout_minutes: how long the asynchronous writes' collectives wait for the other ranks
        (parallel.distributed_timeout_minutes; None: gloo's default)."""
        self.root, self.config, self.keep, self.multi_slice = Path(root), config, keep, multi_slice
        self.device, self.timeout_minutes = device, timeout_minutes
        self.pending = None  # (iteration, tmp, job, event) of the save in flight
        self.events = []
        self._told = False
        self.last_save_s: Optional[float] = None  # the last finalized save's time, start to finalized
        self.staging = HostStaging()  # kept from save to save: after the first, a save allocates nothing
        self.group: Optional[dist.ProcessGroup] = None  # asynchronous writes' own group (_writer_group)

    def save(self, iteration: int, consumed: int, model, optimizer, scheduler, asynchronous: bool) -> None:
        started = time.perf_counter()
        self.finalize(blocking=True)  # one save in flight: a second waits for the first
        final = _iter_dir(self.root, iteration)
        tmp = final.with_name(final.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        strategy = ShardsStrategy()
        with optimizer.materialized():
            from angelgpt.optimizer.megatron import CHECKPOINT_METADATA

            metadata = {**CHECKPOINT_METADATA, **optimizer.checkpoint_metadata()}
            dist_checkpointing.save(checkpoint_state(model, optimizer, scheduler, iteration, consumed, loading=False,
                                           metadata=metadata),
                                    str(tmp), sharded_strategy=strategy, content_metadata=metadata)
            job = WriteJob(strategy.shards, tmp)
            staged = (asynchronous or not self.multi_slice) and not self._told and self.room_for(
                job.staging_bytes() - self.staging.nbytes(), asynchronous)
            if staged:
                job.stage(self.staging)  # the states as of this iteration: the next step updates them in place
            # an asynchronous save writes over its own group on every rank, on a thread where this rank
            # staged its tensors, here (from where they live) where it had no room
            group = self._writer_group() if asynchronous else None
            if not (staged and asynchronous):
                job.write(group)
        event = {"save_iteration": iteration, "async": int(staged and asynchronous),
                 "staged_gib": job.staged_bytes / GIB}
        self.pending = (iteration, tmp, job, event)
        if not asynchronous:
            self._finalize()
        elif staged:
            job.start(group)
        # (an asynchronous save a rank wrote synchronously is finalized with the others' all the same)
        event["stall_s"] = time.perf_counter() - started
        if not event["async"]:  # finalized here (synchronous) or written here (a rank without room)
            self.last_save_s = event["stall_s"]
        self.events.append(event)
        if not asynchronous:  # an asynchronous one says so once written (_finalize)
            log.info(f"saved the checkpoint of iteration {iteration} in {final} ({event['stall_s']:.2f} s)")

    def _writer_group(self) -> dist.ProcessGroup:
        """The gloo group asynchronous writes run their collectives on, used by nothing else (a
        collective: made at the first asynchronous save, which every rank reaches together)."""
        if self.group is None:
            timeout = None if self.timeout_minutes is None else timedelta(minutes=self.timeout_minutes)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        return self.group

    def room_for(self, nbytes: int, asynchronous: bool) -> bool:
        """Whether this rank's host memory holds a staged copy of nbytes; else the save is written from
        where the tensors live, synchronously, and the rank says so once (at start, from the planner's
        figure, or at the first save): every later save of the run is written so too."""
        room = host_memory_available()
        if nbytes <= room:
            return True
        if not self._told:
            self._told = True
            what = "checkpoint.async_save" if asynchronous else "checkpoint.multi_slice=false"
            log.warning(f"rank {dist.get_rank()}: {what} needs a host-memory copy of {nbytes / GIB:.2f} GiB but "
                        f"{room / GIB:.2f} GiB is available to this rank: its checkpoints are written "
                        f"synchronously, tensor by tensor")
        return False

    def finalize(self, blocking: bool) -> None:
        """Finalizes the save in flight; not blocking, only once every rank's write is done (a collective:
        every rank calls it at the same iteration boundaries)."""
        if self.pending is None:
            return
        if not blocking and not parallel.all_ranks(self.pending[2].done(), self.device):
            return
        self._finalize()

    def _finalize(self) -> None:
        iteration, tmp, job, event = self.pending
        self.pending = None
        started = time.perf_counter()
        written = job.finish()
        final = _iter_dir(self.root, iteration)
        if dist.get_rank() == 0:
            _write_manifest(tmp, iteration, self.config, written)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync(self.root)
            tracker_tmp = self.root / (TRACKER + ".tmp")
            tracker_tmp.write_text(f"{iteration}\n")
            _fsync(tracker_tmp)
            os.replace(tracker_tmp, self.root / TRACKER)
            _fsync(self.root)
            if self.keep:
                done = sorted(p for p in self.root.glob("iter_???????") if p.is_dir())
                for old in done[:-self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        slowest = torch.tensor([job.write_s], device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        done = {"save_iteration": iteration, "write_s": float(slowest.item()),
                "finalize_s": time.perf_counter() - started}
        self.events.append(done)
        if event["async"]:
            self.last_save_s = event.get("stall_s", 0.0) + done["write_s"] + done["finalize_s"]
            log.info(f"checkpoint of iteration {iteration} written in the background in {done['write_s']:.2f} s "
                     f"(finalized in {done['finalize_s']:.2f} s)")

    def abandon(self, timeout: float) -> bool:
        """After an error: waits (at most `timeout` seconds) for this rank's write to end and leaves the
        save unfinalized (iter_N.tmp is never renamed: the other ranks may not be there to finalize it);
        whether the write ended (a stuck one is a daemon thread, gone with the process)."""
        pending, self.pending = self.pending, None
        return pending is None or pending[2].join(timeout)

    def take_events(self) -> Optional[dict]:
        """The events since the last call merged into one record (seconds summed), or None."""
        events, self.events = self.events, []
        if not events:
            return None
        merged = {}
        for e in events:
            for k, v in e.items():
                merged[k] = max(merged.get(k, v), v) if k in ("save_iteration", "async") else merged.get(k, 0.0) + v
        return merged


MODEL_ONLY = "model_only"  # content metadata of a checkpoint that holds the model's weights alone


def save_model_only(root: str, model, config: dict) -> None:
    """Iteration 0 with the model's sharded state alone (no optimizer, schedule, RNG): `angelgpt import`'s."""
    tmp = _iter_dir(Path(root), 0).with_name("iter_0000000.tmp")
    tmp.mkdir(parents=True)
    try:
        state = {"model": module_of(model).sharded_state_dict(), "iteration": 0, "consumed_samples": 0}
        strategy = ShardsStrategy()
        dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy, content_metadata={MODEL_ONLY: True})
        job = WriteJob(strategy.shards, tmp)
        job.write()
        _write_manifest(tmp, 0, config, job.finish())
        manifest = json.loads((tmp / MANIFEST).read_text())
        (tmp / MANIFEST).write_text(json.dumps({**manifest, MODEL_ONLY: True}, indent=1))
        os.replace(tmp, _iter_dir(Path(root), 0))
        (Path(root) / TRACKER).write_text("0\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _on_cpu(sharded):  # the model's sharded state with host tensors to load into, whatever its weights' tier
    if isinstance(sharded, dict):
        return {k: _on_cpu(v) for k, v in sharded.items()}
    if isinstance(sharded, (ShardedTensor, ShardedTensorFactory)):
        return replace(sharded, data=torch.empty(sharded.data.shape, dtype=sharded.data.dtype))
    return sharded


def _load_model_only(path: Path, model, optimizer) -> Tuple[int, int]:
    """A model-only checkpoint's weights into the model and the optimizer's main parameters; its states
    and the schedule start fresh (Megatron's --finetune)."""
    with optimizer.materialized():
        state = dist_checkpointing.load({"model": _on_cpu(module_of(model).sharded_state_dict())}, str(path))
        module_of(model).load_state_dict(state["model"])
        optimizer.reload_model_params()  # while offloaded weights are readable tensors
    log.info(f"loaded the model-only checkpoint {path}: optimizer and learning-rate schedule start fresh")
    return 0, 0


def _saved_layout(path: Path) -> Optional[Tuple[int, int]]:
    """(PP, TP) of the run that saved the checkpoint, from its manifest's config (None if unreadable).
    Megatron reshards the model's and the optimizer's ShardedTensors to this run's layout."""
    try:
        par = json.loads((path / MANIFEST).read_text())["config"]["parallel"]
        return int(par["pipeline_model_parallel_size"]), int(par["tensor_model_parallel_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _missing_key(exc: CheckpointException) -> Optional[str]:
    """The first key this run asked for that the checkpoint does not hold (Megatron's KeyError
    "KEY from model not in state dict" on a rank), None for any other failure."""
    for error, _ in exc.failures.values():
        text = error.args[0] if isinstance(error, KeyError) and error.args else ""
        if isinstance(text, str) and " from model not in state dict" in text:
            return text.split(" from model not in state dict")[0]
    return None


def _not_this_runs_state(root: str, path: Path, missing: str) -> str:
    """Why a checkpoint of the same model does not load: another optimizer (or device) laid out its
    state; what it was saved with, and the two ways on."""
    saved = read_manifest(path).get("config") or {}
    optimizer = (saved.get("optim") or {}).get("optimizer", "?")
    device = (saved.get("train") or {}).get("device", "?")
    return (f"checkpoint.load {root}: {path.name} lacks what this run loads ('{missing}'): it was saved with "
            f"optim.optimizer={optimizer} on {device}, and each optimizer lays out the model and its states its "
            f"own way; resume it with that optimizer, or carry its weights to another: angelgpt export --load "
            f"{root} --output HF_DIR, then angelgpt import --hf HF_DIR --save NEW_DIR and train with --load NEW_DIR")


def load(root: str, model, optimizer, scheduler) -> Tuple[int, int]:
    """Loads the latest checkpoint under root into model/optimizer/scheduler; returns (iteration, consumed)."""
    path = find_checkpoint(root, what="checkpoint.load")
    problem = [verify(path), _saved_layout(path), None] if dist.get_rank() == 0 else [None, None, None]
    if problem[0] is None and dist.get_rank() == 0:  # the common state it reads holds the optimizer's too
        with torch.serialization.safe_globals(optimizer.checkpoint_safe_globals()):
            problem[2] = dist_checkpointing.load_content_metadata(str(path))
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ConfigError(f"checkpoint.load: {problem[0]}")
    saved_layout, metadata = problem[1], problem[2]
    if (metadata or {}).get(MODEL_ONLY):
        return _load_model_only(path, model, optimizer)
    here = (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size())
    resharding = saved_layout is not None and tuple(saved_layout) != here
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    from angelgpt.optimizer.megatron import MegatronDistributedOptimizer

    if resharding and sharding == "dp_reshardable" and isinstance(optimizer, MegatronDistributedOptimizer):
        raise ConfigError(f"checkpoint.load: {path} holds Megatron's distributed-optimizer state in the "
                          f"dp_reshardable format (the default), which "
                          f"resumes at another data-parallel size only; it was saved at PP x TP = "
                          f"{saved_layout[0]} x {saved_layout[1]}, this run is {here[0]} x {here[1]}; resume at "
                          f"the saved PP and TP (checkpoints saved with "
                          f"checkpoint.dist_ckpt_optim_fully_reshardable=true resume at any layout)")
    with optimizer.materialized(), torch.serialization.safe_globals(optimizer.checkpoint_safe_globals()):
        request = checkpoint_state(model, optimizer, scheduler, 0, 0, loading=True, saved_layout=saved_layout,
                         metadata=metadata)
        # another (PP, TP) layout: ranks read RNG objects some of which none of them covers, which the
        # integrity check refuses; the RNG states come in a request of their own, unchecked
        rng_request = {"rng_state": request.pop("rng_state")} if resharding else None
        try:
            state = dist_checkpointing.load(request, str(path))
        except CheckpointException as exc:  # raised on every rank alike (DCP scatters the failures)
            missing = _missing_key(exc)
            if missing is None:
                raise
            raise ConfigError(_not_this_runs_state(root, path, missing)) from None
        if rng_request:
            # (the answer holds the checkpoint's common state too: only the RNG is taken)
            state["rng_state"] = dist_checkpointing.load(rng_request, str(path),
                                                         validate_access_integrity=False)["rng_state"]
        module_of(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    from angelgpt.optimizer.schedule import load_schedule

    changed = load_schedule(scheduler, state["opt_param_scheduler"])
    if changed:
        log.info(f"learning-rate schedule: {changed}")
    set_rng_state(state["rng_state"])
    return int(state["iteration"]), int(state["consumed_samples"])
