"""Megatron's distributed optimizer (``optimizer: megatron``) and its CPU offload (``megatron_cpu_offload``,
Megatron's HybridDeviceOptimizer) behind angelgpt's optimizer contract, on GPU: Megatron's
DistributedDataParallel steps from its gradient buffer (main_grad; fp32 with
optim.accumulate_grads_in_fp32, DistributedDataParallelConfig's grad_reduce_in_fp32, set where the
worker wraps the model). Its checkpoint format is Megatron's default, `dp_reshardable` (each rank's bucket
shard as it lies: resumes at another DP only), or with checkpoint.dist_ckpt_optim_fully_reshardable
`fully_reshardable` (model space: each state shaped like its param, keyed like it, so the checkpoint
resumes at any TP, PP and DP); the checkpoint's content metadata names it (`checkpoint_metadata`).

Loading `fully_reshardable` into torch's AdamW (`_load_model_space_state`): megatron-core 0.16 copies
every key of a param's optimizer state from the checkpoint, whose model-space states leave out Adam's
`step` (kept in the param groups): the load runs with the states' `step` set aside and put back.

Adam's `step` after a load, without transformer-engine (`_checkpoint_steps`): Megatron's load gives every
param's state one shared `step` tensor (torch's AdamW then advances it once per param a step), and from
a dp_reshardable checkpoint copies into it the step of the states the load request was built from (the
placeholder states' 1), not the checkpoint's. Each state gets a `step` of its own holding the checkpoint's, which Megatron's loaded param
groups carry, where torch's AdamW keeps it (the param's device when fused, else the host).

The CPU offload (Megatron's HybridDeviceOptimizer) also: its params are Megatron's fp32 main params, so it
keeps no fp32 copies (param_update_in_fp32), and with that flag on its reload hook looks every param up
among those copies and fails: the flag is turned off (no copies, the same updates). Its reload moves every
sub-optimizer's states to the host, the GPU Adam's too (both are torch's AdamW, which it tells apart by
class), and the host copies its CPU Adams step hold the weights from before the load: after the load the
states go back to their params' devices and the host copies take the loaded main params.
"""

from __future__ import annotations

import torch

from angelgpt.config import ResolvedConfig
from angelgpt.optimizer.base import Optimizer


