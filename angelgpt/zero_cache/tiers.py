"""The three tiers of the ZeRO-Cache store: the compute device, (pinned) host memory, NVMe files.

A tier hands out flat chunk buffers and says how many bytes it holds. The device tier is the
compute device, whatever it is (CUDA, or CPU standing in for it); the host tier pins its buffers
when CUDA is present; the NVMe tier keeps each chunk in its own file and is read into (and written
back from) two reusable host staging buffers.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from angelgpt.config import ConfigError

from angelgpt.system import GIB, mem_available_bytes, try_lock  # noqa: F401 (re-exported for callers)


def page_lock(buf: torch.Tensor) -> int:
    """Page-locks a host tensor in place (cudaHostRegister, at its exact size); its CUDA error code, 0 when
    locked. A failure is cleared here: torch hands the call's error back unchecked, and left as the
    thread's last CUDA error the check after the next kernel launch would raise it as that kernel's, so a
    launch here reads, and so clears, it."""
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    err = int(getattr(err, "value", err))
    if err:
        try:
            torch.zeros(1, device=torch.cuda.current_device())
        except RuntimeError:
            pass
    return err


class DeviceTier:
    name = "device"

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0

    def allocate(self, numel: int, dtype: torch.dtype = torch.float32, pinned: bool = False) -> torch.Tensor:
        self.bytes += numel * dtype.itemsize
        return torch.zeros(numel, dtype=dtype, device=self.device)


class HostTier:
    """Host memory. Only what crosses PCIe (gradients, parameter staging) is pinned; fp32 states that
    the CPU updates in place stay pageable, so start-up pins a few bytes per parameter, not twelve.

    Pinned buffers are page-locked in place (cudaHostRegister) at their exact size: torch's pinned
    allocator rounds each allocation up to a power of two, which costs gigabytes at layer-sized
    buffers. ``close()`` unlocks them."""

    name = "host"

    def __init__(self, pin: bool):
        self.pin = pin
        self.bytes = 0
        self.pinned_bytes = 0
        self._registered = []  # tensors page-locked by cudaHostRegister, unlocked by close()

    def allocate(self, numel: int, dtype: torch.dtype = torch.float32, pinned: bool = False) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        self.bytes += nbytes
        buf = torch.zeros(numel, dtype=dtype)
        if pinned and self.pin and nbytes:
            err = page_lock(buf)
            if err:
                raise MemoryError(f"zero_cache: could not pin {nbytes / GIB:.2f} GiB of host memory "
                                  f"(cudaHostRegister error {err}); {self.pinned_bytes / GIB:.2f} GiB pinned so far")
            self.pinned_bytes += nbytes
            self._registered.append(buf)
        return buf

    def close(self) -> None:
        for buf in self._registered:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._registered = []


class NVMeTier:
    """Chunk files under ``path/angelgpt-<id>/``; removed by ``close()``. The directory's lock file stays
    locked while its process lives, so what a killed run leaves behind can be told apart and reclaimed
    (``reclaim``), also across containers that share the disk."""

    name = "nvme"
    LOCK = ".lock"

    def __init__(self, path: str):
        root = Path(path)
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".angelgpt-probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"0")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"zero_cache.nvme_path {path} is not writable: {exc.strerror or exc}") from None
        name = f"angelgpt-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        building = root / f".{name}"  # locked before it takes a name reclaim() looks at
        building.mkdir()
        self._lock = open(building / self.LOCK, "w")
        try_lock(self._lock)  # the directory is new: nobody else holds it
        self.dir = root / name
        building.rename(self.dir)
        self.bytes = 0
        self._staging = []  # two reusable host buffers (double buffering)

    @classmethod
    def reclaim(cls, path: str) -> int:
        """Removes the chunk directories under path whose lock no process holds (runs that were killed
        before close()); returns the bytes they took on disk."""
        freed = 0
        root = Path(path)
        if not root.is_dir():
            return 0
        for d in root.glob("angelgpt-*"):
            try:
                fh = open(d / cls.LOCK, "r")
            except OSError:
                continue  # not a tier's directory, or one being removed
            with fh:
                if try_lock(fh) is not True:
                    continue  # its run is alive (or the lock cannot tell)
                freed += sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())
                shutil.rmtree(d, ignore_errors=True)
        return freed

    @staticmethod
    def free_bytes(path: str) -> int:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return shutil.disk_usage(probe).free

    def create(self, key: str, nbytes: int) -> Path:
        file = self.dir / f"{key}.bin"
        with open(file, "wb") as fh:
            fh.truncate(nbytes)
        self.bytes += nbytes
        return file

    def reserve_staging(self, nbytes: int) -> int:
        """Allocates the two staging buffers (host memory, pageable: the CPU updates them) once; returns bytes."""
        self._staging = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
        return 2 * nbytes

    def staging(self, slot: int, nbytes: int) -> torch.Tensor:
        """Bytes of staging buffer slot (grown when a chunk needs more)."""
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8))
        if self._staging[slot].numel() < nbytes:
            self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[slot][:nbytes]

    # Linux moves at most 0x7ffff000 bytes per read/write call: larger chunks take several calls.
    IO_BLOCK = 1 << 30

    @staticmethod
    def _move(file: Path, mode: str, view: memoryview) -> None:
        """Reads the file into view ('rb') or writes view to it ('r+b'), a block per system call."""
        with open(file, mode, buffering=0) as fh:
            call = fh.readinto if mode == "rb" else fh.write
            done = 0
            while done < len(view):
                moved = call(view[done:done + NVMeTier.IO_BLOCK])
                if not moved:
                    raise IOError(f"short {'read from' if mode == 'rb' else 'write to'} {file}: "
                                  f"{done} of {len(view)} bytes")
                done += moved

    @staticmethod
    def read(file: Path, out: torch.Tensor) -> torch.Tensor:
        NVMeTier._move(file, "rb", memoryview(out.numpy()).cast("B"))
        return out

    @staticmethod
    def write(file: Path, data: torch.Tensor) -> None:
        NVMeTier._move(file, "r+b", memoryview(data.contiguous().numpy()).cast("B"))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._lock.close()
        self._staging = []


class CapacityError(ConfigError):
    """A refusal because memory runs short: `short` names the tiers ('device', 'host', 'nvme') or
    'memlock' that do not have what is needed."""

    def __init__(self, message, short):
        super().__init__(message)
        self.short = list(short)


def check_capacity(needed: dict, available: dict) -> None:
    """Refuses, before any large allocation, a placement that does not fit; the message gives numbers."""
    short = [t for t in needed if needed[t] > available.get(t, 0)]
    if short:
        parts = ", ".join(f"{t} needs {needed[t]:,} B ({needed[t] / GIB:.2f} GiB), has "
                          f"{available.get(t, 0):,} B ({available.get(t, 0) / GIB:.2f} GiB)" for t in needed)
        raise CapacityError(f"zero_cache: model states do not fit ({parts}); lower prefetch_cache_sub_group_rate, "
                            f"raise zero_cache.host_max_gib / nvme_max_gib, or set zero_cache.nvme_path", short)


def check_memlock(pinned_bytes: int, privileged: Optional[bool] = None) -> None:
    """Refuses, before anything is pinned, what the memlock limit (ulimit -l) would not let this process
    lock. A privileged process (root, CAP_IPC_LOCK) is not bound by it."""
    import resource

    if privileged is None:
        privileged = os.geteuid() == 0
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not privileged and soft != resource.RLIM_INFINITY and pinned_bytes > soft:
        raise CapacityError(f"zero_cache: {pinned_bytes:,} B ({pinned_bytes / GIB:.2f} GiB) of host memory must be "
                            f"pinned but the memlock limit (ulimit -l) allows {soft:,} B; raise it (ulimit -l "
                            f"unlimited, or docker run --ulimit memlock=-1)", ["memlock"])


def host_bytes(host_max_gib: Optional[float]) -> int:
    """Host memory the store may take: host_max_gib, else MemAvailable less a small reserve."""
    if host_max_gib is not None:
        return int(host_max_gib * GIB)
    avail = mem_available_bytes()
    return int(avail - max(2 * GIB, 0.03 * avail))


def nvme_bytes(nvme_path: Optional[str], nvme_max_gib: Optional[float]) -> int:
    """The NVMe directory's free space, up to nvme_max_gib; 0 without a path."""
    if not nvme_path:
        return 0
    free = NVMeTier.free_bytes(nvme_path)
    return min(free, int(nvme_max_gib * GIB)) if nvme_max_gib is not None else free


