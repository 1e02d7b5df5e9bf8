"""ZeRO-3 with parameter and optimizer offload (DeepSpeed's design) planned for one rank, as configured
(the search settles recompute and activation offload first); assumed, no constant fitted to a run."""

from __future__ import annotations

from angelgpt.config import Config
from angelgpt.model.flops import recomputed_layers
from angelgpt.planner.calibration import CUDA_CONTEXT, HOST_PROCESS, MODEL_BYTES, WORKSPACE
from angelgpt.planner.layout import rank_params
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import activation_bytes, micro_batches_in_flight
from angelgpt.planner.systemplan import SystemPlan, finish, world_and_dp
from angelgpt.planner.timing import compute_s
from angelgpt.zero_cache.placement import STATES


def plan_step(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int) -> SystemPlan:
    """ZeRO-3 with parameter and optimizer offload to CPU: 16-bit weights and fp32 grads, master and
    moments on the host, weights fetched over PCIe for every forward and backward, the CPU update after
    backward, not overlapped. (Assumed from DeepSpeed's design: no constant here is fitted to a run.)"""
    world, dp = world_and_dp(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, 0))
    shard = -(-n // dp)
    largest = max(p.numel for p in rank_params(cfg, 0) if p.sub_group == 1) * 12  # one layer gathered
    gpu = {"gathered_weights": 2 * largest * MODEL_BYTES,
           "activations": activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp)),
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"host_states": shard * (MODEL_BYTES + 4 + 4 * STATES), "process": HOST_PROCESS}
    mb = cfg.num_microbatches(dp)
    fetch = (2 + recomputed_layers(cfg) / cfg.model.num_layers) * mb * n * MODEL_BYTES / (hw.pcie_gbs * 1e9)
    compute = compute_s(cfg, hw, world)
    step = {"compute": compute,
            "pcie_h2d": max(0.0, fetch - compute),
            "pcie_d2h": shard * 4 / (hw.pcie_gbs * 1e9),
            "cpu_optimizer": shard * gpus_per_node / (hw.cpu_adam_gparams * 1e9),
            "network": (dp - 1) / dp * n * (4 + 2 * MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return finish("zero3_offload", cfg, hw, gpus_per_node, world, gpu, host, 0, step)
