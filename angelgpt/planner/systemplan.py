"""SystemPlan, the planner's answer for one system on one rank, and `finish`, which totals a system's
memory and step terms into it against the machine: margins, step time, bottleneck.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

from angelgpt.config import Config
from angelgpt.model.flops import flops_per_iteration
from angelgpt.planner.calibration import GIB, MODEL_BYTES
from angelgpt.planner.layout import rank_params
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import micro_batches_in_flight, offloaded_activation_bytes
from angelgpt.zero_cache.placement import GPU_HEADROOM


@dataclass
class SystemPlan:
    """One system's plan for a rank: its memory per resource, the margins, the step's terms (exposed
    beyond compute), and the settings it was planned with ('auto' resolved)."""

    system: str
    gpu_bytes: Dict[str, int]
    host_bytes: Dict[str, int]
    nvme_bytes: int
    gpu_total: int
    host_total: int  # per node
    fits: bool
    margin: Dict[str, int]  # capacity minus need, per resource (negative: short)
    step_s: Dict[str, float]
    step_time_s: float
    bottleneck: str
    rate: Optional[float] = None
    tflops_per_gpu: float = 0.0
    offload_params: Optional[bool] = None  # zero_cache: are the weights of host-resident layers offloaded
    accumulate_in_store: Optional[bool] = None  # zero_cache: do micro batches' gradients add up in the store
    device_update_fraction: Optional[float] = None  # zero_cache: of the host-resident states, updated on the GPU
    recompute: str = "none"  # model.recompute as planned ('auto' resolved)
    recompute_num_layers: Optional[int] = None  # with 'full': the layers per stage that recompute (None: all)
    activation_offload: str = "none"  # model.activation_offload as planned ('auto' resolved)

    def to_dict(self) -> dict:
        return asdict(self)

    def recompute_label(self) -> str:
        """'none', 'full', or 'full (first k layers per stage)'."""
        k = self.recompute_num_layers
        return self.recompute + (f" (first {k} layers per stage)" if self.recompute == "full" and k else "")


def _capacity(hw: Machine, gpus_per_node: int):
    return hw.gpu_mem_gib * GIB, hw.host_mem_gib * GIB, hw.nvme_gib * GIB, gpus_per_node


def world_and_dp(cfg: Config, gpus_per_node: int, nodes: int):
    """The world size and the data-parallel size of the config on that many GPUs."""
    world = gpus_per_node * nodes
    dp = cfg.data_parallel_size(world)
    return world, dp


def finish(system, cfg, hw, gpus_per_node, world, gpu, host, nvme, step, rate=None, pp_rank=0) -> SystemPlan:
    """A system's plan from its memory per rank (gpu, host: by part, bytes; nvme: bytes) and its step's
    terms (seconds: compute, and what is exposed beyond it): activation offload's host memory and copies
    added, node totals, margins against the machine (GPU_HEADROOM left free), the step time and its
    bottleneck (the largest exposed term over 5% of the step, else compute)."""
    gpu_cap, host_cap, nvme_cap, _ = _capacity(hw, gpus_per_node)
    offloaded = offloaded_activation_bytes(cfg)
    if offloaded:  # pinned host memory for the micro batches in flight; down and up on the compute stream
        dp = cfg.data_parallel_size(world)
        mb = cfg.num_microbatches(dp)
        host = {**host, "offloaded_activations": offloaded * micro_batches_in_flight(cfg, dp, pp_rank)}
        step = {**step, "activation_offload": mb * 2 * offloaded / (hw.pcie_gbs * 1e9)}
    if cfg.checkpoint.async_save:  # the host buffer asynchronous saves stage into, kept from save to save
        host = {**host, "checkpoint_staging": checkpoint_staging_bytes(cfg, world, pp_rank)}
    gpu_total = sum(gpu.values())
    host_total = sum(host.values()) * gpus_per_node  # ranks of one node share its host memory
    nvme_total = nvme * gpus_per_node
    margin = {"gpu": int(gpu_cap * (1 - GPU_HEADROOM) - gpu_total), "host": int(host_cap - host_total),
              "nvme": int(nvme_cap - nvme_total)}
    exposed = {k: v for k, v in step.items() if k != "compute"}
    total = step["compute"] + sum(exposed.values())
    worst = max(exposed, key=exposed.get) if exposed else None
    bottleneck = worst if worst and exposed[worst] > 0.05 * total else "compute"
    flops = flops_per_iteration(cfg)
    return SystemPlan(system, gpu, host, nvme_total, gpu_total, host_total, all(v >= 0 for v in margin.values()),
                      margin, {k: round(v, 4) for k, v in step.items()}, round(total, 4), bottleneck, rate,
                      round(flops / total / world / 1e12, 1), recompute=cfg.model.recompute,
                      recompute_num_layers=cfg.model.recompute_num_layers,
                      activation_offload="checkpoints" if offloaded else "none")


def checkpoint_staging_bytes(cfg: Config, world: int, pp_rank: int = 0) -> int:
    """Host bytes a rank stages an asynchronous save into, at most: its shard of the fp32 master and two
    moments (12 bytes a parameter over DP; Megatron's distributed optimizer saving fully_reshardable
    gathers its data-parallel group's, 12 bytes a parameter) and the bf16 weights it may be the main
    replica of."""
    n = sum(p.numel for p in rank_params(cfg, pp_rank))
    gathered = (cfg.optim.spec.gathers_states_to_save_fully_reshardable
                and cfg.checkpoint.dist_ckpt_optim_fully_reshardable)
    return -(-n * 12 // (1 if gathered else cfg.data_parallel_size(world))) + n * MODEL_BYTES


def shortfall(p: SystemPlan) -> int:
    """Bytes a plan is short of, over every resource it is short of (0 when it fits)."""
    return -sum(min(0, v) for v in p.margin.values())
