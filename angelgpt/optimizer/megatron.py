"""Megatron's distributed optimizer (``optimizer: megatron``) and its CPU offload (``megatron_cpu_offload``,
Megatron's HybridDeviceOptimizer) behind angelgpt's optimizer contract, on GPU: Megatron's
DistributedDataParallel steps from its gradient buffer (main_grad; fp32 with
optim.accumulate_grads_in_fp32, DistributedDataParallelConfig's grad_reduce_in_fp32, set where the
worker wraps the model). Its checkpoint format is Megatron's dp_reshardable (CHECKPOINT_METADATA).
"""

from __future__ import annotations

import torch

from angelgpt.config import Config, ConfigError
from angelgpt.optimizer.base import Optimizer


class MegatronDistributedOptimizer(Optimizer):
    """Megatron's distributed optimizer (or its CPU offload) with the DDP model whose gradient buffer it
    steps from: zero_grad clears both."""

    def __init__(self, ddp_model, megatron_optimizer, offloaded: bool = False):
        self.model = ddp_model
        self.inner = megatron_optimizer
        self.offloaded = offloaded  # Megatron's HybridDeviceOptimizer (megatron_cpu_offload)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        return self.inner.step()

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.inner.zero_grad()

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """Megatron's distributed-optimizer state in the format `metadata` names (Megatron's
        `distrib_optim_sharding_type`: `dp_reshardable` unless the checkpoint says otherwise; megatron-core's
        own default, `fully_sharded_model_space`, is deprecated and refuses the model's tensors)."""
        if is_loading and self.offloaded:
            raise ConfigError("checkpoint.load: optim.optimizer 'megatron_cpu_offload' cannot resume its "
                              "optimizer state with megatron-core 0.16 without transformer-engine (Megatron's "
                              "HybridDeviceOptimizer fails reloading it); resume with optim.optimizer=megatron, "
                              "or export the checkpoint")
        if is_loading:
            for inner in getattr(self.inner, "chained_optimizers", [self.inner]):
                if not any("step" in s for s in inner.optimizer.state.values()):
                    _placeholder_states(inner.optimizer)
        metadata = dict(metadata or {})
        metadata.setdefault("distrib_optim_sharding_type", DP_RESHARDABLE)
        metadata.setdefault("chained_optim_avoid_prefix", True)
        return self.inner.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


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


DP_RESHARDABLE = "dp_reshardable"
# what a checkpoint records of its format (dist_checkpointing's content metadata), as Megatron's training
# loop names it: the distributed optimizer's sharding type (dp_reshardable, Megatron's default: each rank
# writes its own bucket shard; the checkpoint resumes at another data-parallel size, the same TP and PP;
# megatron-core 0.16's fully_reshardable does not load into torch's AdamW, whose states carry 'step')
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": DP_RESHARDABLE, "chained_optim_avoid_prefix": True}


def build_megatron_optimizer(model, cfg: Config, gloo_groups: bool = True) -> MegatronDistributedOptimizer:
    """Megatron's distributed optimizer over a Megatron DDP-wrapped model (GPU), optionally with its CPU
    offload; `gloo_groups` off where there are none (a rehearsal's fake process group)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optim
    offload = {}
    if o.optimizer == "megatron_cpu_offload":  # Megatron's HybridDeviceOptimizer
        offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=o.offload_fraction,
                       overlap_cpu_optimizer_d2h_h2d=True)  # precision-aware mode needs transformer-engine
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True, **offload,
    )
    return MegatronDistributedOptimizer(model, get_megatron_optimizer(
        opt_config, [model], use_gloo_process_groups=gloo_groups), offloaded=bool(offload))
