"""Sequence parallelism's gradients for optimizers that keep gradients in ``param.grad``.

With ``parallel.sequence_parallel`` the layers' inputs, norms and dropout work on this rank's slice of
the sequence (Megatron's meaning). The norms' weights and biases (and the row-parallel linears' biases,
which Megatron marks alike) are replicated on every TP rank but each rank's gradient covers only its own
tokens: before the data-parallel step they are summed over the TP group, as Megatron's
``finalize_model_grads`` does for its own optimizer (``_allreduce_non_tensor_model_parallel_grads``
for parameters marked ``sequence_parallel``). Summed, they are equal on every TP rank, and a global
gradient norm counts them once (``param_is_not_tensor_parallel_duplicate``: TP rank 0 only).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def sequence_parallel_params(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """The parameters marked ``sequence_parallel`` (True only while sequence parallelism is on)."""
    return [p for p in params if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Sums, in place over the TP group, the gradients of the parameters marked ``sequence_parallel``
    (one all-reduce; a parameter without a gradient contributes zeros). A no-op with TP 1 or none marked.
    Every TP rank must call it with the same parameters in the same order."""
    marked = sequence_parallel_params(params)
    group = parallel_state.get_tensor_model_parallel_group()
    if not marked or group.size() == 1:
        return
    for p in marked:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in marked]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


@contextlib.contextmanager
def cpu_sequence_parallel():
    """Runs Megatron's sequence-parallel communication on CPU tensors. Its gathers and reduce-scatters
    along the sequence (tensor_parallel.mappings, the linear layers' backward, its global memory buffer)
    allocate their outputs with ``device=torch.cuda.current_device()``, in forward and in backward; while
    this is active that answers the CPU device (cpu_schedules.cuda_answers_cpu, restored on exit). A
    replacement of the function rather than a torch function mode: torch runs ``backward`` outside the
    modes that dispatch it."""
    from angelgpt.parallel.cpu_schedules import cuda_answers_cpu

    with cuda_answers_cpu():
        yield
