"""Checkpoint state: the optimizer's states as Megatron dist_checkpointing sharded tensors, saved from
and loaded into the tiers in place.

Per owned parameter: fp32 master, exp_avg, exp_avg_sq, each a ShardedTensor shaped like the
parameter and keyed against the model's sharded tensor, so a checkpoint loads into any placement
(rate, tiers) and any ownership. The tensors are views of the chunks' states where they live (an
NVMe chunk's file mapped into memory): no tier is copied whole into host memory.

Owns: the states a load writes into (``_loading``) and the model key of each owned parameter.
Touches: the chunks' states, NVMe files and step counters, an offloaded layer's ``weights``, the
model's ``p.data`` (the loaded masters copied in). Calls the update's ``wait_all()`` first, and the
weights part's ``all_gather(gi)`` after a load over DP.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from angelgpt.zero_cache.placement import STATES
from angelgpt.zero_cache.store import Chunk, Store


class CheckpointState:
    def __init__(self, store: Store, weights, update):
        self.store, self.weights, self.update = store, weights, update
        self.chunks, self.sub_groups, self.partitioned = store.chunks, store.sub_groups, store.partitioned
        self.dp_size, self.shape = store.dp_size, store.shape
        self._n = store._n
        self._loading = {}  # id(chunk) -> the states a checkpoint load writes into in place
        self._model_key = {}

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
        tier is copied whole into host memory. The next step updates them in place: an asynchronous
        save (checkpoint.async_save) copies what it writes into host memory before returning to
        training (angelgpt/train/checkpoint_writer.py), a synchronous one has written them by then."""

        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        self.update.wait_all()
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
        self.update.wait_all()
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
                    self.weights.all_gather(gi)

