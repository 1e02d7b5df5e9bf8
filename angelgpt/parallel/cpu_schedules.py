"""Megatron's pipeline schedules (1F1B) on CPU under gloo, without editing Megatron.

Megatron-core's schedules and its P2P communicator are written for CUDA: the schedules allocate their
token counter with ``device="cuda"``, the communicator allocates every receive buffer on
``torch.cuda.current_device()`` and, with ``batch_p2p_comm`` and ``batch_p2p_sync``, calls
``torch.cuda.synchronize()``; the last stage's copy of a tied output weight moves itself with
``.cuda()`` before its first all-reduce (when the model is built). ``on_cpu()`` runs such code on the CPU:

- a ``torch.overrides.TorchFunctionMode`` (a mode of this thread only: ZeRO-Cache's update threads are
  untouched) turns every CUDA device a torch function is given (``device=`` as ``"cuda"``, ``"cuda:N"``,
  ``torch.device("cuda")`` or an index) into the CPU, and ``Tensor.cuda()`` / ``Tensor.to("cuda")`` into
  no move;
- ``torch.cuda.current_device`` answers the CPU and ``torch.cuda.synchronize`` does nothing while it is active
  (module attributes, so for the process; both restored on exit; a CPU-only torch would raise instead).

The model's TransformerConfig on CPU says ``batch_p2p_comm=False`` (one isend/irecv per tensor: gloo
has no batched P2P, and the synchronize goes with it), ``overlap_p2p_comm=False`` and
``deallocate_pipeline_outputs=False``; ``forward_backward_func`` checks them. Receive buffers come out
as fp32 CPU tensors of shape (seq_length, micro_batch_size, hidden_size), the model's
``set_input_tensor`` feeds them to the stage, and the loss exists on the last stage only.

Only the non-interleaved schedule runs here (``virtual_pipeline_model_parallel_size`` is not offered:
the interleaved schedule needs model chunks, which angelgpt does not build). With one stage the loop
keeps its own no-pipelining loop (``angelgpt.train.step.forward_backward_cpu``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare index names a CUDA device
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCPU(TorchFunctionMode):
    """Every CUDA device a torch function is given becomes the CPU; .cuda() moves nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        if "device" in kwargs and kwargs["device"] is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        return func(*args, **kwargs)


_PATCH_LOCK = threading.Lock()
_PATCH = {"depth": 0, "saved": None}


@contextlib.contextmanager
def cuda_answers_cpu():
    """While inside, torch.cuda.current_device answers the CPU device and torch.cuda.synchronize does
    nothing (module attributes, so for the process: the one place angelgpt replaces them). Uses may nest
    (sequence parallelism inside a CPU pipeline): they share one replacement, which the last to leave
    restores. The CPU itself, not an index: torch routes a backward pass outside torch function modes,
    and Megatron's sequence-parallel gathers allocate there with device=torch.cuda.current_device()."""
    with _PATCH_LOCK:
        if _PATCH["depth"] == 0:
            _PATCH["saved"] = torch.cuda.current_device, torch.cuda.synchronize
            torch.cuda.current_device = lambda: torch.device("cpu")
            torch.cuda.synchronize = lambda device=None: None
        _PATCH["depth"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH["depth"] -= 1
            if _PATCH["depth"] == 0:
                torch.cuda.current_device, torch.cuda.synchronize = _PATCH["saved"]


@contextlib.contextmanager
def on_cpu():
    """CUDA allocations, moves and synchronizes of the code run inside become CPU ones (this thread)."""
    with cuda_answers_cpu(), _CudaToCPU():
        yield


def check_config(config) -> None:
    """The TransformerConfig settings the CPU schedule relies on (set by angelgpt.model.gpt on CPU)."""
    wrong = {k: getattr(config, k) for k in ("batch_p2p_comm", "overlap_p2p_comm", "deallocate_pipeline_outputs",
                                              "variable_seq_lengths") if getattr(config, k)}
    if wrong or config.pipeline_dtype != torch.float32:
        raise ValueError(f"the CPU pipeline schedule needs batch_p2p_comm, overlap_p2p_comm, "
                         f"deallocate_pipeline_outputs and variable_seq_lengths off and fp32 stages: {wrong}, "
                         f"pipeline_dtype={config.pipeline_dtype}")


def forward_backward_func() -> Callable:
    """Megatron's forward-backward function for this rank's pipeline (1F1B over PP stages), run on CPU.
    Called as Megatron's: keyword arguments forward_step_func, data_iterator, model, num_microbatches,
    seq_length, micro_batch_size, forward_only; returns the last stage's loss records ([] elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    megatron_func = get_forward_backward_func()

    def run(*, model, **kwargs):
        chunks = model if isinstance(model, list) else [model]
        check_config(get_model_config(chunks[0]))
        with on_cpu():
            return megatron_func(model=chunks, **kwargs)

    return run
