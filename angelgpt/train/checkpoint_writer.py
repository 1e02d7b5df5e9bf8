"""Writing a checkpoint's tensors with PyTorch DCP's public save, in Megatron's torch_dist format.

    strategy = ShardsStrategy()
    dist_checkpointing.save(state, dir, sharded_strategy=strategy)  # common state; the shards handed over
    job = WriteJob(strategy.shards, dir)
    job.stage(staging)                    # optional: host copies of what this rank writes
    job.write() / job.start(group)        # dcp.save: now, or on a thread over a process group of its own
    written = job.finish()                # collective: every rank's outcome and files gathered

Megatron's dist_checkpointing.save writes the common state and hands the sharded tensors to the strategy;
the strategy keeps this rank's main replicas grouped by key (each stored tensor written by one rank).
An asynchronous write first copies every tensor this rank writes into host memory (`stage`, into a
buffer kept from save to save: HostStaging), so that the next optimizer step, which updates the states
in place, cannot change what is written; then DCP's save (its planning, write and metadata, collectives
included) runs on a daemon thread over a gloo group used by nothing else, as dcp.async_save runs it (whose
executor thread the interpreter would wait for at exit: a write stuck on a lost rank would keep a failed
process alive). Each data file's size and CRC32 are taken from the bytes as they are written
(`written`, for the manifest), not by reading the files back.

Owns: the DCP writer and the state dict of one save, its staged copies, its writer thread and timings.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import FileSystem

from angelgpt.system import mem_available_bytes
from angelgpt.zero_cache.tiers import page_lock


class _CRCStream:
    """A file being written, the CRC32 and size of the bytes written through it kept as they pass
    (DCP's writer only appends: torch.save streams into it without seeking back)."""

    def __init__(self, raw):
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.raw.write(view)

    def __getattr__(self, name):  # tell, flush, fileno, ...
        return getattr(self.raw, name)


class _CRCFileSystem(FileSystem):
    """DCP's local file system, noting each file written: name -> (size, CRC32)."""

    def __init__(self):
        super().__init__()
        self.written: Dict[str, Tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _CRCStream(raw)
            yield stream
        self.written[Path(path).name] = (stream.size, stream.crc)


_ALIGN = 64  # bytes: every staged tensor starts at a multiple (any dtype's view of the buffer is aligned)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostStaging:
    """The host memory asynchronous saves stage into: one buffer, allocated at the first save and kept
    for the next ones (grown when a save needs more), page-locked in place where CUDA runs so that the
    device-to-host copies run at the link's speed with no page faults. `close()` frees it."""

    def __init__(self):
        self.buffer: Optional[torch.Tensor] = None
        self.pinned = False

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least nbytes long (a new one only when the kept one is shorter)."""
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.close()
            self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self.pinned = page_lock(self.buffer) == 0  # else pageable: slower, still correct
        return self.buffer

    def close(self) -> None:
        if self.buffer is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.pinned = None, False


class ShardsStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist format through dist_checkpointing.save, which saves the common state and
    calls save() with the sharded tensors: save() keeps this rank's main replicas grouped by key
    (`shards`, what Megatron's own torch_dist saver writes) for a WriteJob; nothing is copied or written."""

    def __init__(self):
        super().__init__("torch_dist", 1, keep_only_main_replica=True)
        self.shards: Optional[Dict[str, List[ShardedBase]]] = None

    def save(self, sharded_state_dict, checkpoint_dir):
        grouped = defaultdict(list)
        for sharded in nested_values(sharded_state_dict):
            if is_main_replica(sharded.replica_id):
                grouped[sharded.unique_key if isinstance(sharded, ShardedObject) else sharded.key].append(sharded)
        self.shards = dict(grouped)


class WriteJob:
    """One save's tensors on this rank: staged or not, then written (now or by a thread), then finished."""

    def __init__(self, shards: Dict[str, List[ShardedBase]], checkpoint_dir: Path):
        self.shards = shards
        self.writer = dcp.FileSystemWriter(str(checkpoint_dir))
        self.fs = self.writer.fs = _CRCFileSystem()
        self.staged_bytes = 0
        self.state_dict: Optional[dict] = None  # DCP's state dict, made by stage() or write()
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.write_s = 0.0

    def _tensors(self):
        return [s for group in self.shards.values() for s in group if isinstance(s, ShardedTensor)]

    def staging_bytes(self) -> int:
        """Host bytes a staged copy of what this rank writes takes (each tensor aligned)."""
        return sum(_aligned(_nbytes(s.data)) for s in self._tensors())

    def stage(self, staging: HostStaging) -> None:
        """Every tensor this rank writes copied into `staging`'s buffer (the device's ones as asynchronous
        copies waited for together) and every object serialized; what is written from then on is these."""
        buffer, offset = staging.reserve(self.staging_bytes()), 0
        for sharded in self._tensors():
            data, nbytes = sharded.data, _nbytes(sharded.data)
            copy = buffer[offset:offset + nbytes].view(data.dtype).view(data.shape)
            sharded.data = copy.copy_(data.detach(), non_blocking=staging.pinned)
            offset += _aligned(nbytes)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.staged_bytes = sum(_nbytes(s.data) for s in self._tensors())
        # objects (schedules, counters, RNG states) are serialized here, in the training thread, as
        # they are now: a thread writing after the next step must not see them changed
        self.state_dict = mcore_to_pyt_state_dict(self.shards, False)
        # staged tensors are on the host already: the writer's device-to-host loader (a CUDA stream,
        # on the writer thread's current device) is not wanted
        self.writer.per_thread_copy_ahead = 0

    def write(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """DCP's save of this rank's shards over `group` (None: the default group); every rank calls it
        with the same group. A failure is kept for finish()."""
        started = time.perf_counter()
        try:
            if self.state_dict is None:
                self.state_dict = mcore_to_pyt_state_dict(self.shards, False)
            dcp.save(self.state_dict, storage_writer=self.writer,
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
                     process_group=group)
        except BaseException as exc:  # reported to every rank by finish()
            self.error = exc
        self.write_s = time.perf_counter() - started

    def start(self, group: dist.ProcessGroup) -> None:
        """write(group) in a background thread (a daemon: see the module docstring)."""
        self.thread = threading.Thread(target=self.write, args=(group,), name="angelgpt-checkpoint-writer",
                                       daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the background write (at most `timeout` seconds); whether it has ended."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.done()

    def finish(self) -> Optional[Dict[str, Tuple[int, int]]]:
        """Collective, after write() on every rank: on rank 0 every data file's (size, CRC32) as written,
        None elsewhere. A rank's failed write raises on every rank, naming the ranks and their errors."""
        self.join()
        outcomes = [None] * dist.get_world_size()
        error = None if self.error is None else f"{type(self.error).__name__}: {str(self.error).strip()[:400]}"
        dist.all_gather_object(outcomes, (error, self.fs.written))
        failed = {rank: error for rank, (error, _) in enumerate(outcomes) if error}
        if failed:
            raise RuntimeError(f"checkpoint write failed on rank(s) {sorted(failed)}: "
                               + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())))
        self.shards, self.state_dict = {}, None  # the staged copies are freed
        if dist.get_rank() != 0:
            return None
        return {name: meta for _, written in outcomes for name, meta in written.items()}


def host_memory_available() -> int:
    """Bytes of host memory one rank may take for a staged copy: what the node has available, shared by
    its local ranks, which stage at the same time."""
    return int(mem_available_bytes() * 0.9) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
