"""The model's weights as the forward sees them: offloaded layers fetched, prefetched and released,
resident layers all-gathered from their owners over DP, and the forward hooks that do both.

Owns: the fetched layers (``live``: weights and their H2D event), the prefetch depth, the peak of
fetched parameters, and the forward pre/post hooks. Touches: the model's ``p.data`` (set to a fetched
or gathered copy, or to an empty tensor when released), reads the chunks' ``weights`` (an offloaded
layer's host copy) and the layouts in the store, the H2D stream and the profile. Calls the update's
``complete(gi)`` before a layer is used (its latest update has landed) and ``wait_all()`` before
weights are materialized; the update calls back ``all_gather(gi)`` and ``release(gi)``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from angelgpt.zero_cache.placement import prefetch_depth
from angelgpt.zero_cache.store import Store, hook_module_name


class Weights:
    def __init__(self, store: Store):
        self.store = store
        self.device, self.model_dtype = store.device, store.model_dtype
        self.group, self.dp_rank, self.dp_size = store.group, store.dp_rank, store.dp_size
        self.use_reduce_scatter, self.recompute = store.use_reduce_scatter, store.recompute
        self.sub_groups, self.chunks_of, self.group_of = store.sub_groups, store.chunks_of, store.group_of
        self.layouts, self.slot_of, self.shape = store.layouts, store.slot_of, store.shape
        self.partitioned = store.partitioned
        self.streams, self.profile = store.streams, store.profile
        self._n = store._n
        self.update = None  # the Update part (complete, wait_all), set once it exists
        self.live: Dict[int, Tuple[torch.Tensor, object]] = {}  # fetched layers: weights, H2D event
        self.peak_live_params = 0  # most fetched parameters on the device at once
        zc = store.cfg.zero_cache
        offloaded = [sum(self._n(p) for p in g) for g, f in zip(self.sub_groups, self.partitioned) if f]
        self.prefetch_depth = prefetch_depth(max(offloaded, default=1), zc.prefetch_bucket_size,
                                             zc.max_live_parameters, zc.max_contigous_params_size,
                                             store.params[0].element_size())
        self.handles = []

    # -- offloaded weights (offload_params) -------------------------------------------------------
    def release_offloaded(self) -> None:
        """Transformer layers whose states are all off the device keep their weights on the host and
        are fetched before each use; the embedding and output stay (they run at both ends)."""
        for gi, flag in enumerate(self.partitioned):
            if flag:
                self.release(gi)  # also those of which this rank owns nothing

    def release(self, gi: int) -> None:
        """Drops a fetched layer's weights from the device (autograd may hold them until its backward)."""
        self.live.pop(gi, None)
        for p in self.sub_groups[gi]:
            p.data = torch.empty(0, dtype=self.model_dtype, device=self.device)

    def _fetch(self, gi: int) -> None:
        """Starts bringing layer gi's weights to the device: H2D of the owned pieces, all-gather over DP."""
        if gi in self.live:
            return
        self.update.complete(gi)  # its latest update has reached the host copy
        per_rank, seg = self.layouts[gi]
        t0 = self.profile.start("fetch", self.streams.h2d)
        if self.streams.cuda:
            with torch.cuda.stream(self.streams.h2d):
                full = torch.empty(self.dp_size * seg, dtype=self.model_dtype, device=self.device)
        else:
            full = torch.empty(self.dp_size * seg, dtype=self.model_dtype, device=self.device)
        mine = full[self.dp_rank * seg:(self.dp_rank + 1) * seg]
        off = 0
        stream_ctx = torch.cuda.stream(self.streams.h2d) if self.streams.cuda else contextlib.nullcontext()
        with stream_ctx:
            for p in per_rank[self.dp_rank]:
                c, coff = self.slot_of[id(p)]
                mine[off:off + self._n(p)].copy_(c.weights[coff:coff + self._n(p)], non_blocking=True)
                off += self._n(p)
            ready = self.streams.h2d.record_event() if self.streams.cuda else None
        self.profile.stop("fetch", t0, self.streams.h2d)
        self.profile.add_bytes("fetch", off * full.element_size())
        if self.dp_size > 1:
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
                ready = None
            t1 = self.profile.start("all_gather")
            if self.use_reduce_scatter:
                dist.all_gather_into_tensor(full, mine.clone(), group=self.group)
            else:
                parts = list(full.split(seg))
                dist.all_gather(parts, mine.clone(), group=self.group)
            self.profile.stop("all_gather", t1)
        for r, ps in enumerate(per_rank):
            off = r * seg
            for p in ps:
                p.data = full[off:off + self._n(p)].view(self.shape[id(p)])
                off += self._n(p)
        self.live[gi] = (full, ready)
        self.peak_live_params = max(self.peak_live_params, sum(self.layouts[g][1] * self.dp_size for g in self.live))

    def _use(self, gi: int) -> None:
        """Layer gi is about to run: its weights are fetched (waited for on this stream)."""
        self._fetch(gi)
        full, ready = self.live[gi]
        if ready is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).wait_event(ready)
            full.record_stream(torch.cuda.current_stream(self.device))
            self.live[gi] = (full, None)
            self.profile.exposed("wait_fetch", time.perf_counter() - t0)

    def _before_layer(self, gis) -> None:
        for gi in gis:
            if self.partitioned[gi]:
                self._use(gi)
                # prefetch: the next layers in forward order, or the previous ones while backward recomputes
                step = -1 if (torch.is_grad_enabled() and self.recompute) else 1
                for k in range(1, self.prefetch_depth + 1):
                    nxt = gi + k * step
                    if not (0 <= nxt < len(self.partitioned) and self.partitioned[nxt]):
                        break
                    self._fetch(nxt)
            else:
                self.update.complete(gi)

    def _after_layer(self, gis) -> None:
        if torch.is_grad_enabled():
            return  # autograd keeps the weights for backward: released once the layer's gradients are in
        for gi in gis:
            if self.partitioned[gi]:
                self.release(gi)

    @contextlib.contextmanager
    def materialized(self):
        """Offloaded weights readable as ordinary tensors (host memory), for checkpoint save and load."""
        self.update.wait_all()
        held = [gi for gi, f in enumerate(self.partitioned) if f]
        for gi in held:
            if self.dp_size == 1:
                for c in self.chunks_of[gi]:
                    for p, view in c.views(c.weights):
                        p.data = view
            else:
                self._fetch(gi)
                self._use(gi)
                for p in self.sub_groups[gi]:
                    p.data = p.data.cpu()
                self.live.pop(gi, None)
        try:
            yield
        finally:
            for gi in held:
                self.release(gi)

    # -- resident weights: the owners' updates gathered over DP ------------------------------------
    @torch.no_grad()
    def all_gather(self, gi: int) -> None:
        per_rank, seg = self.layouts[gi]
        group = self.sub_groups[gi]
        t0 = self.profile.start("all_gather")
        dtype = group[0].dtype
        mine = torch.zeros(seg, dtype=dtype, device=self.device)
        off = 0
        for p in per_rank[self.dp_rank]:
            mine[off:off + p.numel()].copy_(p.detach().reshape(-1))
            off += p.numel()
        if self.use_reduce_scatter:
            full = torch.empty(self.dp_size * seg, dtype=dtype, device=self.device)
            dist.all_gather_into_tensor(full, mine, group=self.group)
            parts = full.split(seg)
        else:
            parts = [torch.empty_like(mine) for _ in range(self.dp_size)]
            dist.all_gather(parts, mine, group=self.group)
        for r, ps in enumerate(per_rank):
            if r == self.dp_rank:
                continue
            off = 0
            for p in ps:
                p.data.copy_(parts[r][off:off + p.numel()].view_as(p))
                off += p.numel()
        self.profile.stop("all_gather", t0)

    # -- hooks -----------------------------------------------------------------------------------
    def install_hooks(self, model: torch.nn.Module, named) -> None:
        """A forward pre-hook (wait for the update, fetch) and a forward hook (release) on the module
        that runs each sub-group's parameters."""
        modules = dict(model.named_modules())
        waits: Dict[str, set] = collections.defaultdict(set)
        for name, p in named:
            waits[hook_module_name(name)].add(self.group_of[id(p)])
        for mod_name, gis in waits.items():
            gis = sorted(gis)

            self.handles.append(modules[mod_name].register_forward_pre_hook(
                lambda module, args, gis=gis: self._before_layer(gis)))
            self.handles.append(modules[mod_name].register_forward_hook(
                lambda module, args, out, gis=gis: self._after_layer(gis)))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
