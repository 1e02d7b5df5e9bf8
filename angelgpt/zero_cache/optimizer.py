"""ZeRO-Cache optimizer: model states sharded over data-parallel ranks, placed over three tiers, and
updated in a pipeline that overlaps the training compute.

Each data-parallel rank owns a disjoint set of whole parameters (balanced by size). The fp32 master
weights and Adam moments of what a rank owns live in flat chunks, one per (sub-group, weight-decay
class), beside a flat gradient buffer in the model's dtype; a sub-group is one transformer layer
(the embedding first, the final norm and output last). Placement puts the first
``prefetch_cache_sub_group_rate`` of the state bytes, in forward order, on the compute device (the
next forward needs the first layers first), the rest in host memory, and what host memory cannot
hold on NVMe.

One iteration, pipelined (``pipeline_optimizer: true``):

1. backward: as soon as a sub-group's gradients are final (the last micro batch's hook fired for
   every parameter in it), they are reduced to their owner (reduce-scatter; at most
   ``max_param_reduce_events`` in flight) and copied into the owner's chunk on the D2H stream; the
   model's gradient is released at once, so GPU memory holds gradients of a few layers only;
2. ``step()``: the one host sync: the global norm over every tier and rank; a non-finite norm skips
   the step; device chunks run fused AdamW on the GPU at once, and one worker thread updates host
   and NVMe chunks sub-group by sub-group in forward order (fused CPU AdamW, NVMe chunks double
   buffered), converting each updated master to the model dtype and uploading it on the H2D stream;
   beside it a second thread has the GPU update ``device_update_fraction`` of the host chunks
   (states up, fused AdamW there, weights in place, states back down);
3. next forward: a pre-hook on each sub-group's modules waits for that sub-group's upload only (a
   stream wait on its event), then all-gathers the owners' weights over DP; later sub-groups are
   still being updated while the first layers compute.

    opt = ZeroCacheOptimizer(model, cfg, device)   # Megatron-optimizer interface
    ok, grad_norm, _ = opt.step()
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.config import Config, ConfigError
from angelgpt.train.optim import _no_weight_decay, clip_coefficient
from angelgpt.zero_cache.cpu_adam import CpuAdam, CpuAdamUnavailable
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import (ACCUMULATION_SLOTS, DEVICE_UPDATE_SLICE, SLICE, STATES,
                                           accumulation_bytes, chunk_runs, device_update_bytes, largest_off_device_group,
                                           partition, place, slices)
from angelgpt.zero_cache.tiers import (GIB, DeviceTier, HostTier, NVMeTier, available_bytes, check_capacity,
                                       check_memlock)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def refuse_together(check) -> None:
    """Runs a rank's refusal check on every rank: when any refuses, all raise the first refusing rank's
    message (prefixed with its rank), so rank 0 reports it and no rank waits in a collective for one
    that left. Placements differ per rank (an uneven DP partition), so one rank alone may not fit."""
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


def sub_group_index(name: str, num_layers: int) -> int:
    """0 for embeddings, 1 + layer number for a transformer layer, num_layers + 1 for the rest."""
    m = _LAYER.search(name)
    if m:
        return 1 + int(m.group(1))
    return 0 if "embedding" in name else num_layers + 1


def hook_module_name(name: str) -> str:
    """The module whose forward pre-hook waits for this parameter: its transformer layer, else its owner."""
    m = _LAYER.search(name)
    return name[:m.end() - 1] if m else name.rsplit(".", 1)[0]


@dataclass
class Chunk:
    """Flat states of the parameters one rank owns in one sub-group and weight-decay class."""

    key: str
    group: int
    params: List[torch.nn.Parameter]
    decay: bool
    tier: str = "host"
    numel: int = 0
    offsets: List[int] = field(default_factory=list)
    shapes: List[torch.Size] = field(default_factory=list)  # the params' shapes (a released param is empty)
    states: Optional[torch.Tensor] = None  # [3, numel] fp32: master, exp_avg, exp_avg_sq (device/host tiers)
    file: Optional[object] = None  # NVMe tier
    grad: Optional[torch.Tensor] = None  # [numel], model dtype: reduced and owned (device tier, else host)
    grad_ready: Optional[object] = None  # CUDA event: the gradient's D2H copy is done
    weights: Optional[torch.Tensor] = None  # offloaded layer (offload_params): its weights, in the grad buffer
    step: Optional[torch.Tensor] = None
    device_update: bool = False  # a host chunk that the device updates (device_update_fraction)
    states_home: Optional[object] = None  # CUDA event: its states are back in host memory after that update

    def views(self, flat: torch.Tensor):
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            yield p, flat[off:off + shape.numel()].view(shape)


class ZeroCacheOptimizer:
    def __init__(self, model: torch.nn.Module, cfg: Config, device: torch.device):
        zc, o = cfg.zero_cache, cfg.optim
        from angelgpt.planner.plan import auto_settings, fetch_depth

        # 'auto' as the planner resolves it
        rate, self.offload_params, self.device_update_fraction, accumulate = auto_settings(
            cfg, device, parallel_state.get_data_parallel_group().size())
        cfg = replace(cfg, zero_cache=replace(zc, accumulate_in_store=accumulate))
        zc = cfg.zero_cache
        self.cfg = cfg
        self.device = device
        self.clip_grad = o.clip_grad
        self.betas = (o.adam_beta1, o.adam_beta2)
        self.eps = o.adam_eps
        self.group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = self.group.rank(), self.group.size()
        self.use_reduce_scatter = dist.get_backend(self.group) == "nccl"
        self.pipelined = zc.pipeline_optimizer
        self.max_reduce_events = zc.max_param_reduce_events
        self.num_microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * self.dp_size)
        self.recompute = cfg.model.recompute == "full"
        self.accumulate = accumulate and self.num_microbatches > 1
        self.rate = float(rate)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.shape = {id(p): p.shape for p in self.params}
        owners = partition([p.numel() for p in self.params], self.dp_size)
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        n_groups = cfg.model.num_layers + 2
        groups: List[List[Tuple[str, torch.nn.Parameter]]] = [[] for _ in range(n_groups)]
        decay = {}
        for name, p in named:
            groups[sub_group_index(name, cfg.model.num_layers)].append((name, p))
            decay[id(p)] = not _no_weight_decay(name, p)
        groups = [g for g in groups if g]
        self.sub_groups = [[p for _, p in g] for g in groups]
        self.group_of = {id(p): gi for gi, g in enumerate(self.sub_groups) for p in g}
        self.layouts = [self._owner_layout(g) for g in self.sub_groups]
        self.param_groups = [
            {"params": [p for p in self.params if decay[id(p)]], "lr": o.lr, "weight_decay": o.weight_decay,
             "wd_mult": 1.0},
            {"params": [p for p in self.params if not decay[id(p)]], "lr": o.lr, "weight_decay": 0.0,
             "wd_mult": 0.0},
        ]

        self.chunks: List[Chunk] = []
        for gi, group in enumerate(self.sub_groups):
            for is_decay in (True, False):
                mine = [p for p in group if decay[id(p)] == is_decay and self.owner[id(p)] == self.dp_rank]
                for part, run in enumerate(chunk_runs([p.numel() for p in mine])):
                    c = Chunk(key=f"g{gi:04d}_{'decay' if is_decay else 'nodecay'}_{part}", group=gi,
                              params=[mine[i] for i in run], decay=is_decay)
                    off = 0
                    for p in c.params:
                        c.offsets.append(off)
                        c.shapes.append(p.shape)
                        off += p.numel()
                    c.numel = off
                    self.chunks.append(c)
        self.chunks_of: List[List[Chunk]] = [[c for c in self.chunks if c.group == gi]
                                             for gi in range(len(self.sub_groups))]
        self.slot_of = {id(p): (c, off) for c in self.chunks for p, off in zip(c.params, c.offsets)}  # owned params
        self.model_dtype = self.params[0].dtype
        self._place(zc)
        self.cpu_adam = self._load_cpu_adam(zc.cpu_adam)
        self.streams = Streams(device)
        self.profile = Profile(device, enabled=zc.is_communication_time_profiling)
        self._live: Dict[int, Tuple[torch.Tensor, object]] = {}  # fetched layers: weights, H2D event
        self.peak_live_params = 0  # most fetched parameters on the device at once
        offloaded = [sum(self._n(p) for p in g) for g, f in zip(self.sub_groups, self.partitioned) if f]
        self.prefetch_depth = fetch_depth(cfg, max(offloaded, default=1), self.params[0].element_size())
        self._allocate()
        self._release_offloaded()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-update")
        self._device_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-cache-device-update")
        self._prefetcher = ThreadPoolExecutor(max_workers=1) if self.nvme else None
        self._pending: Dict[int, List[Future]] = {}  # sub-group -> its updates in flight (events to wait on)
        self._needs_gather: set = set()
        self._handles = []
        self._install_hooks(model, named)
        self._reset_backward_state()

    # -- placement and allocation ------------------------------------------------------------
    def _place(self, zc) -> None:
        from angelgpt.planner.plan import GPU_HEADROOM, device_reserve

        grad_bytes = self.params[0].element_size()
        if zc.nvme_path:  # chunk files a killed run left would count against this run's NVMe room
            freed = NVMeTier.reclaim(zc.nvme_path)
            if freed:
                print(f"zero_cache: removed {freed / GIB:.2f} GiB of NVMe chunks that an ended run left under "
                      f"{zc.nvme_path}", flush=True)
        avail = available_bytes(self.device, zc.host_max_gib, zc.nvme_path, zc.nvme_max_gib)
        numels = [c.numel for c in self.chunks]
        groups = [c.group for c in self.chunks]
        args = (groups, numels, len(self.sub_groups), self.rate, avail["host"],
                bool(zc.nvme_path), grad_bytes, self.offload_params, self.accumulate)
        kw = {"device_update_fraction": self.device_update_fraction}
        tiers, flags, needed, streamed = place(*args, **kw)
        if self.dp_size > 1:  # a layer is fetched (and all-gathered) on every rank or on none
            t = torch.tensor([float(f) for f in flags], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            tiers, flags, needed, streamed = place(*args, allowed=[bool(v) for v in t.tolist()], **kw)
        for c, t, d in zip(self.chunks, tiers, streamed):
            c.tier, c.device_update = t, d
        self.partitioned = flags
        if self.device.type == "cuda":  # what training needs beside the states, as the planner counts it
            largest = max(sum(self._n(p) for p in g) for g in self.sub_groups)
            avail["device"] -= device_reserve(self.cfg, largest, grad_bytes, any(flags),
                                              sum(self._n(p) for p in self.params), self.dp_size)
            # (device_reserve counts every gradient when micro batches accumulate on the GPU)
            avail["device"] -= int(GPU_HEADROOM * torch.cuda.mem_get_info(self.device)[1])
        # offloaded layers leave the device once their chunks exist, making room for the states
        avail["device"] += grad_bytes * sum(self._n(p) for gi, f in enumerate(flags) if f for p in self.sub_groups[gi])
        if not zc.nvme_path:
            needed.pop("nvme")

        def check():
            check_capacity(needed, avail)
            if self.device.type == "cuda":  # what crosses PCIe is pinned: host gradients, offloaded weights,
                # the states the device updates
                off = sum(c.numel for c, t in zip(self.chunks, tiers) if t != "device")
                own_weights = sum(c.numel for c in self.chunks if flags[c.group]) if self.accumulate else 0
                streamed = sum(c.numel for c in self.chunks if c.device_update)
                check_memlock(grad_bytes * (off + own_weights) + STATES * 4 * streamed)

        refuse_together(check)
        self.planned_bytes = needed

    def _load_cpu_adam(self, mode: str) -> Optional[CpuAdam]:
        """The one-pass CPU AdamW when the CPU updates some chunk (None: torch's)."""
        if self.device.type == "cuda" and not any(c.tier != "device" and not c.device_update for c in self.chunks):
            return None
        kernel = None

        def load():
            nonlocal kernel
            try:
                kernel = CpuAdam.load(mode)
            except CpuAdamUnavailable as e:
                raise ConfigError(f"zero_cache.cpu_adam=native cannot be built: {e}") from e

        refuse_together(load)
        return kernel

    def _allocate(self) -> None:
        on_cuda = self.device.type == "cuda"
        self.tiers = {"device": DeviceTier(self.device), "host": HostTier(pin=on_cuda)}
        zc = self.cfg.zero_cache
        self.nvme = NVMeTier(zc.nvme_path) if zc.nvme_path else None
        self._loading = {}  # id(chunk) -> the states a checkpoint load writes into in place
        if self.nvme:
            self.tiers["nvme"] = self.nvme
        sizes = {t: [c.numel for c in self.chunks if (c.tier == "device") == (t == "device")] for t in ("device", "host")}
        self.scratch = {t: self.tiers[t].allocate(min(max(n), SLICE)) for t, n in sizes.items() if n}
        nvme_sizes = [c.numel for c in self.chunks if c.tier == "nvme"]
        if nvme_sizes:
            self.tiers["host"].bytes += self.nvme.reserve_staging(STATES * max(nvme_sizes))
        upload = [c.numel for c in self.chunks
                  if c.tier != "device" and not self.partitioned[c.group] and not c.device_update]
        # two pinned buffers in the model dtype carry updated weights to the device (double buffered)
        self._upload = [torch.empty(min(max(upload), SLICE), dtype=self.model_dtype, pin_memory=True)
                        for _ in range(2)] if upload and on_cuda else []
        self._upload_done, self._slot = [None, None], 0  # which upload buffer comes next
        self._allocate_shared()
        done = collections.Counter()
        for c in reversed(self.chunks):  # last layers first: offloaded ones leave the device before states arrive
            grad_tier = self.tiers["device" if c.tier == "device" else "host"]
            c.grad = grad_tier.allocate(c.numel, self.model_dtype, pinned=True)
            step_device = self.device if c.tier == "device" or c.device_update else torch.device("cpu")
            c.step = torch.zeros((), dtype=torch.float32, device=step_device)
            # the owned weights reach the chunk through its gradient buffer (pinned when it is on the host)
            for p, view in c.views(c.grad):
                view.copy_(p.detach())
            if self.partitioned[c.group] and self.accumulate:  # gradients arrive from the first micro batch on
                c.weights = self.tiers["host"].allocate(c.numel, self.model_dtype, pinned=True)
                c.weights.copy_(c.grad)
            elif self.partitioned[c.group]:
                c.weights = c.grad  # holds the weights until the last backward's gradients replace them
            if c.tier == "nvme":
                c.file = self.nvme.create(c.key, STATES * c.numel)
                staging = self.nvme.staging(0, STATES * c.numel).zero_()
                staging[:c.numel].copy_(c.grad)
                NVMeTier.write(c.file, staging)
            else:
                c.states = self.tiers[c.tier].allocate(STATES * c.numel, pinned=c.device_update).view(STATES, c.numel)
                c.states[0].copy_(c.grad)
            done[c.group] += 1
            if self.partitioned[c.group] and done[c.group] == len(self.chunks_of[c.group]):
                self._release(c.group)

    def _allocate_shared(self) -> None:
        """One device buffer for what never runs at once: the accumulation slots that host chunks'
        running sums make their round trips through (later backward passes), and the two buffers that
        host chunks updated on the device stream through (between the last backward and the next
        forward): [fp32 states and gradient] x 2, then [gradient as it arrives] x 2."""
        groups, numels, tiers = ([c.group for c in self.chunks], [c.numel for c in self.chunks],
                                 [c.tier for c in self.chunks])
        streamed = [c.device_update for c in self.chunks]
        size = self.model_dtype.itemsize
        slot = largest_off_device_group(groups, numels, tiers) if self.accumulate else 0
        n = min(max((c.numel for c in self.chunks if c.device_update), default=0), DEVICE_UPDATE_SLICE)
        # the sizes placement counts: the slots, or the update buffers, whichever is larger
        slots_bytes = accumulation_bytes(groups, numels, tiers, self.partitioned, size)["device"] \
            if self.accumulate else 0
        nbytes = max(slots_bytes, device_update_bytes(numels, streamed, size))
        pool = self.tiers["device"].allocate(nbytes, torch.uint8) if nbytes else None
        self._acc_slots = [pool[i * slot * size:(i + 1) * slot * size].view(self.model_dtype)
                           for i in range(ACCUMULATION_SLOTS)] if slot else []
        self._acc_free, self._acc_slot = [None] * ACCUMULATION_SLOTS, 0
        states = (STATES + 1) * 4 * n
        self._update_bufs = [(pool[j * states:(j + 1) * states].view(torch.float32).view(STATES + 1, n),
                              pool[2 * states + j * n * size:2 * states + (j + 1) * n * size].view(self.model_dtype))
                             for j in range(2)] if n else []
        self._update_free, self._update_slot = [None, None], 0

    def summary(self) -> str:
        """One line: where this rank's states went and who updates the host-resident ones."""
        owned = {t: sum(c.numel for c in self.chunks if c.tier == t) for t in ("device", "host", "nvme")}
        on_device = sum(c.numel for c in self.chunks if c.device_update)
        return (f"zero_cache: prefetch_cache_sub_group_rate {self.rate:.2f}, offload_params {self.offload_params}; "
                f"owned parameters' states on device {owned['device']:,}, host {owned['host']:,}, nvme "
                f"{owned['nvme']:,}; host states updated on the device {on_device:,} "
                f"(device_update_fraction {self.device_update_fraction:.2f}); CPU AdamW "
                f"{'native' if self.cpu_adam else 'torch'}")

    def allocated_bytes(self) -> Dict[str, int]:
        """Bytes each tier actually holds (chunk states, owned gradients, scratch and staging)."""
        return {name: tier.bytes for name, tier in self.tiers.items()}

    def _n(self, p: torch.nn.Parameter) -> int:
        return self.shape[id(p)].numel()

    def _owner_layout(self, group: List[torch.nn.Parameter]):
        """Per rank, its owned params in this sub-group and the size of a padded flat segment."""
        per_rank: List[List[torch.nn.Parameter]] = [[] for _ in range(self.dp_size)]
        for p in group:
            per_rank[self.owner[id(p)]].append(p)
        seg = max(sum(p.numel() for p in ps) for ps in per_rank)
        return per_rank, seg

    # -- offloaded weights (offload_params) -------------------------------------------------------
    def _release_offloaded(self) -> None:
        """Transformer layers whose states are all off the device keep their weights on the host and
        are fetched before each use; the embedding and output stay (they run at both ends)."""
        for gi, flag in enumerate(self.partitioned):
            if flag:
                self._release(gi)  # also those of which this rank owns nothing

    def _release(self, gi: int) -> None:
        """Drops a fetched layer's weights from the device (autograd may hold them until its backward)."""
        self._live.pop(gi, None)
        for p in self.sub_groups[gi]:
            p.data = torch.empty(0, dtype=self.model_dtype, device=self.device)

    def _fetch(self, gi: int) -> None:
        """Starts bringing layer gi's weights to the device: H2D of the owned pieces, all-gather over DP."""
        if gi in self._live:
            return
        self._complete(gi)  # its latest update has reached the host copy
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
        self._live[gi] = (full, ready)
        self.peak_live_params = max(self.peak_live_params, sum(self.layouts[g][1] * self.dp_size for g in self._live))

    def _use(self, gi: int) -> None:
        """Layer gi is about to run: its weights are fetched (waited for on this stream)."""
        self._fetch(gi)
        full, ready = self._live[gi]
        if ready is not None:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).wait_event(ready)
            full.record_stream(torch.cuda.current_stream(self.device))
            self._live[gi] = (full, None)
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
                self._complete(gi)

    def _after_layer(self, gis) -> None:
        if torch.is_grad_enabled():
            return  # autograd keeps the weights for backward: released once the layer's gradients are in
        for gi in gis:
            if self.partitioned[gi]:
                self._release(gi)

    @contextlib.contextmanager
    def materialized(self):
        """Offloaded weights readable as ordinary tensors (host memory), for checkpoint save and load."""
        self.wait_all()
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
                self._live.pop(gi, None)
        try:
            yield
        finally:
            for gi in held:
                self._release(gi)

    # -- hooks -----------------------------------------------------------------------------------
    def _install_hooks(self, model: torch.nn.Module, named) -> None:
        modules = dict(model.named_modules())
        waits: Dict[str, set] = collections.defaultdict(set)
        for name, p in named:
            waits[hook_module_name(name)].add(self.group_of[id(p)])
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for mod_name, gis in waits.items():
            gis = sorted(gis)

            self._handles.append(modules[mod_name].register_forward_pre_hook(
                lambda module, args, gis=gis: self._before_layer(gis)))
            self._handles.append(modules[mod_name].register_forward_hook(
                lambda module, args, out, gis=gis: self._after_layer(gis)))

    def _reset_backward_state(self) -> None:
        self._seen = collections.Counter()  # gradients of the sub-group in this micro batch so far
        self._completed = collections.Counter()  # micro batches whose backward finished the sub-group
        self._offloaded = [False] * len(self.sub_groups)
        self._sq = torch.zeros((), dtype=torch.float32, device=self.device)
        self._in_flight = collections.deque()
        self._micro = collections.Counter()  # micro batches of each sub-group offloaded so far
        self._sq_side = torch.zeros((), dtype=torch.float32, device=self.device)  # host sums' norms (H2D stream)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate hook: a sub-group whose gradients are final is reduced and offloaded now."""
        gi = self.group_of[id(p)]
        self._seen[gi] += 1
        if self._seen[gi] == len(self.sub_groups[gi]):  # this micro batch is done with the sub-group
            self._seen[gi] = 0
            self._completed[gi] += 1
            if self.accumulate or self._completed[gi] == self.num_microbatches:
                self._offload(gi)
            if self.partitioned[gi]:
                self._release(gi)

    # -- gradients: reduce to the owner, offload, release -----------------------------------------
    @torch.no_grad()
    def _offload(self, gi: int, last: bool = False) -> None:
        """This micro batch's (or, not accumulating in the store, the step's) gradients of a sub-group
        go to their owner's chunk; the model's gradients are released."""
        if self._offloaded[gi]:
            return
        first = self._micro[gi] == 0
        self._micro[gi] += 1
        last = last or not self.accumulate or self._micro[gi] >= self.num_microbatches
        self._offloaded[gi] = last
        if first:
            self._complete(gi)  # never overwrite a chunk's gradient before its last update read it
        group = self.sub_groups[gi]
        if self.dp_size == 1:
            self._to_owner(gi, [(p, p.grad if p.grad is not None else
                                 torch.zeros(self.shape[id(p)], dtype=self.model_dtype, device=self.device))
                                for p in group], first, last)
            for p in group:  # a stream that reads it recorded itself there (_to_owner, _accumulate)
                p.grad = None
            return
        per_rank, seg = self.layouts[gi]
        flat = torch.zeros(self.dp_size * seg, dtype=torch.float32, device=self.device)
        for r, ps in enumerate(per_rank):
            off = r * seg
            for p in ps:
                if p.grad is not None:
                    flat[off:off + self._n(p)].copy_(p.grad.reshape(-1))
                off += self._n(p)
        for p in group:  # copied into flat on this stream
            p.grad = None
        t0 = self.profile.start("reduce_scatter")
        if self.use_reduce_scatter:
            mine = torch.empty(seg, dtype=torch.float32, device=self.device)
            work = dist.reduce_scatter_tensor(mine, flat, group=self.group, async_op=True)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            mine = flat[self.dp_rank * seg:(self.dp_rank + 1) * seg]
        self._in_flight.append((gi, work, mine, t0, first, last))
        while len(self._in_flight) > self.max_reduce_events:
            self._finish_reduce()

    def _finish_reduce(self) -> None:
        gi, work, mine, t0, first, last = self._in_flight.popleft()
        work.wait()
        self.profile.stop("reduce_scatter", t0)
        mine.div_(self.dp_size)
        per_rank, _ = self.layouts[gi]
        grads, off = [], 0
        for p in per_rank[self.dp_rank]:
            grads.append((p, mine[off:off + self._n(p)].view(self.shape[id(p)])))
            off += self._n(p)
        self._to_owner(gi, grads, first, last)

    def _to_owner(self, gi: int, grads, first: bool = True, last: bool = True) -> None:
        """Owned gradients into their chunks, and their squared norm (on the device, no sync). The
        first micro batch copies; later ones (accumulate_in_store) add (_accumulate)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        if not first:
            return self._accumulate(gi, grads, last)
        for p, g in grads:
            if last and param_is_not_tensor_parallel_duplicate(p):
                self._sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        # copied here without CUDA streams; a device chunk's copy stays on the compute stream too, so its
        # gradient is free at once rather than held until the D2H stream's queued copies have passed
        down = []
        for p, g in grads:
            c, off = self.slot_of[id(p)]
            if not self.streams.cuda or c.tier == "device":
                c.grad[off:off + self._n(p)].copy_(g.reshape(-1))
            else:
                down.append((c, off, p, g))
        if not down:
            return
        produced = torch.cuda.current_stream(self.device).record_event()
        t0 = self.profile.start("d2h", self.streams.d2h)
        with torch.cuda.stream(self.streams.d2h):
            self.streams.d2h.wait_event(produced)
            for c, off, p, g in down:
                c.grad[off:off + self._n(p)].copy_(g.reshape(-1), non_blocking=True)
                g.record_stream(self.streams.d2h)
                self.profile.add_bytes("d2h", g.numel() * g.element_size())
            for c in {id(c): c for c, _, _, _ in down}.values():
                c.grad_ready = self.streams.d2h.record_event()
        self.profile.stop("d2h", t0, self.streams.d2h)

    def _accumulate(self, gi: int, grads, last: bool) -> None:
        """A later micro batch's gradients added to their owner's chunks: in place for device chunks; for
        host chunks the running sum goes up to a device slot (H2D stream), gets the gradients added and,
        after the last micro batch, its norm taken there, and goes back down (D2H stream)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        host = []
        for p, g in grads:
            c, off = self.slot_of[id(p)]
            view = c.grad[off:off + self._n(p)]
            if c.tier == "device":  # its first micro batch was copied on this stream too
                view.add_(g.reshape(-1))
                if last and param_is_not_tensor_parallel_duplicate(p):
                    self._sq += torch.linalg.vector_norm(view, dtype=torch.float32).square()
            else:
                host.append((p, g, view))
        if not host:
            return
        i = self._acc_slot = (self._acc_slot + 1) % len(self._acc_slots)
        slot, pieces, off = self._acc_slots[i], [], 0
        for p, g, view in host:
            pieces.append((g.reshape(-1), view, slot[off:off + g.numel()], param_is_not_tensor_parallel_duplicate(p)))
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
            for c in {id(c): c for c in (self.slot_of[id(p)][0] for p, _, _ in host)}.values():
                if c.grad_ready is not None:
                    h2d.wait_event(c.grad_ready)  # the previous micro batch's sum has landed
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
            self.slot_of[id(p)][0].grad_ready = done

    def _flush(self) -> None:
        """Offloads what no hook offloaded (a parameter without a gradient, a partial last micro batch)."""
        for gi in range(len(self.sub_groups)):
            if not self._offloaded[gi]:
                self._offload(gi, last=True)
        while self._in_flight:
            self._finish_reduce()
        if self.streams.cuda and self.accumulate:  # the norms of the host chunks' sums (side stream)
            torch.cuda.current_stream(self.device).wait_stream(self.streams.h2d)
        self._sq += self._sq_side

    # -- the step -----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._reset_backward_state()

    def _global_norm(self) -> float:
        sq = self._sq
        if self.dp_size > 1:
            dist.all_reduce(sq, group=self.group)
        mp = parallel_state.get_model_parallel_group()
        if mp.size() > 1:
            dist.all_reduce(sq, group=mp)
        return math.sqrt(sq.item())  # the one host sync of the step: clipping needs the norm

    @torch.no_grad()
    def step(self) -> Tuple[bool, float, Optional[int]]:
        t0 = time.perf_counter()
        self._flush()
        norm = self._global_norm()
        for gi in list(self._live):  # a fetched copy would be stale after this update
            self._release(gi)
        if self.streams.cuda:
            self.streams.h2d.synchronize()  # no fetch still reads a host copy the update will overwrite
        self.profile.exposed("step", time.perf_counter() - t0)
        self.profile.end_iteration()
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm, None
        coef = clip_coefficient(norm, self.clip_grad)
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

    def _adamw(self, c: Chunk, states: torch.Tensor, grad: torch.Tensor, hyper, coef: float) -> None:
        """AdamW where the chunk lives. On the CPU the one-pass kernel where it was built (every CPU
        update uses it: placements agree); else torch's fused AdamW (fp32 gradient), clipping riding in
        the kernel (grad_scale divides the gradient), so it costs no extra pass over memory."""
        if self.cpu_adam is not None and not grad.is_cuda:
            return self._native_adamw(c, states, grad, hyper, coef)
        lr, wd = hyper[0 if c.decay else 1]
        scale = None if coef >= 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=grad.device)
        torch._fused_adamw_([states[0]], [grad], [states[1]], [states[2]], [], [c.step],
                            lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                            weight_decay=wd, eps=self.eps, amsgrad=False, maximize=False, grad_scale=scale)

    def _native_adamw(self, c: Chunk, states: torch.Tensor, grad: torch.Tensor, hyper, coef: float,
                      out=None) -> None:
        """The one-pass CPU kernel, the new weights into out (grad's dtype) unless it is None."""
        lr, wd = hyper[0 if c.decay else 1]
        self.cpu_adam.step(states, grad, out, step=int(c.step.item()), lr=lr, weight_decay=wd, betas=self.betas,
                           eps=self.eps, coef=coef)

    def _update_on_device(self, c: Chunk, coef: float, hyper) -> None:
        c.step += 1
        for lo, hi in slices(c.numel):
            grad = self.scratch["device"][:hi - lo]
            grad.copy_(c.grad[lo:hi])
            self._adamw(c, c.states[:, lo:hi], grad, hyper, coef)
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
            states = self._nvme_states(c) if c.tier == "nvme" else c.states
            c.step += 1
            for lo, hi in slices(c.numel):
                slot = None
                if c.weights is not None:  # fetched from here before the layer next runs
                    out = c.weights[lo:hi]
                elif self.streams.cuda:  # up through a pinned staging buffer
                    slot, out = self._staging(hi - lo)
                else:
                    out = None  # CPU: copied into the model from the master
                self._cpu_update(c, states[:, lo:hi], lo, hi, out, hyper, coef)
                if slot is not None:
                    events.append(self._upload_staging(c, slot, lo, hi, after_backward))
                elif out is None:
                    for p, a, b, sa, sb in self._param_ranges(c, lo, hi):
                        p.data.view(-1)[a:b].copy_(states[0, sa:sb])
            if c.tier == "nvme":
                t2 = time.perf_counter()
                NVMeTier.write(c.file, states.reshape(-1))
                self.profile.busy("nvme", time.perf_counter() - t2, c.numel * STATES * 4)
            self.profile.busy("update_thread", time.perf_counter() - t0)
        return events

    def _update_streamed(self, gi: int, coef: float, hyper, after_backward) -> list:
        """Device-update thread: the host chunks of one sub-group that the device updates, a slice at a
        time through two device buffers: fp32 states and gradient up (H2D stream), fused AdamW there,
        the new weights straight into the model, the states back down (D2H stream). Returns the events
        the next forward waits on (weights written); the states' return is waited on by their next
        upload, and by wait_all."""
        events = []
        cuda, h2d, d2h = self.streams.cuda, self.streams.h2d, self.streams.d2h
        on_h2d = (lambda: torch.cuda.stream(h2d)) if cuda else contextlib.nullcontext
        for c in self.chunks_of[gi]:
            if not c.device_update:
                continue
            t0 = time.perf_counter()
            with on_h2d():
                c.step += 1
                if cuda:
                    h2d.wait_event(after_backward)  # the gradients are in, backward read the old weights
                    if c.states_home is not None:
                        h2d.wait_event(c.states_home)  # the previous update's states are home
            for lo, hi in slices(c.numel, DEVICE_UPDATE_SLICE):
                i = self._update_slot = 1 - self._update_slot
                if self._update_free[i] is not None:
                    self._update_free[i].synchronize()  # the buffer's last states have left it
                buf, grad_in = self._update_bufs[i]
                states, grad, grad_in = buf[:STATES, :hi - lo], buf[STATES, :hi - lo], grad_in[:hi - lo]
                t1 = self.profile.start("device_update", h2d)
                with on_h2d():
                    for k in range(STATES):  # row by row: each row slice is contiguous (async copies)
                        states[k].copy_(c.states[k, lo:hi], non_blocking=True)
                    grad_in.copy_(c.grad[lo:hi], non_blocking=True)
                    grad.copy_(grad_in)
                    self._adamw(c, states, grad, hyper, coef)
                    for p, a, b, sa, sb in self._param_ranges(c, lo, hi):
                        p.data.view(-1)[a:b].copy_(states[0, sa - lo:sb - lo])
                    updated = h2d.record_event() if cuda else None
                self.profile.stop("device_update", t1, h2d)
                self.profile.add_bytes("device_update", (hi - lo) * (2 * STATES * 4 + grad_in.element_size()))
                if not cuda:
                    c.states[:, lo:hi].copy_(states)
                    continue
                with torch.cuda.stream(d2h):
                    d2h.wait_event(updated)
                    for k in range(STATES):
                        c.states[k, lo:hi].copy_(states[k], non_blocking=True)
                    c.states_home = self._update_free[i] = d2h.record_event()
                events.append(updated)
            self.profile.busy("device_update_thread", time.perf_counter() - t0)
        return events

    def _nvme_states(self, c: Chunk) -> torch.Tensor:
        """Reads this NVMe chunk (prefetched while the previous one was updated) and starts the next read."""
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
        out = NVMeTier.read(c.file, self.nvme.staging(slot, STATES * c.numel)).view(STATES, c.numel)
        self.profile.busy("nvme", time.perf_counter() - t0, c.numel * STATES * 4)
        return out

    def _cpu_update(self, c: Chunk, states: torch.Tensor, lo: int, hi: int, out, hyper, coef: float) -> None:
        """AdamW of a host or NVMe chunk's slice [lo, hi), the new weights into out (model dtype; may be
        the gradient buffer itself) unless it is None."""
        t0 = time.perf_counter()
        if self.cpu_adam is not None:  # one pass: model-dtype gradient in, model-dtype weights out
            self._native_adamw(c, states, c.grad[lo:hi], hyper, coef, out)
            self.profile.busy("cpu_optimizer", time.perf_counter() - t0)
            return
        grad = self.scratch["host"][:hi - lo]
        grad.copy_(c.grad[lo:hi])  # before an offloaded layer's new weights overwrite the buffer
        t1 = time.perf_counter()
        self._adamw(c, states, grad, hyper, coef)
        t2 = time.perf_counter()
        if out is not None:
            out.copy_(states[0])
        self.profile.busy("cpu_copy", (t1 - t0) + (time.perf_counter() - t2))
        self.profile.busy("cpu_optimizer", t2 - t1)

    def _staging(self, n: int) -> Tuple[int, torch.Tensor]:
        """The next pinned upload buffer, once its previous upload has left it."""
        slot = self._slot = 1 - self._slot
        if self._upload_done[slot] is not None:
            self._upload_done[slot].synchronize()
        return slot, self._upload[slot][:n]

    def _upload_staging(self, c: Chunk, slot: int, lo: int, hi: int, after_backward):
        """Updated weights [lo, hi) of a chunk, in staging buffer slot, into the model on the upload
        stream; returns the event to wait on."""
        staging = self._upload[slot][:hi - lo]
        upload = self.streams.upload
        t0 = self.profile.start("h2d", upload)
        with torch.cuda.stream(upload):
            upload.wait_event(after_backward)  # backward has finished reading the old weights
            for p, a, b, sa, sb in self._param_ranges(c, lo, hi):
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

    def _complete(self, gi: int) -> None:
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
            self._all_gather(gi)

    def wait_all(self) -> None:
        """Every pending update applied (before a checkpoint, an evaluation or the end)."""
        for gi in sorted(set(self._pending) | self._needs_gather):
            self._complete(gi)
        for c in self.chunks:  # the states the device updated are back in host memory
            if c.states_home is not None:
                c.states_home.synchronize()
                c.states_home = None

    @torch.no_grad()
    def _all_gather(self, gi: int) -> None:
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

    def profile_record(self) -> Optional[dict]:
        """The last iteration's transfer and optimizer times (is_communication_time_profiling)."""
        return self.profile.last

    # -- checkpoints -----------------------------------------------------------------------------
    def _chunk_states(self, c: Chunk, writable: bool = False) -> torch.Tensor:
        """A chunk's [STATES, numel] states where they live: an NVMe chunk's file mapped into memory, so
        a checkpoint reads (or, writable, loads into) it page by page without a host copy of it."""
        if c.tier != "nvme":
            return c.states
        return torch.from_file(str(c.file), shared=writable, size=STATES * c.numel,
                               dtype=torch.float32).view(STATES, c.numel)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **_):
        """Per owned parameter: fp32 master, exp_avg, exp_avg_sq as ShardedTensors shaped like the
        parameter, so a checkpoint loads into any placement (rate, tiers) and any ownership. The tensors
        are views of the states in their tiers (saved from there, and loaded into them in place): no
        tier is copied whole into host memory."""

        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        self.wait_all()
        self._loading = {}
        owned = [p for c in self.chunks for p in c.params]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(owned))
        index = {id(p): i for i, p in enumerate(owned)}
        # a layer's tensors share one key (the layer axis is prepended), so the offset tells them apart
        self._model_key = {id(p): f"{id_map[i].key}@{','.join(map(str, id_map[i].global_offset))}"
                           for i, p in enumerate(owned)}
        state = {}
        for c in self.chunks:
            flat = self._chunk_states(c, writable=is_loading)
            if is_loading:
                self._loading[id(c)] = flat
            for i, p in enumerate(c.params):
                model_ten = id_map[index[id(p)]]
                replica = model_ten.replica_id
                replica = (*replica[:-1], 0) if isinstance(replica, tuple) else 0  # the owner is the main replica
                for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
                    view = flat[k][c.offsets[i]:c.offsets[i] + self._n(p)].view(self.shape[id(p)])
                    ten = make_sharded_optimizer_tensor(model_ten, view,
                                                        prefix=f"optimizer.zero_cache.{name}")
                    state[f"{name}.{self._model_key[id(p)]}"] = replace(ten, replica_id=replica)
        step = float(self.chunks[0].step) if self.chunks else 0.0
        return {"state": state, "common_step": step}

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes what dist_checkpointing loaded for sharded_state_dict(..., is_loading=True)."""
        self.wait_all()
        tensors = state_dict["state"]
        step = float(state_dict["common_step"])
        loading, self._loading = self._loading, {}
        for c in self.chunks:
            flat = loading.get(id(c))
            if flat is None:
                flat = self._chunk_states(c, writable=True)
            for p, off in zip(c.params, c.offsets):
                key = self._model_key[id(p)]
                for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
                    dst, src = flat[k][off:off + self._n(p)], tensors[f"{name}.{key}"].reshape(-1)
                    if src.data_ptr() != dst.data_ptr():  # loaded elsewhere than in place
                        dst.copy_(src)
            c.step.fill_(step)
            if c.weights is not None:
                c.weights.copy_(flat[0])
            for p, view in c.views(flat[0]):
                if p.numel():  # a released (offloaded) weight is refetched from c.weights
                    p.data.copy_(view)
        if self.dp_size > 1:
            for gi in range(len(self.sub_groups)):
                if not self.partitioned[gi]:
                    self._all_gather(gi)

    def close(self) -> None:
        self.wait_all()
        self._worker.shutdown()
        self._device_worker.shutdown()
        if self._prefetcher:
            self._prefetcher.shutdown()
        for h in self._handles:
            h.remove()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy still reads a buffer about to be unlocked
        self.tiers["host"].close()
        if self.nvme:
            self.nvme.close()
