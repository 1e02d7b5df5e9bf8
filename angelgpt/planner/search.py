"""The 'auto' search: which recompute, activation offload, accumulate_in_store, offload_params and
prefetch rate to plan with, found by planning the concrete configs each could become and picking.

settle_recompute and settle_store take the config and a function that plans a config (`plan_fn`),
plan the concrete configs their 'auto' settings could become with it and return the plan picked;
best_rate takes a function that plans at a rate. The entry points in planner.plan compose them,
outermost first: recompute and activation offload (every system), then ZeRO-Cache's store settings,
then its rate. Nothing here plans a system itself: no module of the planner's systems imports this one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, List, Optional

from angelgpt.config import Config
from angelgpt.planner.systemplan import SystemPlan, shortfall
from angelgpt.planner.zero_cache import offload_params_on, stream_held_bytes

PlanFn = Callable[[Config], SystemPlan]


def pick(plans: List[SystemPlan]) -> SystemPlan:
    """Of the plans for each choice, the fastest that fits (the first on a tie), else the one closest to
    fitting (least short of, the first on a tie)."""
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: p.step_time_s) if fitting else min(plans, key=shortfall)


def settle_recompute(cfg: Config, plan_fn: PlanFn) -> SystemPlan:
    """With model.recompute 'auto', the fastest plan that fits of: no recompute, and full recompute of
    the first k layers per stage (the rest keep their activations), k from all layers down while the
    plans fit (fewer recomputed layers need more memory); otherwise plan_fn's plan as configured. A
    layer kept saves its recompute on every micro batch but takes GPU memory that the states or the
    weights would have had. With model.activation_offload 'auto', each recomputing choice is planned
    with its kept inputs on the GPU and offloaded (on the GPU first, so a tie keeps them), and the pick
    is among all of those; without recompute there is nothing to offload."""
    m = cfg.model
    if m.recompute != "auto" and m.activation_offload != "auto":
        return plan_fn(cfg)
    offloads = ("none", "checkpoints") if m.activation_offload == "auto" else (m.activation_offload,)

    def with_(recompute, k, offload):
        return plan_fn(replace(cfg, model=replace(m, recompute=recompute, recompute_num_layers=k,
                                                  activation_offload=offload)))

    if m.recompute == "full":
        return pick([with_("full", m.recompute_num_layers, o) for o in offloads])
    plans = [with_("none", None, "none" if m.activation_offload == "auto" else m.activation_offload)]
    if m.recompute == "none":
        return plans[0]
    per_stage = m.num_layers // cfg.parallel.pipeline_model_parallel_size
    for k in range(per_stage, 0, -1):
        ps = [with_("full", None if k == per_stage else k, o) for o in offloads]
        if not any(p.fits for p in ps) and k < per_stage:
            break
        plans += ps
    return pick(plans)


def settle_store(cfg: Config, dp: int, plan_fn: PlanFn) -> SystemPlan:
    """ZeRO-Cache's store settings: accumulate_in_store 'auto' planned each way it can go (gradients added
    up on the GPU, in the store) and the pick of those taken; in each, offload_params 'auto' refined where
    it needs to be (_settle_offload_params). plan_fn's plan of the config as it is where neither is to
    settle."""
    choices = _accumulation_choices(cfg, dp)
    if choices:
        return pick([_settle_offload_params(c, dp, plan_fn) for c in choices])
    return _settle_offload_params(cfg, dp, plan_fn)


def _accumulation_choices(cfg: Config, dp: int):
    """With accumulate_in_store 'auto' and several micro batches per step, the two configs to plan:
    gradients added up on the GPU, and in the store. None when there is no choice to make."""
    zc = cfg.zero_cache
    if zc.accumulate_in_store != "auto":
        return None
    if cfg.num_microbatches(dp) <= 1:
        return [replace(cfg, zero_cache=replace(zc, accumulate_in_store=False))]
    return [replace(cfg, zero_cache=replace(zc, accumulate_in_store=v)) for v in (False, True)]


def _settle_offload_params(cfg: Config, dp: int, plan_fn: PlanFn) -> SystemPlan:
    """offload_params 'auto' refined (_resident_first): the weights resident if that fits, else the pick
    of resident and offloaded; plan_fn's plan of the config as it is where there is nothing to refine."""
    tries = _resident_first(cfg, dp)
    if not tries:
        return plan_fn(cfg)
    resident = plan_fn(tries[0])
    return resident if resident.fits else pick([resident, plan_fn(tries[1])])


def _resident_first(cfg: Config, dp: int) -> Optional[List[Config]]:
    """With 'auto' offload_params, full recompute and micro batches accumulating in the store, the
    configs to try in order: weights resident first, offloaded only if that does not fit. Offloaded
    weights are fetched again for every micro batch on the link that carries the running sums
    (measured at 19 layers, 16 micro batches: 757 GB up per step, 245 model TFLOP/s offloaded against
    285 resident: accumulate-L19-offloaded-weights.json against peers-zero_cache-L19-mb2-gb32.json).
    None when 'auto' needs no refining."""
    zc = cfg.zero_cache
    if zc.offload_params != "auto" or not offload_params_on(cfg) or not (
            zc.accumulate_in_store is True and cfg.num_microbatches(dp) > 1):
        return None
    return [replace(cfg, zero_cache=replace(zc, offload_params=v)) for v in (False, True)]


def best_rate(cfg: Config, dp: int, plan_at: Callable[[float], SystemPlan]) -> SystemPlan:
    """ZeRO-Cache's prefetch_cache_sub_group_rate 'auto', plan_at(rate) planning cfg at a rate: the largest
    rate (in steps of 0.01) that fits and leaves the transfer streams their room (stream_held_bytes),
    else the largest that fits; states on GPU are updated 30x faster than on the CPU and cross no PCIe,
    so more on the GPU is faster while it fits. Where no rate fits, the one closest to fitting (least
    short of; the largest on a tie), so that the plan and a refusal say how far the configuration is
    from fitting rather than how far its smallest rate is."""
    room = stream_held_bytes(cfg, dp)
    fitting = None  # the largest rate that fits, taken when no rate leaves the transfer streams their room
    closest = None
    for i in range(100, -1, -1):
        p = plan_at(i / 100)
        if p.fits and p.margin["gpu"] >= room:
            return p
        if p.fits:
            fitting = fitting or p
        elif fitting:  # below the rates that fit: lower ones only move more states off the device
            break
        if closest is None or shortfall(p) < shortfall(closest):
            closest = p
    return fitting or closest
