"""Pipeline sends and receives of CUDA tensors over a gloo group, through host memory.

gloo carries all-reduce, reduce-scatter and all-gather of CUDA tensors but not send and receive, which
Megatron's P2P communicator issues for every activation and gradient between pipeline stages. With
several ranks on one GPU (``parallel.SharedDevice``: NCCL refuses two ranks on one GPU) the pipeline
still runs: inside ``host_staged()`` a send copies its tensor into host memory and sends the copy, and a
receive receives into a host buffer that its ``wait()`` copies into the CUDA tensor Megatron gave.

The replacement is contained: it holds only while the schedule runs (the loop enters it around
Megatron's forward-backward function), one schedule at a time (a lock), and only
``torch.distributed.isend`` and ``irecv`` change, which Megatron's communicator calls one tensor at a
time when the model config says ``batch_p2p_comm=False`` (``check_config``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

_LOCK = threading.Lock()


class _Staged:
    """A send or receive in flight; wait() ends it (a receive then copies into the CUDA tensor)."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor = None):
        self.work, self.host, self.target = work, host, target

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        if self.target is not None:
            self.target.copy_(self.host)
            self.target = None
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.target is None


def _staging(isend, irecv):
    def send(tensor, dst=None, group=None, tag=0, **kwargs):
        if not tensor.is_cuda:
            return isend(tensor, dst, group, tag, **kwargs)
        host = tensor.detach().to("cpu")
        return _Staged(isend(host, dst, group, tag, **kwargs), host)

    def recv(tensor, src=None, group=None, tag=0, **kwargs):
        if not tensor.is_cuda:
            return irecv(tensor, src, group, tag, **kwargs)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        return _Staged(irecv(host, src, group, tag, **kwargs), host, tensor)

    return send, recv


def check_config(config) -> None:
    """Megatron sends one tensor at a time only with batch_p2p_comm and overlap_p2p_comm off."""
    if config.batch_p2p_comm or config.overlap_p2p_comm:
        raise ValueError("host-staged pipeline P2P needs batch_p2p_comm and overlap_p2p_comm off")


@contextlib.contextmanager
def host_staged():
    """torch.distributed.isend/irecv of CUDA tensors staged through host memory while inside."""
    with _LOCK:
        saved = dist.isend, dist.irecv
        dist.isend, dist.irecv = _staging(*saved)
        try:
            yield
        finally:
            dist.isend, dist.irecv = saved


def needs_staging(on_gpu: bool) -> bool:
    """Whether this rank's pipeline group is gloo while its tensors live on a GPU."""
    from megatron.core import parallel_state

    return (on_gpu and parallel_state.get_pipeline_model_parallel_world_size() > 1
            and dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo")
