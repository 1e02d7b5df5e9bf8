"""The planner's entry points: each system's plan for a rank with every 'auto' settled (planner.search),
all four systems' (plan) and the configured optimizer's (plan_for); the names callers import from here.

    from angelgpt.planner import plan, MACHINES
    report = plan(cfg, MACHINES["h200"], gpus_per_node=1, nodes=1)

The model itself lives beside this module, one concern a module: calibration (the fitted, measured and
assumed constants and their sources), memory (activations, micro batches in flight, gradient bytes),
timing (compute and the host update's rates), systemplan (SystemPlan and the totals, margins and
bottleneck of a plan), one module per system (megatron, megatron_cpu_offload, zero_cache,
zero3_offload: a rank's memory and step as configured) and search (the 'auto' choices). planner.resolve
turns the choices into a concrete config. This module re-exports the model's names its callers import
(__all__).
"""

from __future__ import annotations

from typing import Dict, Optional

from angelgpt.config import Config, ConfigError
import angelgpt.planner.megatron as megatron
import angelgpt.planner.megatron_cpu_offload as megatron_cpu_offload
import angelgpt.planner.zero3_offload as zero3_offload
import angelgpt.planner.zero_cache as zero_cache
from angelgpt.planner.calibration import (CPU_BESIDE_DEVICE_UPDATE, CUDA_CONTEXT, DEVICE_UPDATE_PER_PCIE_GBS,
                                          GIB, HOST_PROCESS, MODEL_BYTES, PCIE_DUPLEX_SHARE, STREAM_HELD_LAYERS,
                                          TORCH_CPU_UPDATE, WORKSPACE)
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import (accumulating, activation_bytes, beside_store_bytes, grad_bytes,
                                     micro_batches_in_flight, offloaded_activation_bytes, sub_group_numels)
from angelgpt.planner.search import best_rate, settle_recompute, settle_store
from angelgpt.planner.systemplan import SystemPlan, shortfall, world_and_dp
from angelgpt.planner.timing import forward_share, host_update_rates
from angelgpt.planner.zero_cache import (device_update_fraction, offload_params_on, rank_tier_bytes,
                                         stream_held_bytes)
# placement's constants, importable from here (__all__)
from angelgpt.zero_cache.placement import GPU_HEADROOM, STATES

__all__ = ["CPU_BESIDE_DEVICE_UPDATE", "CUDA_CONTEXT", "DEVICE_UPDATE_PER_PCIE_GBS", "GIB", "GPU_HEADROOM",
           "HOST_PROCESS", "MODEL_BYTES", "PCIE_DUPLEX_SHARE", "STATES", "STREAM_HELD_LAYERS",
           "SystemPlan", "TORCH_CPU_UPDATE", "WORKSPACE", "accumulating", "activation_bytes", "auto_plan",
           "beside_store_bytes", "device_update_fraction", "forward_share", "grad_bytes", "host_update_rates",
           "micro_batches_in_flight", "offload_params_on", "offloaded_activation_bytes", "plan", "plan_for",
           "plan_megatron", "plan_megatron_cpu_offload", "plan_zero3_offload", "plan_zero_cache",
           "rank_tier_bytes", "shortfall", "stream_held_bytes", "sub_group_numels"]


def plan_zero_cache(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1,
                    rate: Optional[float] = None, nvme: Optional[bool] = None, pp_rank: int = 0) -> SystemPlan:
    """ZeRO-Cache on data-parallel rank 0 of pipeline stage pp_rank (default the first, the largest: it
    holds the embedding): its parameters and store (zero_cache.plan_step), at `rate` and with the NVMe
    tier `nvme` (default: as configured), recompute, activation offload, accumulate_in_store and
    offload_params settled by the search. A rate of 'auto' is chosen for the first stage (auto_plan)."""
    zc = cfg.zero_cache
    rate = zc.prefetch_cache_sub_group_rate if rate is None else rate
    use_nvme = bool(zc.nvme_path) if nvme is None else nvme
    if rate == "auto":
        return auto_plan(cfg, hw, gpus_per_node, nodes, use_nvme)
    dp = world_and_dp(cfg, gpus_per_node, nodes)[1]

    def at_rate(c: Config) -> SystemPlan:
        return zero_cache.plan_step(c, hw, gpus_per_node, nodes, rate, use_nvme, pp_rank)

    return settle_recompute(cfg, lambda c: settle_store(c, dp, at_rate))


def auto_plan(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, nvme: bool = False) -> SystemPlan:
    """ZeRO-Cache's plan of the first stage at the largest prefetch_cache_sub_group_rate that fits, else
    the closest to fitting (search.best_rate), with recompute, activation offload, accumulate_in_store and
    offload_params settled by the search for each rate's sake."""
    dp = world_and_dp(cfg, gpus_per_node, nodes)[1]

    def at_best_rate(c: Config) -> SystemPlan:
        use_nvme = bool(c.zero_cache.nvme_path) if nvme is None else nvme
        return best_rate(c, dp, lambda rate: zero_cache.plan_step(c, hw, gpus_per_node, nodes, rate, use_nvme))

    return settle_recompute(cfg, lambda c: settle_store(c, dp, at_best_rate))


def plan_megatron(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, pp_rank: int = 0) -> SystemPlan:
    """Megatron's distributed optimizer (megatron.plan_step), recompute and activation offload settled."""
    return settle_recompute(cfg, lambda c: megatron.plan_step(c, hw, gpus_per_node, nodes, pp_rank))


def plan_megatron_cpu_offload(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1,
                              pp_rank: int = 0) -> SystemPlan:
    """Megatron's HybridDeviceOptimizer (megatron_cpu_offload.plan_step), recompute and activation offload
    settled."""
    return settle_recompute(cfg, lambda c: megatron_cpu_offload.plan_step(c, hw, gpus_per_node, nodes, pp_rank))


def plan_zero3_offload(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1) -> SystemPlan:
    """ZeRO-3 with parameter and optimizer offload (zero3_offload.plan_step), recompute and activation
    offload settled."""
    return settle_recompute(cfg, lambda c: zero3_offload.plan_step(c, hw, gpus_per_node, nodes))


def plan(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1) -> Dict[str, SystemPlan]:
    """The four systems' plans, by name, each with its 'auto' settings settled."""
    return {"zero_cache": plan_zero_cache(cfg, hw, gpus_per_node, nodes),
            "megatron": plan_megatron(cfg, hw, gpus_per_node, nodes),
            "megatron_cpu_offload": plan_megatron_cpu_offload(cfg, hw, gpus_per_node, nodes),
            "zero3_offload": plan_zero3_offload(cfg, hw, gpus_per_node, nodes)}


def plan_for(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, pp_rank: int = 0) -> SystemPlan:
    """The plan of the optimizer the configuration asks for, for a rank of pipeline stage pp_rank (its
    parameters, optimizer states and micro batches in flight)."""
    system = cfg.optim.spec.planner_system
    if system not in SYSTEM_PLANS:
        raise ConfigError(f"optim.optimizer '{cfg.optim.optimizer}' has no GPU plan (the planner models "
                          f"{', '.join(SYSTEM_PLANS)})")
    return SYSTEM_PLANS[system](cfg, hw, gpus_per_node, nodes, pp_rank=pp_rank)


# the systems an optimizer's spec may name as its planner_system (angelgpt.config.optimizers)
SYSTEM_PLANS = {"zero_cache": plan_zero_cache, "megatron": plan_megatron,
                "megatron_cpu_offload": plan_megatron_cpu_offload}