class MegatronDistributedOptimizer(Optimizer):
    """Megatron's distributed optimizer (or its CPU offload) with the DDP model whose gradient buffer it
    steps from: zero_grad clears both."""

    def __init__(self, ddp_model, megatron_optimizer, offloaded: bool = False, fully_reshardable: bool = True):
        self.model = ddp_model
        self.inner = megatron_optimizer
        self.offloaded = offloaded  # Megatron's HybridDeviceOptimizer (megatron_cpu_offload)
        self.sharding_type = FULLY_RESHARDABLE if fully_reshardable else DP_RESHARDABLE

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        return self.inner.step()

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.inner.zero_grad()

    def checkpoint_metadata(self) -> dict:
        return {"distrib_optim_sharding_type": self.sharding_type}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """Megatron's distributed-optimizer state in the format `metadata` names (Megatron's
        `distrib_optim_sharding_type`: the one checkpoint_metadata gives when saving, the checkpoint's when
        loading; `dp_reshardable` for a checkpoint that names none; megatron-core's own default,
        `fully_sharded_model_space`, is deprecated: its flattened ShardedTensors are refused)."""
        if is_loading:
            for torch_optimizer in _torch_optimizers(self.inner):
                if not any("step" in s for s in torch_optimizer.state.values()):
                    _placeholder_states(torch_optimizer)
        metadata = dict(metadata or {})
        metadata.setdefault("distrib_optim_sharding_type", DP_RESHARDABLE)
        metadata.setdefault("chained_optim_avoid_prefix", True)
        return self.inner.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def checkpoint_safe_globals(self) -> list:
        """A HybridDeviceOptimizer's param groups hold its CPU and GPU optimizer classes (torch's AdamW),
        saved in the common state by the fully_reshardable format."""
        if not self.offloaded:
            return []
        classes = {value for hybrid in _torch_optimizers(self.inner)
                   for group in (hybrid.defaults, *hybrid.param_groups) for value in group.values()
                   if isinstance(value, type)}
        return sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}")

    def reload_model_params(self) -> None:
        if self.offloaded:  # Megatron's reload skips the main params a HybridDeviceOptimizer steps on
            for distributed in _distributed_optimizers(self.inner):
                _main_params_from_model(distributed)
        self.inner.reload_model_params()  # the model's weights into the fp32 main params (the hybrid's copies)
        if self.offloaded:  # and those into the HybridDeviceOptimizers' host copies, which its step updates
            for hybrid in _torch_optimizers(self.inner):
                _refresh_host_copies(hybrid)

    def load_state_dict(self, state: dict) -> None:
        distributed = _distributed_optimizers(self.inner)
        model_space = [_take_model_space_state(s) for s in _per_optimizer(state, len(distributed))]
        self.inner.load_state_dict(state)  # param groups (Adam's step with them); dp_reshardable's states
        for distributed_optimizer, param_state in zip(distributed, model_space):
            if param_state is not None:
                _load_model_space_state(distributed_optimizer, param_state)
        for torch_optimizer in _torch_optimizers(self.inner):
            if self.offloaded:  # a HybridDeviceOptimizer
                _settle_hybrid(torch_optimizer)
                for sub in torch_optimizer.sub_optimizers:
                    _checkpoint_steps(sub)
            else:
                _checkpoint_steps(torch_optimizer)


def _checkpoint_steps(torch_optimizer) -> None:
    """Each param's Adam `step` its own tensor holding the checkpoint's step (the module's note), on the
    param's device where the Adam is fused or capturable, else on the host, as torch's AdamW keeps it."""
    for group in torch_optimizer.param_groups:
        if "step" not in group:
            continue
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            param_state = torch_optimizer.state.get(param)
            if param_state and "step" in param_state:
                param_state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32,
                                                   device=param.device if on_device else "cpu")


def _settle_hybrid(hybrid) -> None:
    """A HybridDeviceOptimizer after Megatron loaded it (the module's note): each sub-optimizer's states
    on its param's device, the host copies equal to the loaded main params. The state dicts are the
    HybridDeviceOptimizer's own (shared with its sub-optimizers): changed in place."""
    for sub in hybrid.sub_optimizers:
        for param, param_state in sub.state.items():
            for key, value in list(param_state.items()):
                if torch.is_tensor(value):
                    param_state[key] = value.to(param.device)
    _refresh_host_copies(hybrid)


def _main_params_from_model(distributed) -> None:
    """A DistributedOptimizer's fp32 main-param shards equal to its rank's range of the model's weights."""
    pairs = ((distributed.model_float16_groups, distributed.shard_fp32_from_float16_groups),
             (distributed.model_fp32_groups, distributed.shard_fp32_groups))
    with torch.no_grad():
        for model_groups, main_groups in pairs:
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    buffer, dtype, bucket = distributed.model_param_gbuf_map[model_param]
                    span = distributed.gbuf_ranges[buffer][dtype][bucket]["param_map"][model_param]["param"]
                    main_param.copy_(model_param.detach().view(-1)[span.start:span.end])


def _refresh_host_copies(hybrid) -> None:
    """A HybridDeviceOptimizer's host copies of its offloaded main params equal to those params (its step
    updates the copies and writes them back: a stale copy would put its values back)."""
    for main_param, host_copy in hybrid.gpu_params_map_cpu_copy.items():
        host_copy.data.copy_(main_param.data)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _distributed_optimizers(megatron_optimizer):
    """The DistributedOptimizers of Megatron's (chained) distributed optimizer."""
    return list(getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]))


