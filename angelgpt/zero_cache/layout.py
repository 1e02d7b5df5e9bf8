"""The layout: what is fixed once the chunks are placed, read by every part and changed by none.

Holds: the partition of whole parameters over DP ranks, the sub-groups (one per transformer layer, the
embedding first, the final norm and output last) and their DP layouts, the chunks (``Chunk``: the
parameters one rank owns per sub-group and weight-decay class, their offsets and shapes, the tier the
chunk lives in and whether the device updates it), the offloaded layers, the dtypes and the format
the states are kept in, and the bytes the placement counts per tier.

``place_chunks`` builds it: it reads the config (concrete: no 'auto' left), asks the DP group for
the placement every rank takes (a layer is offloaded on every rank or on none) and refuses, on every
rank together, a placement that does not fit. The buffers the layout describes are allocated apart
(buffers.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import List, Mapping, Tuple

import torch
import torch.distributed as dist

from angelgpt.config import Config
from angelgpt.parallel.log import EVERY_RANK, get_logger
from angelgpt.zero_cache.placement import (GPU_HEADROOM, chunk_runs, own_weight_buffers, partition, place,
                                           prefetch_depth, training_reserve)
from angelgpt.zero_cache.precision import StateFormat
from angelgpt.zero_cache.rules import no_weight_decay
from angelgpt.zero_cache.tiers import (GIB, NVMeTier, available_bytes, check_capacity, check_memlock,
                                       device_memory, refuse_together)

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


@dataclass(frozen=True, eq=False)
class Chunk:
    """The parameters one rank owns in one sub-group and weight-decay class, laid out flat."""

    key: str
    group: int
    params: Tuple[torch.nn.Parameter, ...]
    decay: bool
    numel: int
    offsets: Tuple[int, ...]
    shapes: Tuple[torch.Size, ...]  # the params' shapes (kept while a released param is empty)
    index: int  # its place among the rank's chunks (its buffers'; seeds an fp8 moment's stochastic rounding)
    tier: str = "host"
    device_update: bool = False  # a host chunk that the device updates (device_update_fraction)

    def views(self, flat: torch.Tensor):
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            yield p, flat[off:off + shape.numel()].view(shape)

    def param_ranges(self, lo: int, hi: int):
        """(param, start, end in the param, start, end in the chunk) for the params overlapping [lo, hi)."""
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            a, b = max(lo, off), min(hi, off + shape.numel())
            if a < b:
                yield p, a - off, b - off, a, b


@dataclass(frozen=True, eq=False)
class Layout:
    """One rank's chunks and where they live; parameters are keyed by id()."""

    params: Tuple[torch.nn.Parameter, ...]
    shape: Mapping[int, torch.Size]  # the params' shapes (kept while a released param is empty)
    decay: Mapping[int, bool]
    dp_rank: int
    dp_size: int
    sub_groups: Tuple[Tuple[torch.nn.Parameter, ...], ...]
    group_of: Mapping[int, int]
    # per sub-group: per DP rank, its owned params in it, and the size of a padded flat segment
    dp_layouts: Tuple[Tuple[Tuple[Tuple[torch.nn.Parameter, ...], ...], int], ...]
    chunks: Tuple[Chunk, ...]
    chunks_of: Tuple[Tuple[Chunk, ...], ...]
    slot_of: Mapping[int, Tuple[Chunk, int]]  # owned params: their chunk and offset in it
    partitioned: Tuple[bool, ...]  # offloaded layers (offload_params): weights on the host, fetched to run
    model_dtype: torch.dtype
    # the dtype micro batches' gradients add up in (optim.accumulate_grads_in_fp32): the gradient buffers
    # and accumulation slots; with one micro batch nothing adds up (model dtype)
    grad_dtype: torch.dtype
    format: StateFormat  # how the chunks keep their states (precision.py)
    num_microbatches: int
    accumulate: bool  # micro batches add up in the store (accumulate_in_store)
    # micro batches add up on the device in an fp32 main grad per parameter (gradients.py)
    main_grads: bool
    own_weights: bool  # an offloaded layer's weights have a buffer of their own (not its gradient buffer)
    slice_numel: int  # elements of a chunk updated at a time (zero_cache.update_slice_numel)
    planned_bytes: Mapping[str, int]  # per tier, as placement counts them

    def numel(self, p: torch.nn.Parameter) -> int:
        return self.shape[id(p)].numel()


