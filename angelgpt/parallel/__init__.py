"""Process groups and Megatron parallel_state for one torchrun worker (rank-aware logging: `log.py`).

A rehearsal (`angelgpt train --rehearse`) plays one rank of a larger world in one process: the default
group is torch's fake process group, whose collectives return at once and move no data (an all-gather
copies the rank's own input into every slot, a receive writes nothing: here it is filled with
standard normal values, so a pipeline stage computes on values like real ones, neither uninitialised
memory nor zeros, on which GEMMs run faster; and a reduce-scatter writes this rank's own chunk
whatever the torch version, Megatron's sequence-parallel one included). `rehearsal()`
says so to the code that would otherwise wait on other ranks (resolving once on rank 0 and broadcasting
an object, refusing together).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from angelgpt.parallel.shared_device import SharedDevice


@dataclass(frozen=True)
class Rehearsal:
    """The rank a rehearsal plays, the world it plays it in, and on GPU the bytes its allocator may take."""

    rank: int
    world_size: int
    gpu_cap_bytes: Optional[int] = None


_REHEARSAL: dict = {"now": None}


def rehearsal() -> Optional[Rehearsal]:
    """The rehearsal this process runs (None in a real run)."""
    return _REHEARSAL["now"]


# Megatron's modules that bind collectives to names of their own when imported (the sequence-parallel
# gathers and reduce-scatters: dist_reduce_scatter_func, dist_all_gather_func), out of reach of a patch of
# torch.distributed made later
_BOUND_AT_IMPORT = ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
                    "megatron.core.tensor_parallel.utils")


def _patch_collective(name: str, wrap) -> None:
    """Replaces torch.distributed's `name` by wrap(original) where Megatron's P2P communicator,
    batch_isend_irecv and the callers of torch.distributed look it up, and under any name that Megatron's
    tensor-parallel modules bound it to (_BOUND_AT_IMPORT); once (a patched one is marked `_rehearsal_patch`)."""
    import importlib

    from torch.distributed import distributed_c10d as c10d

    original = getattr(c10d, name)
    if getattr(original, "_rehearsal_patch", False):  # not `__wrapped__`: torch's own decorators set that
        return
    patched = wrap(original)
    patched.__wrapped__, patched._rehearsal_patch = original, True
    setattr(c10d, name, patched)
    setattr(dist, name, patched)
    for module in map(importlib.import_module, _BOUND_AT_IMPORT):
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, patched)


def _filled_receives() -> None:
    """A fake group's receive leaves its buffer as allocated (torch.empty: any bytes, NaN included);
    fill it with standard normal values first (an integer buffer, such as a shape, with zeros). Not
    zeros: a stage after the first computes on what it receives, and GEMMs on zeros run faster than on
    real values (an H200 bf16 GEMM: 793 TFLOP/s on zeros, 688 on random values)."""
    def filling(original):
        def receive(*args, **kwargs):
            tensor = args[0] if args else kwargs["tensor"]
            with torch.no_grad():
                tensor.normal_() if tensor.is_floating_point() else tensor.zero_()
            return original(*args, **kwargs)
        return receive

    for name in ("recv", "irecv"):
        _patch_collective(name, filling)


def _own_chunk_reduce_scatter() -> None:
    """A reduce-scatter writes this rank's own chunk of the input into its output, what a reduction over
    one rank gives. torch's fake group does so on the CPU with torch 2.13; with 2.11 (the GPU machine's)
    it leaves the output as allocated, on the CPU and the GPU alike. Megatron's sequence-parallel
    backward reduce-scatters every layer's input gradient: left as allocated on the GPU, those gradients
    were any bytes (every rehearsed gradient norm non-finite until 5d82cdc, finite since), and the GEMMs
    that read them ran on such bytes, faster than on real values (compute-grid-tp.json's TP 2-8 points)."""
    def own_chunk(original):
        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = original(output, input, op=op, group=group, async_op=async_op)
            with torch.no_grad():
                me = dist.get_rank(group) if group is not None else dist.get_rank()
                output.view(-1).copy_(input.view(-1)[me * output.numel():(me + 1) * output.numel()])
            return work
        return reduce_scatter_tensor

    _patch_collective("reduce_scatter_tensor", own_chunk)


def _start_rehearsal(r: Rehearsal, tensor_parallel: int, pipeline_parallel: int, on_gpu: bool) -> None:
    """Rank r.rank of r.world_size under torch's fake process group, on this machine's first GPU (its
    allocator capped at r.gpu_cap_bytes) or the CPU; Megatron's groups for the whole world, no gloo."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _REHEARSAL["now"] = r
    if on_gpu:
        torch.cuda.set_device(0)
        if r.gpu_cap_bytes is not None:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, r.gpu_cap_bytes / total), 0)
    _filled_receives()
    _own_chunk_reduce_scatter()
    dist.init_process_group("fake", store=FakeStore(), rank=r.rank, world_size=r.world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        create_gloo_process_groups=False,
    )


def initialize(tensor_parallel: int, pipeline_parallel: int, on_gpu: bool, timeout_minutes: float = 10.0,
               rehearse: Optional[Rehearsal] = None, shared: Optional[SharedDevice] = None) -> None:
    """Creates the default group (NCCL on GPU, gloo on CPU) and Megatron's TP/PP/DP groups; a collective
    that waits longer than timeout_minutes raises on the waiting rank. With `rehearse`, the one rank it
    names under the fake process group instead; with `shared` (GPU), every rank on that one GPU under gloo."""
    from megatron.core import parallel_state

    if rehearse is not None:
        return _start_rehearsal(rehearse, tensor_parallel, pipeline_parallel, on_gpu)
    if on_gpu and shared is not None:
        shared.start()
    elif on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if on_gpu and shared is None else "gloo"
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


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
