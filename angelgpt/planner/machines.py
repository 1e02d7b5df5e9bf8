"""The machine catalogue: one node's hardware figures, and where each figure came from.

Owns `Machine` (built with keyword arguments; `sources` says for every figure whether it was measured,
and where, or assumed, and why), the catalogue `MACHINES`, `machine_from` (a catalogue entry with
figures given on the command line), `describe` (the catalogue's figures for a GPU read by name, with
the memory, host memory and disk read on the machine), `read_this_machine` (that reading, here) and
`rehearsing_machine` (a target node as one of its ranks runs when rehearsed on another machine).
Also `Machine.to_json`: the reading the launcher resolved with, recorded in the run config it writes.
Torch-free except `read_this_machine`.

Measured figures are of the one-H200 test machine: hardware probes of it (GPU and host memory, free
disk, pinned PCIe and NVMe rates, CPU AdamW), whose readings have no committed result file and are quoted
in their figures' sources (as FACTS.md, the probes' notes), and the committed result files under
benchmarks/results/, each named in its figure's source (H200_STEP_RUNS for the compute rate). Those runs are the planner's
calibration set; tests/data/planner_runs.json declares it, and the runs that validate the planner apart
from it. The 8-GPU rows were never measured: their figures are assumed, most of them scaled from the H200's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Optional, Tuple

from angelgpt.planner.calibration import GIB, HOST_PROCESS

# the hardware figures of a Machine (every one of them has a source)
FIGURES: Tuple[str, ...] = ("gpus_per_node", "gpu_mem_gib", "host_mem_gib", "nvme_gib", "pcie_gbs", "nvme_gbs",
                            "net_gbps", "gpu_tflops", "cpu_adam_gparams", "cpu_update_gparams")
RATES: Tuple[str, ...] = ("pcie_gbs", "nvme_gbs", "net_gbps", "gpu_tflops", "cpu_adam_gparams", "cpu_update_gparams")


@dataclass(kw_only=True)
class Machine:
    """One node's hardware figures; any of them can be overridden on the command line."""

    name: str
    gpu: str  # the GPU model the figures are of, as its name reads ("H200"), matched by describe()
    gpus_per_node: int
    gpu_mem_gib: float
    host_mem_gib: float  # per node
    nvme_gib: float  # per node, free
    pcie_gbs: float  # per GPU, each direction, pinned
    nvme_gbs: float  # per node, reading and writing at once (the update writes a chunk while the next is read)
    net_gbps: float  # per GPU, collective bus bandwidth inside the node (GB/s)
    gpu_tflops: float  # achieved dense bf16 rate on transformer layers (hardware FLOPs)
    cpu_adam_gparams: float  # fused CPU AdamW, G params/s per node
    cpu_update_gparams: float  # ZeRO-Cache's whole host update (gradient in, AdamW, weights out), G params/s
    # per figure: "measured: <where>" or "assumed: <why>" ("given: ..." where a caller set it)
    sources: Dict[str, str] = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


