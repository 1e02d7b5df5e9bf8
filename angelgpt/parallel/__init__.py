"""Process groups and Megatron parallel_state for one torchrun worker (rank-aware logging: `log.py`)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def initialize(tensor_parallel: int, pipeline_parallel: int, on_gpu: bool, timeout_minutes: float = 10.0) -> None:
    """Creates the default group (NCCL on GPU, gloo on CPU) and Megatron's TP/PP/DP groups; a collective
    that waits longer than timeout_minutes raises on the waiting rank."""
    from megatron.core import parallel_state

    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timedelta(minutes=timeout_minutes))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        distributed_timeout_minutes=timeout_minutes,
    )


def is_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting (gloo's and NCCL's timeout errors)."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