def place_chunks(named: List[Tuple[str, torch.nn.Parameter]], cfg: Config, device: torch.device, group,
                 beside_store_bytes: int = 0, rehearsal: bool = False) -> Layout:
    """This rank's layout over the DP group `group`. A rehearsal (one rank played alone under fake
    collectives) refuses alone. beside_store_bytes: device memory training needs beside the store."""
    zc, o = cfg.zero_cache, cfg.optim
    dp_rank, dp_size = group.rank(), group.size()
    num_microbatches = cfg.num_microbatches(dp_size)
    accumulate = zc.accumulate_in_store is True and num_microbatches > 1
    params = tuple(p for _, p in named)
    shape = {id(p): p.shape for p in params}
    owner = {id(p): r for p, r in zip(params, partition([p.numel() for p in params], dp_size))}
    groups: List[List[torch.nn.Parameter]] = [[] for _ in range(cfg.model.num_layers + 2)]
    decay = {}
    for name, p in named:
        groups[sub_group_index(name, cfg.model.num_layers)].append(p)
        decay[id(p)] = not no_weight_decay(name, p)
    sub_groups = tuple(tuple(g) for g in groups if g)

    chunks: List[dict] = []  # a chunk's fields but its tier, which the placement gives
    for gi, sub_group in enumerate(sub_groups):
        for is_decay in (True, False):
            mine = [p for p in sub_group if decay[id(p)] == is_decay and owner[id(p)] == dp_rank]
            for part, run in enumerate(chunk_runs([p.numel() for p in mine], zc.chunk_numel)):
                ps = tuple(mine[i] for i in run)
                offsets = tuple(sum(p.numel() for p in ps[:k]) for k in range(len(ps)))
                chunks.append(dict(key=f"g{gi:04d}_{'decay' if is_decay else 'nodecay'}_{part}", group=gi,
                                   params=ps, decay=is_decay, numel=sum(p.numel() for p in ps), offsets=offsets,
                                   shapes=tuple(p.shape for p in ps), index=len(chunks)))
    model_dtype = params[0].dtype
    fmt = StateFormat.from_config(cfg, model_dtype)
    fp32 = o.accumulate_grads_in_fp32 and num_microbatches > 1
    grad_dtype = torch.float32 if fp32 else model_dtype
    numel = lambda p: shape[id(p)].numel()  # noqa: E731
    tiers, streamed, partitioned, planned = _place(
        zc, device, group, rehearsal, beside_store_bytes, [c["group"] for c in chunks], [c["numel"] for c in chunks],
        sub_groups, numel, fmt, grad_dtype.itemsize, model_dtype.itemsize, accumulate, num_microbatches)
    placed = tuple(Chunk(**c, tier=t, device_update=d) for c, t, d in zip(chunks, tiers, streamed))
    own_weights = own_weight_buffers(accumulate, grad_dtype.itemsize, model_dtype.itemsize, fmt.remainders)

    def dp_layout(sub_group):
        per_rank = [tuple(p for p in sub_group if owner[id(p)] == r) for r in range(dp_size)]
        return tuple(per_rank), max(sum(p.numel() for p in ps) for ps in per_rank)

    return Layout(
        params=params, shape=MappingProxyType(shape), decay=MappingProxyType(decay), dp_rank=dp_rank,
        dp_size=dp_size, sub_groups=sub_groups,
        group_of=MappingProxyType({id(p): gi for gi, g in enumerate(sub_groups) for p in g}),
        dp_layouts=tuple(dp_layout(g) for g in sub_groups), chunks=placed,
        chunks_of=tuple(tuple(c for c in placed if c.group == gi) for gi in range(len(sub_groups))),
        slot_of=MappingProxyType({id(p): (c, off) for c in placed for p, off in zip(c.params, c.offsets)}),
        partitioned=tuple(partitioned), model_dtype=model_dtype, grad_dtype=grad_dtype, format=fmt,
        num_microbatches=num_microbatches, accumulate=accumulate,
        main_grads=num_microbatches > 1 and not accumulate and grad_dtype != model_dtype,
        own_weights=own_weights, slice_numel=zc.update_slice_numel, planned_bytes=MappingProxyType(planned))


