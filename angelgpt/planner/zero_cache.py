"""ZeRO-Cache's plan for one rank at a given rate (the search settles the other 'auto's first): its store
as the optimizer places it (rank_tier_bytes), memory and step; how it reads its own 'auto' settings.

Memory (bytes per rank). GPU: the model's weights in the model dtype (every rank holds its TP/PP shard
whole, less the layers whose weights are offloaded), the gradients in flight (the sub-groups between
their backward and their offload, at most a few layers) and the offloaded layers' weights fetched, as
the optimizer reserves them (placement.training_reserve), the device-tier chunks exactly as ZeRO-Cache
allocates them (placement.tier_bytes), activations (memory.activation_bytes) and a fixed workspace.
Host: the host-tier chunks exactly as allocated, the two pinned upload buffers, the offloaded
activations, and the process. NVMe: the NVMe-tier chunks.
Time: gradient D2H hides behind the last micro batch's backward, the CPU update and the H2D upload
behind the next step's first micro batch forward (the pipelined optimizer), NVMe I/O runs beside the CPU
update, the DP collectives (reduce-scatter in backward, all-gather in forward) on the network.
"""

from __future__ import annotations

from dataclasses import replace

from angelgpt.config import Config
from angelgpt.model.flops import recomputed_layers
from angelgpt.planner.calibration import (CUDA_CONTEXT, GIB, HOST_PROCESS, IN_STORE_TRIP_HIDDEN, MODEL_BYTES,
                                          PCIE_DUPLEX_SHARE, STREAM_HELD_LAYERS, WORKSPACE)
from angelgpt.planner.layout import chunk_numels, rank_params
from angelgpt.planner.machines import Machine
from angelgpt.planner.memory import (accumulating, activation_bytes, grad_bytes, micro_batches_in_flight,
                                     offloaded_activation_bytes, sub_group_numels)
from angelgpt.planner.systemplan import SystemPlan, finish, world_and_dp
from angelgpt.planner.timing import compute_s, forward_share, host_update_rates
from angelgpt.zero_cache.placement import place, prefetch_depth, state_bytes, training_reserve, upload_buffers


def _fetch_depth(cfg: Config, layer_numel: int) -> int:
    """Offloaded layers ZeRO-Cache prefetches ahead of the running one, from the zero_cache knobs."""
    zc = cfg.zero_cache
    return prefetch_depth(layer_numel, zc.prefetch_bucket_size, zc.max_live_parameters,
                          zc.max_contigous_params_size, MODEL_BYTES)


def offload_params_on(cfg: Config) -> bool:
    """zero_cache.offload_params with 'auto' read as: on when every layer recomputes (a layer's weights
    are then needed only while it runs; a layer that keeps its activations keeps its weights too).
    The search refines 'auto' when micro batches accumulate in the store (search.settle_store)."""
    op = cfg.zero_cache.offload_params
    return op if op != "auto" else recomputed_layers(cfg) == cfg.model.num_layers > 0


def device_update_fraction(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int = 1) -> float:
    """zero_cache.device_update_fraction, 'auto' resolved so that the device path and the CPU beside it
    finish their shares of the host update together."""
    frac = cfg.zero_cache.device_update_fraction
    if frac != "auto":
        return float(frac)
    _, cpu_rate, device_rate = update_rates(cfg, hw, gpus_per_node, nodes)
    return round(device_rate / (device_rate + cpu_rate), 2)


def update_rates(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int):
    """The host update's rates (timing.host_update_rates) for the config's states: the CPU's path for its
    moments, the device path for the bytes a parameter it moves (the gradient sum up, the states up and
    back down; the weight stays on the GPU)."""
    moved = grad_bytes(cfg, world_and_dp(cfg, gpus_per_node, nodes)[1]) + 2 * states_per_element(cfg)[1]
    return host_update_rates(hw, gpus_per_node, cfg.zero_cache.cpu_adam, fp8_moments(cfg), moved)


def fp8_moments(cfg: Config) -> bool:
    """Is a moment kept in fp8 (the host update's slower path)?"""
    return "fp8" in (cfg.optim.exp_avg_dtype, cfg.optim.exp_avg_sq_dtype)


def remainders_on(optim, zero_cache_on_gpu: bool) -> bool:
    """optim.store_param_remainders with 'auto' read as: on where ZeRO-Cache runs on a GPU (the launcher
    resolves it so; ZeRO-Cache's plan is for a GPU machine)."""
    value = optim.store_param_remainders
    return zero_cache_on_gpu if value == "auto" else value is True


def states_per_element(cfg: Config, model_bytes: int = MODEL_BYTES):
    """(remainders, bytes): whether the masters are kept as remainders beside bf16 weights
    (optim.store_param_remainders, for a 2-byte model) and the bytes a chunk keeps per element."""
    o = cfg.optim
    remainders = remainders_on(o, zero_cache_on_gpu=True) and model_bytes == 2
    return remainders, state_bytes(remainders, o.exp_avg_dtype, o.exp_avg_sq_dtype)


