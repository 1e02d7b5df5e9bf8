"""Writing a checkpoint's tensors: PyTorch DCP's save split in three, as Megatron's async save splits it.

    job = strategy.job                    # planned inside dist_checkpointing.save (collective)
    job.start() / job.write()             # file I/O only: a background thread, or the training thread
    written = job.finish()                # collective: the write results gathered, DCP's .metadata written

Planning and finishing are collectives and run in the training thread on every rank; the write does
no communication, so a thread may run it while training goes on. An asynchronous write first copies
every tensor this rank writes into host memory (`staged`, into a buffer kept from save to save:
HostStaging), so that the next optimizer step, which
updates the states in place, cannot change what is written. Each data file's size and CRC32 are taken
from the bytes as they are written (`written`, for the manifest), not by reading the files back.

Owns: the DCP writer, plan and staged copies of one save, its writer thread and its timings.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.utils import _DistWrapper, _get_failure_dict, _wrap_exception

from angelgpt.system import mem_available_bytes


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
                err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
                self.pinned = int(getattr(err, "value", err)) == 0  # else pageable: slower, still correct
        return self.buffer

    def close(self) -> None:
        if self.buffer is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer, self.pinned = None, False


class _StagedPlanner:
    """The planner, its data answered from the staged copies."""

    def __init__(self, planner, staged: dict):
        self.planner, self.staged = planner, staged

    def resolve_data(self, item):
        return self.staged[item.index]

    def __getattr__(self, name):
        return getattr(self.planner, name)


class WriteJob:
    """One save's tensors on this rank: planned, then written (now or by a thread), then finished."""

    def __init__(self, state_dict: dict, checkpoint_dir: Path, keep_only_main_replica: bool):
        self.writer = FileSystemWriter(str(checkpoint_dir))
        self.fs = self.writer.fs = _CRCFileSystem()
        self.planner = MCoreSavePlanner(dedup_replicated_tensors=not keep_only_main_replica,
                                        flatten_state_dict=False)
        self.dist = _DistWrapper(None, True, 0)
        self.metadata = None
        self.writes_from = self.planner
        self.staged_bytes = 0
        self.results = None
        self.thread: Optional[threading.Thread] = None
        self.write_s = 0.0
        self.plan = self._plan(state_dict)

    def _plan(self, state_dict):
        """DCP's planning (torch.distributed.checkpoint.state_dict_saver._save_state_dict): every rank's
        local plan gathered, the global plan and metadata made on the coordinator, scattered back."""
        def local_step():
            self.planner.set_up_planner(state_dict=state_dict, storage_meta=self.writer.storage_meta(),
                                        is_coordinator=self.dist.is_coordinator)
            if "kwargs" in inspect.signature(self.writer.set_up_storage_writer).parameters:  # as DCP calls it
                self.writer.set_up_storage_writer(self.dist.is_coordinator, rank=self.dist.rank, use_collectives=True)
            else:
                self.writer.set_up_storage_writer(self.dist.is_coordinator)
            return self.writer.prepare_local_plan(self.planner.create_local_plan())

        def global_step(plans):
            plans, self.metadata = self.planner.create_global_plan(plans)
            return self.writer.prepare_global_plan(plans)

        return self.planner.finish_plan(self.dist.reduce_scatter("plan", local_step, global_step))

    def staging_bytes(self) -> int:
        """Host bytes a staged copy of what this rank writes takes (each tensor aligned)."""
        total = 0
        for item in self.plan.items:
            if item.type != WriteItemType.BYTE_IO:
                data = self.planner.resolve_data(item)
                total += _aligned(data.numel() * data.element_size())
        return total

    def stage(self, staging: HostStaging) -> None:
        """Copies every item this rank writes into `staging`'s buffer (tensors, the device's ones as
        asynchronous copies waited for together) or bytes (objects)."""
        buffer = staging.reserve(self.staging_bytes())
        staged, offset = {}, 0
        for item in self.plan.items:
            data = self.planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                staged[item.index] = data
                continue
            nbytes = data.numel() * data.element_size()
            copy = buffer[offset:offset + nbytes].view(data.dtype).view(data.shape)
            staged[item.index] = copy.copy_(data.detach(), non_blocking=staging.pinned)
            offset += _aligned(nbytes)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.staged_bytes = sum(t.numel() * t.element_size() for t in staged.values() if isinstance(t, torch.Tensor))
        self.writes_from = _StagedPlanner(self.planner, staged)
        # staged tensors are on the host already: the writer's device-to-host loader (a CUDA stream,
        # on the writer thread's current device) is not wanted
        self.writer.per_thread_copy_ahead = 0

    def write(self) -> None:
        """Writes this rank's files (no communication); the results or the error are kept for finish()."""
        started = time.perf_counter()
        try:
            self.results = self.writer.write_data(self.plan, self.writes_from).value()
        except BaseException as exc:  # reported to every rank by finish()
            self.results = _wrap_exception(exc)
        self.write_s = time.perf_counter() - started

    def start(self) -> None:
        """write() in a background thread."""
        self.thread = threading.Thread(target=self.write, name="angelgpt-checkpoint-writer", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Waits for the background write (at most `timeout` seconds); whether it has ended."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.done()

    def finish(self) -> Optional[Dict[str, Tuple[int, int]]]:
        """Collective, after write() on every rank: the coordinator writes DCP's .metadata from all
        ranks' write results; on rank 0 returns every data file's (size, CRC32) as written. A rank's
        failed write raises CheckpointException on every rank."""
        self.join()
        gathered = self.dist.gather_object((self.results, self.fs.written))
        outcome = None
        if self.dist.is_coordinator:
            results = [r for r, _ in gathered]
            failures = _get_failure_dict(results)
            if not failures:
                try:
                    self.writer.finish(metadata=self.metadata, results=results)
                except BaseException as exc:
                    failures = {self.dist.rank: _wrap_exception(exc)}
            if failures:
                outcome = CheckpointException("write", failures)
            else:
                outcome = {name: meta for _, written in gathered for name, meta in written.items()}
        outcome = self.dist.broadcast_object(outcome)
        if isinstance(outcome, CheckpointException):
            raise outcome
        self.writes_from = self.planner  # the staged copies are freed
        return outcome if self.dist.is_coordinator else None


class PlanningStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist format through dist_checkpointing.save, which saves the common state and
    calls save() with the sharded tensors: save() only plans (a WriteJob, left in `job`); the caller
    writes and finishes it. The state dict's tensors stay where they are until written or staged."""

    def __init__(self):
        super().__init__("torch_dist", 1)
        self.job: Optional[WriteJob] = None

    def save(self, sharded_state_dict, checkpoint_dir):
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        self.job = WriteJob(mcore_to_pyt_state_dict(state, False), Path(checkpoint_dir), self.keep_only_main_replica)


def host_memory_available() -> int:
    """Bytes of host memory one rank may take for a staged copy: what the node has available, shared by
    its local ranks, which stage at the same time."""
    return int(mem_available_bytes() * 0.9) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