_FACTS = "../shared/FACTS.md"
# The runs gpu_tflops was fitted to (benchmarks/results/; every completed `angelgpt train` run of the
# peers-* cases committed by then): they are calibration, never validation, of the planner's step time
H200_STEP_RUNS = (
    "peers-megatron-L7-mb1-gb32-recomputenone.json",
    "peers-megatron-L7-mb2-gb32-recomputenone.json",
    "peers-megatron-L7-mb4-gb32.json",
    "peers-megatron_cpu_offload-L11-mb1-gb32-recomputenone.json",
    "peers-megatron_cpu_offload-L11-mb2-gb32.json",
    "peers-megatron_cpu_offload-L7-mb4-gb32.json",
    "peers-megatron_cpu_offload-L8-mb2-gb32.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone-devupdate0.45.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.7.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.74.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.78.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.79.json",
    "peers-zero_cache-L11-mb1-gb32-recomputenone.json",
    "peers-zero_cache-L11-mb2-gb32.json",
    "peers-zero_cache-L12-mb2-gb32.json",
    "peers-zero_cache-L13-mb2-gb32.json",
    "peers-zero_cache-L19-mb2-gb32-recomputeauto-devupdate0.45.json",
    "peers-zero_cache-L19-mb2-gb32-recomputeauto-split0.56.json",
    "peers-zero_cache-L19-mb2-gb32-recomputeauto-split0.61.json",
    "peers-zero_cache-L19-mb2-gb32-recomputeauto.json",
    "peers-zero_cache-L19-mb2-gb32-recomputefull.json",
    "peers-zero_cache-L19-mb2-gb32.json",
    "peers-zero_cache-L20-mb2-gb2.json",
    "peers-zero_cache-L6-mb4-gb32.json",
    "peers-zero_cache-L7-mb1-gb32-recomputenone.json",
    "peers-zero_cache-L7-mb2-gb32-recomputenone.json",
    "peers-zero_cache-L7-mb4-gb32.json",
    "peers-zero_cache-L8-mb2-gb32.json",
    "peers-zero_cache_nvme-L24-mb2-gb2.json",
)
_H200_SOURCES = {
    "gpus_per_node": "measured: the test machine has one GPU (FACTS.md: one single-H200 machine)",
    "gpu_mem_gib": "measured: FACTS.md, 'NVIDIA H200, 139.8 GiB usable'",
    "host_mem_gib": "measured: MemAvailable 125.4 GiB on a fresh test machine (FACTS.md: 128 GiB total) less "
                    "the 3% ZeRO-Cache leaves (tiers.host_bytes), plus the process (HOST_PROCESS)",
    "nvme_gib": "measured: FACTS.md, disk '/', 64 GB free",
    "pcie_gbs": "measured: FACTS.md, pinned host to device and device to host 55.3 GB/s each",
    "nvme_gbs": "measured: ZeRO-Cache's NVMe tier reading and writing at once, 2.0 GB/s (24 layers of the 55 "
                "shape: 135.3 GB per step in 67.6 s, benchmarks/results/peers-zero_cache_nvme-L24-mb2-gb2.json; "
                "FACTS.md: 1.4 GB/s written, 1.5 read, one way at a time)",
    "net_gbps": "assumed: never measured (one GPU: no data-parallel collectives; FACTS.md: NCCL refuses two "
                "ranks on the one GPU); NVLink-class bus bandwidth, unused at one GPU",
    "gpu_tflops": "measured: fitted to the step times of the committed H200 training runs of the 55 shape "
                  "named in H200_STEP_RUNS (6 to 24 layers, Megatron's optimizers and ZeRO-Cache): planned "
                  "step times averaged 0.3% under the measured ones; with the host update at its in-training "
                  "rate (cpu_update_gparams) 0.4% over, 2.8% off in size, 7.7% at worst (FACTS.md: Megatron "
                  "GPT forward and backward alone at h=8192 with full recompute 630 hardware TFLOP/s). One figure "
                  "for every micro batch and TP size: a rank's kernels alone (scripts/bench_compute.py, forward "
                  "and backward with full recompute, no optimizer) ran 602-628 at TP 1 from 1 to 32 micro "
                  "batches of 2,048 tokens (compute-grid.json) and 534-626 at TP 2-8 from 2 to 32 "
                  "(compute-grid-tp-patched.json), flat in the micro batch; 570 is that less what training adds",
    "cpu_adam_gparams": "measured: FACTS.md, 'CPU AdamW, torch fused, fp32, 16 threads: 4.2 G params/s'",
    "cpu_update_gparams": "measured: ZeRO-Cache's host update in training with the CPU alone (weights offloaded, "
                          "no device updates), the update thread's median time a step after warm-up: 4.83B "
                          "parameters in 2.01 s (2.41 G params/s, "
                          "benchmarks/results/peers-zero_cache-L13-mb2-gb32.json) and 8.86B in 3.86 s (2.30, "
                          "peers-zero_cache-L20-mb2-gb2.json); the low end taken. The "
                          "kernel alone (scripts/bench_cpu_adam.py, native, 16 threads) ran 2.8-3.5 "
                          "(cpu_adam-67108864-static-split.json, cpu_adam-67108864-t16.json), more than in training",
}


def _node8(name: str, gpu: str, gpu_mem_gib: float, mem_source: str, host: float, pcie: float, pcie_why: str,
           nvme_gbs: float, net: float, tflops: float, tflops_why: str, cpu: float, cpu_update: float) -> Machine:
    """An 8-GPU node of the catalogue: never measured."""
    return Machine(
        name=name, gpu=gpu, gpus_per_node=8, gpu_mem_gib=gpu_mem_gib, host_mem_gib=host, nvme_gib=3000.0,
        pcie_gbs=pcie, nvme_gbs=nvme_gbs, net_gbps=net, gpu_tflops=tflops, cpu_adam_gparams=cpu,
        cpu_update_gparams=cpu_update,
        sources={
            "gpus_per_node": f"assumed: an 8-GPU {gpu} server (not measured)",
            "gpu_mem_gib": mem_source,
            "host_mem_gib": f"assumed: a typical 8-GPU {gpu} server's host memory, {host:g} GiB (not measured)",
            "nvme_gib": "assumed: 3 TB of free local NVMe per node (not measured)",
            "pcie_gbs": pcie_why,
            "nvme_gbs": f"assumed: local NVMe drives at {nvme_gbs:g} GB/s reading and writing at once (not measured)",
            "net_gbps": f"assumed: NVLink collective bus bandwidth {net:g} GB/s per GPU (not measured)",
            "gpu_tflops": tflops_why,
            "cpu_adam_gparams": f"assumed: the H200 host's measured 4.2 G params/s (16 threads, FACTS.md) scaled to "
                                f"the node's CPUs, {cpu:g} (not measured)",
            "cpu_update_gparams": "assumed: the CPU AdamW figure times the ratio measured on the H200 host "
                                  "(ZeRO-Cache's host update in training 2.3 against torch's AdamW 4.2), not "
                                  "measured",
        })