def rank_tier_bytes(cfg: Config, dp: int, dp_rank: int, rate: float, host_limit: float, use_nvme: bool,
                    model_bytes: int = MODEL_BYTES, pp_rank: int = 0, fraction: float = 0.0):
    """Chunk sizes, tiers and bytes per tier of one rank's ZeRO-Cache store, as the optimizer places them,
    the sizes of the chunks whose weights are offloaded (held in pinned host memory, not on the GPU),
    and per chunk whether the device updates it (`fraction` of the host chunks). model_bytes: the
    weights' bytes per element (the gradients' follow from it, grad_bytes)."""
    params = rank_params(cfg, pp_rank)
    n_groups = len({p.sub_group for p in params})
    in_store = cfg.zero_cache.accumulate_in_store is True and cfg.num_microbatches(dp) > 1
    remainders, states = states_per_element(cfg, model_bytes)

    def placed(rank, allowed=None):
        chunks = chunk_numels(params, dp, rank, cfg.zero_cache.chunk_numel)
        groups, numels = [g for g, _ in chunks], [n for _, n in chunks]
        return (groups, numels, *place(groups, numels, n_groups, float(rate), host_limit, use_nvme,
                                       grad_bytes(cfg, dp, model_bytes), offload_params_on(cfg),
                                       cfg.zero_cache.update_slice_numel, in_store, allowed, fraction,
                                       weight_bytes=model_bytes, states=states, remainders=remainders))

    allowed = None
    if dp > 1:  # a layer is offloaded on every rank or on none, as the optimizer agrees over DP
        allowed = [all(fs) for fs in zip(*(placed(r)[3] for r in range(dp)))]
    groups, numels, tiers, flags, need, streamed = placed(dp_rank, allowed)
    offloaded = [n for g, n in zip(groups, numels) if flags[g]]
    return numels, tiers, need, offloaded, streamed


def plan_step(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int, rate: float, use_nvme: bool,
              pp_rank: int = 0) -> SystemPlan:
    """ZeRO-Cache on data-parallel rank 0 of pipeline stage pp_rank: its parameters and store at `rate`
    (prefetch_cache_sub_group_rate), the NVMe tier used or not, with model.recompute,
    activation_offload and zero_cache.accumulate_in_store concrete (the search settles them:
    plan.plan_zero_cache); offload_params 'auto' read by offload_params_on, device_update_fraction 'auto'
    by device_update_fraction. Activations are activation_bytes's, for the stage's micro batches in flight."""
    world, dp = world_and_dp(cfg, gpus_per_node, nodes)
    zc = cfg.zero_cache
    params = rank_params(cfg, pp_rank)
    in_flight = micro_batches_in_flight(cfg, dp, pp_rank)
    host_limit = hw.host_mem_gib * GIB / gpus_per_node - HOST_PROCESS - offloaded_activation_bytes(cfg, in_flight)
    if zc.host_max_gib is not None:
        host_limit = min(host_limit, zc.host_max_gib * GIB)
    fraction = device_update_fraction(cfg, hw, gpus_per_node, nodes)
    store = rank_tier_bytes(cfg, dp, 0, float(rate), host_limit, use_nvme, pp_rank=pp_rank, fraction=fraction)
    gpu, host = _memory(cfg, dp, params, in_flight, store)
    step, in_store = _step_times(cfg, hw, gpus_per_node, nodes, sum(p.numel for p in params), store)
    tb, streamed = store[2], store[4]
    return replace(finish("zero_cache", cfg, hw, gpus_per_node, world, gpu, host, tb.get("nvme", 0), step,
                           float(rate), pp_rank), offload_params=offload_params_on(cfg), accumulate_in_store=in_store,
                   device_update_fraction=fraction if any(streamed) else 0.0)


def _memory(cfg: Config, dp: int, params, in_flight: int, store):
    """(GPU bytes, host bytes) by use, of a rank holding `params` with `in_flight` micro batches' activations
    and its store as rank_tier_bytes placed it (`store`, that function's result)."""
    numels, tiers, tb, offloaded, streamed = store
    model_numel = sum(p.numel for p in params)
    largest_layer = max(sub_group_numels(params).values())  # the largest sub-group, all of it (as the optimizer counts)
    resident = model_numel - sum(offloaded) * dp
    # as the optimizer reserves them: gradients accumulated over micro batches (every parameter's), else
    # only those between backward and offload; offloaded layers' weights in use, prefetched, freeing
    g = grad_bytes(cfg, dp)  # fp32 where micro batches add up in fp32
    reserve = [training_reserve(0, largest_layer, g, off, model_numel, accumulating(cfg, dp),
                                _fetch_depth(cfg, largest_layer), MODEL_BYTES) for off in (False, bool(offloaded))]
    gpu = {
        "weights": resident * MODEL_BYTES,
        "fetched_weights": reserve[1] - reserve[0],
        "gradients": reserve[0],
        "cached_states": tb["device"],  # with the device update buffers
        "activations": activation_bytes(cfg, in_flight=in_flight),
        "workspace": WORKSPACE + CUDA_CONTEXT,
    }
    uploads = [n for n, t in zip(numels, tiers) if t != "device"]
    for n in offloaded + [n for n, s in zip(numels, streamed) if s]:  # no upload buffer: fetched, or device-updated
        uploads.remove(n)
    remainders, _ = states_per_element(cfg)
    upload_numel = min(max(uploads), cfg.zero_cache.update_slice_numel) if uploads else 0
    host = {
        "host_states": tb["host"],
        "upload_buffers": upload_buffers(remainders) * upload_numel * MODEL_BYTES,
        "process": HOST_PROCESS,
    }
    return gpu, host


