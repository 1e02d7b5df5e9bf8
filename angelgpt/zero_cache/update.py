"""The update: AdamW of every chunk once the step's gradients are in, pipelined with the next forward.

Device chunks run fused AdamW on the GPU at once; one worker thread updates host and NVMe chunks
sub-group by sub-group in forward order (the host update: host_update.py); beside it a second thread
has the GPU update the host chunks marked ``device_update`` (the device update: device_update.py).
``complete(gi)`` makes sub-group gi's new weights usable on the current stream (and all-gathers them
over DP); ``wait_all()`` completes every one.

Owns: the two update threads, the updates in flight per sub-group and the sub-groups still to
all-gather. Touches: the device chunks' states, step counters and device scratch, the model's
``p.data`` of their params, the chunks' ``states_home`` events (waited on and cleared), the profile.
Calls the gradients part handed to ``step`` (flush, global_norm, zero_grad), the weights part
(release of fetched copies before the update, all_gather after it), and the host and device updates.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from angelgpt.zero_cache.adamw import AdamW, cut
from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.device_update import DeviceUpdate
from angelgpt.zero_cache.host_update import HostUpdate
from angelgpt.zero_cache.layout import Chunk, Layout
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import slices
from angelgpt.zero_cache.rules import clip_coefficient


class Update:
    def __init__(self, layout: Layout, bufs: Sequence[ChunkBuffers], scratch: Optional[torch.Tensor],
                 adamw: AdamW, host: HostUpdate, device_update: DeviceUpdate, weights, device: torch.device,
                 streams: Streams, profile: Profile, param_groups: List[dict], clip_grad: float,
                 pipelined: bool, rehearsal: bool):
        """bufs: the chunks' buffers (at their indices); scratch: a slice's fp32 gradient on the device
        (device chunks); param_groups: the groups whose 'lr' and 'weight_decay' the scheduler sets (read
        when a step starts); pipelined: the update lands at the next forward's pre-hooks (else before
        step returns); rehearsal: one rank played alone under fake collectives (its update runs whatever
        the gradient norm, so that its time and memory are measured)."""
        self.layout, self.bufs, self.scratch, self.adamw = layout, bufs, scratch, adamw
        self.host, self.device_update, self.weights = host, device_update, weights
        self.device, self.streams, self.profile = device, streams, profile
        self.param_groups, self.clip_grad = param_groups, clip_grad
        self.pipelined, self.rehearsal = pipelined, rehearsal
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-update")
        self._device_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-device-update")
        self._pending: Dict[int, List[Future]] = {}  # sub-group -> its updates in flight (events to wait on)
        self._needs_gather: set = set()

    @torch.no_grad()
    def step(self, gradients) -> Tuple[bool, float, Optional[int]]:
        """The step from the gradients part's flushed gradients and global norm (a non-finite norm skips
        it, its gradients dropped)."""
        t0 = time.perf_counter()
        gradients.flush()
        norm = gradients.global_norm()
        for gi in list(self.weights.live):  # a fetched copy would be stale after this update
            self.weights.release(gi)
        if self.streams.cuda:
            self.streams.h2d.synchronize()  # no fetch still reads a host copy the update will overwrite
        self.profile.exposed("step", time.perf_counter() - t0)
        self.profile.end_iteration()
        if not math.isfinite(norm) and not self.rehearsal:
            gradients.zero_grad()
            return False, norm, None
        # a rehearsal's gradients are meaningless (collectives move no data): the update runs whatever the
        # norm, so its time and memory are measured
        coef = clip_coefficient(norm, self.clip_grad) if math.isfinite(norm) else 1.0
        hyper = [(g["lr"], g["weight_decay"]) for g in self.param_groups]  # the scheduler moves on meanwhile
        after_backward = None
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)  # host chunks' gradients are in
            after_backward = torch.cuda.current_stream(self.device).record_event()
        L = self.layout
        for gi in range(len(L.sub_groups)):
            for c in L.chunks_of[gi]:
                if c.tier == "device":
                    self._update_on_device(c, self.bufs[c.index], coef, hyper)
            futures = []
            if any(c.tier != "device" and not c.device_update for c in L.chunks_of[gi]):
                futures.append(self._worker.submit(self.host.update, gi, coef, hyper, after_backward))
            if any(c.device_update for c in L.chunks_of[gi]):
                futures.append(self._device_worker.submit(self.device_update.update, gi, coef, hyper,
                                                          after_backward))
            if futures:
                self._pending[gi] = futures
            if L.dp_size > 1 and not L.partitioned[gi]:
                self._needs_gather.add(gi)
        if not self.pipelined:
            t0 = time.perf_counter()
            self.wait_all()
            self.profile.exposed("step", time.perf_counter() - t0)
        return True, norm, None

    def _update_on_device(self, c: Chunk, b: ChunkBuffers, coef: float, hyper) -> None:
        b.step += 1
        b.step_count += 1
        for lo, hi in slices(c.numel, self.layout.slice_numel):
            grad = self.scratch[:hi - lo]
            grad.copy_(b.grad[lo:hi])
            self.adamw.apply(c, b, cut(b.states, lo, hi), grad, hyper, coef,
                             hi=b.hi[lo:hi] if b.hi is not None else None, base=lo)
        if b.hi is None:  # with remainders the params are views of b.hi, written by the update
            for p, view in c.views(b.states[0]):
                p.data.copy_(view)

    def complete(self, gi: int) -> None:
        """Makes sub-group gi's updated weights usable on the current stream (the forward pre-hook)."""
        futures = self._pending.pop(gi, None)
        if futures:
            t0 = time.perf_counter()
            events = [e for fut in futures for e in fut.result()]
            self.profile.exposed("wait_update", time.perf_counter() - t0)
            for e in events:
                torch.cuda.current_stream(self.device).wait_event(e)
        if gi in self._needs_gather:
            self._needs_gather.discard(gi)
            self.weights.all_gather(gi)

    def wait_all(self) -> None:
        """Every pending update applied (before a checkpoint, an evaluation or the end)."""
        for gi in sorted(set(self._pending) | self._needs_gather):
            self.complete(gi)
        for b in self.bufs:  # the states the device updated are back in host memory
            if b.states_home is not None:
                b.states_home.synchronize()
                b.states_home = None

    def shutdown(self) -> None:
        """The threads end (after wait_all: nothing is in flight)."""
        self._worker.shutdown()
        self._device_worker.shutdown()
        self.host.shutdown()
