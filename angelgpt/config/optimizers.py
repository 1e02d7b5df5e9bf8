"""The optimizer registry: one `OptimizerSpec` per value of `optim.optimizer` (in the spirit of
torchtitan's TrainSpec registry), holding what the config checks, the planner, the launcher, the worker
and the rehearsal ask of an optimizer. Nothing outside this module compares optimizer names; each asks
the spec for the fact it branches on.

    from angelgpt.config import optimizers
    spec = optimizers.get(cfg.optim.optimizer)      # ConfigError naming the registered ones if unknown
    model, optimizer = spec.builder()(model, cfg, on_gpu, deferred=False, beside_store_bytes=0, rehearsal=False)

A module named in `optim.custom_import` is imported before the name is checked, so it may `register` an
optimizer of its own (tests/toy_optimizer.py registers one). The registry lives in the config package,
the lowest one, because the schema checks names against it: a spec names its build function as
"module:function", imported when the worker first builds, so this module imports nothing above it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Union

from angelgpt.config.errors import ConfigError


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    """The value of optim.optimizer that selects it."""
    build: Union[str, Callable]
    """The worker's call, or "module:function" naming it: build(model, cfg, on_gpu, *, deferred,
    beside_store_bytes, rehearsal) -> (model, optimizer). `model` is the rank's GPT model (in Megatron's
    Float16Module on GPU; its layers on the meta device where `deferred`); the model returned is the one
    trained (the same, or wrapped, e.g. in Megatron's DDP); the optimizer keeps the contract of
    angelgpt.optimizer.base.Optimizer. `beside_store_bytes`: GPU bytes the planner sets aside beside an
    optimizer's own store; `rehearsal`: the rank runs alone under fake collectives (no gloo groups)."""
    description: str = ""
    """What it is, in a few words (said where a device refuses it)."""
    runs_on_cpu: bool = True
    """Trains with train.device 'cpu'."""
    runs_on_gpu: bool = True
    """Trains with train.device 'cuda'."""
    defers_layer_init: bool = False
    """On GPU its layers are built on the meta device and made real one at a time as it places them
    (angelgpt.model.deferred; not with transformer-engine's layer spec)."""
    uses_zero_cache_settings: bool = False
    """The zero_cache section configures it: the planner settles that section's 'auto' fields from its
    plan, zero_cache.accumulate_in_store moves micro batches' gradients off the GPU, and a rehearsal
    reports the settled fields and its host budget."""
    planner_system: Optional[str] = None
    """The planner system (angelgpt.planner.plan) that models its memory and step time on GPU; None:
    the planner has no model of it (it then runs on CPU only)."""
    supports_compact_states: bool = False
    """Honours optim.store_param_remainders and 16/8-bit moments (optim.exp_avg_dtype,
    exp_avg_sq_dtype); 'auto' store_param_remainders is on for it on a GPU."""
    gathers_states_to_save_fully_reshardable: bool = False
    """Saving with checkpoint.dist_ckpt_optim_fully_reshardable, each rank gathers its data-parallel
    group's states into host memory (Megatron's distributed optimizer): the planner counts them."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables the launcher sets for its workers unless the user's environment has them."""
    needs_several_cuda_work_queues: bool = False
    """Its transfer streams need more than one CUDA hardware work queue: the launcher warns when the
    user's environment sets CUDA_DEVICE_MAX_CONNECTIONS=1."""

    def builder(self) -> Callable:
        """The build function (imported here when named by "module:function")."""
        if callable(self.build):
            return self.build
        module, _, function = self.build.partition(":")
        return getattr(importlib.import_module(module), function)


_REGISTRY: Dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Adds an optimizer under spec.name; the same spec again is a no-op, another under a taken name
    is refused."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ConfigError(f"optimizer '{spec.name}' is registered already")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> List[str]:
    return list(_REGISTRY)


def get(name: str) -> OptimizerSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        quoted = [f"'{n}'" for n in _REGISTRY]
        listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        raise ConfigError(f"optim.optimizer must be {listed}, got '{name}'")
    return spec


def import_custom(modules: List[str]) -> None:
    """Imports each module named in optim.custom_import (which may register optimizers); one that does
    not import is refused in one line."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the user's input
            raise ConfigError(f"optim.custom_import: cannot import '{module}': {type(exc).__name__}: {exc}") from None


# Megatron's launch scripts use one CUDA hardware work queue
_ONE_QUEUE = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

register(OptimizerSpec(
    name="megatron", build="angelgpt.optimizer.build:build_megatron",
    description="Megatron's distributed optimizer; on CPU its math in angelgpt's data-parallel AdamW",
    planner_system="megatron", gathers_states_to_save_fully_reshardable=True, env=_ONE_QUEUE))
register(OptimizerSpec(
    name="megatron_cpu_offload", build="angelgpt.optimizer.build:build_megatron_cpu_offload",
    description="Megatron's HybridDeviceOptimizer", runs_on_cpu=False, planner_system="megatron_cpu_offload",
    gathers_states_to_save_fully_reshardable=True, env=_ONE_QUEUE))
register(OptimizerSpec(
    name="zero_cache", build="angelgpt.optimizer.build:build_zero_cache",
    description="ZeRO-Cache's GPU + CPU + NVMe state store", defers_layer_init=True,
    uses_zero_cache_settings=True, planner_system="zero_cache", supports_compact_states=True,
    needs_several_cuda_work_queues=True))