def _torch_optimizers(megatron_optimizer):
    """The torch optimizers (or HybridDeviceOptimizers) inside Megatron's (chained) distributed optimizer."""
    return [inner.optimizer for inner in _distributed_optimizers(megatron_optimizer)]


def _per_optimizer(state, n: int) -> list:
    """Each chained DistributedOptimizer's part of a loaded optimizer state, in chain order: the state
    itself for one (Megatron's ChainedOptimizer saves a single optimizer's unwrapped), else its entries
    (a dict keyed by position, or a list)."""
    if n == 1:
        return [state]
    return [state[k] for k in sorted(state)] if isinstance(state, dict) else list(state)


def _take_model_space_state(state: dict):
    """A DistributedOptimizer's loaded `fully_reshardable` param state, taken out of `state` (which then
    loads the param groups only); None, `state` untouched, for another format."""
    if state.get("param_state_sharding_type") != FULLY_RESHARDABLE:
        return None
    del state["param_state_sharding_type"]
    return state.pop("param_state")


def _load_model_space_state(distributed_optimizer, param_state) -> None:
    """Megatron's load of a `fully_reshardable` param state (the module's note): the main params and
    moments from the checkpoint, each state's `step` left as it was. A HybridDeviceOptimizer's state
    dicts are the ones its sub-optimizers hold: set aside and put back there too."""
    states = [s for s in distributed_optimizer.optimizer.state.values() if "step" in s]
    steps = [s.pop("step") for s in states]
    try:
        distributed_optimizer.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for s, step in zip(states, steps):
            s["step"] = step


def _placeholder_states(torch_optimizer) -> None:
    """A fresh torch optimizer has no states to load into (torch's AdamW makes them in its first step):
    one step on zero gradients makes them, as Megatron's loading does, and the load replaces them, and
    the fp32 main params that step moved, in place."""
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            if p.numel():
                p.grad = torch.zeros_like(p)
    torch_optimizer.step()
    torch_optimizer.zero_grad()


DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
# what every checkpoint records of its format (dist_checkpointing's content metadata), as Megatron's
# training loop names it; Megatron's distributed optimizer records its own sharding type over it
# (checkpoint_metadata): `fully_reshardable` (at a save every rank gathers its data-parallel group's
# states into host memory, shaped like the params, and DP rank 0 writes them: resumes at any TP, PP and
# DP; at a load every rank reads its TP x PP part whole and keeps its shard) or
# `dp_reshardable` (each rank writes its own bucket shard, no communication: resumes at another DP only)
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": DP_RESHARDABLE, "chained_optim_avoid_prefix": True}


def build_megatron_optimizer(model, cfg: ResolvedConfig, gloo_groups: bool = True,
                             cpu_offload: bool = False) -> MegatronDistributedOptimizer:
    """Megatron's distributed optimizer over a Megatron DDP-wrapped model (GPU), with its CPU offload
    (HybridDeviceOptimizer, optim.offload_fraction of the states) where `cpu_offload`; `gloo_groups` off
    where there are none (a rehearsal's fake process group)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optim
    offload = {}
    if cpu_offload:  # Megatron's HybridDeviceOptimizer
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=o.offload_fraction,
                       overlap_cpu_optimizer_d2h_h2d=True)  # precision-aware mode needs transformer-engine
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True, **offload,
    )
    optimizer = get_megatron_optimizer(opt_config, [model], use_gloo_process_groups=gloo_groups)
    if offload:
        for hybrid in _torch_optimizers(optimizer):
            if not hybrid.param_to_fp32_param:  # Megatron's fp32 main params: no copies (the module's note)
                hybrid.param_update_in_fp32 = False
    return MegatronDistributedOptimizer(model, optimizer, offloaded=bool(offload),
                                        fully_reshardable=cfg.checkpoint.dist_ckpt_optim_fully_reshardable)
