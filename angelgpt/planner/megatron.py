"""Megatron's distributed optimizer's plan for one rank (planned as configured: the search settles
recompute and activation offload first): bf16 weights, main grads, fp32 master and moments over DP."""

from __future__ import annotations

from angelgpt.config import Config
from angelgpt.planner.calibration import (CUDA_CONTEXT, GPU_ADAMW_PARAMS_PER_S, HOST_PROCESS,
                                          MEGATRON_STEP_TEMPORARY_BYTES, MODEL_BYTES, WORKSPACE)
from angelgpt.planner.layout import rank_params
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import activation_bytes, micro_batches_in_flight
from angelgpt.planner.systemplan import SystemPlan, finish, world_and_dp
from angelgpt.planner.timing import compute_s


def plan_step(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int, pp_rank: int = 0) -> SystemPlan:
    """Megatron's distributed optimizer: bf16 weights, fp32 main grads, fp32 master + moments sharded over DP
    (a rank of pipeline stage pp_rank)."""
    world, dp = world_and_dp(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, pp_rank))
    # torch's foreach AdamW's temporaries (calibration.MEGATRON_STEP_TEMPORARY_BYTES a parameter). The step's
    # temporaries and the activations are not live at once: the larger of the two counts.
    activations = activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank))
    # main grads in fp32 (optim.accumulate_grads_in_fp32: grad_reduce_in_fp32), else in bf16, from which
    # the step makes an fp32 copy of the rank's shard (distrib_optimizer's _copy_model_grads_to_main_grads)
    fp32 = cfg.optim.accumulate_grads_in_fp32
    temporaries = -(-n * MEGATRON_STEP_TEMPORARY_BYTES // dp) * (1 if fp32 else 2)
    gpu = {"weights": n * MODEL_BYTES, "main_grads": n * (4 if fp32 else MODEL_BYTES),
           "optimizer_states": -(-n * 12 // dp),
           "optimizer_temporaries": max(0, temporaries - activations), "activations": activations,
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"process": HOST_PROCESS}
    step = {"compute": compute_s(cfg, hw, world),
            "gpu_optimizer": n / dp / GPU_ADAMW_PARAMS_PER_S,
            "network": (dp - 1) / dp * n * (4 + MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return finish("megatron", cfg, hw, gpus_per_node, world, gpu, host, 0, step, pp_rank=pp_rank)