def _step_times(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int, model_numel: int, store):
    """(seconds of a step by cause, as far as they are not hidden; whether micro batches accumulate in the
    store) of a rank holding model_numel parameters, its store as rank_tier_bytes placed it (`store`)."""
    numels, tiers, _, offloaded, streamed = store
    world, dp = world_and_dp(cfg, gpus_per_node, nodes)
    zc = cfg.zero_cache
    g = grad_bytes(cfg, dp)
    mb = cfg.num_microbatches(dp)
    compute = compute_s(cfg, hw, world)
    fwd_first = compute / mb * forward_share(cfg)
    bwd_last = compute / mb - fwd_first
    host_numel = sum(n for n, t in zip(numels, tiers) if t == "host")
    nvme_numel = sum(n for n, t in zip(numels, tiers) if t == "nvme")
    off_numel = host_numel + nvme_numel
    d2h = off_numel * g / (hw.pcie_gbs * 1e9)
    on_device = sum(n for n, s in zip(numels, streamed) if s)  # host chunks the GPU updates
    h2d = (off_numel - on_device) * MODEL_BYTES / (hw.pcie_gbs * 1e9)
    cpu = _host_update_s(cfg, hw, gpus_per_node, nodes, off_numel - on_device, on_device)
    nvme_io = 2 * nvme_numel * states_per_element(cfg)[1] * gpus_per_node / (hw.nvme_gbs * 1e9)
    network = 0.0
    if dp > 1:  # fp32 reduce-scatter in backward, bf16 all-gather before forward
        network = (dp - 1) / dp * model_numel * (4 + MODEL_BYTES) / (hw.net_gbps * 1e9)
    # per micro batch on PCIe: offloaded weights fetched (again in the recomputing backward) and, when
    # accumulating in the store, each host chunk's running sum up to the GPU and back down
    in_store = zc.accumulate_in_store is True and mb > 1
    passes = 1 + recomputed_layers(cfg) / cfg.model.num_layers
    fetch_mb = passes * sum(offloaded) * MODEL_BYTES / (hw.pcie_gbs * 1e9)
    transfers = mb * max(0.0, fetch_mb - compute / mb)
    if in_store:  # after the first micro batch: a round trip per host sub-group, up and down at once
        # (pipelined over the slots), behind part of the micro batch's backward (IN_STORE_TRIP_HIDDEN)
        # the sums go up and come down at once: each direction at its share of both directions' rate
        trip = off_numel * g / (hw.pcie_gbs * PCIE_DUPLEX_SHARE * 1e9)
        transfers += (mb - 1) * max(0.0, trip - IN_STORE_TRIP_HIDDEN * bwd_last)
    update = max(cpu, nvme_io)  # NVMe reads and writes are double buffered beside the CPU update
    exposed_update = max(0.0, update - fwd_first) if zc.pipeline_optimizer else update
    off_device = sum(1 for t in tiers if t != "device")
    step = {
        "compute": compute,
        "pcie_d2h": max(0.0, d2h - bwd_last),
        "cpu_optimizer": exposed_update if cpu >= nvme_io else 0.0,
        "nvme_io": exposed_update if nvme_io > cpu else 0.0,
        "micro_batch_transfers": transfers,
        # pipelined, only the last chunk's upload waits; otherwise every upload does
        "pcie_h2d": h2d / max(1, off_device) if zc.pipeline_optimizer else h2d,
        "network": max(0.0, network - compute / 2),
    }
    return step, in_store


def _host_update_s(cfg: Config, hw: Machine, gpus_per_node: int, nodes: int, cpu_work: int, on_device: int) -> float:
    """Seconds of the host update: the device path updates on_device elements while the CPU, at its shared
    rate, works through cpu_work; what the CPU has left then runs at its rate alone."""
    cpu_alone, cpu_shared, device_rate = update_rates(cfg, hw, gpus_per_node, nodes)
    beside = on_device / device_rate  # the device path's time, while the CPU runs at its shared rate
    cpu = cpu_work / cpu_shared if cpu_work <= cpu_shared * beside else beside + (
        cpu_work - cpu_shared * beside) / cpu_alone
    return max(cpu, beside)


def stream_held_bytes(cfg: Config, dp: int) -> int:
    """GPU memory 'auto' rates leave free beyond the plan where they can (0 unless accumulating in the
    store): STREAM_HELD_LAYERS of the largest layer's gradients."""
    if not (cfg.zero_cache.accumulate_in_store is True and cfg.num_microbatches(dp) > 1):
        return 0
    layers = [n for g, n in sub_group_numels(rank_params(cfg, 0)).items() if 0 < g <= cfg.model.num_layers]
    return STREAM_HELD_LAYERS * max(layers, default=0) * MODEL_BYTES
