"""Resolution: a config whose 'auto' settings become concrete values for one machine, decided once.

Owns `resolve_config` (the one place where every 'auto' of a config is settled: the launcher calls it
with its reading of the machine and writes the ResolvedConfig it returns as the run config the workers
build from) and `resolved_line` (the line that says what was settled). The choices are the memory and
time model's (planner.plan, searched by planner.search) for the machine given; the machine's figures
are used as given (planner.machines).
Torch-free: it looks for a C compiler without running it.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import List, Optional, Tuple

from angelgpt.config import Config, ConfigError, ResolvedConfig
from angelgpt.planner.machines import Machine
from angelgpt.planner.plan import plan_for
from angelgpt.planner.systemplan import SystemPlan
from angelgpt.planner.zero_cache import device_update_fraction, offload_params_on, remainders_on
from angelgpt.system import c_compiler


def _transformer_impl(impl: str) -> str:
    """model.transformer_impl 'auto': the local spec (Megatron's local layers with angelgpt's SDPA core
    attention), on GPU too, whether or not transformer-engine is installed. That is the path angelgpt's
    tests run; transformer-engine (its torch extension ships only as a source distribution that builds
    against CUDA) has not been run by them, so it is an explicit opt-in: 'transformer_engine'."""
    return "local" if impl == "auto" else impl


def resolve_config(cfg: Config, machine: Machine, gpus_per_node: int, nodes: int,
                   on_gpu: bool) -> Tuple[ResolvedConfig, Optional[SystemPlan]]:
    """The config with every 'auto' made a value for `machine` (gpus_per_node GPUs on each of `nodes`),
    and the plan of that resolved config (None on CPU). Values already concrete are kept, so resolving a
    resolved config returns it unchanged. What each 'auto' becomes:

    train.device: 'cuda' on GPU, else 'cpu' (a concrete device that disagrees with on_gpu is an error).
    model.transformer_impl: 'local' (transformer-engine only when asked for by name).
    zero_cache.cpu_adam: 'native' where the kernel's C compiler is found ($CC, cc or gcc), else 'torch';
      decided first, as the planner's host update rate depends on it.
    optim.store_param_remainders: on for ZeRO-Cache on a GPU (a bf16 model), else off; decided before
      the plan, as it sets the bytes a parameter.
    On GPU, the plan of the configured optimizer for this machine (plan_for) decides:
      model.recompute and model.recompute_num_layers: the fastest choice that fits (else the closest);
      model.activation_offload: with that choice, 'checkpoints' where offloading the recomputed layers'
      kept inputs is what fits or is faster, else 'none';
      zero_cache (optimizer zero_cache): prefetch_cache_sub_group_rate, offload_params and
      accumulate_in_store as that plan placed them, device_update_fraction the split of the host update
      by the rates of its two paths (zero_cache.device_update_fraction).
    On CPU: model.recompute 'none' (full recompute needs CUDA) and model.activation_offload 'none'.
    parallel.sequence_parallel (not an 'auto', but settled here too): off with TP 1, where there is no
      group to split the sequence over; resolved_line says so.
    zero_cache's settings that are still 'auto' (on CPU, or with another optimizer, which ignores them):
      rate 1.0 (every state on the device), offload_params on only with every layer recomputed,
      device_update_fraction 0.0, accumulate_in_store off.
    """
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if on_gpu else "cpu"
    elif (device == "cuda") != on_gpu:
        raise ConfigError(f"train.device is '{device}' but the config is being resolved for "
                          f"{'a GPU' if on_gpu else 'the CPU'}")
    zc, o = cfg.zero_cache, cfg.optim
    cpu_adam = zc.cpu_adam if zc.cpu_adam != "auto" else ("native" if c_compiler() else "torch")
    # before the plan: it sets the bytes a parameter
    o = replace(o, store_param_remainders=remainders_on(o, o.spec.supports_compact_states and on_gpu))
    cfg = replace(cfg, train=replace(cfg.train, device=device), optim=o,
                  model=replace(cfg.model, transformer_impl=_transformer_impl(cfg.model.transformer_impl)),
                  zero_cache=replace(zc, cpu_adam=cpu_adam))
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1:
        cfg = replace(cfg, parallel=replace(cfg.parallel, sequence_parallel=False))
    m, zc = cfg.model, cfg.zero_cache
    if on_gpu:
        chosen = plan_for(cfg, machine, gpus_per_node, nodes)
        if m.recompute == "auto":
            m = replace(m, recompute=chosen.recompute, recompute_num_layers=chosen.recompute_num_layers)
        if m.activation_offload == "auto":
            m = replace(m, activation_offload=chosen.activation_offload)
        cfg = replace(cfg, model=m)
        if cfg.optim.spec.uses_zero_cache_settings:
            cfg = replace(cfg, zero_cache=replace(
                zc,
                prefetch_cache_sub_group_rate=chosen.rate if zc.prefetch_cache_sub_group_rate == "auto"
                else zc.prefetch_cache_sub_group_rate,
                offload_params=chosen.offload_params if zc.offload_params == "auto" else zc.offload_params,
                accumulate_in_store=bool(chosen.accumulate_in_store) if zc.accumulate_in_store == "auto"
                else zc.accumulate_in_store,
                device_update_fraction=device_update_fraction(cfg, machine, gpus_per_node, nodes)))
    else:
        if m.recompute == "auto":
            m = replace(m, recompute="none", recompute_num_layers=None)
        if m.activation_offload == "auto":
            m = replace(m, activation_offload="none")
        cfg = replace(cfg, model=m)
    zc = cfg.zero_cache
    rate, frac = zc.prefetch_cache_sub_group_rate, zc.device_update_fraction
    cfg = replace(cfg, zero_cache=replace(
        zc,
        prefetch_cache_sub_group_rate=1.0 if rate == "auto" else rate,
        offload_params=offload_params_on(cfg),
        device_update_fraction=0.0 if frac == "auto" else frac,
        accumulate_in_store=zc.accumulate_in_store is True))
    resolved = ResolvedConfig.from_config(cfg)
    return resolved, (plan_for(resolved, machine, gpus_per_node, nodes) if on_gpu else None)


def _text(value) -> str:
    """A value as a KEY=VALUE override would give it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def resolved_line(before: Config, after: ResolvedConfig) -> str:
    """'resolved: section.key=value, ...' for each setting that was 'auto' in `before` (with
    model.recompute, the recompute_num_layers chosen with it), in the config's order, then
    parallel.sequence_parallel when it was turned off (TP 1); '' when none was."""
    parts: List[str] = []
    for section in fields(before):
        b, a = getattr(before, section.name), getattr(after, section.name)
        if not is_dataclass(b):
            continue
        for f in fields(b):
            if getattr(b, f.name) != "auto":
                continue
            parts.append(f"{section.name}.{f.name}={_text(getattr(a, f.name))}")
            if (section.name, f.name) == ("model", "recompute") and (
                    a.recompute_num_layers is not None or b.recompute_num_layers is not None):
                parts.append(f"model.recompute_num_layers={_text(a.recompute_num_layers)}")
    if before.parallel.sequence_parallel and not after.parallel.sequence_parallel:
        parts.append("parallel.sequence_parallel=false (tensor_model_parallel_size 1: no group to split the "
                     "sequence over)")
    return "resolved: " + ", ".join(parts) if parts else ""
