"""Text and JSON forms of the planner's answer (what `angelgpt plan` prints)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Dict

from angelgpt.model.flops import format_params
from angelgpt.planner.machines import GIB, Machine
from angelgpt.planner.calibration import MODEL_BYTES
from angelgpt.planner.memory import activation_bytes, grad_bytes
from angelgpt.planner.systemplan import SystemPlan
from angelgpt.planner.zero_cache import states_per_element


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f} GiB"


def to_json(cfg, hw: Machine, gpus_per_node: int, nodes: int, plans: Dict[str, SystemPlan], params: int) -> dict:
    return {"machine": asdict(hw), "gpus_per_node": gpus_per_node, "nodes": nodes, "params": params,
            "activations_bytes": {"with_recompute": activation_bytes(cfg, True, False),
                                  "with_recompute_offloaded": activation_bytes(cfg, True, True),
                                  "without_recompute": activation_bytes(cfg, False)},
            "plans": {k: p.to_dict() for k, p in plans.items()}}


def bytes_per_parameter(cfg, world: int) -> str:
    """ZeRO-Cache's model states a parameter: the weight, the states as the config keeps them
    (optim.store_param_remainders, exp_avg_dtype, exp_avg_sq_dtype) and the gradient."""
    remainders, states = states_per_element(cfg)
    dp = max(1, world // cfg.model_parallel_size)
    grad = grad_bytes(cfg, dp)
    o = cfg.optim
    master = "master as an int16 remainder beside the weight" if remainders else "fp32 master"
    said = lambda x: f"{x:.2f}".rstrip("0").rstrip(".")  # noqa: E731  (fp8 scales: a fraction of a byte)
    return (f"model states: {said(MODEL_BYTES + states + grad)} bytes a parameter ({MODEL_BYTES} weight + "
            f"{said(states)} states [{master}, exp_avg {o.exp_avg_dtype}, exp_avg_sq {o.exp_avg_sq_dtype}] + "
            f"{grad} gradient)")


def render(cfg, hw: Machine, gpus_per_node: int, nodes: int, plans: Dict[str, SystemPlan], params: int) -> str:
    m = cfg.model
    lines = [f"model: {format_params(params)} parameters ({m.num_layers} x {m.hidden_size}, seq {m.seq_length}), "
             f"micro/global batch {cfg.train.micro_batch_size}/{cfg.train.global_batch_size}, "
             f"TP {cfg.parallel.tensor_model_parallel_size} x PP {cfg.parallel.pipeline_model_parallel_size}",
             f"machine: {nodes} x {gpus_per_node} GPUs ({hw.name}): {hw.gpu_mem_gib:.1f} GiB GPU, "
             f"{hw.host_mem_gib:.0f} GiB host and {hw.nvme_gib:.0f} GiB NVMe per node, PCIe {hw.pcie_gbs:g} GB/s, "
             f"NVMe {hw.nvme_gbs:g} GB/s, network {hw.net_gbps:g} GB/s, {hw.gpu_tflops:g} TFLOP/s, "
             f"CPU AdamW {hw.cpu_adam_gparams:g} G params/s",
             f"activations per micro batch on the GPU: {activation_bytes(cfg, True, False) / GIB:.2f} GiB with full "
             f"recompute ({activation_bytes(cfg, True, True) / GIB:.2f} GiB with its kept inputs offloaded), "
             f"{activation_bytes(cfg, False) / GIB:.2f} GiB without (model.recompute={m.recompute}, "
             f"model.activation_offload={m.activation_offload})"]
    for name, p in plans.items():
        chosen = ([f"recompute {p.recompute_label()}"] if m.recompute == "auto" else []) + (
            [f"activation offload {p.activation_offload}"] if m.activation_offload == "auto" else []) + (
            [f"prefetch_cache_sub_group_rate {p.rate:.2f}"] if p.rate is not None else []) + (
            [f"device_update_fraction {p.device_update_fraction:.2f}"] if p.device_update_fraction else []) + (
            ["accumulate_in_store"] if p.accumulate_in_store else [])
        title = name + (f" ({', '.join(chosen)})" if chosen else "")
        verdict = ("fits (margin: " + ", ".join(f"{k} {v / GIB:+.2f} GiB" for k, v in p.margin.items()
                                                 if k != "nvme" or p.nvme_bytes) + ")") if p.fits else "DOES NOT FIT"
        short = [f"{k} by {-v / GIB:.2f} GiB" for k, v in p.margin.items() if v < 0]
        if short and name == "zero_cache" and cfg.zero_cache.prefetch_cache_sub_group_rate == "auto":
            short.append("no rate fits; the closest shown")
        lines += ["", f"== {title}: {verdict}" + (f" (short of {', '.join(short)})" if short else "")]
        if name == "zero_cache":
            lines.append("  " + bytes_per_parameter(cfg, gpus_per_node * nodes))
        lines.append("  GPU per rank:")
        lines += [f"    {k:<24}{_gib(v)}" for k, v in p.gpu_bytes.items() if v]
        lines.append(f"    {'total':<24}{_gib(p.gpu_total)}   margin {p.margin['gpu'] / GIB:+.2f} GiB")
        lines.append("  host per rank:")
        lines += [f"    {k:<24}{_gib(v)}" for k, v in p.host_bytes.items() if v]
        lines.append(f"    {'node total':<24}{_gib(p.host_total)}   margin {p.margin['host'] / GIB:+.2f} GiB")
        if p.nvme_bytes:
            lines.append(f"  NVMe per node: {_gib(p.nvme_bytes)}   margin {p.margin['nvme'] / GIB:+.2f} GiB")
        parts = ", ".join(f"{k} {v:.2f}" for k, v in p.step_s.items() if v or k == "compute")
        lines.append(f"  step: {p.step_time_s:.2f} s ({parts}; exposed beyond compute) -> "
                     f"{p.tflops_per_gpu:.0f} model TFLOP/s/GPU, bound by {p.bottleneck}")
        if p.bottleneck == "micro_batch_transfers" and p.accumulate_in_store:
            lines.append("  (the host chunks' gradient sums go up and back down every micro batch after the "
                         "first: fewer, larger micro batches, train.micro_batch_size, send them fewer times)")
    return "\n".join(lines)
