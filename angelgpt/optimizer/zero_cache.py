"""ZeRO-Cache optimizer: model states sharded over data-parallel ranks, placed over three tiers, and
updated in a pipeline that overlaps the training compute.

Each data-parallel rank owns a disjoint set of whole parameters (balanced by size). The fp32 master
weights and Adam moments of what a rank owns live in flat chunks, one per (sub-group, weight-decay
class), beside a flat gradient buffer (fp32 while micro batches add up in fp32,
optim.accumulate_grads_in_fp32; else the model's dtype); a sub-group is one transformer layer
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

This module is the front: from a resolved config it builds the parts in order, each handed what it
uses (the layout, its buffers, the DP group, config values and the parts it calls, built before it),
and exposes the `angelgpt.optimizer.Optimizer` contract. In build order:

- ``layout.place_chunks``: the ``Layout``, fixed once built: ownership, sub-groups, chunks and
  their placement over the tiers (refused here if it does not fit);
- ``buffers.allocate``: the ``Buffers``: each chunk's gradient buffer, states and step counter in its
  tier, the scratch, upload and device update buffers, the accumulation slots;
- ``weights.Weights``: offloaded weights fetched/prefetched/released, DP all-gather, forward hooks;
- ``adamw.AdamW``, ``host_update.HostUpdate``, ``device_update.DeviceUpdate``: AdamW where the
  states live, the CPU's update of host and NVMe chunks with its uploads, the GPU's update of host
  chunks;
- ``update.Update``: the step, device chunks' AdamW, the update threads, ``complete``/``wait_all``;
- ``gradients.Gradients``: post-accumulate hooks, reduction to the owner, offload, accumulation in
  the store, the squared norm;
- ``state.CheckpointState``: sharded_state_dict / load_state_dict.

    cfg, _ = resolve_config(cfg, machine, ...)   # the planner: every 'auto' made concrete first
    opt = ZeroCacheOptimizer(model, cfg, device, beside_store_bytes)
    ok, grad_norm, _ = opt.step()
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from angelgpt.config import ConfigError, ResolvedConfig
from angelgpt.optimizer.base import Optimizer
from angelgpt.parallel.embedding import tied_embedding_weight
from angelgpt.zero_cache.adamw import AdamW
from angelgpt.zero_cache.buffers import allocate
from angelgpt.zero_cache.cpu_adam import CpuAdam, CpuAdamUnavailable
from angelgpt.zero_cache.device_update import DeviceUpdate
from angelgpt.zero_cache.gradients import Gradients
from angelgpt.zero_cache.host_update import HostUpdate
from angelgpt.zero_cache.layout import Layout, place_chunks
from angelgpt.zero_cache.pipeline import Profile, Streams
from angelgpt.zero_cache.state import CheckpointState
from angelgpt.zero_cache.tiers import refuse_together
from angelgpt.zero_cache.update import Update
from angelgpt.zero_cache.weights import Weights, fetch_depth


class ZeroCacheOptimizer(Optimizer):
    per_layer_checkpoint_keys = True  # states are per parameter of a layer

    def __init__(self, model: torch.nn.Module, cfg: ResolvedConfig, device: torch.device,
                 beside_store_bytes: int = 0, materialize: Optional[Callable[[List[torch.nn.Parameter]], None]] = None,
                 rehearsal: bool = False):
        """cfg: a resolved config (every 'auto' a value). beside_store_bytes: device memory
        training needs beside the store that the optimizer cannot count (activations and workspace);
        the capacity check leaves it free on CUDA. materialize(params): for a model whose layers were
        built on the meta device, makes one sub-group's parameters real (called a sub-group at a time
        while the store fills, so an offloaded layer leaves the device before the next one arrives).
        rehearsal: this rank is played alone under fake collectives (angelgpt.parallel.rehearsal)."""
        zc, o = cfg.zero_cache, cfg.optim
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        group = parallel_state.get_data_parallel_group()
        self.device, self.rate = device, float(zc.prefetch_cache_sub_group_rate)
        self.offload_params, self.device_update_fraction = zc.offload_params, float(zc.device_update_fraction)
        self.layout = L = place_chunks(named, cfg, device, group, beside_store_bytes, rehearsal)
        self.cpu_adam = _load_cpu_adam(L, device, zc.cpu_adam, rehearsal)
        self.streams, self.profile = Streams(device), Profile(device, enabled=zc.is_communication_time_profiling)
        self.buffers = allocate(L, device, zc.nvme_path, materialize)
        bufs = self.buffers.chunks
        # the scheduler sets 'lr' and 'weight_decay' here; the update reads them when a step starts
        self._param_groups = [
            {"params": [p for p in L.params if L.decay[id(p)]], "lr": o.lr, "weight_decay": o.weight_decay,
             "wd_mult": 1.0},
            {"params": [p for p in L.params if not L.decay[id(p)]], "lr": o.lr, "weight_decay": 0.0,
             "wd_mult": 0.0},
        ]
        # gradients on the GPU are reduce-scattered, whatever group carries them (NCCL; gloo with ranks
        # sharing one GPU; a rehearsal's fake group); on the CPU each owner's chunk is reduced
        use_reduce_scatter = device.type == "cuda"
        self.weights = Weights(L, [b.weights for b in bufs], device, group, self.streams, self.profile,
                               use_reduce_scatter, cfg.model.recompute == "full", fetch_depth(L, zc))
        adamw = AdamW(L.format, self.cpu_adam, self.buffers.work, (o.adam_beta1, o.adam_beta2), o.adam_eps, device)
        host = HostUpdate(L, bufs, adamw, self.buffers.scratch.get("host"), self.buffers.upload, self.buffers.nvme,
                          self.streams, self.profile)
        device_update = DeviceUpdate(L, bufs, adamw, self.buffers.update_bufs, self.buffers.update_free,
                                     self.streams, self.profile)
        self.update = Update(L, bufs, self.buffers.scratch.get("device"), adamw, host, device_update, self.weights,
                             device, self.streams, self.profile, self._param_groups, o.clip_grad,
                             zc.pipeline_optimizer, rehearsal)
        self.gradients = Gradients(L, bufs, self.buffers.acc_slots, self.buffers.update_free, self.weights,
                                   self.update, device, group, self.streams, self.profile, use_reduce_scatter,
                                   zc.max_param_reduce_events)
        self.checkpoint = CheckpointState(L, bufs, self.weights, self.update)
        self.gradients.install_hooks(named)
        self.gradients.defer_tied_embedding(tied_embedding_weight(model))  # PP > 1: summed over both stages
        self.weights.install_hooks(model, named, self.update)
        self.gradients.reset_backward_state()

    # -- the contract ----------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[dict]:
        return self._param_groups

    def step(self) -> Tuple[bool, float, Optional[int]]:
        return self.update.step(self.gradients)

    def zero_grad(self) -> None:
        self.gradients.zero_grad()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None, **_):
        return self.checkpoint.sharded_state_dict(model_sharded_state_dict, is_loading, metadata)

    def checkpoint_metadata(self) -> dict:
        return self.checkpoint.metadata()

    def load_state_dict(self, state_dict: dict) -> None:
        self.checkpoint.load_state_dict(state_dict)

    def reload_model_params(self) -> None:
        self.checkpoint.load_model_weights()

    def materialized(self):
        """Offloaded weights readable as ordinary tensors (host memory), for checkpoint save and load."""
        return self.weights.materialized(self.update)

    def wait(self) -> None:
        """Every pending update applied (before a checkpoint, an evaluation or the end)."""
        self.update.wait_all()

    def close(self) -> None:
        self.update.wait_all()
        self.update.shutdown()
        self.gradients.remove_hooks()
        self.weights.remove_hooks()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy still reads a buffer about to be unlocked
        self.buffers.close()

    def placement(self) -> str:
        """One line: where this rank's states went and who updates the host-resident ones."""
        chunks = self.layout.chunks
        owned = {t: sum(c.numel for c in chunks if c.tier == t) for t in ("device", "host", "nvme")}
        on_device = sum(c.numel for c in chunks if c.device_update)
        return (f"zero_cache: prefetch_cache_sub_group_rate {self.rate:.2f}, offload_params {self.offload_params}; "
                f"owned parameters' states on device {owned['device']:,}, host {owned['host']:,}, nvme "
                f"{owned['nvme']:,}; host states updated on the device {on_device:,} "
                f"(device_update_fraction {self.device_update_fraction:.2f}); CPU AdamW "
                f"{'native' if self.cpu_adam else 'torch'}; states {self.layout.format.describe()}")

    def summary(self) -> str:
        """One line: where this rank's states went, who updates the host-resident ones and, on CUDA, the
        bytes each tier holds."""
        line = self.placement()
        if self.device.type == "cuda":
            line += "; bytes held " + ", ".join(f"{t} {b:,}" for t, b in self.memory().items())
        return line

    def profile_record(self) -> Optional[dict]:
        """The last iteration's transfer and optimizer times (is_communication_time_profiling)."""
        return self.profile.last

    def profile_line(self) -> Optional[str]:
        return self.profile.line() if self.profile.last else None

    def memory(self) -> Dict[str, int]:
        """Bytes each tier actually holds (chunk states, owned gradients, scratch and staging)."""
        return self.buffers.allocated_bytes()

    def pinned_bytes(self) -> int:
        """Host memory pinned for the states, gradients and weights that cross PCIe, and the upload buffers."""
        return self.buffers.tiers["host"].pinned_bytes + sum(b.numel() * b.element_size() for b in self.buffers.upload)


def _load_cpu_adam(layout: Layout, device: torch.device, mode: str, rehearsal: bool) -> Optional[CpuAdam]:
    """The one-pass CPU AdamW when the CPU updates some chunk (None: torch's); refused on every rank
    together (a rehearsal alone) where zero_cache.cpu_adam=native cannot be built."""
    if device.type == "cuda" and not any(c.tier != "device" and not c.device_update for c in layout.chunks):
        return None
    kernel = None

    def load():
        nonlocal kernel
        try:
            kernel = CpuAdam.load(mode)
        except CpuAdamUnavailable as e:
            raise ConfigError(f"zero_cache.cpu_adam=native cannot be built: {e}") from e

    refuse_together(load, rehearsal)
    return kernel
