"""Gradients on their way into the store: the post-accumulate hooks, the fp32 main grads that micro
batches add up in on the device, the reduction to each parameter's owner over DP, the copy into the
owner's chunk (D2H stream for host chunks), in-store accumulation over micro batches (a host chunk's
running sum through a device slot), the flush before the step, and the squared norm of what was stored.

Micro batches add up in the store's gradient dtype (fp32 with optim.accumulate_grads_in_fp32 and
several micro batches): in the store (accumulate_in_store), each micro batch's gradient is added to
the fp32 buffers and slots; on the device, each is added to an fp32 main grad per parameter and
autograd's model-dtype gradient is released at once (Megatron's main_grad), unless the model is fp32
already or the opt-out lets autograd add up in the model's dtype.

Owns: the backward state of one step (gradients seen per sub-group, micro batches offloaded,
reductions in flight, main grads), the squared norm on the device, and the accumulation slots' cursor
and events. Touches: the model's ``p.grad`` (released once copied), the chunks' ``grad`` buffers and
``grad_ready`` events, the accumulation slots, the D2H and H2D streams, the profile, and the
``update_free`` events (waited on and cleared: the device update buffers share the slots' memory).
Calls the update's ``complete(gi)`` before a chunk's gradient is overwritten and the weights part's
``release(gi)`` once an offloaded layer's backward is done.
"""

from __future__ import annotations

import collections
import math
import time
from typing import List, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.parallel.embedding import allreduce_tied_embedding_grad
from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.layout import Layout
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import ACCUMULATION_SLOTS


