"""The model's weights as the forward sees them: offloaded layers fetched, prefetched and released,
resident layers all-gathered from their owners over DP, and the forward hooks that do both.

Owns: the fetched layers (``live``: weights and their H2D event), the peak of fetched parameters, and
the forward pre/post hooks. Touches: the model's ``p.data`` (set to a fetched or gathered copy, or to
an empty tensor when released), reads the offloaded layers' host weights (the chunks' ``weights``
buffers), the H2D stream and the profile. The update part handed to ``install_hooks`` and
``materialized`` is asked to ``complete(gi)`` before a layer is used (its latest update has landed)
and to ``wait_all()`` before weights are materialized; the update calls ``all_gather(gi)`` and
``release(gi)``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from angelgpt.zero_cache.buffers import release_weights
from angelgpt.zero_cache.layout import Layout, hook_module_name
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import prefetch_depth


def fetch_depth(layout: Layout, zc) -> int:
    """Offloaded layers fetched ahead of the running one (zero_cache.prefetch_bucket_size,
    max_live_parameters, max_contigous_params_size)."""
    offloaded = [sum(layout.numel(p) for p in g) for g, f in zip(layout.sub_groups, layout.partitioned) if f]
    return prefetch_depth(max(offloaded, default=1), zc.prefetch_bucket_size, zc.max_live_parameters,
                          zc.max_contigous_params_size, layout.model_dtype.itemsize)


class Weights:
    def __init__(self, layout: Layout, host_weights: Sequence[Optional[torch.Tensor]], device: torch.device,
                 group, streams: Streams, profile: Profile, use_reduce_scatter: bool, recompute: bool,
                 prefetch_depth: int):
        """host_weights: per chunk index, an offloaded layer's weights on the host (None elsewhere).
        use_reduce_scatter: collectives on tensors of the device (NCCL), not lists (gloo on CPU).
        recompute: full recompute (a backward runs the forward again, its prefetch goes backwards)."""
        self.layout, self.host_weights, self.device, self.group = layout, host_weights, device, group
        self.streams, self.profile = streams, profile
        self.use_reduce_scatter, self.recompute, self.prefetch_depth = use_reduce_scatter, recompute, prefetch_depth
        self.live: Dict[int, Tuple[torch.Tensor, object]] = {}  # fetched layers: weights, H2D event
        self.peak_live_params = 0  # most fetched parameters on the device at once
        self.handles = []

    # -- offloaded weights (offload_params) -------------------------------------------------------
    def release(self, gi: int) -> None:
        """Drops a fetched layer's weights from the device (autograd may hold them until its backward)."""
        self.live.pop(gi, None)
        release_weights(self.layout.sub_groups[gi], self.layout.model_dtype, self.device)

    def _fetch(self, gi: int, update) -> None:
        """Starts bringing layer gi's weights to the device: H2D of the owned pieces, all-gather over DP."""
        if gi in self.live:
            return
        update.complete(gi)  # its latest update has reached the host copy
        L = self.layout
        dp_rank, dp_size, dtype = L.dp_rank, L.dp_size, L.model_dtype
        per_rank, seg = L.dp_layouts[gi]
        t0 = self.profile.start("fetch", self.streams.h2d)
        if self.streams.cuda:
            with torch.cuda.stream(self.streams.h2d):
                full = torch.empty(dp_size * seg, dtype=dtype, device=self.device)
        else:
            full = torch.empty(dp_size * seg, dtype=dtype, device=self.device)
        mine = full[dp_rank * seg:(dp_rank + 1) * seg]
        off = 0
        stream_ctx = torch.cuda.stream(self.streams.h2d) if self.streams.cuda else contextlib.nullcontext()
        with stream_ctx:
            for p in per_rank[dp_rank]:
                c, coff = L.slot_of[id(p)]
                n = L.numel(p)
                mine[off:off + n].copy_(self.host_weights[c.index][coff:coff + n], non_blocking=True)
                off += n
            ready = self.streams.h2d.record_event() if self.streams.cuda else None
        self.profile.stop("fetch", t0, self.streams.h2d)
        self.profile.add_bytes("fetch", off * full.element_size())
        if dp_size > 1:
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
                p.data = full[off:off + L.numel(p)].view(L.shape[id(p)])
                off += L.numel(p)
        self.live[gi] = (full, ready)
        self.peak_live_params = max(self.peak_live_params, sum(L.dp_layouts[g][1] * dp_size for g in self.live))

    def _use(self, gi: int, update) -> None:
        """Layer gi is about to run: its weights are fetched (waited for on this stream)."""
        self._fetch(gi, update)
        full, ready = self.live[gi]
        if ready is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).wait_event(ready)
            full.record_stream(torch.cuda.current_stream(self.device))
            self.live[gi] = (full, None)
            self.profile.exposed("wait_fetch", time.perf_counter() - t0)

    def _before_layer(self, gis, update) -> None:
        partitioned = self.layout.partitioned
        for gi in gis:
            if partitioned[gi]:
                self._use(gi, update)
                # prefetch: the next layers in forward order, or the previous ones while backward recomputes
                step = -1 if (torch.is_grad_enabled() and self.recompute) else 1
                for k in range(1, self.prefetch_depth + 1):
                    nxt = gi + k * step
                    if not (0 <= nxt < len(partitioned) and partitioned[nxt]):
                        break
                    self._fetch(nxt, update)
            else:
                update.complete(gi)

    def _after_layer(self, gis) -> None:
        if torch.is_grad_enabled():
            return  # autograd keeps the weights for backward: released once the layer's gradients are in
        for gi in gis:
            if self.layout.partitioned[gi]:
                self.release(gi)

    @contextlib.contextmanager
    def materialized(self, update):
        """Offloaded weights readable as ordinary tensors (host memory), for checkpoint save and load;
        every update of `update` applied first."""
        update.wait_all()
        L = self.layout
        held = [gi for gi, f in enumerate(L.partitioned) if f]
        for gi in held:
            if L.dp_size == 1:
                for c in L.chunks_of[gi]:
                    for p, view in c.views(self.host_weights[c.index]):
                        p.data = view
            else:
                self._fetch(gi, update)
                self._use(gi, update)
                for p in L.sub_groups[gi]:
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
        L = self.layout
        dp_rank, dp_size = L.dp_rank, L.dp_size
        per_rank, seg = L.dp_layouts[gi]
        group = L.sub_groups[gi]
        t0 = self.profile.start("all_gather")
        dtype = group[0].dtype
        mine = torch.zeros(seg, dtype=dtype, device=self.device)
        off = 0
        for p in per_rank[dp_rank]:
            mine[off:off + p.numel()].copy_(p.detach().reshape(-1))
            off += p.numel()
        if self.use_reduce_scatter:
            full = torch.empty(dp_size * seg, dtype=dtype, device=self.device)
            dist.all_gather_into_tensor(full, mine, group=self.group)
            parts = full.split(seg)
        else:
            parts = [torch.empty_like(mine) for _ in range(dp_size)]
            dist.all_gather(parts, mine, group=self.group)
        for r, ps in enumerate(per_rank):
            if r == dp_rank:
                continue
            off = 0
            for p in ps:
                p.data.copy_(parts[r][off:off + p.numel()].view_as(p))
                off += p.numel()
        self.profile.stop("all_gather", t0)

    # -- hooks -----------------------------------------------------------------------------------
    def install_hooks(self, model: torch.nn.Module, named, update) -> None:
        """A forward pre-hook (wait for `update`'s sub-group, fetch) and a forward hook (release) on the
        module that runs each sub-group's parameters."""
        modules = dict(model.named_modules())
        waits: Dict[str, set] = collections.defaultdict(set)
        for name, p in named:
            waits[hook_module_name(name)].add(self.layout.group_of[id(p)])
        for mod_name, gis in waits.items():
            gis = sorted(gis)

            self.handles.append(modules[mod_name].register_forward_pre_hook(
                lambda module, args, gis=gis: self._before_layer(gis, update)))
            self.handles.append(modules[mod_name].register_forward_hook(
                lambda module, args, out, gis=gis: self._after_layer(gis)))

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
