"""The buffers: the tensors and events the layout describes, allocated in their tiers.

Per chunk (``ChunkBuffers``, at the chunk's index): its gradient buffer, states, step counter, an
offloaded layer's host weights, and the events that order the parts' copies. Beside them
(``Buffers``): the tiers' allocators, the update scratch, the pinned upload buffers and the device
pool that the accumulation slots and the device update buffers share.

``allocate`` fills them one sub-group after another and touches the model's parameters only then:
their weights are copied into the chunks, and an offloaded layer's weights leave the device. After
that the parts write the tensors' contents and the events, each the fields its docstring names; no
tensor is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from angelgpt.zero_cache.layout import Chunk, Layout
from angelgpt.zero_cache.placement import (ACCUMULATION_SLOTS, CODEC_SLICE, STATES, accumulation_bytes,
                                           device_update_bytes, device_update_elements, largest_off_device_group,
                                           packed_nbytes, upload_buffers)
from angelgpt.zero_cache.tiers import DeviceTier, HostTier, NVMeTier


@dataclass(eq=False)
class ChunkBuffers:
    """One chunk's tensors (fixed once allocated) and the state its update and copies change."""

    grad: torch.Tensor  # [numel], layout.grad_dtype: reduced and owned (device tier, else host)
    step: torch.Tensor
    # master, exp_avg, exp_avg_sq (device/host tiers): [3, numel] fp32, or their rows in the layout's
    # format (views of `raw`)
    states: Optional[object] = None
    raw: Optional[torch.Tensor] = None  # the bytes the states live in (device/host tiers)
    # the bf16 weights whose remainders the master row holds (optim.store_param_remainders): the owned
    # params' weights are views of it (a resident layer's, on the device) or it is `weights`
    hi: Optional[torch.Tensor] = None
    file: Optional[object] = None  # NVMe tier
    weights: Optional[torch.Tensor] = None  # offloaded layer (offload_params): its weights (the grad buffer or its own)
    step_count: int = 0  # the step counter as an int, read without a device sync
    grad_ready: Optional[object] = None  # CUDA event: the gradient's D2H copy is done
    states_home: Optional[object] = None  # CUDA event: its states are back in host memory after a device update


@dataclass(eq=False)
class Buffers:
    chunks: List[ChunkBuffers]  # at the chunks' indices
    tiers: Dict[str, object]
    nvme: Optional[NVMeTier]
    scratch: Dict[str, torch.Tensor]  # per updating tier, a slice's fp32 gradient
    work: Dict[str, torch.Tensor]  # per updating tier, three fp32 rows to decode into (states not all fp32)
    upload: List[torch.Tensor]  # pinned, the model dtype: updated weights on their way to the device
    acc_slots: List[torch.Tensor] = field(default_factory=list)
    # (fp32 states and gradient, the gradient as it arrives, the packed rows as they arrive) x 2
    update_bufs: list = field(default_factory=list)
    # the events of the device update buffers' last use: the gradients part waits on them (and clears
    # them) before a slot overwrites that memory
    update_free: list = field(default_factory=lambda: [None, None])

    def close(self) -> None:
        """Unlocks the pinned host buffers and removes the NVMe files (nothing may read them after)."""
        self.tiers["host"].close()
        if self.nvme:
            self.nvme.close()

    def allocated_bytes(self) -> Dict[str, int]:
        """Bytes each tier actually holds (chunk states, owned gradients, scratch and staging)."""
        return {name: tier.bytes for name, tier in self.tiers.items()}


def release_weights(params, dtype: torch.dtype, device: torch.device) -> None:
    """Drops the params' weights from the device (autograd may hold them until its backward)."""
    for p in params:
        p.data = torch.empty(0, dtype=dtype, device=device)


def allocate(layout: Layout, device: torch.device, nvme_path: Optional[str], materialize=None) -> Buffers:
    """Every chunk's states and gradient buffer in its tier, the scratch and staging buffers, one
    sub-group after another, the last first; an offloaded layer's weights leave the device once its
    chunks hold them. materialize(params), when given, makes a sub-group's weights real first (layers
    built on the meta device, as angelgpt.model.deferred builds them): the device then holds the resident
    layers and one offloaded layer at a time, never the whole model."""
    on_cuda = device.type == "cuda"
    fmt, chunks = layout.format, layout.chunks
    tiers = {"device": DeviceTier(device), "host": HostTier(pin=on_cuda)}
    nvme = NVMeTier(nvme_path) if nvme_path else None
    if nvme:
        tiers["nvme"] = nvme
    sizes = {t: [c.numel for c in chunks if (c.tier == "device") == (t == "device")] for t in ("device", "host")}
    scratch = {t: tiers[t].allocate(min(max(n), layout.slice_numel)) for t, n in sizes.items() if n}
    # states not all fp32: three fp32 rows to decode a slice into for torch's AdamW
    work = {t: tiers[t].allocate(STATES * min(max(n), CODEC_SLICE)).view(STATES, -1)
            for t, n in sizes.items() if n and not fmt.fp32}
    nvme_sizes = [c.numel for c in chunks if c.tier == "nvme"]
    if nvme_sizes:
        tiers["host"].bytes += nvme.reserve_staging(fmt.nbytes(max(nvme_sizes)))
    upload = [c.numel for c in chunks if c.tier != "device" and not layout.partitioned[c.group] and not c.device_update]
    # pinned buffers in the model dtype carry updated weights to the device (placement.upload_buffers)
    upload = [torch.empty(min(max(upload), layout.slice_numel), dtype=layout.model_dtype, pin_memory=True)
              for _ in range(upload_buffers(fmt.remainders))] if upload and on_cuda else []
    buffers = Buffers([None] * len(chunks), tiers, nvme, scratch, work, upload)
    _allocate_shared(layout, buffers)
    for gi in reversed(range(len(layout.sub_groups))):  # last layers first: offloaded ones leave the device
        if materialize is not None:                      # before the first layers' states arrive
            materialize(list(layout.sub_groups[gi]))
        for c in reversed(layout.chunks_of[gi]):
            buffers.chunks[c.index] = _allocate_chunk(layout, c, tiers, nvme, device)
        if layout.partitioned[gi]:  # also a layer of which this rank owns nothing
            release_weights(layout.sub_groups[gi], layout.model_dtype, device)
    return buffers