_SCALED_H200_PCIE = "assumed: the H200's measured 55 GB/s (FACTS.md), each GPU on its own PCIe gen5 x16 link"
MACHINES: Dict[str, Machine] = {
    "h200": Machine(name="h200", gpu="H200", gpus_per_node=1, gpu_mem_gib=139.8, host_mem_gib=123.4, nvme_gib=64.0,
                    pcie_gbs=55.0, nvme_gbs=2.0, net_gbps=150.0, gpu_tflops=570.0, cpu_adam_gparams=4.2,
                    cpu_update_gparams=2.3, sources=dict(_H200_SOURCES)),
    "h200x8": _node8("h200x8", "H200", 139.8, "measured: the same GPU, FACTS.md '139.8 GiB usable'", 2000.0, 55.0,
                     _SCALED_H200_PCIE, 6.0, 150.0, 570.0,
                     "assumed: the one-H200 fit (570, measured there) taken for each GPU of the node", 20.0, 11.0),
    "h100x8": _node8("h100x8", "H100", 79.6, "assumed: an 80 GB H100 less what CUDA keeps (not measured)", 2000.0,
                     50.0, "assumed: PCIe gen5 x16 a little under the H200's measured 55 GB/s (not measured)", 6.0,
                     150.0, 600.0, "assumed: H100 SXM achieved dense bf16 rate (not measured)", 20.0, 11.0),
    "a100-80gx8": _node8("a100-80gx8", "A100", 79.2, "assumed: an 80 GB A100 less what CUDA keeps (not measured)",
                         1000.0, 24.0, "assumed: PCIe gen4 x16 pinned transfers (not measured)", 3.0, 100.0, 240.0,
                         "assumed: A100 achieved dense bf16 rate (not measured)", 8.0, 4.4),
    "a100-40gx8": _node8("a100-40gx8", "A100", 39.4, "assumed: a 40 GB A100 less what CUDA keeps (not measured)",
                         1000.0, 24.0, "assumed: PCIe gen4 x16 pinned transfers (not measured)", 3.0, 100.0, 240.0,
                         "assumed: A100 achieved dense bf16 rate (not measured)", 8.0, 4.4),
}


def machine_from(name: Optional[str], **overrides) -> Machine:
    """A catalogue entry (default h200) with the figures given (None: the catalogue's)."""
    hw = MACHINES[name or "h200"]
    given = {k: v for k, v in overrides.items() if v is not None}
    sources = dict(hw.sources)
    for k, v in given.items():
        sources[k] = f"given: {v:g} by the caller, over the catalogue's {getattr(hw, k):g}"
    return replace(hw, **given, sources=sources)


def rehearsing_machine(target: Machine, here: Machine) -> Machine:
    """The target node as a rehearsal on `here` plays one of its ranks (angelgpt.cli.rehearse): the
    target's memory and layout, by which the rank is placed, with `here`'s rates, by which it runs. The
    rank has the rehearsing host to itself (every core its threads, its disk), and the plan divides a
    node's CPU and NVMe figures among the node's GPUs, so those figures are `here`'s whole, times the
    target's GPUs per node; the GPU's rates (compute, PCIe) are `here`'s GPU's. `here`'s figures are
    those describe() gives: for a GPU the catalogue has only as an 8-GPU server (the A100 rows), that
    server's CPU, marked assumed in its sources."""
    n = target.gpus_per_node
    whole = {"cpu_adam_gparams": here.cpu_adam_gparams * n, "cpu_update_gparams": here.cpu_update_gparams * n,
             "nvme_gbs": here.nvme_gbs * n}
    rates = {"gpu_tflops": here.gpu_tflops, "pcie_gbs": here.pcie_gbs, "net_gbps": here.net_gbps, **whole}
    sources = dict(target.sources)
    for k in rates:
        sources[k] = (f"{here.sources.get(k, 'unknown source')} [the rehearsing machine {here.name}"
                      + (f"'s whole host for the one rank: times {n}, the target's GPUs per node]" if k in whole
                         else "]"))
    return replace(target, name=f"{target.name} rehearsed on {here.name}", sources=sources, **rates)


