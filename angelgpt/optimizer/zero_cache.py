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

This module is the front: from a resolved config it builds the parts in order, wires them to one
another and exposes the `angelgpt.optimizer.Optimizer` contract. The parts:

- ``store.Store``: chunks, placement over the tiers, allocation, shared buffers, streams, profile;
- ``weights.Weights``: offloaded weights fetched/prefetched/released, DP all-gather, forward hooks;
- ``gradients.Gradients``: post-accumulate hooks, reduction to the owner, offload, accumulation in
  the store, the squared norm;
- ``update.Update``: the step, device and host AdamW, NVMe streaming, device updates of host states,
  uploads, ``complete``/``wait_all``;
- ``state.CheckpointState``: sharded_state_dict / load_state_dict.

    cfg, _ = resolve_config(cfg, machine, ...)   # the planner: every 'auto' made concrete first
    opt = ZeroCacheOptimizer(model, cfg, device, beside_store_bytes)
    ok, grad_norm, _ = opt.step()
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from angelgpt.config import ResolvedConfig
from angelgpt.optimizer.base import Optimizer
from angelgpt.parallel.embedding import tied_embedding_weight
from angelgpt.zero_cache.gradients import Gradients
from angelgpt.zero_cache.state import CheckpointState
from angelgpt.zero_cache.store import Store
from angelgpt.zero_cache.update import Update
from angelgpt.zero_cache.weights import Weights


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
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.store = Store(named, cfg, device, beside_store_bytes, rehearsal)  # placed (refused here if it does not fit)
        self.weights = Weights(self.store)
        self.store.allocate(self.weights.release, materialize)
        self.weights.release_offloaded()
        self.update = Update(self.store, self.weights)
        self.gradients = Gradients(self.store, self.weights, self.update)
        self.update.gradients = self.gradients
        self.weights.update = self.update
        self.checkpoint = CheckpointState(self.store, self.weights, self.update)
        self.gradients.install_hooks(named)
        self.gradients.defer_tied_embedding(tied_embedding_weight(model))  # PP > 1: summed over both stages
        self.weights.install_hooks(model, named)
        self.gradients.reset_backward_state()

    # -- the contract ----------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[dict]:
        return self.store.param_groups

    def step(self) -> Tuple[bool, float, Optional[int]]:
        return self.update.step()

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
        return self.weights.materialized()

    def wait(self) -> None:
        """Every pending update applied (before a checkpoint, an evaluation or the end)."""
        self.update.wait_all()

    def close(self) -> None:
        self.update.wait_all()
        self.update.shutdown()
        self.gradients.remove_hooks()
        self.weights.remove_hooks()
        if self.store.device.type == "cuda":
            torch.cuda.synchronize(self.store.device)  # no copy still reads a buffer about to be unlocked
        self.store.close()

    def summary(self) -> str:
        """One line: where this rank's states went, who updates the host-resident ones and, on CUDA, the
        bytes each tier holds."""
        line = self.store.summary()
        if self.store.device.type == "cuda":
            line += "; bytes held " + ", ".join(f"{t} {b:,}" for t, b in self.memory().items())
        return line

    def profile_record(self) -> Optional[dict]:
        """The last iteration's transfer and optimizer times (is_communication_time_profiling)."""
        return self.store.profile.last

    def profile_line(self) -> Optional[str]:
        return self.store.profile.line() if self.store.profile.last else None

    def memory(self) -> Dict[str, int]:
        """Bytes each tier actually holds (chunk states, owned gradients, scratch and staging)."""
        return self.store.allocated_bytes()
