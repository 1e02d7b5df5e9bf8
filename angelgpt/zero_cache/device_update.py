"""The device update of host states (``device_update_fraction``): the host chunks marked
``device_update`` are updated on the GPU, a slice at a time through the two device update buffers:
states and gradient up (H2D), decoded, AdamW and encoded on the update stream as the next slice comes
up, the new weights straight into the model, the states back down (D2H).

Owns: the device update buffers' cursor. Touches: the chunks' states, step counters and
``states_home`` events, the ``update_free`` events (set when a buffer's states have left it: the
accumulation slots share that memory), the model's ``p.data`` (or, with remainders, the weights
the params are views of), the H2D, update and D2H streams and the profile.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from angelgpt.zero_cache.adamw import AdamW, cut
from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.layout import Layout
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import STATES, device_update_slice, slices
from angelgpt.zero_cache.precision import decode, encode


class DeviceUpdate:
    def __init__(self, layout: Layout, bufs: Sequence[ChunkBuffers], adamw: AdamW, update_bufs: list,
                 update_free: list, streams: Streams, profile: Profile):
        """bufs: the chunks' buffers (at their indices); update_bufs: the two device update buffers
        (buffers.Buffers.update_bufs); update_free: their events of last use."""
        self.layout, self.bufs, self.adamw = layout, bufs, adamw
        self.update_bufs, self.update_free = update_bufs, update_free
        self.streams, self.profile = streams, profile
        self._slot = 0  # which device update buffer comes next

    def update(self, gi: int, coef: float, hyper, after_backward) -> list:
        """Device-update thread: a sub-group's host chunks the device updates, a slice at a time through two
        device buffers. Returns the events the next forward waits on; their next upload and wait_all wait
        for the states' return. (The profile's device_update time runs from a slice's upload to its
        update's end: slices overlap.)"""
        fmt = self.layout.format
        events = []
        cuda, h2d, d2h, compute = self.streams.cuda, self.streams.h2d, self.streams.d2h, self.streams.update
        on_h2d = (lambda: torch.cuda.stream(h2d)) if cuda else contextlib.nullcontext
        on_compute = (lambda: torch.cuda.stream(compute)) if cuda else contextlib.nullcontext
        for c in self.layout.chunks_of[gi]:
            if not c.device_update:
                continue
            b = self.bufs[c.index]
            t0 = time.perf_counter()
            with on_h2d():
                b.step += 1
                b.step_count += 1
                if cuda:
                    h2d.wait_event(after_backward)  # the gradients are in, backward read the old weights
                    if b.states_home is not None:
                        h2d.wait_event(b.states_home)  # the previous update's states are home
            for lo, hi in slices(c.numel, device_update_slice(self.layout.slice_numel)):
                i = self._slot = 1 - self._slot
                if self.update_free[i] is not None:
                    self.update_free[i].synchronize()  # the buffer's last states have left it
                buf, grad_in, packed = self.update_bufs[i]
                states, grad = buf[:STATES, :hi - lo], buf[STATES, :hi - lo]
                # the rows as they travel: fp32 straight into the update's rows, else packed, decoded here
                arriving = states if packed is None else cut(packed, 0, hi - lo)
                weights = b.hi[lo:hi] if b.hi is not None else None  # with remainders: the model's, in place
                t1 = self.profile.start("device_update", h2d)
                with on_h2d():
                    for k in range(STATES):  # row by row: each row slice is contiguous (async copies)
                        arriving[k].copy_(b.states[k][lo:hi], non_blocking=True)
                    if grad_in is None:  # an fp32 gradient lands in its row
                        grad.copy_(b.grad[lo:hi], non_blocking=True)
                    else:  # up in its dtype, converted on the device
                        grad_in[:hi - lo].copy_(b.grad[lo:hi], non_blocking=True)
                    arrived = h2d.record_event() if cuda else None
                with on_compute():
                    if cuda:
                        compute.wait_event(arrived)
                    if packed is not None:
                        decode(fmt, arriving, weights, states)
                    if grad_in is not None:
                        grad.copy_(grad_in[:hi - lo])
                    self.adamw.apply_fp32(c, b, states, grad, hyper, coef)  # the rows decoded, if they were not fp32
                    if packed is not None:
                        encode(fmt, states, arriving, weights, seed=(c.index, b.step_count), base=lo)
                    if weights is None:
                        for p, a, z, sa, sz in c.param_ranges(lo, hi):
                            p.data.view(-1)[a:z].copy_(states[0, sa - lo:sz - lo])
                    updated = compute.record_event() if cuda else None
                self.profile.stop("device_update", t1, compute)
                self.profile.add_bytes("device_update", (hi - lo) * (2 * fmt.bytes + b.grad.element_size()))
                if not cuda:
                    for k in range(STATES):
                        b.states[k][lo:hi].copy_(arriving[k])
                    continue
                with torch.cuda.stream(d2h):
                    d2h.wait_event(updated)
                    for k in range(STATES):
                        b.states[k][lo:hi].copy_(arriving[k], non_blocking=True)
                    b.states_home = self.update_free[i] = d2h.record_event()
                events.append(updated)
            self.profile.busy("device_update_thread", time.perf_counter() - t0)
        return events
