"""The store: this rank's chunks of model states, the tier each lives in, and the buffers the other
parts share.

Owns: the partition of whole parameters over DP ranks, the sub-groups (one per transformer layer, the
embedding first, the final norm and output last) and their DP layouts, the chunks (``Chunk``: flat
fp32 master, exp_avg, exp_avg_sq and a flat gradient buffer, fp32 while micro batches add up in
fp32 and else in the model dtype, per sub-group and weight-decay class), their placement over the
tiers (``placement.place``, refused on every rank when one rank's does not fit), the tiers'
allocators, the update scratch, the pinned upload buffers, the device pool that the accumulation
slots and the device update buffers share, the CPU AdamW kernel, the CUDA streams and the time
profile. Reads the config (concrete: no 'auto' left) and the DP group.

Touches the model's parameters only while allocating: their weights are copied into the chunks, and
an offloaded layer's weights leave the device through the ``release`` the weights part hands in. The
other parts read what is here; after construction only they change it (chunk gradients, states,
events), each the fields its docstring names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.config import Config, ConfigError
from angelgpt.parallel.log import EVERY_RANK, get_logger
from angelgpt.zero_cache.cpu_adam import CpuAdam, CpuAdamUnavailable
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.placement import (ACCUMULATION_SLOTS, CODEC_SLICE, GPU_HEADROOM, SLICE,
                                           STATES, accumulation_bytes, chunk_runs, device_update_bytes,
                                           device_update_elements, largest_off_device_group,
                                           own_weight_buffers, packed_nbytes, partition, place,
                                           prefetch_depth, training_reserve, upload_buffers)
from angelgpt.zero_cache.precision import StateFormat
from angelgpt.zero_cache.rules import no_weight_decay
from angelgpt.zero_cache.tiers import (GIB, DeviceTier, HostTier, NVMeTier, available_bytes, check_capacity,
                                       check_memlock, device_memory, refuse_together)

log = get_logger(__name__)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    # master, exp_avg, exp_avg_sq (device/host tiers): [3, numel] fp32, or their rows in the store's
    # format (Store.format: views of `raw`)
    states: Optional[object] = None
    raw: Optional[torch.Tensor] = None  # the bytes the states live in (device/host tiers)
    # the bf16 weights whose remainders the master row holds (optim.store_param_remainders): the owned
    # params' weights are views of it (a resident layer's, on the device) or it is `weights`
    hi: Optional[torch.Tensor] = None
    file: Optional[object] = None  # NVMe tier
    grad: Optional[torch.Tensor] = None  # [numel], Store.grad_dtype: reduced and owned (device tier, else host)
    grad_ready: Optional[object] = None  # CUDA event: the gradient's D2H copy is done
    weights: Optional[torch.Tensor] = None  # offloaded layer (offload_params): its weights (the grad buffer or its own)
    step: Optional[torch.Tensor] = None
    step_count: int = 0  # the step counter as an int, read without a device sync
    device_update: bool = False  # a host chunk that the device updates (device_update_fraction)
    index: int = 0  # its place among the rank's chunks (seeds an fp8 moment's stochastic rounding)
    states_home: Optional[object] = None  # CUDA event: its states are back in host memory after that update

    def views(self, flat: torch.Tensor):
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            yield p, flat[off:off + shape.numel()].view(shape)


class Store:
    """Chunks, placement and buffers of one rank (built in two steps: ``Store(...)`` places the chunks,
    ``allocate(release)`` fills the tiers once the weights part exists)."""

    def __init__(self, named: List[Tuple[str, torch.nn.Parameter]], cfg: Config, device: torch.device,
                 beside_store_bytes: int = 0, rehearsal: bool = False):
        zc, o = cfg.zero_cache, cfg.optim
        self.cfg = cfg
        # a rehearsal: one rank played alone under fake collectives (it refuses alone, and its update
        # runs whatever the gradient norm, so that its time and memory are measured)
        self.rehearsal = rehearsal
        self.device = device
        self.beside_store_bytes = beside_store_bytes
        self.offload_params = zc.offload_params
        self.device_update_fraction = float(zc.device_update_fraction)
        self.group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = self.group.rank(), self.group.size()
        # gradients on the GPU are reduce-scattered, whatever group carries them (NCCL; gloo with
        # ranks sharing one GPU; a rehearsal's fake group); on the CPU each owner's chunk is reduced
        self.use_reduce_scatter = device.type == "cuda"
        self.num_microbatches = cfg.num_microbatches(self.dp_size)
        self.recompute = cfg.model.recompute == "full"
        self.accumulate = zc.accumulate_in_store is True and self.num_microbatches > 1
        self.rate = float(zc.prefetch_cache_sub_group_rate)

        self.params = [p for _, p in named]
        self.shape = {id(p): p.shape for p in self.params}
        owners = partition([p.numel() for p in self.params], self.dp_size)
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        n_groups = cfg.model.num_layers + 2
        groups: List[List[Tuple[str, torch.nn.Parameter]]] = [[] for _ in range(n_groups)]
        decay = {}
        for name, p in named:
            groups[sub_group_index(name, cfg.model.num_layers)].append((name, p))
            decay[id(p)] = not no_weight_decay(name, p)
        groups = [g for g in groups if g]
        self.sub_groups = [[p for _, p in g] for g in groups]
        self.group_of = {id(p): gi for gi, g in enumerate(self.sub_groups) for p in g}
        self.layouts = [self._owner_layout(g) for g in self.sub_groups]
        # the scheduler sets 'lr' and 'weight_decay' here; the update reads them when a step starts
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
                              params=[mine[i] for i in run], decay=is_decay, index=len(self.chunks))
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
        # how the chunks keep their states (optim.store_param_remainders, exp_avg_dtype, exp_avg_sq_dtype)
        self.format = StateFormat.from_config(o, self.model_dtype)
        # the dtype micro batches' gradients add up in (optim.accumulate_grads_in_fp32): the store's
        # gradient buffers and accumulation slots; with one micro batch nothing adds up (model dtype)
        fp32 = o.accumulate_grads_in_fp32 and self.num_microbatches > 1
        self.grad_dtype = torch.float32 if fp32 else self.model_dtype
        # adding up on the device (not in the store) in fp32 where autograd's gradients are not: an fp32
        # main grad per parameter takes each micro batch's gradient (gradients.py)
        self.main_grads = self.num_microbatches > 1 and not self.accumulate and self.grad_dtype != self.model_dtype
        self._place(zc)
        self.cpu_adam = self._load_cpu_adam(zc.cpu_adam)
        self.streams = Streams(device)
        self.profile = Profile(device, enabled=zc.is_communication_time_profiling)

    # -- placement ---------------------------------------------------------------------------
    def _place(self, zc) -> None:
        grad_bytes, weight_bytes = self.grad_dtype.itemsize, self.model_dtype.itemsize
        if zc.nvme_path:  # chunk files a killed run left would count against this run's NVMe room
            freed = NVMeTier.reclaim(zc.nvme_path)
            if freed:
                log.info(f"zero_cache: removed {freed / GIB:.2f} GiB of NVMe chunks that an ended run left under "
                         f"{zc.nvme_path}", extra=EVERY_RANK)
        avail = available_bytes(self.device, zc.host_max_gib, zc.nvme_path, zc.nvme_max_gib)
        numels = [c.numel for c in self.chunks]
        groups = [c.group for c in self.chunks]
        args = (groups, numels, len(self.sub_groups), self.rate, avail["host"],
                bool(zc.nvme_path), grad_bytes, self.offload_params, self.accumulate)
        kw = {"device_update_fraction": self.device_update_fraction, "weight_bytes": weight_bytes,
              "states": self.format.bytes, "remainders": self.format.remainders}
        tiers, flags, needed, streamed = place(*args, **kw)
        if self.dp_size > 1:  # a layer is fetched (and all-gathered) on every rank or on none
            t = torch.tensor([float(f) for f in flags], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
            tiers, flags, needed, streamed = place(*args, allowed=[bool(v) for v in t.tolist()], **kw)
        for c, t, d in zip(self.chunks, tiers, streamed):
            c.tier, c.device_update = t, d
        self.partitioned = flags
        if self.device.type == "cuda":  # what training needs beside the states: activations and workspace
            # (the caller's beside_store_bytes), gradients (every one while micro batches add up on the
            # GPU) and offloaded layers in use, prefetched or not yet freed, as the planner counts them
            largest = max(sum(self._n(p) for p in g) for g in self.sub_groups)
            depth = prefetch_depth(largest, zc.prefetch_bucket_size, zc.max_live_parameters,
                                   zc.max_contigous_params_size, weight_bytes)
            avail["device"] -= training_reserve(self.beside_store_bytes, largest, grad_bytes, any(flags),
                                                sum(self._n(p) for p in self.params),
                                                self.num_microbatches > 1 and not self.accumulate, depth,
                                                weight_bytes)
            avail["device"] -= int(GPU_HEADROOM * device_memory(self.device)[1])
        # offloaded layers leave the device once their chunks exist, making room for the states; layers
        # still on the meta device (deferred init: made real by allocate) are not in the reading above:
        # the resident ones will take their room, the offloaded ones never do
        avail["device"] += weight_bytes * sum(self._n(p) for gi, f in enumerate(flags) if f
                                              for p in self.sub_groups[gi] if not p.is_meta)
        avail["device"] -= weight_bytes * sum(self._n(p) for gi, f in enumerate(flags) if not f
                                              for p in self.sub_groups[gi] if p.is_meta)
        if not zc.nvme_path:
            needed.pop("nvme")
        self.own_weights = own_weight_buffers(self.accumulate, grad_bytes, weight_bytes, self.format.remainders)

        def check():
            check_capacity(needed, avail)
            if self.device.type == "cuda":  # what crosses PCIe is pinned: host gradients, offloaded weights,
                # the states the device updates
                off = sum(c.numel for c, t in zip(self.chunks, tiers) if t != "device")
                own_weights = sum(c.numel for c in self.chunks if flags[c.group]) if self.own_weights else 0
                check_memlock(grad_bytes * off + weight_bytes * own_weights + sum(self.format.nbytes(c.numel) for c in self.chunks if c.device_update))

        refuse_together(check, self.rehearsal)
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

        refuse_together(load, self.rehearsal)
        return kernel

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, release, materialize=None) -> None:
        """Every chunk's states and gradient buffer in its tier, the scratch and staging buffers, one
        sub-group after another, the last first; release(gi) drops an offloaded layer's weights from the
        device once its chunks hold them. materialize(params), when given, makes a sub-group's weights real
        first (layers built on the meta device, as angelgpt.model.deferred builds them): the device then holds the
        resident layers and one offloaded layer at a time, never the whole model."""
        on_cuda = self.device.type == "cuda"
        self.tiers = {"device": DeviceTier(self.device), "host": HostTier(pin=on_cuda)}
        zc = self.cfg.zero_cache
        self.nvme = NVMeTier(zc.nvme_path) if zc.nvme_path else None
        if self.nvme:
            self.tiers["nvme"] = self.nvme
        sizes = {t: [c.numel for c in self.chunks if (c.tier == "device") == (t == "device")] for t in ("device", "host")}
        self.scratch = {t: self.tiers[t].allocate(min(max(n), SLICE)) for t, n in sizes.items() if n}
        # states not all fp32: three fp32 rows to decode a slice into for torch's AdamW
        self.work = {t: self.tiers[t].allocate(STATES * min(max(n), CODEC_SLICE)).view(STATES, -1)
                     for t, n in sizes.items() if n and not self.format.fp32}
        nvme_sizes = [c.numel for c in self.chunks if c.tier == "nvme"]
        if nvme_sizes:
            self.tiers["host"].bytes += self.nvme.reserve_staging(self.format.nbytes(max(nvme_sizes)))
        upload = [c.numel for c in self.chunks
                  if c.tier != "device" and not self.partitioned[c.group] and not c.device_update]
        # pinned buffers in the model dtype carry updated weights to the device (placement.upload_buffers)
        self.upload = [torch.empty(min(max(upload), SLICE), dtype=self.model_dtype, pin_memory=True)
                       for _ in range(upload_buffers(self.format.remainders))] if upload and on_cuda else []
        self._allocate_shared()
        for gi in reversed(range(len(self.sub_groups))):  # last layers first: offloaded ones leave the device
            if materialize is not None:                    # before the first layers' states arrive
                materialize(self.sub_groups[gi])
            for c in reversed(self.chunks_of[gi]):
                self._allocate_chunk(c)
            if self.partitioned[gi]:  # also a layer of which this rank owns nothing
                release(gi)

    def _allocate_chunk(self, c: Chunk) -> None:
        """One chunk: its gradient buffer (holding the owned weights first), step counter and states.
        With remainders the master starts as the weights (remainder 0): an offloaded layer's in its
        weight buffer, a resident layer's in a flat device buffer that the params become views of."""
        grad_tier = self.tiers["device" if c.tier == "device" else "host"]
        c.grad = grad_tier.allocate(c.numel, self.grad_dtype, pinned=True)
        step_device = self.device if c.tier == "device" or c.device_update else torch.device("cpu")
        c.step = torch.zeros((), dtype=torch.float32, device=step_device)
        # the owned weights reach the chunk through its gradient buffer (pinned when it is on the host)
        for p, view in c.views(c.grad):
            view.copy_(p.detach())
        if self.partitioned[c.group] and self.own_weights:  # gradients arrive from the first micro batch
            c.weights = self.tiers["host"].allocate(c.numel, self.model_dtype, pinned=True)  # on, are fp32,
            c.weights.copy_(c.grad)                                                          # or the masters'
        elif self.partitioned[c.group]:
            c.weights = c.grad  # holds the weights until the last backward's gradients replace them
        fmt = self.format
        if fmt.remainders:
            if self.partitioned[c.group]:
                c.hi = c.weights
            else:
                # (the weights the model had: not store bytes, as the planner counts them)
                c.hi = torch.empty(c.numel, dtype=self.model_dtype, device=self.device)
                for p, view in c.views(c.hi):
                    view.copy_(p.detach())
                    p.data = view
        if c.tier == "nvme":
            c.file = self.nvme.create(c.key, fmt.nbytes(c.numel))
            staging = self.nvme.staging(0, fmt.nbytes(c.numel)).zero_()
            if not fmt.remainders:
                fmt.states(staging, c.numel)[0].copy_(c.grad)
            NVMeTier.write(c.file, staging)
        else:
            c.raw = self.tiers[c.tier].allocate(fmt.nbytes(c.numel), torch.uint8, pinned=c.device_update)
            c.states = fmt.states(c.raw, c.numel)
            if not fmt.remainders:
                c.states[0].copy_(c.grad)

    def _allocate_shared(self) -> None:
        """One device buffer for what never runs at once: the accumulation slots that host chunks'
        running sums make their round trips through (later backward passes), and the two buffers that
        host chunks updated on the device stream through (between the last backward and the next
        forward): [fp32 states and gradient] x 2, then, where the gradients are not fp32, [gradient as it
        arrives, in their dtype] x 2 (None: an fp32 gradient arrives in its row). Slots and arriving
        gradients are in the gradients' dtype (grad_dtype). update_free holds the events of the update
        buffers' last use: the gradients part waits on them before a slot overwrites that memory."""
        groups, numels, tiers = ([c.group for c in self.chunks], [c.numel for c in self.chunks],
                                 [c.tier for c in self.chunks])
        streamed = [c.device_update for c in self.chunks]
        dtype = self.grad_dtype
        size = dtype.itemsize
        slot = largest_off_device_group(groups, numels, tiers) if self.accumulate else 0
        n = device_update_elements(max((c.numel for c in self.chunks if c.device_update), default=0))
        # the sizes placement counts: the slots, or the update buffers, whichever is larger
        slots_bytes = accumulation_bytes(groups, numels, tiers, size) if self.accumulate else 0
        nbytes = max(slots_bytes, device_update_bytes(numels, streamed, size, self.format.bytes))
        pool = self.tiers["device"].allocate(nbytes, torch.uint8) if nbytes else None
        self.acc_slots = [pool[i * slot * size:(i + 1) * slot * size].view(dtype)
                          for i in range(ACCUMULATION_SLOTS)] if slot else []
        states = (STATES + 1) * 4 * n
        arriving = size if dtype != torch.float32 else 0
        packed = packed_nbytes(n, self.format.bytes)
        tail = 2 * states  # then, per buffer, the gradient and the states as they arrive

        def part(j, off, nbytes):
            lo = tail + j * (arriving * n + packed) + off
            return pool[lo:lo + nbytes]

        self.update_bufs = [(pool[j * states:(j + 1) * states].view(torch.float32).view(STATES + 1, n),
                             part(j, 0, n * size).view(dtype) if arriving else None,
                             self.format.rows(part(j, arriving * n, packed), n) if packed else None)
                            for j in range(2)] if n else []
        self.update_free = [None, None]

    def close(self) -> None:
        """Unlocks the pinned host buffers and removes the NVMe files (nothing may read them after)."""
        self.tiers["host"].close()
        if self.nvme:
            self.nvme.close()

    # -- what it holds ------------------------------------------------------------------------
    def summary(self) -> str:
        """One line: where this rank's states went and who updates the host-resident ones."""
        owned = {t: sum(c.numel for c in self.chunks if c.tier == t) for t in ("device", "host", "nvme")}
        on_device = sum(c.numel for c in self.chunks if c.device_update)
        return (f"zero_cache: prefetch_cache_sub_group_rate {self.rate:.2f}, offload_params {self.offload_params}; "
                f"owned parameters' states on device {owned['device']:,}, host {owned['host']:,}, nvme "
                f"{owned['nvme']:,}; host states updated on the device {on_device:,} "
                f"(device_update_fraction {self.device_update_fraction:.2f}); CPU AdamW "
                f"{'native' if self.cpu_adam else 'torch'}; states {self.format.describe()}")

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