# A GPU the catalogue does not know: rates no better than the slowest catalogue GPU's, and the measured
# host's CPU figures; every one of them marked assumed
_GENERIC_RATES = {
    "pcie_gbs": (24.0, "assumed: unknown GPU, taken as PCIe gen4 x16 pinned transfers (the A100 rows' figure)"),
    "nvme_gbs": (1.4, "assumed: unknown disk, taken as the test machine's one-way rate (FACTS.md: 1.4 GB/s written)"),
    "net_gbps": (100.0, "assumed: unknown interconnect, taken as the A100 rows' collective bandwidth"),
    "gpu_tflops": (200.0, "assumed: unknown GPU, taken below every catalogue GPU's achieved rate"),
    "cpu_adam_gparams": (4.2, "assumed: unknown host, taken as the measured 16-core H200 host's (FACTS.md)"),
    "cpu_update_gparams": (2.3, "assumed: unknown host, taken as the measured 16-core H200 host's "
                                "(ZeRO-Cache's host update in training)"),
}


def _catalogue_row(gpu_name: str, gpu_mem_gib: float, gpus_per_node: int) -> Optional[Machine]:
    """The catalogue row for this GPU (its model named as a word in the name: 'NVIDIA H200 NVL' is an
    H200, 'NVIDIA GH200' is not): the nearest in memory (A100 40 or 80 GB), then in GPUs per node."""
    rows = [m for m in MACHINES.values() if re.search(rf"\b{re.escape(m.gpu)}\b", gpu_name, re.IGNORECASE)]
    if not rows:
        return None
    return min(rows, key=lambda m: (abs(m.gpu_mem_gib - gpu_mem_gib), abs(m.gpus_per_node - gpus_per_node),
                                    m.gpus_per_node))


def describe(gpu_name: str, gpu_total_bytes: int, gpus_per_node: int, host_bytes: int, nvme_bytes: int) -> Machine:
    """This node as read: the catalogue's rates for the GPU of that name (the row nearest in memory and
    GPUs per node; a GPU the catalogue does not know gets generic rates, every one marked assumed),
    with the GPU memory, host memory and free NVMe per node as given."""
    gpu_mem = gpu_total_bytes / GIB
    row = _catalogue_row(gpu_name, gpu_mem, gpus_per_node)
    sources = {
        "gpus_per_node": "measured: read on this machine (GPUs per node)",
        "gpu_mem_gib": f"measured: read on this machine ({gpu_name}'s total memory)",
        "host_mem_gib": "measured: read on this machine (the host memory ZeRO-Cache may take)",
        "nvme_gib": "measured: read on this machine (the NVMe space ZeRO-Cache may take)",
    }
    if row is None:
        rates = {k: v for k, (v, _) in _GENERIC_RATES.items()}
        sources.update({k: why for k, (_, why) in _GENERIC_RATES.items()})
    else:
        rates = {k: getattr(row, k) for k in RATES}
        note = "" if row.gpus_per_node == gpus_per_node else (
            f" [catalogue row {row.name} is of {row.gpus_per_node} GPUs per node, this node has {gpus_per_node}]")
        for k in RATES:
            src = row.sources[k]
            kind, _, why = src.partition(": ")
            sources[k] = f"{kind}: catalogue {row.name}: {why}{note}" if not note else (
                f"assumed: catalogue {row.name} ({kind}: {why}){note}")
    return Machine(name=f"{gpu_name} x{gpus_per_node}", gpu=row.gpu if row else gpu_name,
                   gpus_per_node=gpus_per_node, gpu_mem_gib=gpu_mem, host_mem_gib=host_bytes / GIB,
                   nvme_gib=nvme_bytes / GIB, sources=sources, **rates)


def read_this_machine(zero_cache_cfg, gpus_per_node: int, before_workers: bool = False) -> Machine:
    """This node, read here (`describe`): CUDA device 0's name and total memory (no CUDA context made;
    on a machine without CUDA, GPU memory 0 and generic rates: CPU resolution does not use them), and
    per GPU the host memory and NVMe space that ZeRO-Cache's capacity check will allow
    (tiers.host_bytes and nvme_bytes with `zero_cache_cfg`'s host_max_gib, nvme_path, nvme_max_gib),
    plus the process (HOST_PROCESS, which the plan counts on top of the store).

    Read in a worker (the default), the host memory has the process in it already, hence added back.
    `before_workers=True` (a launcher, before any worker exists): with no host_max_gib the workers'
    processes will come out of the host memory read now, so HOST_PROCESS per GPU is taken out first."""
    import torch

    from angelgpt.zero_cache.tiers import host_bytes, nvme_bytes

    zc = zero_cache_cfg
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name, total = props.name, props.total_memory
    else:
        name, total = "no CUDA GPU", 0
    host = host_bytes(zc.host_max_gib)
    if before_workers and zc.host_max_gib is None:
        host = max(0, host - HOST_PROCESS * gpus_per_node)
    return describe(name, total, gpus_per_node, (host + HOST_PROCESS) * gpus_per_node,
                    nvme_bytes(zc.nvme_path, zc.nvme_max_gib) * gpus_per_node)
