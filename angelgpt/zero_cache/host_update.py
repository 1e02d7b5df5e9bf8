"""The host update: AdamW of a sub-group's host and NVMe chunks on the CPU, a slice at a time, with the
new weights uploaded to the device through the pinned upload buffers on the upload stream.

NVMe chunks are read ahead (double buffered, on a thread of their own) and written back. With
remainders the weights are the masters' high half: read and written where they are (an offloaded
layer's host copy, a resident layer's on a CPU device) or, on CUDA, brought down into an upload buffer
a slice ahead of the update and sent back up from it.

Owns: the NVMe read-ahead thread and the upload buffers' cursor and events. Touches: the chunks'
states, step counters, NVMe files and host scratch, an offloaded layer's host ``weights`` (the new
weights written there, over the gradient where they share its buffer), the model's ``p.data`` of
resident layers (new weights copied in), the upload stream and the profile; waits on the chunks'
``grad_ready`` events.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

import torch

from angelgpt.zero_cache.adamw import AdamW, cut
from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.layout import Chunk, Layout
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import slices
from angelgpt.zero_cache.tiers import NVMeTier


class HostUpdate:
    def __init__(self, layout: Layout, bufs: Sequence[ChunkBuffers], adamw: AdamW,
                 scratch: Optional[torch.Tensor], upload: List[torch.Tensor], nvme: Optional[NVMeTier],
                 streams: Streams, profile: Profile):
        """bufs: the chunks' buffers (at their indices); scratch: a slice's fp32 gradient on the host
        (torch's AdamW); upload: the pinned upload buffers (CUDA); nvme: the NVMe tier, if any."""
        self.layout, self.bufs, self.adamw = layout, bufs, adamw
        self.scratch, self.upload, self.nvme = scratch, upload, nvme
        self.streams, self.profile = streams, profile
        self._upload_done, self._slot = [None] * len(upload), 0  # which upload buffer comes next
        self._prefetcher = ThreadPoolExecutor(max_workers=1) if nvme else None
        self._nvme_order = [c for c in layout.chunks if c.tier == "nvme"]

    def update(self, gi: int, coef: float, hyper, after_backward) -> list:
        """Worker thread: host and NVMe chunks of one sub-group, a slice at a time (the fp32 gradient
        scratch and the upload buffers hold one slice); returns the events of the uploads."""
        fmt = self.layout.format
        events = []
        for c in self.layout.chunks_of[gi]:
            if c.tier == "device" or c.device_update:
                continue
            b = self.bufs[c.index]
            if b.grad_ready is not None:
                b.grad_ready.synchronize()
            t0 = time.perf_counter()
            raw = self._nvme_states(c) if c.tier == "nvme" else None
            states = fmt.states(raw, c.numel) if raw is not None else b.states
            b.step += 1
            b.step_count += 1
            if b.hi is not None:
                events += self._update_remainders(c, b, states, hyper, coef, after_backward)
            else:
                events += self._update_slices(c, b, states, hyper, coef, after_backward)
            if c.tier == "nvme":
                t2 = time.perf_counter()
                NVMeTier.write(b.file, raw)
                self.profile.busy("nvme", time.perf_counter() - t2, c.numel * fmt.bytes)
            self.profile.busy("update_thread", time.perf_counter() - t0)
        return events

    def _update_slices(self, c: Chunk, b: ChunkBuffers, states, hyper, coef: float, after_backward) -> list:
        """A host or NVMe chunk with an fp32 master row, on the CPU, a slice at a time: the new weights
        into an offloaded layer's host copy, up through a pinned upload buffer, or (a CPU run) into the
        model from the master; returns the uploads' events."""
        events = []
        for lo, hi in slices(c.numel, self.layout.slice_numel):
            slot = None
            if b.weights is not None:  # fetched from here before the layer next runs
                out = b.weights[lo:hi]
            elif self.streams.cuda:  # up through a pinned staging buffer
                slot, out = self._staging(hi - lo)
            else:
                out = None  # CPU: copied into the model from the master
            self._cpu_update(c, b, cut(states, lo, hi), lo, hi, out, hyper, coef)
            if slot is not None:
                events.append(self._upload_staging(c, b, slot, lo, hi, after_backward))
            elif out is None:
                for p, a, z, sa, sz in c.param_ranges(lo, hi):
                    p.data.view(-1)[a:z].copy_(states[0][sa:sz])
        return events

    def _update_remainders(self, c: Chunk, b: ChunkBuffers, states, hyper, coef: float, after_backward) -> list:
        """A host or NVMe chunk whose master row holds remainders, on the CPU: the weights (the masters'
        high half) are read and written where they are (an offloaded layer's host copy, or a resident
        layer's on a CPU device), or, on CUDA, come down into a pinned staging buffer a slice ahead of
        the update (on the upload stream) and go back up from it; returns the uploads' events."""
        events = []
        ranges = slices(c.numel, self.layout.slice_numel)
        download = self.streams.cuda and b.weights is None
        ahead = self._download(b, *ranges[0]) if download else None
        for k, (lo, hi) in enumerate(ranges):
            if download:
                slot, weights, ready = ahead
                ahead = self._download(b, *ranges[k + 1]) if k + 1 < len(ranges) else None
                ready.synchronize()
            else:
                slot, weights = None, b.hi[lo:hi]
            self._cpu_update(c, b, cut(states, lo, hi), lo, hi, None, hyper, coef, hi_weights=weights)
            if slot is not None:
                events.append(self._upload_staging(c, b, slot, lo, hi, after_backward))
        return events

    def _download(self, b: ChunkBuffers, lo: int, hi: int):
        """(slot, staging, event): a resident layer's weights [lo, hi) down into the next staging buffer."""
        slot, staging = self._staging(hi - lo)
        upload = self.streams.upload
        with torch.cuda.stream(upload):
            staging.copy_(b.hi[lo:hi], non_blocking=True)
            ready = upload.record_event()
        return slot, staging, ready

    def _nvme_states(self, c: Chunk) -> torch.Tensor:
        """This NVMe chunk's bytes (read while the previous one was updated); starts the next read."""
        order = self._nvme_order
        i = next(k for k, x in enumerate(order) if x is c)
        slot = i % 2
        if i == 0:
            self._nvme_next = self._prefetcher.submit(self._timed_read, order[0], 0)
        states = self._nvme_next.result()
        if i + 1 < len(order):
            self._nvme_next = self._prefetcher.submit(self._timed_read, order[i + 1], 1 - slot)
        return states

    def _timed_read(self, c: Chunk, slot: int) -> torch.Tensor:
        t0 = time.perf_counter()
        fmt = self.layout.format
        out = NVMeTier.read(self.bufs[c.index].file, self.nvme.staging(slot, fmt.nbytes(c.numel)))
        self.profile.busy("nvme", time.perf_counter() - t0, c.numel * fmt.bytes)
        return out

    def _cpu_update(self, c: Chunk, b: ChunkBuffers, states, lo: int, hi: int, out, hyper, coef: float,
                    hi_weights=None) -> None:
        """AdamW of a host or NVMe chunk's slice [lo, hi) (its rows' slices), the new weights into out
        (model dtype; may be the gradient buffer itself, when that is in the model dtype) unless it is
        None; with remainders hi_weights are the slice's bf16 weights, read and written in place."""
        t0 = time.perf_counter()
        if self.adamw.one_pass:  # one pass: the gradient in (fp32 or model dtype), model-dtype weights out
            self.adamw.native(c, b, states, b.grad[lo:hi], hyper, coef, out, hi=hi_weights, base=lo)
            self.profile.busy("cpu_optimizer", time.perf_counter() - t0)
            return
        grad = self.scratch[:hi - lo]
        grad.copy_(b.grad[lo:hi])  # before an offloaded layer's new weights overwrite the buffer
        t1 = time.perf_counter()
        self.adamw.apply(c, b, states, grad, hyper, coef, hi=hi_weights, base=lo)
        t2 = time.perf_counter()
        if out is not None:
            out.copy_(states[0])
        self.profile.busy("cpu_copy", (t1 - t0) + (time.perf_counter() - t2))
        self.profile.busy("cpu_optimizer", t2 - t1)

    def _staging(self, n: int) -> Tuple[int, torch.Tensor]:
        """The next pinned upload buffer, once its previous upload has left it."""
        slot = self._slot = (self._slot + 1) % len(self.upload)
        if self._upload_done[slot] is not None:
            self._upload_done[slot].synchronize()
        return slot, self.upload[slot][:n]

    def _upload_staging(self, c: Chunk, b: ChunkBuffers, slot: int, lo: int, hi: int, after_backward):
        """A chunk's updated weights [lo, hi), in staging buffer slot, up into the model; returns the event."""
        staging = self.upload[slot][:hi - lo]
        upload = self.streams.upload
        t0 = self.profile.start("h2d", upload)
        with torch.cuda.stream(upload):
            upload.wait_event(after_backward)  # backward has finished reading the old weights
            if b.hi is not None:  # the params are views of it
                b.hi[lo:hi].copy_(staging, non_blocking=True)
            for p, a, z, sa, sz in c.param_ranges(lo, hi) if b.hi is None else ():
                p.data.view(-1)[a:z].copy_(staging[sa - lo:sz - lo], non_blocking=True)
            done = upload.record_event()
        self.profile.stop("h2d", t0, upload)
        self.profile.add_bytes("h2d", (hi - lo) * staging.element_size())
        self._upload_done[slot] = done
        return done

    def shutdown(self) -> None:
        """The NVMe read-ahead thread ends (nothing is in flight)."""
        if self._prefetcher:
            self._prefetcher.shutdown()
