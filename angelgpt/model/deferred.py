"""Transformer layers built on the meta device and materialized one at a time (deferred init).

A rank of a large model cannot always hold all its layers' weights on its GPU at once: 55B at TP 2 is
51 GiB of bf16 weights a rank against an A100's 40 GiB, although ZeRO-Cache keeps most layers' weights
in host memory once training runs. With ``build_gpt(..., defer_layers=True)`` every TransformerLayer is
built as a skeleton whose tensors live on the meta device (shapes and dtypes, no memory); the
embedding, final norm and output layer are built as usual. ZeRO-Cache's store then calls
``materialize(gi)`` for one sub-group at a time, last layer first: a fresh layer of the same spec,
config and layer number is built on the compute device with Megatron's own initialization
(``init_method`` for QKV and FC1, ``output_layer_init_method`` for the projections, zero biases, unit
norms, under Megatron's model-parallel RNG tracker), its tensors become the skeleton's, the store
copies what the rank owns into its chunks and releases the layer if it is offloaded. So the device
never holds more than the resident layers and one offloaded layer.

The fresh layer is angelgpt's seeded layer (its full weights drawn on ``device`` from the seed and its
global layer number, the rank's tensor-parallel slice kept), so a deferred build equals an ordinary one
exactly, on the CPU and on a GPU; the RNG states are kept around each materialization.

    model = build_gpt(cfg, on_gpu, defer_layers=True)          # layers on 'meta'
    opt = ZeroCacheOptimizer(model, cfg, device, ...)           # materializes them one by one
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
from torch.overrides import TorchFunctionMode

_META = torch.device("meta")


class _OnMeta(TorchFunctionMode):
    """Every device a torch function is given becomes the meta device; .cuda()/.to(device) move nothing.
    (Calls without a device go to the meta device by torch.device('meta') as the default device.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.cpu:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple(a for a in args if not isinstance(a, (torch.device, str, int)) or isinstance(a, bool))
            kwargs.pop("device", None)
        elif kwargs.get("device") is not None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


def deferred_layer(base: type) -> type:
    """A subclass of the layer class ``base`` whose instances are built on the meta device and know how to
    build their real selves (``materialize()``)."""

    class DeferredTransformerLayer(base):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            with torch.device(_META), _OnMeta():
                super().__init__(config, submodules, layer_number, *args, **kwargs)
            self._angelgpt_build = (config, submodules, layer_number, args, kwargs)

        @property
        def is_meta(self) -> bool:
            return any(p.is_meta for p in self.parameters())

        def materialize(self, device: torch.device) -> None:
            """This layer's tensors replaced by those of a fresh, initialised layer of the same build on
            ``device`` (its parameters stay the same Python objects: the references others hold stay valid)."""
            config, submodules, layer_number, args, kwargs = self._angelgpt_build
            # the generators as the ordinary build leaves them; the layer drawn on the device it goes to
            gpus = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=gpus), device:
                fresh = base(config, submodules, layer_number, *args, **kwargs)
            # swapped, not assigned: a meta tensor cannot take another device's data, and the store, its
            # hooks and the optimizer hold these very parameter objects
            # in the skeleton's dtypes: a wrapper (Megatron's Float16Module) may have cast the model after it
            # was built, norms included, and the fresh layer is built as the spec builds it
            mine = dict(self.named_parameters())
            for name, q in fresh.named_parameters():
                q.data = q.data.to(mine[name].dtype)
                torch.utils.swap_tensors(mine[name], q)
            bufs = dict(self.named_buffers())
            for name, b in fresh.named_buffers():
                b.data = b.data.to(bufs[name].dtype)
                torch.utils.swap_tensors(bufs[name], b)
            del fresh

    return DeferredTransformerLayer


def deferred_layers(model: torch.nn.Module) -> Dict[int, torch.nn.Module]:
    """id(parameter) -> the deferred layer holding it, for every deferred layer of the model."""
    return {id(p): m for m in model.modules() if hasattr(m, "_angelgpt_build") for p in m.parameters()}


def materializer(model: torch.nn.Module, device: torch.device) -> Callable[[List[torch.nn.Parameter]], None]:
    """materialize(params): the deferred layers holding any of ``params`` made real on ``device`` (a no-op
    for parameters of no deferred layer, or once their layer is real). ZeRO-Cache's store calls it with
    one sub-group's parameters at a time."""
    owners = deferred_layers(model)

    def materialize(params: List[torch.nn.Parameter]) -> None:
        seen = set()
        for p in params:
            layer = owners.get(id(p))
            if layer is not None and id(layer) not in seen:
                seen.add(id(layer))
                if layer.is_meta:
                    layer.materialize(device)

    return materialize