def _place(zc, device, group, rehearsal, beside_store_bytes, groups, numels, sub_groups, numel, fmt,
           grad_bytes, weight_bytes, accumulate, num_microbatches):
    """(tier per chunk, device update per chunk, offloaded per sub-group, bytes needed per tier), the
    capacity refused on every rank together."""
    if zc.nvme_path:  # chunk files a killed run left would count against this run's NVMe room
        freed = NVMeTier.reclaim(zc.nvme_path)
        if freed:
            log.info(f"zero_cache: removed {freed / GIB:.2f} GiB of NVMe chunks that an ended run left under "
                     f"{zc.nvme_path}", extra=EVERY_RANK)
    avail = available_bytes(device, zc.host_max_gib, zc.nvme_path, zc.nvme_max_gib)
    args = (groups, numels, len(sub_groups), float(zc.prefetch_cache_sub_group_rate), avail["host"],
            bool(zc.nvme_path), grad_bytes, zc.offload_params, zc.update_slice_numel, accumulate)
    kw = {"device_update_fraction": float(zc.device_update_fraction), "weight_bytes": weight_bytes,
          "states": fmt.bytes, "remainders": fmt.remainders}
    tiers, flags, needed, streamed = place(*args, **kw)
    if group.size() > 1:  # a layer is fetched (and all-gathered) on every rank or on none
        t = torch.tensor([float(f) for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        tiers, flags, needed, streamed = place(*args, allowed=[bool(v) for v in t.tolist()], **kw)
    if device.type == "cuda":  # what training needs beside the states: activations and workspace
        # (the caller's beside_store_bytes), gradients (every one while micro batches add up on the
        # GPU) and offloaded layers in use, prefetched or not yet freed, as the planner counts them
        largest = max(sum(numel(p) for p in g) for g in sub_groups)
        depth = prefetch_depth(largest, zc.prefetch_bucket_size, zc.max_live_parameters,
                               zc.max_contigous_params_size, weight_bytes)
        avail["device"] -= training_reserve(beside_store_bytes, largest, grad_bytes, any(flags),
                                            sum(numel(p) for g in sub_groups for p in g),
                                            num_microbatches > 1 and not accumulate, depth, weight_bytes)
        avail["device"] -= int(GPU_HEADROOM * device_memory(device)[1])
    # offloaded layers leave the device once their chunks exist, making room for the states; layers
    # still on the meta device (deferred init: made real by allocate) are not in the reading above:
    # the resident ones will take their room, the offloaded ones never do
    avail["device"] += weight_bytes * sum(numel(p) for gi, f in enumerate(flags) if f
                                          for p in sub_groups[gi] if not p.is_meta)
    avail["device"] -= weight_bytes * sum(numel(p) for gi, f in enumerate(flags) if not f
                                          for p in sub_groups[gi] if p.is_meta)
    if not zc.nvme_path:
        needed.pop("nvme")
    own_weights = own_weight_buffers(accumulate, grad_bytes, weight_bytes, fmt.remainders)

    def check():
        check_capacity(needed, avail)
        if device.type == "cuda":  # what crosses PCIe is pinned: host gradients, offloaded weights, the
            # states the device updates
            off = sum(n for n, t in zip(numels, tiers) if t != "device")
            weights = sum(n for n, g in zip(numels, groups) if flags[g]) if own_weights else 0
            check_memlock(grad_bytes * off + weight_bytes * weights
                          + sum(fmt.nbytes(n) for n, d in zip(numels, streamed) if d))

    refuse_together(check, rehearsal)
    return tiers, streamed, flags, needed
