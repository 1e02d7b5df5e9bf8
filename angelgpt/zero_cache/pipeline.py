"""CUDA streams of the ZeRO-Cache pipeline and its per-iteration time profile.

Streams: gradients leave the GPU on ``d2h``; fetched weights, running sums and the states the device
updates come up on ``h2d``; the weights the CPU updated come up on ``upload``, so that they do not queue
behind the device update's states; the device update computes on ``update``, so that a slice's states
come up while the one before is updated; collectives run on NCCL's own stream. On CPU there are no streams
and every copy is synchronous.

Profile (``zero_cache.is_communication_time_profiling``): per iteration, the busy time of each
transfer and of the optimizer (CUDA events on their streams, wall time on the update thread), and
the time the training thread was exposed to them (waiting in a forward pre-hook for a sub-group's
update, in a backward hook for an accumulation slot to come home, or in ``step()`` for the norm).
Busy time minus exposed time is what overlapped compute.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

import torch


class Streams:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.upload = torch.cuda.Stream(device) if self.cuda else None
        self.update = torch.cuda.Stream(device) if self.cuda else None


class Profile:
    BUSY = ("reduce_scatter", "all_gather", "d2h", "h2d", "fetch", "nvme", "accumulate", "cpu_optimizer",
            "cpu_copy", "update_thread", "device_update", "device_update_thread")
    EXPOSED = ("wait_update", "wait_fetch", "wait_slot", "step")

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.last: Optional[dict] = None
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self._busy = collections.Counter()
        self._bytes = collections.Counter()
        self._exposed = collections.Counter()
        self._events = []  # (name, start event, end event)

    def start(self, name: str, stream=None):
        if not self.enabled:
            return None
        if self.cuda and stream is not None:
            return stream.record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter()

    def stop(self, name: str, token, stream=None) -> None:
        if token is None:
            return
        if isinstance(token, torch.cuda.Event):
            end = stream.record_event(torch.cuda.Event(enable_timing=True))
            with self._lock:
                self._events.append((name, token, end))
            return
        self.busy(name, time.perf_counter() - token)

    def busy(self, name: str, seconds: float, nbytes: int = 0) -> None:
        if self.enabled:
            with self._lock:
                self._busy[name] += seconds
                self._bytes[name] += nbytes

    def add_bytes(self, name: str, nbytes: int) -> None:
        if self.enabled:
            with self._lock:
                self._bytes[name] += nbytes

    def exposed(self, name: str, seconds: float) -> None:
        if self.enabled:
            with self._lock:
                self._exposed[name] += seconds

    def end_iteration(self) -> None:
        """Closes the iteration's record: transfers of this backward, the previous update, the waits."""
        if not self.enabled:
            return
        with self._lock:
            events, self._events = self._events, []
        for name, start, end in events:
            end.synchronize()
            self._busy[name] += start.elapsed_time(end) / 1000.0
        record = {f"{k}_ms": round(self._busy[k] * 1000.0, 2) for k in self.BUSY}
        record.update({f"{k}_gb": round(self._bytes[k] / 1e9, 3) for k in self.BUSY if self._bytes[k]})
        record.update({f"exposed_{k}_ms": round(self._exposed[k] * 1000.0, 2) for k in self.EXPOSED})
        self.last = record
        self._reset()

    def line(self) -> str:
        r = self.last or {}
        parts = [f"{k} {r.get(k + '_ms', 0):.1f} ms" + (f" ({r[k + '_gb']:.2f} GB)" if k + "_gb" in r else "")
                 for k in self.BUSY]
        exposed = " + ".join(f"{k} {r.get('exposed_' + k + '_ms', 0):.1f}" for k in self.EXPOSED)
        return "zero_cache profile | " + " | ".join(parts) + f" | exposed: {exposed} ms"
