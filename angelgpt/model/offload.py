"""Activation offload (model.activation_offload 'checkpoints'): the inputs that full recompute keeps of
each recomputed layer, which Megatron's CheckpointFunction saves for that layer's backward, go to pinned
host memory as the forward saves them and come back when the layer's backward recomputes it.

`offloading(model, mode)` is the context forward_step runs the model's forward in (one per micro batch):
a saved_tensors_hooks pair whose pack copies a tensor to host memory as
torch.autograd.graph.save_on_cpu(pin_memory=True) does (a pinned buffer, an asynchronous copy on the
current stream) and whose unpack copies it back the same way; every other saved tensor passes through
untouched. The recomputed forward in backward runs outside the context, so what it saves stays on the
GPU. The copies run on the compute stream, in its order: the planner counts their time as exposed.

Which tensors (mode 'checkpoints'): while Megatron's checkpointing runs a TransformerLayer
(tensor_parallel.random.IS_CHECKPOINTING), a forward pre-hook notes the layer's hidden_states;
CheckpointFunction saves exactly those tensors once its forward returns, and the pack hook moves the
tensors noted (the same objects). The final norm, the output layer and the cross entropy keep theirs on
the GPU.

Mode 'everything' (the CPU stand-in: Megatron's checkpointing needs CUDA, so on CPU no layer recomputes):
every tensor the forward saves is copied into a buffer of its own in host memory and back, so the pack
and unpack path runs on CPU and tests compare it against training without it.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Optional

import torch


def offload_mode(activation_offload: str, on_gpu: bool) -> Optional[str]:
    """What forward_step offloads for model.activation_offload as resolved: None (nothing),
    'checkpoints' (on GPU) or 'everything' (the CPU stand-in)."""
    if activation_offload != "checkpoints":
        return None
    return "checkpoints" if on_gpu else "everything"


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks of one forward; `moved` and `moved_bytes` count what went to the host."""

    def __init__(self, model, mode: str):
        if mode not in ("checkpoints", "everything"):
            raise ValueError(f"offload mode must be 'checkpoints' or 'everything', got '{mode}'")
        self.mode = mode
        self.moved = 0
        self.moved_bytes = 0
        self._noted = {}  # id -> weakref of the hidden_states of layers run under checkpointing
        self._layers = _transformer_layers(model) if mode == "checkpoints" else []
        self._handles = []
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._handles = [layer.register_forward_pre_hook(self._note, with_kwargs=True) for layer in self._layers]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles, self._noted = [], {}
        return super().__exit__(*exc)

    def _note(self, module, args, kwargs):
        from megatron.core.tensor_parallel import random as tp_random

        if tp_random.IS_CHECKPOINTING:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(hidden, torch.Tensor):
                self._noted[id(hidden)] = weakref.ref(hidden)

    def _selected(self, tensor: torch.Tensor) -> bool:
        if self.mode == "everything":
            return True
        ref = self._noted.pop(id(tensor), None)
        return ref is not None and ref() is tensor

    def _pack(self, tensor: torch.Tensor):
        if not self._selected(tensor):
            return False, tensor
        pin = tensor.is_cuda
        with torch.no_grad():
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor.detach(), non_blocking=pin)
        self.moved += 1
        self.moved_bytes += tensor.numel() * tensor.element_size()
        return True, (tensor.device, host)

    @staticmethod
    def _unpack(packed):
        moved, value = packed
        if not moved:
            return value
        device, host = value
        return host.to(device, non_blocking=host.is_pinned())


def _transformer_layers(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    models = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in models for m in chunk.modules() if isinstance(m, TransformerLayer)]


def offloading(model, mode: Optional[str]):
    """The context of one forward: ActivationOffload(model, mode), or nothing when mode is None."""
    return ActivationOffload(model, mode) if mode else nullcontext()
