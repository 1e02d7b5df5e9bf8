"""Megatron's HybridDeviceOptimizer's plan for one rank (planned as configured: the search settles
recompute and activation offload first): optim.offload_fraction of the states on the host, CPU AdamW."""

from __future__ import annotations

from angelgpt.config import Config
from angelgpt.planner.calibration import (CUDA_CONTEXT, GPU_ADAMW_PARAMS_PER_S, HOST_PROCESS,
                                          HYBRID_HOST_STATE_BYTES, HYBRID_STEP_TRANSIENT_BYTES,
                                          HYBRID_TRANSFER_BUFFER_BYTES, MODEL_BYTES, WORKSPACE)
from angelgpt.planner.layout import rank_params
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import activation_bytes, micro_batches_in_flight
from angelgpt.planner.systemplan import SystemPlan, finish, world_and_dp
from angelgpt.planner.timing import compute_s


def plan_step(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int, pp_rank: int = 0) -> SystemPlan:
    """Megatron's HybridDeviceOptimizer: offload_fraction of fp32 master, moments and an fp32 gradient copy
    in pinned host memory, updated by torch's CPU AdamW after backward (the transfers overlap it); a rank of
    pipeline stage pp_rank."""
    world, dp = world_and_dp(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, pp_rank))
    f = cfg.optim.offload_fraction
    shard = -(-n // dp)
    # transfer buffers on the GPU; on the host the states between steps and a transient fp32 gradient copy
    # during the step (bytes a parameter of the offloaded shard: calibration.HYBRID_*)
    gpu = {"weights": n * MODEL_BYTES, "main_grads": n * (4 if cfg.optim.accumulate_grads_in_fp32 else MODEL_BYTES),
           "optimizer_states": int(shard * 12 * (1 - f)),
           "transfer_buffers": int(shard * HYBRID_TRANSFER_BUFFER_BYTES * f),
           "activations": activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank)),
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"host_states": int(shard * HYBRID_HOST_STATE_BYTES * f),
            "step_transient": int(shard * HYBRID_STEP_TRANSIENT_BYTES * f), "process": HOST_PROCESS}
    step = {"compute": compute_s(cfg, hw, world),
            "cpu_optimizer": shard * f * gpus_per_node / (hw.cpu_adam_gparams * 1e9),
            "gpu_optimizer": shard * (1 - f) / GPU_ADAMW_PARAMS_PER_S,
            "network": (dp - 1) / dp * n * (4 + MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return finish("megatron_cpu_offload", cfg, hw, gpus_per_node, world, gpu, host, 0, step, pp_rank=pp_rank)
