"""ZeRO-Cache optimizer: model states sharded over data-parallel ranks and placed over three tiers.

Each data-parallel rank owns a disjoint set of whole parameters (balanced by size). The fp32
master weights, Adam moments and fp32 gradients of what a rank owns live in flat chunks, one per
(sub-group, weight-decay class); a sub-group is one transformer layer (the embedding first, the
final norm and output last). Placement puts the first ``prefetch_cache_sub_group_rate`` of the
bytes, in forward order, on the compute device (the next forward needs the first layers first),
the rest in host memory, and what host memory cannot hold on NVMe.

A step: gradients are reduced to their owner one sub-group at a time (a reduce-scatter over a
buffer laid out by owner), the global norm is taken over every tier and rank, the step is skipped
on a non-finite norm, gradients are clipped, each chunk runs torch's fused AdamW where it lives
(NVMe chunks stream through two host staging buffers, the next read overlapping this update), and
the updated weights are all-gathered back into the model one sub-group at a time.

    opt = ZeroCacheOptimizer(model, cfg, device)   # Megatron-optimizer interface
    ok, grad_norm, _ = opt.step()
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.config import Config
from angelgpt.train.optim import _no_weight_decay, clip_coefficient
from angelgpt.zero_cache.tiers import STATES, DeviceTier, HostTier, NVMeTier, available_bytes, check_capacity

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def sub_group_index(name: str, num_layers: int) -> int:
    """0 for embeddings, 1 + layer number for a transformer layer, num_layers + 1 for the rest."""
    m = _LAYER.search(name)
    if m:
        return 1 + int(m.group(1))
    return 0 if "embedding" in name else num_layers + 1


def partition(numels: List[int], ranks: int) -> List[int]:
    """Owner rank per parameter: largest first onto the least-loaded rank (deterministic)."""
    load = [0] * ranks
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


@dataclass
class Chunk:
    """Flat fp32 states of the parameters one rank owns in one sub-group and weight-decay class."""

    key: str
    params: List[torch.nn.Parameter]
    decay: bool
    tier: str = "host"
    numel: int = 0
    offsets: List[int] = field(default_factory=list)
    states: Optional[torch.Tensor] = None  # [3, numel]: master, exp_avg, exp_avg_sq (device/host tiers)
    file: Optional[object] = None  # NVMe tier
    grad: Optional[torch.Tensor] = None  # [numel] fp32, reduced and owned
    step: Optional[torch.Tensor] = None

    def views(self, flat: torch.Tensor):
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view_as(p)


def plan_tiers(chunk_bytes: List[int], rate: float, host_limit: int, nvme_enabled: bool) -> List[str]:
    """Tier per chunk, chunks in forward order: device for the first `rate` of the bytes, then host, then NVMe."""
    total = sum(chunk_bytes)
    tiers, on_device, on_host = [], 0, 0
    for b in chunk_bytes:
        if rate >= 1.0 or (rate > 0.0 and on_device + b <= rate * total + 0.5 * b):
            tiers.append("device")
            on_device += b
        elif not nvme_enabled or on_host + b <= host_limit:
            tiers.append("host")
            on_host += b
        else:
            tiers.append("nvme")
    return tiers


class ZeroCacheOptimizer:
    def __init__(self, model: torch.nn.Module, cfg: Config, device: torch.device):
        zc, o = cfg.zero_cache, cfg.optim
        self.cfg = cfg
        self.device = device
        self.clip_grad = o.clip_grad
        self.betas = (o.adam_beta1, o.adam_beta2)
        self.eps = o.adam_eps
        self.group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = self.group.rank(), self.group.size()
        self.use_reduce_scatter = dist.get_backend(self.group) == "nccl"
        rate = zc.prefetch_cache_sub_group_rate
        if rate == "auto":
            rate = 1.0 if device.type == "cpu" else 0.0
        self.rate = float(rate)

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        owners = partition([p.numel() for p in self.params], self.dp_size)
        self.owner = {id(p): r for p, r in zip(self.params, owners)}
        n_groups = cfg.model.num_layers + 2
        self.sub_groups: List[List[torch.nn.Parameter]] = [[] for _ in range(n_groups)]
        decay = {}
        for name, p in named:
            self.sub_groups[sub_group_index(name, cfg.model.num_layers)].append(p)
            decay[id(p)] = not _no_weight_decay(name, p)
        self.sub_groups = [g for g in self.sub_groups if g]
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
                if mine:
                    c = Chunk(key=f"g{gi:04d}_{'decay' if is_decay else 'nodecay'}", params=mine, decay=is_decay)
                    off = 0
                    for p in mine:
                        c.offsets.append(off)
                        off += p.numel()
                    c.numel = off
                    self.chunks.append(c)
        self._place(zc)
        self._allocate()
        self._prefetcher = ThreadPoolExecutor(max_workers=1) if self.nvme else None

    # -- placement and allocation ------------------------------------------------------------
    def _place(self, zc) -> None:
        avail = available_bytes(self.device, zc.host_max_gib, zc.nvme_path, zc.nvme_max_gib)
        state_bytes = [c.numel * 4 * STATES for c in self.chunks]
        host_for_states = avail["host"] - sum(c.numel * 4 for c in self.chunks)  # grads of every non-device chunk
        tiers = plan_tiers(state_bytes, self.rate, host_for_states, bool(zc.nvme_path))
        needed = {"device": 0, "host": 0, "nvme": 0}
        for c, t, b in zip(self.chunks, tiers, state_bytes):
            c.tier = t
            needed[t] += b
            needed["device" if t == "device" else "host"] += c.numel * 4  # the owned fp32 gradient
        if not zc.nvme_path:
            needed.pop("nvme")
        check_capacity(needed, avail)
        self.planned_bytes = needed

    def _allocate(self) -> None:
        pin = self.device.type == "cuda"
        self.tiers = {"device": DeviceTier(self.device), "host": HostTier(pin)}
        self.nvme = NVMeTier(self.cfg.zero_cache.nvme_path, pin) if self.cfg.zero_cache.nvme_path else None
        if self.nvme:
            self.tiers["nvme"] = self.nvme
        for c in self.chunks:
            grad_tier = self.tiers["device" if c.tier == "device" else "host"]
            c.grad = grad_tier.allocate(c.numel)
            step_device = self.device if c.tier == "device" else torch.device("cpu")
            c.step = torch.zeros((), dtype=torch.float32, device=step_device)
            if c.tier == "nvme":
                c.file = self.nvme.create(c.key, STATES * c.numel)
                staging = self.nvme.staging(0, STATES * c.numel).zero_()
                self._fill_master(c, staging.view(STATES, c.numel)[0])
                NVMeTier.write(c.file, staging)
            else:
                c.states = self.tiers[c.tier].allocate(STATES * c.numel).view(STATES, c.numel)
                self._fill_master(c, c.states[0])

    @staticmethod
    def _fill_master(c: Chunk, master: torch.Tensor) -> None:
        for p, view in c.views(master):
            view.copy_(p.detach())

    def allocated_bytes(self) -> Dict[str, int]:
        """Bytes each tier actually holds (chunk states and owned gradients)."""
        return {name: tier.bytes for name, tier in self.tiers.items()}

    # -- the step -----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _owner_layout(self, group: List[torch.nn.Parameter]):
        """Per rank, its owned params in this sub-group and their offsets in a padded flat segment."""
        per_rank: List[List[torch.nn.Parameter]] = [[] for _ in range(self.dp_size)]
        for p in group:
            per_rank[self.owner[id(p)]].append(p)
        seg = max(sum(p.numel() for p in ps) for ps in per_rank)
        return per_rank, seg

    def _reduce_grads(self) -> torch.Tensor:
        """Averages gradients over DP into their owner's chunk; returns the owned squared norm."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        owned_grad = {}
        for c in self.chunks:
            for p, view in c.views(c.grad):
                owned_grad[id(p)] = view
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for group in self.sub_groups:
            per_rank, seg = self._owner_layout(group)
            flat = torch.zeros(self.dp_size * seg, dtype=torch.float32, device=self.device)
            for r, ps in enumerate(per_rank):
                off = r * seg
                for p in ps:
                    if p.grad is not None:
                        flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                    off += p.numel()
            if self.dp_size > 1:
                if self.use_reduce_scatter:
                    mine = torch.empty(seg, dtype=torch.float32, device=self.device)
                    dist.reduce_scatter_tensor(mine, flat, group=self.group)
                else:
                    dist.all_reduce(flat, group=self.group)
                    mine = flat[self.dp_rank * seg:(self.dp_rank + 1) * seg]
                mine.div_(self.dp_size)
            else:
                mine = flat
            off = 0
            for p in per_rank[self.dp_rank]:
                g = mine[off:off + p.numel()]
                if param_is_not_tensor_parallel_duplicate(p):
                    sq += g.pow(2).sum()
                owned_grad[id(p)].copy_(g.view_as(p))
                off += p.numel()
        return sq

    def _global_norm(self, sq: torch.Tensor) -> float:
        if self.dp_size > 1:
            dist.all_reduce(sq, group=self.group)
        mp = parallel_state.get_model_parallel_group()
        if mp.size() > 1:
            dist.all_reduce(sq, group=mp)
        return math.sqrt(sq.item())

    def _adamw(self, c: Chunk, states: torch.Tensor, grad: torch.Tensor, step: torch.Tensor) -> None:
        group = self.param_groups[0 if c.decay else 1]
        step += 1
        torch._fused_adamw_([states[0]], [grad], [states[1]], [states[2]], [], [step],
                            lr=group["lr"], beta1=self.betas[0], beta2=self.betas[1],
                            weight_decay=group["weight_decay"], eps=self.eps, amsgrad=False, maximize=False)

    def _update_chunks(self, coef: float) -> None:
        nvme_chunks = [c for c in self.chunks if c.tier == "nvme"]
        pending = {}
        if nvme_chunks:
            first = nvme_chunks[0]
            pending[first.key] = self._prefetcher.submit(
                NVMeTier.read, first.file, self.nvme.staging(0, STATES * first.numel))
        slot = 0
        position = {c.key: i for i, c in enumerate(nvme_chunks)}
        for c in self.chunks:
            if coef < 1.0:
                c.grad.mul_(coef)
            if c.tier != "nvme":
                self._adamw(c, c.states, c.grad, c.step)
                continue
            staging = pending.pop(c.key).result().view(STATES, c.numel)
            i = position[c.key]
            if i + 1 < len(nvme_chunks):  # double buffering: read the next chunk during this update
                nxt = nvme_chunks[i + 1]
                pending[nxt.key] = self._prefetcher.submit(
                    NVMeTier.read, nxt.file, self.nvme.staging(1 - slot, STATES * nxt.numel))
            self._adamw(c, staging, c.grad, c.step)
            self._master_to_model(c, staging[0])
            NVMeTier.write(c.file, staging)
            slot = 1 - slot

    def _master_to_model(self, c: Chunk, master: torch.Tensor) -> None:
        for p, view in c.views(master):
            p.data.copy_(view)

    @torch.no_grad()
    def _gather_params(self) -> None:
        for c in self.chunks:
            if c.tier != "nvme":
                self._master_to_model(c, c.states[0])
        if self.dp_size == 1:
            return
        for group in self.sub_groups:
            per_rank, seg = self._owner_layout(group)
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

    @torch.no_grad()
    def step(self) -> Tuple[bool, float, Optional[int]]:
        norm = self._global_norm(self._reduce_grads())
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm, None
        self._update_chunks(clip_coefficient(norm, self.clip_grad))
        self._gather_params()
        return True, norm, None

    # -- checkpoints -----------------------------------------------------------------------------
    def _chunk_states(self, c: Chunk) -> torch.Tensor:
        if c.tier != "nvme":
            return c.states
        return NVMeTier.read(c.file, torch.empty(STATES * c.numel, dtype=torch.float32)).view(STATES, c.numel)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **_):
        """Per owned parameter: fp32 master, exp_avg, exp_avg_sq as ShardedTensors shaped like the
        parameter, so a checkpoint loads into any placement (rate, tiers) and any ownership."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
        )

        owned = [p for c in self.chunks for p in c.params]
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(owned))
        index = {id(p): i for i, p in enumerate(owned)}
        # a layer's tensors share one key (the layer axis is prepended), so the offset tells them apart
        self._model_key = {id(p): f"{id_map[i].key}@{','.join(map(str, id_map[i].global_offset))}"
                           for i, p in enumerate(owned)}
        state = {}
        for c in self.chunks:
            flat = torch.empty(STATES, c.numel) if is_loading else self._chunk_states(c)
            for i, p in enumerate(c.params):
                model_ten = id_map[index[id(p)]]
                replica = model_ten.replica_id
                replica = (*replica[:-1], 0) if isinstance(replica, tuple) else 0  # the owner is the main replica
                for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
                    view = flat[k][c.offsets[i]:c.offsets[i] + p.numel()].view_as(p)
                    ten = make_sharded_optimizer_tensor(model_ten, view,
                                                        prefix=f"optimizer.zero_cache.{name}")
                    state[f"{name}.{self._model_key[id(p)]}"] = replace(ten, replica_id=replica)
        step = float(self.chunks[0].step) if self.chunks else 0.0
        return {"state": state, "common_step": step}

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes what dist_checkpointing loaded for sharded_state_dict(..., is_loading=True)."""
        tensors = state_dict["state"]
        step = float(state_dict["common_step"])
        for c in self.chunks:
            flat = torch.empty(STATES, c.numel)
            for p, off in zip(c.params, c.offsets):
                key = self._model_key[id(p)]
                for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
                    flat[k][off:off + p.numel()].copy_(tensors[f"{name}.{key}"].reshape(-1))
            c.step.fill_(step)
            if c.tier == "nvme":
                NVMeTier.write(c.file, flat.reshape(-1))
            else:
                c.states.copy_(flat)
            for p, off in zip(c.params, c.offsets):
                p.data.copy_(flat[0][off:off + p.numel()].view_as(p))
        self._gather_params()

    def close(self) -> None:
        if self._prefetcher:
            self._prefetcher.shutdown()
        if self.nvme:
            self.nvme.close()