def _in_norm(p) -> bool:
    """Counted in the global norm: not a TP duplicate, not the last stage's copy of tied embeddings."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    return param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)


class Gradients:
    def __init__(self, layout: Layout, bufs: Sequence[ChunkBuffers], acc_slots: List[torch.Tensor],
                 update_free: list, weights, update, device: torch.device, group, streams: Streams,
                 profile: Profile, use_reduce_scatter: bool, max_reduce_events: int):
        """bufs: the chunks' buffers (at their indices); acc_slots: the device slots host chunks'
        running sums pass through; update_free: the device update buffers' events (shared memory);
        weights, update: the parts it calls. use_reduce_scatter: collectives on tensors of the device
        (NCCL), not lists (gloo on CPU); max_reduce_events: reductions in flight at most."""
        self.layout, self.bufs, self.weights, self.update = layout, bufs, weights, update
        self.device, self.group, self.streams, self.profile = device, group, streams, profile
        self.use_reduce_scatter, self.max_reduce_events = use_reduce_scatter, max_reduce_events
        self._acc_slots, self._update_free = acc_slots, update_free
        self._acc_free, self._acc_slot = [None] * ACCUMULATION_SLOTS, 0
        self.handles = []
        self.tied, self.deferred = None, set()

    def defer_tied_embedding(self, weight) -> None:
        """PP > 1 with tied embeddings: this stage's copy (the first stage's embedding, the last stage's
        output weight; angelgpt.parallel.embedding) has the other stage's gradient added before its
        sub-group goes to the owner, in flush: an all-reduce in a backward hook would wait for the other
        stage, which under 1F1B waits for this one."""
        self.tied = weight
        self.deferred = set() if weight is None else {self.layout.group_of[id(weight)]}

    def install_hooks(self, named) -> None:
        """A post-accumulate hook on every parameter (on_grad)."""
        for name, p in named:
            self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()

    def reset_backward_state(self) -> None:
        self._seen = collections.Counter()  # gradients of the sub-group in this micro batch so far
        self._completed = collections.Counter()  # micro batches whose backward finished the sub-group
        self._offloaded = [False] * len(self.layout.sub_groups)
        self._sq = torch.zeros((), dtype=torch.float32, device=self.device)
        self._in_flight = collections.deque()
        self._micro = collections.Counter()  # micro batches of each sub-group offloaded so far
        self._sq_side = torch.zeros((), dtype=torch.float32, device=self.device)  # host sums' norms (H2D stream)
        self._main = {}  # id(p) -> its fp32 main grad: the micro batches' sum so far (main_grads)

    def _grad(self, p):
        """The gradient of p so far: its main grad where micro batches add up in one, else p.grad."""
        return self._main.get(id(p), p.grad)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate hook: this micro batch's gradient added to p's fp32 main grad (main_grads) and
        released; a sub-group whose gradients are final is reduced and offloaded now."""
        L = self.layout
        if L.main_grads:
            main = self._main.get(id(p))
            if main is None:
                self._main[id(p)] = p.grad.to(torch.float32)
            else:
                main.add_(p.grad)
            p.grad = None
        gi = L.group_of[id(p)]
        self._seen[gi] += 1
        if self._seen[gi] == len(L.sub_groups[gi]):  # this micro batch is done with the sub-group
            self._seen[gi] = 0
            self._completed[gi] += 1
            if gi not in self.deferred and (L.accumulate or self._completed[gi] == L.num_microbatches):
                self._offload(gi)
            if L.partitioned[gi]:
                self.weights.release(gi)

    # -- reduce to the owner, offload, release ----------------------------------------------------
    @torch.no_grad()
    def _offload(self, gi: int, last: bool = False) -> None:
        """This micro batch's (or, not accumulating in the store, the step's) gradients of a sub-group
        go to their owner's chunk; the model's gradients are released."""
        if self._offloaded[gi]:
            return
        L = self.layout
        first = self._micro[gi] == 0
        self._micro[gi] += 1
        last = last or not L.accumulate or self._micro[gi] >= L.num_microbatches
        self._offloaded[gi] = last
        if first:
            self.update.complete(gi)  # never overwrite a chunk's gradient before its last update read it
        group = L.sub_groups[gi]
        self._sum_sequence_parallel(group)
        if L.dp_size == 1:
            self._to_owner(gi, [(p, self._grad(p) if self._grad(p) is not None else
                                 torch.zeros(L.shape[id(p)], dtype=L.model_dtype, device=self.device))
                                for p in group], first, last)
            self._release(group)  # a stream that reads it recorded itself there (_to_owner, _accumulate)
            return
        per_rank, seg = L.dp_layouts[gi]
        flat = torch.zeros(L.dp_size * seg, dtype=torch.float32, device=self.device)
        for r, ps in enumerate(per_rank):
            off = r * seg
            for p in ps:
                if self._grad(p) is not None:
                    flat[off:off + L.numel(p)].copy_(self._grad(p).reshape(-1))
                off += L.numel(p)
        self._release(group)  # copied into flat on this stream
        t0 = self.profile.start("reduce_scatter")
        if self.use_reduce_scatter:
            mine = torch.empty(seg, dtype=torch.float32, device=self.device)
            work = dist.reduce_scatter_tensor(mine, flat, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            mine = flat[L.dp_rank * seg:(L.dp_rank + 1) * seg]
        self._in_flight.append((gi, work, mine, t0, first, last))
        while len(self._in_flight) > self.max_reduce_events:
            self._finish_reduce()

    def _release(self, group) -> None:
        for p in group:
            p.grad = None
            self._main.pop(id(p), None)

    def _sum_sequence_parallel(self, group) -> None:
        """Sequence parallelism: the gradients of the sub-group's parameters marked ``sequence_parallel``
        (the norms, each TP rank's from its own slice of the sequence) summed over TP before they go to
        their owner (in fp32), as Megatron's finalize_model_grads does (angelgpt.parallel.sequence); summed,
        they are TP duplicates, counted once in the norm (param_is_not_tensor_parallel_duplicate: TP rank
        0). Every TP rank offloads its sub-groups in the same order. A parameter without a gradient (one
        no rank's backward reached) adds zeros."""
        marked = [p for p in group if getattr(p, "sequence_parallel", False)]
        tp = parallel_state.get_tensor_model_parallel_group()
        if not marked or tp.size() == 1:
            return
        grads = [self._grad(p) if self._grad(p) is not None else
                 torch.zeros(self.layout.shape[id(p)], dtype=self.layout.model_dtype, device=self.device)
                 for p in marked]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=tp)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def _finish_reduce(self) -> None:
        gi, work, mine, t0, first, last = self._in_flight.popleft()
        work.wait()
        self.profile.stop("reduce_scatter", t0)
        L = self.layout
        mine.div_(L.dp_size)
        per_rank, _ = L.dp_layouts[gi]
        grads, off = [], 0
        for p in per_rank[L.dp_rank]:
            grads.append((p, mine[off:off + L.numel(p)].view(L.shape[id(p)])))
            off += L.numel(p)
        self._to_owner(gi, grads, first, last)

    def _to_owner(self, gi: int, grads, first: bool = True, last: bool = True) -> None:
        """Owned gradients into their chunks, and their squared norm (on the device, no sync). The
        first micro batch copies; later ones (accumulate_in_store) add (_accumulate)."""
        if not first:
            return self._accumulate(gi, grads, last)
        for p, g in grads:
            if last and _in_norm(p):
                self._sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        # copied here without CUDA streams; a device chunk's copy stays on the compute stream too, so its
        # gradient is free at once rather than held until the D2H stream's queued copies have passed
        down = []
        for p, g in grads:
            c, off = self.layout.slot_of[id(p)]
            b = self.bufs[c.index]
            if not self.streams.cuda or c.tier == "device":
                b.grad[off:off + self.layout.numel(p)].copy_(g.reshape(-1))
            else:  # in the chunk's dtype first: a copy to the host that converts goes through pageable
                down.append((b, off, p, g.to(b.grad.dtype)))  # memory, synchronously
        if not down:
            return
        produced = torch.cuda.current_stream(self.device).record_event()
        t0 = self.profile.start("d2h", self.streams.d2h)
        with torch.cuda.stream(self.streams.d2h):
            self.streams.d2h.wait_event(produced)
            for b, off, p, g in down:
                b.grad[off:off + self.layout.numel(p)].copy_(g.reshape(-1), non_blocking=True)
                g.record_stream(self.streams.d2h)
                self.profile.add_bytes("d2h", g.numel() * g.element_size())
            for b in {id(b): b for b, _, _, _ in down}.values():
                b.grad_ready = self.streams.d2h.record_event()
        self.profile.stop("d2h", t0, self.streams.d2h)

    def _accumulate(self, gi: int, grads, last: bool) -> None:
        """A later micro batch's gradients added to their owner's chunks: in place for device chunks; for
        host chunks the running sum goes up to a device slot (H2D stream), gets the gradients added and,
        after the last micro batch, its norm taken there, and goes back down (D2H stream)."""
        host = []
        for p, g in grads:
            c, off = self.layout.slot_of[id(p)]
            view = self.bufs[c.index].grad[off:off + self.layout.numel(p)]
            if c.tier == "device":  # its first micro batch was copied on this stream too
                view.add_(g.reshape(-1))
                if last and _in_norm(p):
                    self._sq += torch.linalg.vector_norm(view, dtype=torch.float32).square()
            else:
                host.append((p, g, view))
        if not host:
            return
        i = self._acc_slot = (self._acc_slot + 1) % len(self._acc_slots)
        slot, pieces, off = self._acc_slots[i], [], 0
        for p, g, view in host:
            pieces.append((g.reshape(-1), view, slot[off:off + g.numel()], _in_norm(p)))
            off += g.numel()
        if not self.streams.cuda:
            for g, view, s, counted in pieces:
                s.copy_(view)
                s.add_(g)
                view.copy_(s)
                if last and counted:
                    self._sq += torch.linalg.vector_norm(s, dtype=torch.float32).square()
            return
        if self._acc_free[i] is not None:
            t0 = time.perf_counter()
            self._acc_free[i].synchronize()  # the slot's last round trip is home (bounds gradients in flight)
            self.profile.exposed("wait_slot", time.perf_counter() - t0)
        h2d, d2h = self.streams.h2d, self.streams.d2h
        for j, e in enumerate(self._update_free):  # the device update that shares the slots' memory is done
            if e is not None:
                h2d.wait_event(e)
                self._update_free[j] = None
        produced = torch.cuda.current_stream(self.device).record_event()
        t0 = self.profile.start("accumulate", h2d)
        with torch.cuda.stream(h2d):  # the sum so far comes up and the new gradients are added to it
            for b in {id(b): b for b in (self._buffers_of(p) for p, _, _ in host)}.values():
                if b.grad_ready is not None:
                    h2d.wait_event(b.grad_ready)  # the previous micro batch's sum has landed
            for g, view, s, counted in pieces:  # while the layer's backward may still be running:
                s.copy_(view, non_blocking=True)  # only the add waits for its gradients
            h2d.wait_event(produced)
            for g, view, s, counted in pieces:
                s.add_(g)
                g.record_stream(h2d)
                if last and counted:
                    self._sq_side += torch.linalg.vector_norm(s, dtype=torch.float32).square()
            summed = h2d.record_event()
        self.profile.stop("accumulate", t0, h2d)
        with torch.cuda.stream(d2h):  # and goes back down
            d2h.wait_event(summed)
            for g, view, s, counted in pieces:
                view.copy_(s, non_blocking=True)
            done = d2h.record_event()
        self.profile.add_bytes("accumulate", 2 * off * slot.element_size())
        self._acc_free[i] = done
        for p, _, _ in host:
            self._buffers_of(p).grad_ready = done

    def _buffers_of(self, p) -> ChunkBuffers:
        """The buffers of the chunk that owns p."""
        return self.bufs[self.layout.slot_of[id(p)][0].index]

    def flush(self) -> None:
        """Offloads what no hook offloaded (a parameter without a gradient, a partial last micro batch, the
        tied embedding's sub-group once both stages' gradients are summed)."""
        if self.tied is not None:  # Megatron's _allreduce_word_embedding_grads
            if self.layout.main_grads and self._grad(self.tied) is None:
                self._main[id(self.tied)] = torch.zeros_like(self.tied, dtype=torch.float32)
            elif self._grad(self.tied) is None:
                self.tied.grad = torch.zeros_like(self.tied)
            allreduce_tied_embedding_grad(self._grad(self.tied))
        for gi in range(len(self.layout.sub_groups)):
            if not self._offloaded[gi]:
                self._offload(gi, last=True)
        while self._in_flight:
            self._finish_reduce()
        if self.streams.cuda and self.layout.accumulate:  # the norms of the host chunks' sums (side stream)
            torch.cuda.current_stream(self.device).wait_stream(self.streams.h2d)
        self._sq += self._sq_side
        self._sq_side.zero_()  # counted once, however often flush runs

    # -- the step's view of them ------------------------------------------------------------------
    def zero_grad(self) -> None:
        self._release(self.layout.params)
        self.reset_backward_state()

    def global_norm(self) -> float:
        sq = self._sq
        if self.layout.dp_size > 1:
            dist.all_reduce(sq, group=self.group)
        mp = parallel_state.get_model_parallel_group()
        if mp.size() > 1:
            dist.all_reduce(sq, group=mp)
        return math.sqrt(sq.item())  # the one host sync of the step: clipping needs the norm
