"""The update: AdamW of every chunk once the step's gradients are in, pipelined with the next forward.

Device chunks run fused AdamW on the GPU at once; one worker thread updates host and NVMe chunks sub-group by
sub-group in forward order (the CPU AdamW, NVMe chunks read ahead and written back), uploading each slice's
new weights through the pinned upload buffers on the upload stream; beside it a second thread has the GPU
update the host chunks marked ``device_update`` (states up, fused AdamW there, weights in place, states back
down). ``complete(gi)`` makes sub-group gi's new weights usable on the current stream (and all-gathers them
over DP); ``wait_all()`` completes every one.

Owns: the update threads and the NVMe read-ahead thread, the updates in flight per sub-group, the sub-groups
still to all-gather, the upload buffers' and device update buffers' cursors and events. Touches: the chunks'
states, step counters, NVMe files and ``states_home`` events in the store, an offloaded layer's ``weights``
(the new weights written there, over the gradient where they share its buffer), the model's ``p.data`` of
resident layers (new weights copied in), the store's ``update_free`` events, the streams and the profile.
Calls the gradients part (flush, global_norm, zero_grad) and the weights part (release of fetched copies
before the update, all_gather after it).
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch
from torch.optim.adamw import adamw

from angelgpt.zero_cache.placement import CODEC_SLICE, DEVICE_UPDATE_SLICE, STATES, slices
from angelgpt.zero_cache.precision import decode, encode
from angelgpt.zero_cache.rules import clip_coefficient
from angelgpt.zero_cache.store import Chunk, Store
from angelgpt.zero_cache.tiers import NVMeTier


class Update:
    def __init__(self, store: Store, weights):
        o = store.cfg.optim
        self.store, self.weights = store, weights
        self.gradients = None  # the Gradients part (flush, global_norm, zero_grad), set once it exists
        self.device, self.dp_size = store.device, store.dp_size
        self.pipelined = store.cfg.zero_cache.pipeline_optimizer
        self.clip_grad = o.clip_grad
        self.betas = (o.adam_beta1, o.adam_beta2)
        self.eps = o.adam_eps
        self.param_groups = store.param_groups
        self.chunks, self.chunks_of, self.sub_groups = store.chunks, store.chunks_of, store.sub_groups
        self.partitioned, self.cpu_adam = store.partitioned, store.cpu_adam
        self.nvme, self.scratch, self.work = store.nvme, store.scratch, store.work
        self.format = store.format
        self._upload, self._update_bufs, self._update_free = store.upload, store.update_bufs, store.update_free
        self._upload_done, self._slot = [None] * len(self._upload), 0  # which upload buffer comes next
        self._update_slot = 0  # which device update buffer comes next
        self.streams, self.profile = store.streams, store.profile
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-update")
        self._device_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-device-update")
        self._prefetcher = ThreadPoolExecutor(max_workers=1) if self.nvme else None
        self._pending: Dict[int, List[Future]] = {}  # sub-group -> its updates in flight (events to wait on)
        self._needs_gather: set = set()

    @torch.no_grad()
    def step(self) -> Tuple[bool, float, Optional[int]]:
        t0 = time.perf_counter()
        self.gradients.flush()
        norm = self.gradients.global_norm()
        for gi in list(self.weights.live):  # a fetched copy would be stale after this update
            self.weights.release(gi)
        if self.streams.cuda:
            self.streams.h2d.synchronize()  # no fetch still reads a host copy the update will overwrite
        self.profile.exposed("step", time.perf_counter() - t0)
        self.profile.end_iteration()
        if not math.isfinite(norm) and not self.store.rehearsal:
            self.gradients.zero_grad()
            return False, norm, None
        # a rehearsal's gradients are meaningless (collectives move no data): the update runs whatever the
        # norm, so its time and memory are measured
        coef = clip_coefficient(norm, self.clip_grad) if math.isfinite(norm) else 1.0
        hyper = [(g["lr"], g["weight_decay"]) for g in self.param_groups]  # the scheduler moves on meanwhile
        after_backward = None
        if self.streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.streams.d2h)  # host chunks' gradients are in
            after_backward = torch.cuda.current_stream(self.device).record_event()
        for gi in range(len(self.sub_groups)):
            for c in self.chunks_of[gi]:
                if c.tier == "device":
                    self._update_on_device(c, coef, hyper)
            futures = []
            if any(c.tier != "device" and not c.device_update for c in self.chunks_of[gi]):
                futures.append(self._worker.submit(self._update_off_device, gi, coef, hyper, after_backward))
            if any(c.device_update for c in self.chunks_of[gi]):
                futures.append(self._device_worker.submit(self._update_streamed, gi, coef, hyper, after_backward))
            if futures:
                self._pending[gi] = futures
            if self.dp_size > 1 and not self.partitioned[gi]:
                self._needs_gather.add(gi)
        if not self.pipelined:
            t0 = time.perf_counter()
            self.wait_all()
            self.profile.exposed("step", time.perf_counter() - t0)
        return True, norm, None

    def _adamw(self, c: Chunk, states, grad: torch.Tensor, hyper, coef: float, hi=None, base: int = 0) -> None:
        """AdamW where the chunk lives, of its states' rows (a slice of each from chunk element `base`,
        in the store's format; hi: the slice's bf16 weights where the master row holds remainders). On
        the CPU the one-pass kernel where it was built (every CPU update uses it: placements agree); else
        torch's fused AdamW (fp32 gradient), clipping riding in the kernel (grad_scale divides the
        gradient), so it costs no extra pass over memory; states not all fp32 are decoded into fp32 rows
        (store.work) a part at a time and encoded back."""
        if self.format.fp32:
            return self._fp32_adamw(c, states, grad, hyper, coef)
        if self.cpu_adam is not None and not grad.is_cuda:
            return self._native_adamw(c, states, grad, hyper, coef, hi=hi, base=base)
        work = self.work["device" if grad.device.type == self.device.type and c.tier == "device" else "host"]
        for a, b in slices(grad.numel(), min(CODEC_SLICE, work.shape[1])):
            rows, w, part = [r[a:b] for r in states], work[:, :b - a], None if hi is None else hi[a:b]
            decode(self.format, rows, part, w)
            self._fused_adamw(c, w, grad[a:b], hyper, coef)
            encode(self.format, w, rows, part, seed=(c.index, c.step_count), base=base + a)

    def _fp32_adamw(self, c: Chunk, states, grad: torch.Tensor, hyper, coef: float) -> None:
        """AdamW of fp32 rows: the one-pass kernel on the CPU where it was built (every CPU update uses it:
        placements agree), else torch's fused AdamW."""
        if self.cpu_adam is not None and not grad.is_cuda:
            return self._native_adamw(c, states, grad, hyper, coef)
        return self._fused_adamw(c, states, grad, hyper, coef)

    def _fused_adamw(self, c: Chunk, states, grad: torch.Tensor, hyper, coef: float) -> None:
        """torch's fused AdamW of fp32 rows (master, exp_avg, exp_avg_sq) from an fp32 gradient."""
        lr, wd = hyper[0 if c.decay else 1]
        scale = None if coef >= 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=grad.device)
        # torch's functional AdamW counts the step itself: it is handed the count before this update
        adamw([states[0]], [grad], [states[1]], [states[2]], [], [c.step - 1], fused=True, grad_scale=scale,
              lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=wd, eps=self.eps, amsgrad=False,
              maximize=False)

    def _native_adamw(self, c: Chunk, states, grad: torch.Tensor, hyper, coef: float, out=None, hi=None,
                      base: int = 0) -> None:
        """The one-pass CPU kernel, the new weights into out (its own dtype) unless it is None (with hi:
        into hi itself); `base`: the chunk element the rows' first is (fp8 moments' random bits)."""
        lr, wd = hyper[0 if c.decay else 1]
        self.cpu_adam.step(states, grad, out, step=c.step_count, lr=lr, weight_decay=wd, betas=self.betas,
                           eps=self.eps, coef=coef, hi=hi, seed=(c.index, c.step_count), base=base)

    @staticmethod
    def _cut(states, lo: int, hi: int) -> list:
        """Each row's slice [lo, hi) (rows of a [3, n] tensor, or the format's typed rows)."""
        return [r[lo:hi] for r in states]

    def _update_on_device(self, c: Chunk, coef: float, hyper) -> None:
        c.step += 1
        c.step_count += 1
        for lo, hi in slices(c.numel):
            grad = self.scratch["device"][:hi - lo]
            grad.copy_(c.grad[lo:hi])
            self._adamw(c, self._cut(c.states, lo, hi), grad, hyper, coef,
                        hi=c.hi[lo:hi] if c.hi is not None else None, base=lo)
        if c.hi is None:  # with remainders the params are views of c.hi, written by the update
            for p, view in c.views(c.states[0]):
                p.data.copy_(view)

    def _update_off_device(self, gi: int, coef: float, hyper, after_backward) -> list:
        """Worker thread: host and NVMe chunks of one sub-group, a slice at a time (the fp32 gradient
        scratch and the upload buffers hold one slice); returns the events of the uploads."""
        events = []
        for c in self.chunks_of[gi]:
            if c.tier == "device" or c.device_update:
                continue
            if c.grad_ready is not None:
                c.grad_ready.synchronize()
            t0 = time.perf_counter()
            raw = self._nvme_states(c) if c.tier == "nvme" else None
            states = self.format.states(raw, c.numel) if raw is not None else c.states
            c.step += 1
            c.step_count += 1
            if c.hi is not None:
                events += self._update_remainders(c, states, hyper, coef, after_backward)
            else:
                events += self._update_slices(c, states, hyper, coef, after_backward)
            if c.tier == "nvme":
                t2 = time.perf_counter()
                NVMeTier.write(c.file, raw)
                self.profile.busy("nvme", time.perf_counter() - t2, c.numel * self.format.bytes)
            self.profile.busy("update_thread", time.perf_counter() - t0)
        return events

    def _update_slices(self, c: Chunk, states, hyper, coef: float, after_backward) -> list:
        """A host or NVMe chunk with an fp32 master row, on the CPU, a slice at a time: the new weights
        into an offloaded layer's host copy, up through a pinned upload buffer, or (a CPU run) into the
        model from the master; returns the uploads' events."""
        events = []
        for lo, hi in slices(c.numel):
            slot = None
            if c.weights is not None:  # fetched from here before the layer next runs
                out = c.weights[lo:hi]
            elif self.streams.cuda:  # up through a pinned staging buffer
                slot, out = self._staging(hi - lo)
            else:
                out = None  # CPU: copied into the model from the master
            self._cpu_update(c, self._cut(states, lo, hi), lo, hi, out, hyper, coef)
            if slot is not None:
                events.append(self._upload_staging(c, slot, lo, hi, after_backward))
            elif out is None:
                for p, a, b, sa, sb in self._param_ranges(c, lo, hi):
                    p.data.view(-1)[a:b].copy_(states[0][sa:sb])
        return events

    def _update_remainders(self, c: Chunk, states, hyper, coef: float, after_backward) -> list:
        """A host or NVMe chunk whose master row holds remainders, on the CPU: the weights (the masters'
        high half) are read and written where they are (an offloaded layer's host copy, or a resident
        layer's on a CPU device), or, on CUDA, come down into a pinned staging buffer a slice ahead of
        the update (on the upload stream) and go back up from it; returns the uploads' events."""
        events = []
        ranges = slices(c.numel)
        download = self.streams.cuda and c.weights is None
        ahead = self._download(c, *ranges[0]) if download else None
        for k, (lo, hi) in enumerate(ranges):
            if download:
                slot, weights, ready = ahead
                ahead = self._download(c, *ranges[k + 1]) if k + 1 < len(ranges) else None
                ready.synchronize()
            else:
                slot, weights = None, c.hi[lo:hi]
            self._cpu_update(c, self._cut(states, lo, hi), lo, hi, None, hyper, coef, hi_weights=weights)
            if slot is not None:
                events.append(self._upload_staging(c, slot, lo, hi, after_backward))
        return events

    def _download(self, c: Chunk, lo: int, hi: int):
        """(slot, staging, event): a resident layer's weights [lo, hi) down into the next staging buffer."""
        slot, staging = self._staging(hi - lo)
        upload = self.streams.upload
        with torch.cuda.stream(upload):
            staging.copy_(c.hi[lo:hi], non_blocking=True)
            ready = upload.record_event()
        return slot, staging, ready

    def _update_streamed(self, gi: int, coef: float, hyper, after_backward) -> list:
        """Device-update thread: a sub-group's host chunks the device updates, a slice at a time through two
        device buffers: states and gradient up (H2D), decoded, AdamW and encoded on the update stream as the
        next slice comes up, new weights straight into the model, states down (D2H). Returns the events the
        next forward waits on; their next upload and wait_all wait for the states' return. (The profile's
        device_update time runs from a slice's upload to its update's end: slices overlap.)"""
        events = []
        cuda, h2d, d2h, compute = self.streams.cuda, self.streams.h2d, self.streams.d2h, self.streams.update
        on_h2d = (lambda: torch.cuda.stream(h2d)) if cuda else contextlib.nullcontext
        on_compute = (lambda: torch.cuda.stream(compute)) if cuda else contextlib.nullcontext
        for c in self.chunks_of[gi]:
            if not c.device_update:
                continue
            t0 = time.perf_counter()
            with on_h2d():
                c.step += 1
                c.step_count += 1
                if cuda:
                    h2d.wait_event(after_backward)  # the gradients are in, backward read the old weights
                    if c.states_home is not None:
                        h2d.wait_event(c.states_home)  # the previous update's states are home
            for lo, hi in slices(c.numel, DEVICE_UPDATE_SLICE):
                i = self._update_slot = 1 - self._update_slot
                if self._update_free[i] is not None:
                    self._update_free[i].synchronize()  # the buffer's last states have left it
                buf, grad_in, packed = self._update_bufs[i]
                states, grad = buf[:STATES, :hi - lo], buf[STATES, :hi - lo]
                # the rows as they travel: fp32 straight into the update's rows, else packed, decoded here
                arriving = states if packed is None else self._cut(packed, 0, hi - lo)
                weights = c.hi[lo:hi] if c.hi is not None else None  # with remainders: the model's, in place
                t1 = self.profile.start("device_update", h2d)
                with on_h2d():
                    for k in range(STATES):  # row by row: each row slice is contiguous (async copies)
                        arriving[k].copy_(c.states[k][lo:hi], non_blocking=True)
                    if grad_in is None:  # an fp32 gradient lands in its row
                        grad.copy_(c.grad[lo:hi], non_blocking=True)
                    else:  # up in its dtype, converted on the device
                        grad_in[:hi - lo].copy_(c.grad[lo:hi], non_blocking=True)
                    arrived = h2d.record_event() if cuda else None
                with on_compute():
                    if cuda:
                        compute.wait_event(arrived)
                    if packed is not None:
                        decode(self.format, arriving, weights, states)
                    if grad_in is not None:
                        grad.copy_(grad_in[:hi - lo])
                    self._fp32_adamw(c, states, grad, hyper, coef)  # the rows decoded, if they were not fp32
                    if packed is not None:
                        encode(self.format, states, arriving, weights, seed=(c.index, c.step_count), base=lo)
                    if weights is None:
                        for p, a, b, sa, sb in self._param_ranges(c, lo, hi):
                            p.data.view(-1)[a:b].copy_(states[0, sa - lo:sb - lo])
                    updated = compute.record_event() if cuda else None
                self.profile.stop("device_update", t1, compute)
                self.profile.add_bytes("device_update", (hi - lo) * (2 * self.format.bytes + c.grad.element_size()))
                if not cuda:
                    for k in range(STATES):
                        c.states[k][lo:hi].copy_(arriving[k])
                    continue
                with torch.cuda.stream(d2h):
                    d2h.wait_event(updated)
                    for k in range(STATES):
                        c.states[k][lo:hi].copy_(arriving[k], non_blocking=True)
                    c.states_home = self._update_free[i] = d2h.record_event()
                events.append(updated)
            self.profile.busy("device_update_thread", time.perf_counter() - t0)
        return events

    def _nvme_states(self, c: Chunk) -> torch.Tensor:
        """This NVMe chunk's bytes (read while the previous one was updated); starts the next read."""
        order = [x for x in self.chunks if x.tier == "nvme"]
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
        out = NVMeTier.read(c.file, self.nvme.staging(slot, self.format.nbytes(c.numel)))
        self.profile.busy("nvme", time.perf_counter() - t0, c.numel * self.format.bytes)
        return out

    def _cpu_update(self, c: Chunk, states, lo: int, hi: int, out, hyper, coef: float, hi_weights=None) -> None:
        """AdamW of a host or NVMe chunk's slice [lo, hi) (its rows' slices), the new weights into out
        (model dtype; may be the gradient buffer itself, when that is in the model dtype) unless it is
        None; with remainders hi_weights are the slice's bf16 weights, read and written in place."""
        t0 = time.perf_counter()
        if self.cpu_adam is not None:  # one pass: the gradient in (fp32 or model dtype), model-dtype weights out
            self._native_adamw(c, states, c.grad[lo:hi], hyper, coef, out, hi=hi_weights, base=lo)
            self.profile.busy("cpu_optimizer", time.perf_counter() - t0)
            return
        grad = self.scratch["host"][:hi - lo]
        grad.copy_(c.grad[lo:hi])  # before an offloaded layer's new weights overwrite the buffer
        t1 = time.perf_counter()
        self._adamw(c, states, grad, hyper, coef, hi=hi_weights, base=lo)
        t2 = time.perf_counter()
        if out is not None:
            out.copy_(states[0])
        self.profile.busy("cpu_copy", (t1 - t0) + (time.perf_counter() - t2))
        self.profile.busy("cpu_optimizer", t2 - t1)

    def _staging(self, n: int) -> Tuple[int, torch.Tensor]:
        """The next pinned upload buffer, once its previous upload has left it."""
        slot = self._slot = (self._slot + 1) % len(self._upload)
        if self._upload_done[slot] is not None:
            self._upload_done[slot].synchronize()
        return slot, self._upload[slot][:n]

    def _upload_staging(self, c: Chunk, slot: int, lo: int, hi: int, after_backward):
        """A chunk's updated weights [lo, hi), in staging buffer slot, up into the model; returns the event."""
        staging = self._upload[slot][:hi - lo]
        upload = self.streams.upload
        t0 = self.profile.start("h2d", upload)
        with torch.cuda.stream(upload):
            upload.wait_event(after_backward)  # backward has finished reading the old weights
            if c.hi is not None:  # the params are views of it
                c.hi[lo:hi].copy_(staging, non_blocking=True)
            for p, a, b, sa, sb in self._param_ranges(c, lo, hi) if c.hi is None else ():
                p.data.view(-1)[a:b].copy_(staging[sa - lo:sb - lo], non_blocking=True)
            done = upload.record_event()
        self.profile.stop("h2d", t0, upload)
        self.profile.add_bytes("h2d", (hi - lo) * staging.element_size())
        self._upload_done[slot] = done
        return done

    @staticmethod
    def _param_ranges(c: Chunk, lo: int, hi: int):
        """(param, start, end in the param, start, end in the chunk) for the params overlapping [lo, hi)."""
        for p, off, shape in zip(c.params, c.offsets, c.shapes):
            a, b = max(lo, off), min(hi, off + shape.numel())
            if a < b:
                yield p, a - off, b - off, a, b

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
        for c in self.chunks:  # the states the device updated are back in host memory
            if c.states_home is not None:
                c.states_home.synchronize()
                c.states_home = None

    def shutdown(self) -> None:
        """The threads end (after wait_all: nothing is in flight)."""
        self._worker.shutdown()
        self._device_worker.shutdown()
        if self._prefetcher:
            self._prefetcher.shutdown()
