"""A rehearsal: one rank of a larger world played alone in this process, under torch's fake process
group, whose collectives return at once and move no data (an all-gather copies the rank's own input
into every slot). Everything a rehearsal changes in torch.distributed is here, for as long as it runs
(`Rehearsal.started`, a context: on exit every name it replaced is the original object again), and only
a rehearsed rank's process (`angelgpt.train.rehearse`) starts one:

- a receive leaves its buffer as allocated, so it is first filled with standard normal values (a
  pipeline stage computes on values like real ones, neither uninitialised memory nor zeros, on which
  GEMMs run faster);
- a reduce-scatter writes this rank's own chunk, whatever the torch version, Megatron's
  sequence-parallel one included (bound to names of its own when Megatron is imported).

The code that would otherwise wait on other ranks is told by the object, passed in: the worker does
not follow rank 0's config, ZeRO-Cache refuses alone and updates whatever the norm, the loop neither skips nor
aborts on meaningless losses, and Megatron's optimizer makes no gloo groups.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@dataclass(frozen=True)
class Rehearsal:
    """The rank a rehearsal plays, the world it plays it in, and on GPU the bytes its allocator may take."""

    rank: int
    world_size: int
    gpu_cap_bytes: Optional[int] = None

    @contextlib.contextmanager
    def started(self, tensor_parallel: int, pipeline_parallel: int, on_gpu: bool) -> Iterator["Rehearsal"]:
        """Within it, this rank under torch's fake process group (whose store torch supplies), on this
        machine's first GPU (its allocator capped at gpu_cap_bytes) or the CPU; Megatron's groups for the
        whole world, no gloo. On exit Megatron's parallel state and the process group are destroyed and
        torch.distributed's collectives (and Megatron's names for them) are the original objects again."""
        from megatron.core import parallel_state

        if on_gpu:
            torch.cuda.set_device(0)
            if self.gpu_cap_bytes is not None:
                total = torch.cuda.get_device_properties(0).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.gpu_cap_bytes / total), 0)
        with _filled_receives(), _own_chunk_reduce_scatter():
            dist.init_process_group("fake", rank=self.rank, world_size=self.world_size)
            try:
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=tensor_parallel,
                    pipeline_model_parallel_size=pipeline_parallel,
                    create_gloo_process_groups=False,
                )
                try:
                    yield self
                finally:
                    parallel_state.destroy_model_parallel()
            finally:
                dist.destroy_process_group()


# Megatron's modules that bind collectives to names of their own when imported (the sequence-parallel
# gathers and reduce-scatters: dist_reduce_scatter_func, dist_all_gather_func), out of reach of a patch of
# torch.distributed alone
_BOUND_AT_IMPORT = ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
                    "megatron.core.tensor_parallel.utils")


@contextlib.contextmanager
def _patched_collective(name: str, wrap) -> Iterator[None]:
    """Within it, torch.distributed's `name` is wrap(original) where Megatron's P2P communicator,
    batch_isend_irecv and the callers of torch.distributed look it up (distributed_c10d and
    torch.distributed), and under any name that Megatron's tensor-parallel modules bound it to
    (_BOUND_AT_IMPORT); on exit each of those names holds what it held before."""
    original = getattr(c10d, name)
    patched = wrap(original)
    replaced = [(c10d, name, original), (dist, name, getattr(dist, name))]
    for module in map(importlib.import_module, _BOUND_AT_IMPORT):
        replaced += [(module, attr, value) for attr, value in vars(module).items() if value is original]
    for where, attr, _ in replaced:
        setattr(where, attr, patched)
    try:
        yield
    finally:
        for where, attr, value in reversed(replaced):
            setattr(where, attr, value)


@contextlib.contextmanager
def _filled_receives() -> Iterator[None]:
    """A fake group's receive leaves its buffer as allocated (torch.empty: any bytes, NaN included);
    within it, the buffer is filled with standard normal values first (an integer buffer, such as a
    shape, with zeros). Not zeros: a stage after the first computes on what it receives, and GEMMs on
    zeros run faster than on real values (an H200 bf16 GEMM: 793 TFLOP/s on zeros, 688 on random values)."""
    def filling(original):
        def receive(*args, **kwargs):
            tensor = args[0] if args else kwargs["tensor"]
            with torch.no_grad():
                tensor.normal_() if tensor.is_floating_point() else tensor.zero_()
            return original(*args, **kwargs)
        return receive

    with _patched_collective("recv", filling), _patched_collective("irecv", filling):
        yield


@contextlib.contextmanager
def _own_chunk_reduce_scatter() -> Iterator[None]:
    """Within it, a reduce-scatter writes this rank's own chunk of the input into its output, what a
    reduction over one rank gives. torch's fake group does so on the CPU with torch 2.13; with 2.11 (the
    GPU machine's) it leaves the output as allocated, on the CPU and the GPU alike. Megatron's
    sequence-parallel backward reduce-scatters every layer's input gradient: left as allocated on the
    GPU, those gradients are any bytes, the rehearsed gradient norm is non-finite, and the GEMMs that read
    them run on such bytes, faster than on real values (compute-grid-tp.json's TP 2-8 points are of such
    runs; compute-grid-tp-patched.json's are not). So the output must hold the chunk under either torch."""
    def own_chunk(original):
        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            work = original(output, input, op=op, group=group, async_op=async_op)
            with torch.no_grad():
                me = dist.get_rank(group) if group is not None else dist.get_rank()
                output.view(-1).copy_(input.view(-1)[me * output.numel():(me + 1) * output.numel()])
            return work
        return reduce_scatter_tensor

    with _patched_collective("reduce_scatter_tensor", own_chunk):
        yield