def device_memory(device: torch.device):
    """(free, total) bytes of a CUDA device as this process may use them: with a per-process memory
    fraction set (a rehearsal caps the allocator at the target GPU's memory), total is that share and
    free what the allocator may still reserve within it."""
    free, total = torch.cuda.mem_get_info(device)
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(device)
    except (AttributeError, RuntimeError):  # a torch without it: no cap can have been set through it
        fraction = 1.0
    if fraction < 1.0:
        total = int(fraction * total)
        free = max(0, min(free, total - torch.cuda.memory_reserved(device)))
    return free, total


def available_bytes(device: torch.device, host_max_gib: Optional[float], nvme_path: Optional[str],
                    nvme_max_gib: Optional[float]) -> dict:
    """What each tier may take: the device's free memory (the optimizer sets aside what training needs
    beside the states), host_bytes, nvme_bytes. On CPU, which stands in for both, the device and the
    host each get half of MemAvailable unless host_max_gib says otherwise."""
    if device.type == "cuda":
        dev = device_memory(device)[0]
        host = host_bytes(host_max_gib)
    else:
        dev = mem_available_bytes() // 2
        host = host_bytes(host_max_gib) if host_max_gib is not None else dev
    return {"device": dev, "host": host, "nvme": nvme_bytes(nvme_path, nvme_max_gib)}


def refuse_together(check, alone: bool = False) -> None:
    """Runs a rank's refusal check on every rank: when any refuses, all raise the first refusing rank's
    message (prefixed with its rank), so rank 0 reports it and no rank waits in a collective for one
    that left. Placements differ per rank (an uneven DP partition), so one rank alone may not fit.
    `alone` (a rehearsal plays one rank alone): the check raises as it is (a CapacityError keeps what ran
    short)."""
    if alone:
        check()
        return
    try:
        check()
        problem = None
    except ConfigError as exc:
        problem = str(exc)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if problem:
            raise ConfigError(problem)
        return
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for rank, text in enumerate(problems):
        if text:
            raise ConfigError(text if rank == 0 else f"rank {rank}: {text}")
