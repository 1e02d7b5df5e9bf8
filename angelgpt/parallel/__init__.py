"""Process groups and Megatron parallel_state for one torchrun worker (rank-aware logging: `log.py`).

The default group is NCCL on GPUs and gloo on the CPU. The ranks of a node sharing one GPU are an
object passed to `initialize` (of the interface `device_sharing.DeviceSharing`, which this package
defines and does not implement). A rehearsal (`rehearsal.Rehearsal`: one rank of a larger world played
alone under torch's fake process group) is not started here but by its own context,
`Rehearsal.started`.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from angelgpt.parallel.device_sharing import DeviceSharing
from angelgpt.parallel.rehearsal import Rehearsal

__all__ = ["DeviceSharing", "Rehearsal", "all_ranks", "destroy", "initialize", "is_timeout", "rank"]

# what initialize entered for this process (a DeviceSharing's process()), left by destroy
_ENTERED = contextlib.ExitStack()


def initialize(tensor_parallel: int, pipeline_parallel: int, on_gpu: bool, timeout_minutes: float = 10.0,
               sharing: Optional[DeviceSharing] = None) -> None:
    """Creates the default group (NCCL on GPU, gloo on CPU) and Megatron's TP/PP/DP groups; a collective
    that waits longer than timeout_minutes raises on the waiting rank. With `sharing` (GPU), the node's
    ranks on one GPU, the default group of its backend, inside its process() until destroy()."""
    from megatron.core import parallel_state

    if on_gpu and sharing is not None:
        _ENTERED.enter_context(sharing.process())
    elif on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = ("nccl" if sharing is None else sharing.backend) if on_gpu else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
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
    _ENTERED.close()


def all_ranks(value: bool, device) -> bool:
    """Whether `value` holds on every rank of the default group (a collective: every rank calls it)."""
    flag = torch.tensor([1.0 if value else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