def _allocate_chunk(layout: Layout, c: Chunk, tiers, nvme, device: torch.device) -> ChunkBuffers:
    """One chunk: its gradient buffer (holding the owned weights first), step counter and states.
    With remainders the master starts as the weights (remainder 0): an offloaded layer's in its
    weight buffer, a resident layer's in a flat device buffer that the params become views of."""
    grad_tier = tiers["device" if c.tier == "device" else "host"]
    step_device = device if c.tier == "device" or c.device_update else torch.device("cpu")
    b = ChunkBuffers(grad=grad_tier.allocate(c.numel, layout.grad_dtype, pinned=True),
                     step=torch.zeros((), dtype=torch.float32, device=step_device))
    # the owned weights reach the chunk through its gradient buffer (pinned when it is on the host)
    for p, view in c.views(b.grad):
        view.copy_(p.detach())
    offloaded = layout.partitioned[c.group]
    if offloaded and layout.own_weights:  # gradients arrive from the first micro batch on, are fp32,
        b.weights = tiers["host"].allocate(c.numel, layout.model_dtype, pinned=True)  # or the masters'
        b.weights.copy_(b.grad)
    elif offloaded:
        b.weights = b.grad  # holds the weights until the last backward's gradients replace them
    fmt = layout.format
    if fmt.remainders:
        if offloaded:
            b.hi = b.weights
        else:
            # (the weights the model had: not store bytes, as the planner counts them)
            b.hi = torch.empty(c.numel, dtype=layout.model_dtype, device=device)
            for p, view in c.views(b.hi):
                view.copy_(p.detach())
                p.data = view
    if c.tier == "nvme":
        b.file = nvme.create(c.key, fmt.nbytes(c.numel))
        staging = nvme.staging(0, fmt.nbytes(c.numel)).zero_()
        if not fmt.remainders:
            fmt.states(staging, c.numel)[0].copy_(b.grad)
        NVMeTier.write(b.file, staging)
    else:
        b.raw = tiers[c.tier].allocate(fmt.nbytes(c.numel), torch.uint8, pinned=c.device_update)
        b.states = fmt.states(b.raw, c.numel)
        if not fmt.remainders:
            b.states[0].copy_(b.grad)
    return b


def _allocate_shared(layout: Layout, buffers: Buffers) -> None:
    """One device buffer for what never runs at once: the accumulation slots that host chunks'
    running sums make their round trips through (later backward passes), and the two buffers that
    host chunks updated on the device stream through (between the last backward and the next
    forward): [fp32 states and gradient] x 2, then, where the gradients are not fp32, [gradient as it
    arrives, in their dtype] x 2 (None: an fp32 gradient arrives in its row). Slots and arriving
    gradients are in the gradients' dtype (grad_dtype)."""
    chunks, fmt = layout.chunks, layout.format
    groups, numels, tiers = [c.group for c in chunks], [c.numel for c in chunks], [c.tier for c in chunks]
    streamed = [c.device_update for c in chunks]
    dtype = layout.grad_dtype
    size = dtype.itemsize
    slot = largest_off_device_group(groups, numels, tiers) if layout.accumulate else 0
    n = device_update_elements(max((c.numel for c in chunks if c.device_update), default=0), layout.slice_numel)
    # the sizes placement counts: the slots, or the update buffers, whichever is larger
    slots_bytes = accumulation_bytes(groups, numels, tiers, size) if layout.accumulate else 0
    nbytes = max(slots_bytes, device_update_bytes(numels, streamed, size, layout.slice_numel, fmt.bytes))
    pool = buffers.tiers["device"].allocate(nbytes, torch.uint8) if nbytes else None
    buffers.acc_slots = [pool[i * slot * size:(i + 1) * slot * size].view(dtype)
                         for i in range(ACCUMULATION_SLOTS)] if slot else []
    states = (STATES + 1) * 4 * n
    arriving = size if dtype != torch.float32 else 0
    packed = packed_nbytes(n, fmt.bytes)
    tail = 2 * states  # then, per buffer, the gradient and the states as they arrive

    def part(j, off, nbytes):
        lo = tail + j * (arriving * n + packed) + off
        return pool[lo:lo + nbytes]

    buffers.update_bufs = [(pool[j * states:(j + 1) * states].view(torch.float32).view(STATES + 1, n),
                            part(j, 0, n * size).view(dtype) if arriving else None,
                            fmt.rows(part(j, arriving * n, packed), n) if packed else None)
                           for j in range(2)] if n else []
