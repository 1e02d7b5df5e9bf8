"""``optimizer: megatron`` on CPU: Megatron's distributed optimizer allocates on CUDA, so on CPU the same
math runs in ``CPUDataParallelAdamW``: the gradients of parameters marked ``sequence_parallel`` summed
over TP (as Megatron's finalize_model_grads does), gradients averaged over data-parallel ranks, the
global norm over all model-parallel ranks (TP duplicates counted once) clipped, then AdamW on fp32
weights. A non-finite norm skips the step. On CPU the model, and so every gradient, is fp32.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.config import ResolvedConfig
from angelgpt.optimizer.base import Optimizer, clip_coefficient, no_weight_decay
from angelgpt.parallel.embedding import sync_tied_embedding_grads
from angelgpt.parallel.sequence import allreduce_sequence_parallel_grads


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if no_weight_decay(name, p) else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


def global_grad_norm(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients of the model (every TP/PP shard), each TP duplicate counted once and the
    last stage's copy of tied embeddings not at all (Megatron's param_is_not_shared)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in params
             if p.grad is not None and param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)]
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if parallel_state.get_model_parallel_group().size() > 1:
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    return sq.sqrt()


class CPUDataParallelAdamW(Optimizer):
    """Megatron's distributed optimizer's math on CPU: tied embedding gradients summed over the first and
    last pipeline stage, DP-averaged gradients, global-norm clipping, torch's AdamW on fp32 weights."""

    def __init__(self, model: torch.nn.Module, cfg: ResolvedConfig):
        o = cfg.optim
        self.model = model
        self.clip_grad = o.clip_grad
        self.optimizer = torch.optim.AdamW(
            param_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps, weight_decay=o.weight_decay,
        )
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _average_grads_over_dp(self) -> None:
        group = parallel_state.get_data_parallel_group()
        if group.size() == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= group.size()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    @torch.no_grad()
    def step(self) -> Tuple[bool, float, Optional[int]]:
        sync_tied_embedding_grads(self.model)  # PP > 1: first and last stage's copies apply one update
        allreduce_sequence_parallel_grads(self.params)  # sequence parallelism's norms: summed over TP
        self._average_grads_over_dp()
        norm = global_grad_norm(self.params).item()
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm, None
        scale = clip_coefficient(norm, self.clip_grad)
        if scale < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return True, norm, None

    def _init_state(self) -> None:
        for p in self.params:
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:
            self._init_state()
        state = self.optimizer.state_dict()
        state["state"] = {k: dict(v) for k, v in state["state"].items()}  # state_dict() shares the live dicts
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        for s in state["state"].values():
            s.pop("step", None)
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(self.params))
        optim_state_to_sharding_state(state, id_map, exclude_keys="step")
        if steps:
            state["state"]["common_step"] = steps.pop()
        return state

    def load_state_dict(self, state: dict) -> None:
        step = state["state"].pop("common_step", None)
        if step is not None:
            for s in state["state"].values():
                s["step"] = torch.tensor(step, dtype=torch.float32)
        self.optimizer.load_state_dict(state)
