"""DeviceSharing: the interface of an arrangement where the ranks of a node share one GPU.

angelgpt gives each rank its own GPU and an NCCL default group; NCCL refuses two ranks on one GPU. An
object of this interface, passed to the worker (`angelgpt.train.worker.main(sharing=...)`) and from it
to `parallel.initialize` and the training loop, sets up such a process instead: its default group's
backend, this process's GPU and whatever that backend does not carry on CUDA tensors. The worker calls
only these hooks; the object decides what they do.

- `backend`: the default group's backend on GPU (in place of NCCL).
- `process()`: a context entered by `parallel.initialize` before the default group starts and left by
  `parallel.destroy`: it selects this process's GPU and holds whatever process-wide adaptation the
  backend needs, every one undone on exit.
- pipeline sends and receives, when the pipeline group is of that backend and the tensors are on a GPU:
  the loop turns Megatron's batched P2P off, `check_pipeline_config(config)` refuses (ValueError) a
  Megatron model config the adapted sends and receives cannot carry, and `pipeline_p2p()` is held
  around each forward-backward.
"""

from __future__ import annotations

from typing import ContextManager, Protocol


class DeviceSharing(Protocol):
    backend: str

    def process(self) -> ContextManager[None]:
        """This process's GPU and the backend's process-wide adaptations, undone on exit."""

    def check_pipeline_config(self, config) -> None:
        """Raises ValueError when Megatron's model `config` asks for pipeline P2P that pipeline_p2p() cannot
        carry."""

    def pipeline_p2p(self) -> ContextManager[None]:
        """Held around one forward-backward: pipeline sends and receives of CUDA tensors carried."""
