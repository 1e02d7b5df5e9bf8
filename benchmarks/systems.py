"""The systems of the side-by-side benchmark (benchmarks.peers runs them, benchmarks.report labels them):
each system's overrides of `angelgpt train` and its label in BENCHMARKS.md and benchmarks/peers.png."""

from __future__ import annotations

import os

NVME_DIR = os.environ.get("ANGELGPT_BENCH_NVME", "/tmp/angelgpt-nvme")
SYSTEMS = {
    "megatron": ["optim.optimizer=megatron"],
    "megatron_cpu_offload": ["optim.optimizer=megatron_cpu_offload", "optim.offload_fraction=1.0"],
    "deepspeed_zero3_offload": [],  # benchmarks.deepspeed_peer, with the `bench` extra (DeepSpeed)
    "deepspeed_zero3_offload_opt": ["deepspeed_config=zero3_offload_opt"],  # parameters on the GPU
    "deepspeed_zero2_offload_opt": ["deepspeed_config=zero2_offload_opt"],  # ZeRO-Offload
    "zero_cache": ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=auto"],
    "zero_cache_nvme": ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=auto",
                        f"zero_cache.nvme_path={NVME_DIR}"],
}
LABEL = {"megatron": "(a) Megatron distributed optimizer", "megatron_cpu_offload": "(b) Megatron CPU offload",
         "deepspeed_zero3_offload": "(c) DeepSpeed ZeRO-3 offload",
         "deepspeed_zero3_offload_opt": "(c) DeepSpeed ZeRO-3, optimizer offload",
         "deepspeed_zero2_offload_opt": "(c) DeepSpeed ZeRO-2, optimizer offload", "zero_cache": "(d) ZeRO-Cache GPU+CPU",
         "zero_cache_nvme": "(e) ZeRO-Cache GPU+CPU+NVMe"}
