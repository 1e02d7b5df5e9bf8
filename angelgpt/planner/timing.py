"""The time model's shared terms: a step's compute at the machine's achieved rate, the forward's share
of it, and the host update's rates; each system's module says which of its transfers hide behind what.

Compute runs at the machine's achieved dense rate (hardware FLOPs, recompute included). What a system's
transfers, updates and collectives do not hide behind compute is exposed; the largest exposed term,
else compute, is the bottleneck (systemplan.finish). Activation offload's copies (down in forward, up in
backward, every micro batch) run on the compute stream (model/offload.py), so none of their time is hidden.
"""

from __future__ import annotations

from angelgpt.config import Config
from angelgpt.model.flops import flops_per_iteration, recomputed_layers
from angelgpt.planner.calibration import (CPU_BESIDE_DEVICE_UPDATE, DEVICE_UPDATE_BYTES, DEVICE_UPDATE_PER_PCIE_GBS,
                                         FP8_CPU_UPDATE, TORCH_CPU_UPDATE, TORCH_FP8_CPU_UPDATE)
from angelgpt.planner.machines import Machine


def host_update_rates(hw: Machine, gpus_per_node: int, cpu_adam: str, fp8: bool, device_bytes: float):
    """Parameters/s per GPU of the host update: (CPU alone, CPU beside device updates, device path);
    fp8: a moment is kept in fp8 (the CPU's rate scaled by what its path measured); device_bytes: what
    the device path moves over PCIe a parameter (the gradient up, the states up and back down)."""
    if fp8:
        factor = TORCH_FP8_CPU_UPDATE if cpu_adam == "torch" else FP8_CPU_UPDATE
    else:
        factor = TORCH_CPU_UPDATE if cpu_adam == "torch" else 1.0
    cpu = hw.cpu_update_gparams * 1e9 / gpus_per_node * factor
    device = hw.pcie_gbs * DEVICE_UPDATE_PER_PCIE_GBS * 1e9 * DEVICE_UPDATE_BYTES / device_bytes
    return cpu, cpu * CPU_BESIDE_DEVICE_UPDATE, device


def compute_s(cfg: Config, hw: Machine, world: int) -> float:
    """Seconds of one step's compute on each of `world` GPUs, recompute included."""
    return flops_per_iteration(cfg, include_recompute=True) / world / (hw.gpu_tflops * 1e12)


def forward_share(cfg: Config) -> float:
    """The forward's share of a micro batch's compute: a layer's backward costs two forwards, and a
    recomputed layer runs its forward again."""
    return 1.0 / (3.0 + recomputed_layers(cfg) / cfg.model.num_layers)
