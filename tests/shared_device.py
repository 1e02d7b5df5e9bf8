"""SharedDevice: several ranks on one GPU, for tests (a multi-rank layout where one GPU is lent); an
implementation of angelgpt.parallel.DeviceSharing, passed to the worker by tests/gpu/shared_gpu_worker.py.

NCCL refuses two ranks on one GPU, so under ``SharedDevice`` every rank sets GPU 0 and the default
group is gloo, which carries all-reduce, reduce-scatter and all-gather of CUDA tensors. Two things gloo
does not carry on CUDA tensors are adapted here, and only here, for such a process:

- pipeline sends and receives (Megatron's P2P communicator): inside ``pipeline_p2p()`` a send copies its
  tensor into host memory and sends the copy, and a receive receives into a host buffer that its
  ``wait()`` copies into the CUDA tensor Megatron gave. It holds only while the schedule runs (the loop
  enters it around Megatron's forward-backward function), one schedule at a time, and changes only
  ``torch.distributed.isend`` and ``irecv``, which Megatron calls one tensor at a time when the model
  config says ``batch_p2p_comm=False`` (``check_pipeline_config``);
- coalesced collectives: Megatron's gradient buffer groups its buckets' reduce-scatters and all-gathers
  under ``torch.distributed._coalescing_manager``, whose end crashes the process (SIGSEGV) for gloo on
  CUDA tensors (seen on the H200 with torch 2.11). Inside ``process()`` (from parallel.initialize to
  parallel.destroy) Megatron's buffer module holds a manager that lets each collective run as issued
  (synchronously: angelgpt does not overlap them); its own is back on exit.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

_LOCK = threading.Lock()


@dataclass(frozen=True)
class SharedDevice:
    """Every rank of the node on one GPU, under a gloo default group (parallel.initialize)."""

    device: int = 0
    backend: str = "gloo"

    @contextlib.contextmanager
    def process(self):
        """This process's GPU, and Megatron's collectives issued one by one while inside (uncoalesced)."""
        torch.cuda.set_device(self.device)
        with uncoalesced():
            yield

    def check_pipeline_config(self, config) -> None:
        """Megatron sends one tensor at a time only with batch_p2p_comm and overlap_p2p_comm off."""
        if config.batch_p2p_comm or config.overlap_p2p_comm:
            raise ValueError("host-staged pipeline P2P needs batch_p2p_comm and overlap_p2p_comm off")

    def pipeline_p2p(self):
        return host_staged()


class _Staged:
    """A send or receive in flight; wait() ends it (a receive then copies into the CUDA tensor)."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor = None):
        self.work, self.host, self.target = work, host, target

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        if self.target is not None:
            with torch.no_grad():  # the receive buffer of an activation requires grad
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


class _Issued:
    """What a coalescing manager hands back: the collectives already ran, so waiting has nothing to do."""

    def wait(self, timeout=None) -> bool:
        return True


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    yield _Issued()


@contextlib.contextmanager
def uncoalesced():
    """Inside, Megatron's gradient buffer issues its buckets' collectives one by one (see the module's
    docstring); its own coalescing manager is back on exit."""
    from megatron.core.distributed import param_and_grad_buffer

    saved = param_and_grad_buffer._coalescing_manager
    param_and_grad_buffer._coalescing_manager = _one_by_one
    try:
        yield
    finally:
        param_and_grad_buffer._coalescing_manager = saved
