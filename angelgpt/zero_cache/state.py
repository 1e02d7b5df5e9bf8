"""Checkpoint state: the optimizer's states as Megatron dist_checkpointing sharded tensors, saved from
and loaded into the tiers in place.

Per owned parameter: master, exp_avg, exp_avg_sq, each a ShardedTensor shaped like the parameter and
keyed against the model's sharded tensor, so a checkpoint loads into any placement (rate, tiers) and
any ownership. The tensors are views of the chunks' states where they live (an NVMe chunk's file
mapped into memory): no tier is copied whole into host memory. They keep the store's format
(precision.py: fp32 master or its remainder, fp32 or bf16 moments; fp8 moments decoded into bf16,
which holds their values exactly), recorded in the checkpoint's metadata; a checkpoint of another
format loads and is converted.

Owns: the states a load writes into (``_loading``) and the model key of each owned parameter.
Touches: the chunks' states, NVMe files and step counters, an offloaded layer's host ``weights``, the
model's ``p.data`` (the loaded masters copied in). Calls the update's ``wait_all()`` first, and the
weights part's ``all_gather(gi)`` after a load over DP.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from angelgpt.zero_cache.placement import CODEC_SLICE, STATES, slices
from angelgpt.zero_cache.precision import (Blockwise, StateFormat, join_master, moment_as_bf16, split_master,
                                           write_moment)
from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.layout import Chunk, Layout


class CheckpointState:
    def __init__(self, layout: Layout, bufs: Sequence[ChunkBuffers], weights, update):
        """bufs: the chunks' buffers (at their indices); weights, update: the parts it calls."""
        self.layout, self.bufs, self.weights, self.update = layout, bufs, weights, update
        self._loading = {}  # id(chunk) -> the rows a checkpoint load writes into
        self._loading_format = layout.format  # the format of the checkpoint being loaded
        self._model_key = {}

    def metadata(self) -> dict:
        """What a checkpoint records beside the tensors: the format the states are saved in."""
        return self.layout.format.as_metadata()

    def _chunk_states(self, c: Chunk, writable: bool = False):
        """A chunk's state rows where they live: an NVMe chunk's file mapped into memory, so a checkpoint
        reads (or, writable, loads into) it page by page without a host copy of it."""
        b, fmt = self.bufs[c.index], self.layout.format
        if c.tier != "nvme":
            return b.states
        raw = torch.from_file(str(b.file), shared=writable, size=fmt.nbytes(c.numel), dtype=torch.uint8)
        return fmt.states(raw, c.numel)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata: Optional[dict] = None):
        """Per owned parameter: master, exp_avg, exp_avg_sq as ShardedTensors shaped like the parameter,
        so a checkpoint loads into any placement (rate, tiers) and any ownership. The tensors are views
        of the states in their tiers (saved from there, and loaded into them in place): no tier is copied
        whole into host memory (fp8 moments excepted: they are saved decoded, in bf16, a host copy each).
        They are saved in the store's format (the master as 'master', fp32, or as 'master_remainder'
        beside the model's bf16 weights; the moments in their dtypes, fp8 as bf16), named in the
        checkpoint's metadata; a load from another format (`metadata`: the checkpoint's) reads into host
        tensors of that format and converts. The next step updates them in place: an asynchronous
        save (checkpoint.async_save) copies what it writes into host memory before returning to
        training (angelgpt/train/checkpoint_writer.py), a synchronous one has written them by then."""

        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        self.update.wait_all()
        L = self.layout
        self._loading = {}
        saved = StateFormat.from_metadata(metadata) if is_loading else L.format
        owned = [p for c in L.chunks for p in c.params]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(owned))
        index = {id(p): i for i, p in enumerate(owned)}
        # a layer's tensors share one key (the layer axis is prepended), so the offset tells them apart (a
        # factory's, SwiGLU's linear_fc1 saved as its gate and up halves: its first half's)
        offsets = [t.global_offset if hasattr(t, "global_offset") else t.build()[0].global_offset
                   for t in (id_map[i] for i in range(len(owned)))]
        self._model_key = {id(p): f"{id_map[i].key}@{','.join(map(str, offsets[i]))}" for i, p in enumerate(owned)}
        state = {}
        for c in L.chunks:
            rows = self._chunk_states(c, writable=is_loading)
            if is_loading and (saved != L.format or saved.blockwise):
                # loaded into host tensors as the checkpoint keeps them, converted after
                rows = [torch.empty(c.numel, dtype=dtype) for dtype in saved.checkpoint_dtypes]
            elif L.format.blockwise:  # fp8 moments saved decoded, in bf16 (exact)
                rows = [moment_as_bf16(r, squared=k == 2, triton=L.format.triton) if isinstance(r, Blockwise) else r
                        for k, r in enumerate(rows)]
            if is_loading:
                self._loading[id(c)] = rows
            for i, p in enumerate(c.params):
                model_ten = id_map[index[id(p)]]
                replica = model_ten.replica_id
                replica = (*replica[:-1], 0) if isinstance(replica, tuple) else 0  # the owner is the main replica
                for k, name in enumerate(saved.names):
                    view = rows[k][c.offsets[i]:c.offsets[i] + L.numel(p)].view(L.shape[id(p)])
                    ten = make_sharded_optimizer_tensor(model_ten, view,
                                                        prefix=f"optimizer.zero_cache.{name}")
                    state[f"{name}.{self._model_key[id(p)]}"] = replace(ten, replica_id=replica)
        step = float(self.bufs[0].step) if L.chunks else 0.0
        self._loading_format = saved
        return {"state": state, "common_step": step}

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes what dist_checkpointing loaded for sharded_state_dict(..., is_loading=True), after the
        model's weights (with remainders, the masters' high half) were loaded."""
        self.update.wait_all()
        tensors = state_dict["state"]
        step = float(state_dict["common_step"])
        saved = self._loading_format  # the format sharded_state_dict(..., is_loading=True) asked for
        loading, self._loading = self._loading, {}
        L = self.layout
        fmt = L.format
        for c in L.chunks:
            b = self.bufs[c.index]
            dst = self._chunk_states(c, writable=True)
            rows = loading.get(id(c), dst)
            for p, off in zip(c.params, c.offsets):
                key = self._model_key[id(p)]
                for k, name in enumerate(saved.names):
                    into, src = rows[k][off:off + L.numel(p)], tensors[f"{name}.{key}"].reshape(-1)
                    if src.data_ptr() != into.data_ptr():  # loaded elsewhere than in place
                        into.copy_(src)
            if fmt.remainders:  # the model's loaded weights are the masters' high half
                for p, view in c.views(b.hi):
                    if p.numel() and p.data.data_ptr() != view.data_ptr():
                        view.copy_(p.data.reshape(view.shape))
            if saved != fmt or saved.blockwise:
                master = rows[0].float() if not saved.remainders else join_master(
                    self._weights(c), rows[0], torch.empty(c.numel, dtype=torch.float32), triton=fmt.triton)
                if fmt.remainders:
                    hi = b.hi.cpu()
                    split_master(master, hi, dst[0], triton=fmt.triton)
                    b.hi.copy_(hi)
                else:
                    dst[0].copy_(master)
                for k in (1, 2):  # an fp8 moment's values from another format are rounded stochastically
                    for lo, end in slices(c.numel, CODEC_SLICE):  # (whole blocks: the temporaries stay small)
                        write_moment(rows[k][lo:end].float(), dst[k][lo:end], squared=k == 2,
                                     seed=(c.index * STATES + k, int(step)), base=lo, triton=fmt.triton)
            b.step.fill_(step)
            b.step_count = int(step)
            if fmt.remainders:
                continue  # the params are views of b.hi, or refetched from it (an offloaded layer)
            if b.weights is not None:
                b.weights.copy_(dst[0])
            for p, view in c.views(dst[0]):
                if p.numel():  # a released (offloaded) weight is refetched from b.weights
                    p.data.copy_(view)
        if L.dp_size > 1:
            for gi in range(len(L.sub_groups)):
                if not L.partitioned[gi]:
                    self.weights.all_gather(gi)

    def load_model_weights(self) -> None:
        """After the model's weights alone were loaded (an imported checkpoint), inside the weights part's
        materialized(): every owned master equal to its weight (its remainder zero), as a new store's
        master starts as the model's initial weights; the moments and steps stay as allocated."""
        self.update.wait_all()
        for c in self.layout.chunks:
            b = self.bufs[c.index]
            master = self._chunk_states(c, writable=True)[0]
            if self.layout.format.remainders:  # the masters' high half are the weights
                for p, view in c.views(b.hi):
                    if p.data.data_ptr() != view.data_ptr():
                        view.copy_(p.data.reshape(view.shape))
                master.zero_()
                continue
            for p, view in c.views(master):
                view.copy_(p.data.reshape(view.shape))
            if b.weights is not None:  # an offloaded layer's copy, which the next fetch reads
                for p, view in c.views(b.weights):
                    if p.data.data_ptr() != view.data_ptr():
                        view.copy_(p.data.reshape(view.shape))

    @staticmethod
    def _weights(c: Chunk) -> torch.Tensor:
        """The chunk's owned params' weights as loaded into the model, flat on the host, in bf16 (an fp32
        model, a CPU run, holds the saved bf16 weights exactly)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in c.params]).to(torch.bfloat16)
