"""The memory and time model of one training step, per rank, for ZeRO-Cache and its peers: pure
functions of a config and a machine's figures (planner.machines), torch-free, reading nothing.

    from angelgpt.planner import plan, MACHINES
    report = plan(cfg, MACHINES["h200"], gpus_per_node=1, nodes=1)

Owns the model (activation_bytes, plan_zero_cache, plan_megatron, plan_megatron_cpu_offload,
plan_zero3_offload, plan, plan_for, auto_plan, SystemPlan) and the planner's choices for 'auto'
settings within it (recompute, rate, offload_params, accumulate_in_store, device_update_fraction);
planner.resolve turns those choices into a concrete config. Also beside_store_bytes: the device memory
training needs beside ZeRO-Cache's store that the optimizer cannot count itself.

Memory (bytes per rank):
  GPU: the model's weights in the model dtype (every rank holds its TP/PP shard whole), the gradients
  in flight (the sub-groups between their backward and their offload, at most a few layers), the
  device-tier chunks exactly as ZeRO-Cache allocates them (``placement.tier_bytes``), activations by
  Megatron's formula (Korthikanti et al., 2022: s*b*h*34 per layer without recompute with flash
  attention, s*b*h*2 per recomputed layer plus one layer's full set while it recomputes; logits in
  fp32; what a micro batch keeps until its backward, once per micro batch the stage holds in flight
  under 1F1B: micro_batches_in_flight), and a fixed workspace. With model.activation_offload
  'checkpoints' the recomputed layers' kept inputs leave the GPU for pinned host memory
  (offloaded_activation_bytes).
  Host: the host-tier chunks exactly as allocated, the two pinned upload buffers, the offloaded
  activations, and the process.
  NVMe: the NVMe-tier chunks.
Time: compute at the machine's achieved dense rate (hardware FLOPs, recompute included); gradient
D2H hides behind the last micro batch's backward, the CPU update and the H2D upload behind the next
step's first micro batch forward (the pipelined optimizer), NVMe I/O runs beside the CPU update, the
DP collectives (reduce-scatter in backward, all-gather in forward) on the network. What is not
hidden is exposed; the largest exposed term, else compute, is the bottleneck. Activation offload's
copies (down in forward, up in backward, every micro batch) run on the compute stream
(model/offload.py), so none of their time is hidden.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import wraps
from typing import Dict, Optional

from angelgpt.config import Config
from angelgpt.model.flops import flops_per_iteration, recomputed_layers
from angelgpt.planner.layout import chunk_numels, rank_params
from angelgpt.planner.machines import GIB, Machine
from angelgpt.zero_cache.placement import GPU_HEADROOM, SLICE, STATES, place, prefetch_depth, training_reserve

# Each fitted constant names the committed result files (benchmarks/results/) that set it: the planner's
# calibration set, which tests/data/planner_runs.json keeps apart from the runs that validate it.
MODEL_BYTES = 2  # bf16 weights and gradients on GPU
# assumed: a round allowance for cuBLAS workspace, NCCL buffers and allocator slack, never fitted to a run
WORKSPACE = 3 * GIB  # cuBLAS workspace, NCCL buffers, allocator slack
# assumed: what a CUDA context takes on the H200, never recorded in a committed result file
# each direction's share of the pinned rate when host-to-device and device-to-host copies run at once
# (measured: ../shared/FACTS.md, the H200 machine: 97.1 GB/s both directions together against 55.3 alone;
# assumed the same elsewhere)
PCIE_DUPLEX_SHARE = 97.1 / (2 * 55.3)
CUDA_CONTEXT = 1 * GIB  # taken before anything is allocated (not in torch.cuda.mem_get_info's free)
# the Python process with torch, CUDA and Megatron loaded: 1.7-1.8 GiB measured as the peak host memory of
# runs that keep nothing on the host (peers-megatron-L7-mb4-gb32.json, peers-zero_cache-L7-mb4-gb32.json)
HOST_PROCESS = int(1.8 * GIB)


# ZeRO-Cache's host update with device_update_fraction, measured on the H200 in training (11 and 19 layers
# of the 55 shape, 1.9B and 8.9B host-resident parameters, 45% and 56% of them updated on the GPU, the
# one-pass CPU AdamW): the device path ran 2.2-2.7 G params/s (26 bytes a parameter over PCIe, both
# ways), the CPU beside it 3.0-3.8 (median 3.5), 1.52x the machine's cpu_update_gparams (on the H200 the
# CPU alone in training, 2.3, where it writes offloaded layers' weights; beside device updates its chunks
# are of resident-weight layers); other machines scale with their PCIe and CPU figures. At 19 layers, one
# machine: 0.45 on the GPU made 421.0 model TFLOP/s against 414.3 at 0.56, the device path still the
# longer of the two (1.69 against 1.34 s). Runs: peers-zero_cache-L11-mb1-gb32-recomputenone-devupdate0.45.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto-devupdate0.45.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto-split0.56.json
DEVICE_UPDATE_PER_PCIE_GBS = 2.55 / 55.0
CPU_BESIDE_DEVICE_UPDATE = 1.52
# zero_cache.cpu_adam torch (fp32 gradient scratch, torch's fused AdamW, weights converted back) against
# the one-pass kernel, same benchmark: 2.09 against 2.81 G params/s (cpu_adam-67108864-static-split.json)
TORCH_CPU_UPDATE = 0.74


def host_update_rates(hw: Machine, gpus_per_node: int, cpu_adam: str = "auto"):
    """Parameters/s per GPU of the host update: (CPU alone, CPU beside device updates, device path)."""
    cpu = hw.cpu_update_gparams * 1e9 / gpus_per_node * (TORCH_CPU_UPDATE if cpu_adam == "torch" else 1.0)
    return cpu, cpu * CPU_BESIDE_DEVICE_UPDATE, hw.pcie_gbs * DEVICE_UPDATE_PER_PCIE_GBS * 1e9


def micro_batches_in_flight(cfg: Config, dp: int, pp_rank: int = 0) -> int:
    """Micro batches whose forward has run and backward not yet, at most, on pipeline stage pp_rank:
    Megatron's 1F1B schedule (non-interleaved) runs PP - pp_rank - 1 warm-up forwards, then one more
    forward before each backward, so stage p holds up to PP - p of them (fewer when the step has fewer
    micro batches); 1 without pipeline parallelism."""
    pp = cfg.parallel.pipeline_model_parallel_size
    return max(1, min(pp - pp_rank, cfg.num_microbatches(dp)))


def activation_bytes(cfg: Config, recompute: Optional[bool] = None, offload: Optional[bool] = None,
                     in_flight: int = 1) -> int:
    """Peak GPU activation memory of one pipeline stage with `in_flight` micro batches between forward and
    backward (micro_batches_in_flight; bf16): as configured, or with every layer recomputed (True) or none
    (False); the recomputed layers' kept inputs off the GPU with activation offload as configured ('auto'
    counts as off), or on (True) or off (False). What a micro batch stores until its backward counts once
    per micro batch in flight; the logits and a recomputed layer's full set, made during one micro
    batch's backward, once."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h = m.seq_length, cfg.train.micro_batch_size, m.hidden_size
    layers = m.num_layers // cfg.parallel.pipeline_model_parallel_size
    # 10*sbh (norm and block inputs, dropout masks), unsharded unless sequence parallelism splits it over
    # TP too, attention's Q, K, V and output 8*sbh/tp (flash attention: no s*s), the MLP's two ffn-wide
    # tensors: 34*sbh at tp 1 with ffn 4h (measured on the H200 without recompute: 33.5*sbh a layer, 7
    # layers of the 55 shape from micro batch 1 to 2: peers-zero_cache-L7-mb1-gb32-recomputenone.json,
    # peers-zero_cache-L7-mb2-gb32-recomputenone.json); 10*sbh + 24*sbh/tp, or 34*sbh/tp with sequence
    # parallelism (Korthikanti et al. 2022)
    sp = tp if cfg.parallel.sequence_parallel else 1
    full_layer = s * b * h * (10 * tp // sp + 8) // tp + s * b * m.ffn_hidden_size * 4 // tp
    recomputed = recomputed_layers(cfg) // cfg.parallel.pipeline_model_parallel_size if recompute is None \
        else (layers if recompute else 0)
    # the first `recomputed` layers keep their inputs; the rest keep everything, and are done with in
    # backward before the first recomputed layer's full set comes back
    on_gpu_inputs = 0 if _offloading(cfg, offload) else recomputed * _layer_input_bytes(cfg)
    # the logits at their peak: the output layer's bf16 logits beside the fp32 copy Megatron's
    # vocab-parallel cross entropy makes and keeps for backward (its exp, softmax and gradient are made in
    # place in that copy), then that fp32 gradient beside its bf16 cast for the output layer's backward:
    # 2 + 4 bytes an element (read from megatron-core's cross entropy, not fitted)
    logits = s * b * cfg.padded_vocab_size() // tp * (MODEL_BYTES + 4)
    # the logits peak at the end of forward, beside every layer's stored activations; they are gone
    # before the last recomputed layer's full set is made again in backward
    return in_flight * on_gpu_inputs + (in_flight - 1) * (layers - recomputed) * full_layer + max(
        (layers - recomputed) * full_layer + logits, full_layer if recomputed else 0)


def _offloading(cfg: Config, offload: Optional[bool] = None) -> bool:
    return cfg.model.activation_offload == "checkpoints" if offload is None else offload


def _layer_input_bytes(cfg: Config) -> int:
    """The input a recomputed layer keeps for its backward (what Megatron's checkpointing saves): s*b*h in
    bf16, split over TP with sequence parallelism."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    sp = tp if cfg.parallel.sequence_parallel else 1
    return 2 * m.seq_length * cfg.train.micro_batch_size * m.hidden_size // sp


def offloaded_activation_bytes(cfg: Config, in_flight: int = 1) -> int:
    """Bytes that activation offload ('checkpoints') moves from one stage's GPU to pinned host memory for
    one micro batch: every recomputed layer's kept input (0 without offload or without recompute); what
    the host holds with `in_flight` micro batches between forward and backward is that many times it."""
    if not _offloading(cfg):
        return 0
    return in_flight * (recomputed_layers(cfg) // cfg.parallel.pipeline_model_parallel_size) * _layer_input_bytes(cfg)


def accumulating(cfg: Config, dp: int) -> bool:
    """Several micro batches per step, added up on the GPU: every gradient lives there until the last
    one (unless zero_cache.accumulate_in_store moves each micro batch's gradients to their owner)."""
    return cfg.num_microbatches(dp) > 1 and not (cfg.optim.optimizer == "zero_cache"
                                                and cfg.zero_cache.accumulate_in_store is True)


def grad_bytes(cfg: Config, dp: int, model_bytes: int = MODEL_BYTES) -> int:
    """Bytes per element of the gradients that micro batches add up in (ZeRO-Cache's main grads, slots and
    gradient buffers): 4 with optim.accumulate_grads_in_fp32 and several micro batches per step, else the
    model's (with one micro batch nothing adds up)."""
    return 4 if cfg.optim.accumulate_grads_in_fp32 and cfg.num_microbatches(dp) > 1 else model_bytes


def beside_store_bytes(cfg: Config, dp: int = 1, pp_rank: int = 0) -> int:
    """Device memory training needs beside ZeRO-Cache's store that the optimizer cannot count itself, on
    a rank of pipeline stage pp_rank with data-parallel size dp: the activations of the stage's micro
    batches in flight (micro_batches_in_flight; as configured: recompute resolved) and the workspace.
    The optimizer adds the gradients and fetched weights (placement.training_reserve) and leaves
    GPU_HEADROOM free."""
    return activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank)) + WORKSPACE


def _fetch_depth(cfg: Config, layer_numel: int) -> int:
    """Offloaded layers ZeRO-Cache prefetches ahead of the running one, from the zero_cache knobs."""
    zc = cfg.zero_cache
    return prefetch_depth(layer_numel, zc.prefetch_bucket_size, zc.max_live_parameters,
                          zc.max_contigous_params_size, MODEL_BYTES)


@dataclass
class SystemPlan:
    system: str
    gpu_bytes: Dict[str, int]
    host_bytes: Dict[str, int]
    nvme_bytes: int
    gpu_total: int
    host_total: int  # per node
    fits: bool
    margin: Dict[str, int]  # capacity minus need, per resource (negative: short)
    step_s: Dict[str, float]
    step_time_s: float
    bottleneck: str
    rate: Optional[float] = None
    tflops_per_gpu: float = 0.0
    offload_params: Optional[bool] = None  # zero_cache: are the weights of host-resident layers offloaded
    accumulate_in_store: Optional[bool] = None  # zero_cache: do micro batches' gradients add up in the store
    device_update_fraction: Optional[float] = None  # zero_cache: of the host-resident states, updated on the GPU
    recompute: str = "none"  # model.recompute as planned ('auto' resolved)
    recompute_num_layers: Optional[int] = None  # with 'full': the layers per stage that recompute (None: all)
    activation_offload: str = "none"  # model.activation_offload as planned ('auto' resolved)

    def to_dict(self) -> dict:
        return asdict(self)

    def recompute_label(self) -> str:
        """'none', 'full', or 'full (first k layers per stage)'."""
        k = self.recompute_num_layers
        return self.recompute + (f" (first {k} layers per stage)" if self.recompute == "full" and k else "")


def _capacity(hw: Machine, gpus_per_node: int):
    return hw.gpu_mem_gib * GIB, hw.host_mem_gib * GIB, hw.nvme_gib * GIB, gpus_per_node


def _world(cfg: Config, gpus_per_node: int, nodes: int):
    world = gpus_per_node * nodes
    dp = cfg.data_parallel_size(world)
    return world, dp


def _finish(system, cfg, hw, gpus_per_node, world, gpu, host, nvme, step, rate=None, pp_rank=0) -> SystemPlan:
    gpu_cap, host_cap, nvme_cap, _ = _capacity(hw, gpus_per_node)
    offloaded = offloaded_activation_bytes(cfg)
    if offloaded:  # pinned host memory for the micro batches in flight; down and up on the compute stream
        dp = cfg.data_parallel_size(world)
        mb = cfg.num_microbatches(dp)
        host = {**host, "offloaded_activations": offloaded * micro_batches_in_flight(cfg, dp, pp_rank)}
        step = {**step, "activation_offload": mb * 2 * offloaded / (hw.pcie_gbs * 1e9)}
    gpu_total = sum(gpu.values())
    host_total = sum(host.values()) * gpus_per_node  # ranks of one node share its host memory
    nvme_total = nvme * gpus_per_node
    margin = {"gpu": int(gpu_cap * (1 - GPU_HEADROOM) - gpu_total), "host": int(host_cap - host_total),
              "nvme": int(nvme_cap - nvme_total)}
    exposed = {k: v for k, v in step.items() if k != "compute"}
    total = step["compute"] + sum(exposed.values())
    worst = max(exposed, key=exposed.get) if exposed else None
    bottleneck = worst if worst and exposed[worst] > 0.05 * total else "compute"
    flops = flops_per_iteration(cfg)
    return SystemPlan(system, gpu, host, nvme_total, gpu_total, host_total, all(v >= 0 for v in margin.values()),
                      margin, {k: round(v, 4) for k, v in step.items()}, round(total, 4), bottleneck, rate,
                      round(flops / total / world / 1e12, 1), recompute=cfg.model.recompute,
                      recompute_num_layers=cfg.model.recompute_num_layers,
                      activation_offload="checkpoints" if offloaded else "none")


def _compute_s(cfg: Config, hw: Machine, world: int) -> float:
    return flops_per_iteration(cfg, include_recompute=True) / world / (hw.gpu_tflops * 1e12)


def offload_params_on(cfg: Config) -> bool:
    """zero_cache.offload_params with 'auto' read as: on when every layer recomputes (a layer's weights
    are then needed only while it runs; a layer that keeps its activations keeps its weights too).
    plan_zero_cache refines 'auto' when micro batches accumulate in the store."""
    op = cfg.zero_cache.offload_params
    return op if op != "auto" else recomputed_layers(cfg) == cfg.model.num_layers > 0


def forward_share(cfg: Config) -> float:
    """The forward's share of a micro batch's compute: a layer's backward costs two forwards, and a
    recomputed layer runs its forward again."""
    return 1.0 / (3.0 + recomputed_layers(cfg) / cfg.model.num_layers)


def _accumulation_choices(cfg: Config, dp: int):
    """With accumulate_in_store 'auto' and several micro batches per step, the two configs to plan:
    gradients added up on the GPU, and in the store. None when there is no choice to make."""
    zc = cfg.zero_cache
    if zc.accumulate_in_store != "auto":
        return None
    if cfg.num_microbatches(dp) <= 1:
        return [replace(cfg, zero_cache=replace(zc, accumulate_in_store=False))]
    return [replace(cfg, zero_cache=replace(zc, accumulate_in_store=v)) for v in (False, True)]


def _recompute_choice(plan_fn):
    """Wraps a plan function: with model.recompute 'auto', the fastest plan that fits of: no recompute,
    and full recompute of the first k layers per stage (the rest keep their activations), k from all
    layers down while the plans fit (fewer recomputed layers need more memory); otherwise its plan as
    configured. A layer kept saves its recompute on every micro batch but takes GPU memory that the
    states or the weights would have had. With model.activation_offload 'auto', each recomputing choice
    is planned with its kept inputs on the GPU and offloaded (on the GPU first, so a tie keeps them),
    and the pick is among all of those; without recompute there is nothing to offload."""
    @wraps(plan_fn)
    def planned(cfg: Config, *args, **kwargs) -> SystemPlan:
        m = cfg.model
        if m.recompute != "auto" and m.activation_offload != "auto":
            return plan_fn(cfg, *args, **kwargs)
        offloads = ("none", "checkpoints") if m.activation_offload == "auto" else (m.activation_offload,)

        def with_(recompute, k, offload):
            return plan_fn(replace(cfg, model=replace(m, recompute=recompute, recompute_num_layers=k,
                                                      activation_offload=offload)), *args, **kwargs)

        if m.recompute == "full":
            return _pick([with_("full", m.recompute_num_layers, o) for o in offloads])
        plans = [with_("none", None, "none" if m.activation_offload == "auto" else m.activation_offload)]
        if m.recompute == "none":
            return plans[0]
        per_stage = m.num_layers // cfg.parallel.pipeline_model_parallel_size
        for k in range(per_stage, 0, -1):
            ps = [with_("full", None if k == per_stage else k, o) for o in offloads]
            if not any(p.fits for p in ps) and k < per_stage:
                break
            plans += ps
        return _pick(plans)
    return planned


def shortfall(p: SystemPlan) -> int:
    """Bytes a plan is short of, over every resource it is short of (0 when it fits)."""
    return -sum(min(0, v) for v in p.margin.values())


def _pick(plans):
    """Of the plans for each choice, the fastest that fits (the first on a tie), else the one closest to
    fitting (least short of, the first on a tie)."""
    fitting = [p for p in plans if p.fits]
    return min(fitting, key=lambda p: p.step_time_s) if fitting else min(plans, key=shortfall)


def _resolve_auto(cfg: Config, dp: int, plan_fn) -> Optional[SystemPlan]:
    """plan_fn's plan once accumulate_in_store 'auto' and offload_params 'auto' are resolved into
    concrete configs (None when there is nothing to resolve)."""
    choices = _accumulation_choices(cfg, dp)
    if choices:
        return _pick([plan_fn(c) for c in choices])
    tries = _resident_first(cfg, dp)
    if tries:
        resident = plan_fn(tries[0])
        return resident if resident.fits else _pick([resident, plan_fn(tries[1])])
    return None


def _resident_first(cfg: Config, dp: int):
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


def device_update_fraction(cfg: Config, hw: Machine, gpus_per_node: int) -> float:
    """zero_cache.device_update_fraction, 'auto' resolved so that the device path and the CPU beside it
    finish their shares of the host update together."""
    frac = cfg.zero_cache.device_update_fraction
    if frac != "auto":
        return float(frac)
    _, cpu_rate, device_rate = host_update_rates(hw, gpus_per_node, cfg.zero_cache.cpu_adam)
    return round(device_rate / (device_rate + cpu_rate), 2)


def rank_tier_bytes(cfg: Config, dp: int, dp_rank: int, rate: float, host_limit: float, use_nvme: bool,
                    model_bytes: int = MODEL_BYTES, pp_rank: int = 0, fraction: float = 0.0):
    """Chunk sizes, tiers and bytes per tier of one rank's ZeRO-Cache store, as the optimizer places them,
    the sizes of the chunks whose weights are offloaded (held in pinned host memory, not on the GPU),
    and per chunk whether the device updates it (`fraction` of the host chunks). model_bytes: the
    weights' bytes per element (the gradients' follow from it, grad_bytes)."""
    params = rank_params(cfg, pp_rank)
    n_groups = len({p.sub_group for p in params})
    in_store = cfg.zero_cache.accumulate_in_store is True and cfg.num_microbatches(dp) > 1

    def placed(rank, allowed=None):
        chunks = chunk_numels(params, dp, rank)
        groups, numels = [g for g, _ in chunks], [n for _, n in chunks]
        return (groups, numels, *place(groups, numels, n_groups, float(rate), host_limit, use_nvme,
                                       grad_bytes(cfg, dp, model_bytes), offload_params_on(cfg), in_store, allowed,
                                       fraction, weight_bytes=model_bytes))

    allowed = None
    if dp > 1:  # a layer is offloaded on every rank or on none, as the optimizer agrees over DP
        allowed = [all(fs) for fs in zip(*(placed(r)[3] for r in range(dp)))]
    groups, numels, tiers, flags, need, streamed = placed(dp_rank, allowed)
    offloaded = [n for g, n in zip(groups, numels) if flags[g]]
    return numels, tiers, need, offloaded, streamed


@_recompute_choice
def plan_zero_cache(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1,
                    rate: Optional[float] = None, nvme: Optional[bool] = None, pp_rank: int = 0) -> SystemPlan:
    """ZeRO-Cache on data-parallel rank 0 of pipeline stage pp_rank (default the first, the largest: it
    holds the embedding): its parameters and store. A rate of 'auto' is chosen for the first stage.
    Activations are activation_bytes's, for the stage's micro batches in flight."""
    world, dp = _world(cfg, gpus_per_node, nodes)
    zc = cfg.zero_cache
    if rate is None:
        rate = zc.prefetch_cache_sub_group_rate
    use_nvme = bool(zc.nvme_path) if nvme is None else nvme
    if rate == "auto":
        return auto_plan(cfg, hw, gpus_per_node, nodes, use_nvme)
    resolved = _resolve_auto(cfg, dp, lambda c: plan_zero_cache(c, hw, gpus_per_node, nodes, rate, nvme, pp_rank))
    if resolved:
        return resolved
    params = rank_params(cfg, pp_rank)
    model_numel = sum(p.numel for p in params)
    in_flight = micro_batches_in_flight(cfg, dp, pp_rank)
    host_limit = hw.host_mem_gib * GIB / gpus_per_node - HOST_PROCESS - offloaded_activation_bytes(cfg, in_flight)
    if zc.host_max_gib is not None:
        host_limit = min(host_limit, zc.host_max_gib * GIB)
    fraction = device_update_fraction(cfg, hw, gpus_per_node)
    numels, tiers, tb, offloaded, streamed = rank_tier_bytes(cfg, dp, 0, float(rate), host_limit, use_nvme,
                                                             pp_rank=pp_rank, fraction=fraction)
    largest_layer = max(sub_group_numels(params).values())  # the largest sub-group, all of it (as the optimizer counts)
    off_device = [n for n, t in zip(numels, tiers) if t != "device"]
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
    host = {
        "host_states": tb["host"],
        "upload_buffers": 2 * min(max(uploads), SLICE) * MODEL_BYTES if uploads else 0,
        "process": HOST_PROCESS,
    }
    mb = cfg.num_microbatches(dp)
    compute = _compute_s(cfg, hw, world)
    fwd_first = compute / mb * forward_share(cfg)
    bwd_last = compute / mb - fwd_first
    host_numel = sum(n for n, t in zip(numels, tiers) if t == "host")
    nvme_numel = sum(n for n, t in zip(numels, tiers) if t == "nvme")
    off_numel = host_numel + nvme_numel
    d2h = off_numel * g / (hw.pcie_gbs * 1e9)
    on_device = sum(n for n, s in zip(numels, streamed) if s)  # host chunks the GPU updates
    h2d = (off_numel - on_device) * MODEL_BYTES / (hw.pcie_gbs * 1e9)
    cpu_alone, cpu_shared, device_rate = host_update_rates(hw, gpus_per_node, zc.cpu_adam)
    beside = on_device / device_rate  # the device path's time, while the CPU runs at its shared rate
    cpu_work = off_numel - on_device
    cpu = cpu_work / cpu_shared if cpu_work <= cpu_shared * beside else beside + (
        cpu_work - cpu_shared * beside) / cpu_alone
    cpu = max(cpu, beside)
    nvme_io = 2 * nvme_numel * STATES * 4 * gpus_per_node / (hw.nvme_gbs * 1e9)
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
        # (pipelined over the slots), behind the micro batch's backward; measured at 19 layers, 16 micro
        # batches: hidden (the step 2.6 s over compute, 2.0 s of it the update;
        # peers-zero_cache-L19-mb2-gb32.json)
        # the sums go up and come down at once: each direction at its share of both directions' rate
        trip = off_numel * g / (hw.pcie_gbs * PCIE_DUPLEX_SHARE * 1e9)
        transfers += (mb - 1) * max(0.0, trip - bwd_last)
    update = max(cpu, nvme_io)  # NVMe reads and writes are double buffered beside the CPU update
    exposed_update = max(0.0, update - fwd_first) if zc.pipeline_optimizer else update
    step = {
        "compute": compute,
        "pcie_d2h": max(0.0, d2h - bwd_last),
        "cpu_optimizer": exposed_update if cpu >= nvme_io else 0.0,
        "nvme_io": exposed_update if nvme_io > cpu else 0.0,
        "micro_batch_transfers": transfers,
        # pipelined, only the last chunk's upload waits; otherwise every upload does
        "pcie_h2d": h2d / max(1, len(off_device)) if zc.pipeline_optimizer else h2d,
        "network": max(0.0, network - compute / 2),
    }
    return replace(_finish("zero_cache", cfg, hw, gpus_per_node, world, gpu, host, tb.get("nvme", 0), step,
                           float(rate), pp_rank), offload_params=offload_params_on(cfg), accumulate_in_store=in_store,
                   device_update_fraction=fraction if any(streamed) else 0.0)


@_recompute_choice
def auto_plan(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, nvme: bool = False) -> SystemPlan:
    """The largest prefetch_cache_sub_group_rate (in steps of 0.01) that fits; states on GPU are updated
    30x faster than on the CPU and cross no PCIe, so more on the GPU is faster while it fits. Where no
    rate fits, the one closest to fitting (least short of; the largest on a tie), so that the plan and
    a refusal say how far the configuration is from fitting rather than how far its smallest rate is."""
    resolved = _resolve_auto(cfg, _world(cfg, gpus_per_node, nodes)[1],
                             lambda c: auto_plan(c, hw, gpus_per_node, nodes, nvme))
    if resolved:
        return resolved
    room = stream_held_bytes(cfg, _world(cfg, gpus_per_node, nodes)[1])
    fitting = None  # the largest rate that fits, taken when no rate leaves the transfer streams their room
    closest = None
    for i in range(100, -1, -1):
        p = plan_zero_cache(cfg, hw, gpus_per_node, nodes, rate=i / 100, nvme=nvme)
        if p.fits and p.margin["gpu"] >= room:
            return p
        if p.fits:
            fitting = fitting or p
        elif fitting:  # below the rates that fit: lower ones only move more states off the device
            break
        if closest is None or shortfall(p) < shortfall(closest):
            closest = p
    return fitting or closest


# Accumulating in the store, the GPU memory that gradients on their way to the host hold after autograd
# has let them go (the H2D stream still reads them), which the caching allocator cannot hand out again
# meanwhile, beyond what the plan's workspace and in-flight gradients already cover. Measured on the H200
# (55 shape): at 11 layers, 32 micro batches, memory reserved peaked at 131.9 GiB against 132.5 planned
# (rate 0.79, no allocator retries); at 19 layers, 16 micro batches, 137.3 against 135.3 (rate 0.42, 0-1
# retries a step). Counted in layers' gradients: two (peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.79.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto.json). (While every released gradient was also marked with the
# D2H stream, reserved ran 18.3 GiB over allocated at 11 layers and this was six:
# peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.74.json.)
STREAM_HELD_LAYERS = 2


def stream_held_bytes(cfg: Config, dp: int) -> int:
    """GPU memory 'auto' rates leave free beyond the plan where they can (0 unless accumulating in the
    store): STREAM_HELD_LAYERS of the largest layer's gradients."""
    if not (cfg.zero_cache.accumulate_in_store is True and cfg.num_microbatches(dp) > 1):
        return 0
    layers = [n for g, n in sub_group_numels(rank_params(cfg, 0)).items() if 0 < g <= cfg.model.num_layers]
    return STREAM_HELD_LAYERS * max(layers, default=0) * MODEL_BYTES


def sub_group_numels(params) -> Dict[int, int]:
    """Elements of each sub-group (0 embedding, 1 + layer, num_layers + 1 the output) of these params."""
    sizes: Dict[int, int] = {}
    for p in params:
        sizes[p.sub_group] = sizes.get(p.sub_group, 0) + p.numel
    return sizes


@_recompute_choice
def plan_megatron(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, pp_rank: int = 0) -> SystemPlan:
    """Megatron's distributed optimizer: bf16 weights, fp32 main grads, fp32 master + moments sharded over DP
    (a rank of pipeline stage pp_rank)."""
    world, dp = _world(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, pp_rank))
    # without transformer-engine or apex Megatron steps with torch's foreach AdamW, whose temporaries
    # came to 4 bytes per parameter on the H200: 7 layers of the 55 shape peaked at 124.4 GiB allocated
    # with micro batch 1, 2 and 4 alike (weights, main grads, states and these: 124.3;
    # peers-megatron-L7-mb1-gb32-recomputenone.json, peers-megatron-L7-mb2-gb32-recomputenone.json,
    # peers-megatron-L7-mb4-gb32.json). The step's
    # temporaries and the activations are not live at once: the larger of the two counts.
    activations = activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank))
    # main grads in fp32 (optim.accumulate_grads_in_fp32: grad_reduce_in_fp32), else in bf16, from which
    # the step makes an fp32 copy of the rank's shard (distrib_optimizer's _copy_model_grads_to_main_grads)
    fp32 = cfg.optim.accumulate_grads_in_fp32
    temporaries = -(-n * 4 // dp) * (1 if fp32 else 2)
    gpu = {"weights": n * MODEL_BYTES, "main_grads": n * (4 if fp32 else MODEL_BYTES),
           "optimizer_states": -(-n * 12 // dp),
           "optimizer_temporaries": max(0, temporaries - activations), "activations": activations,
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"process": HOST_PROCESS}
    step = {"compute": _compute_s(cfg, hw, world),
            # torch's fused AdamW on the H200, 120 G params/s (FACTS.md's probe; no committed result file)
            "gpu_optimizer": n / dp / 120e9,
            "network": (dp - 1) / dp * n * (4 + MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return _finish("megatron", cfg, hw, gpus_per_node, world, gpu, host, 0, step, pp_rank=pp_rank)


@_recompute_choice
def plan_megatron_cpu_offload(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1,
                              pp_rank: int = 0) -> SystemPlan:
    """Megatron's HybridDeviceOptimizer: offload_fraction of fp32 master, moments and an fp32 gradient copy
    in pinned host memory, updated by torch's CPU AdamW after backward (the transfers overlap it); a rank of
    pipeline stage pp_rank."""
    world, dp = _world(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, pp_rank))
    f = cfg.optim.offload_fraction
    shard = -(-n // dp)
    # transfer buffers: measured 2.8 B/param on the H200 (7 layers of the 55 shape, fraction 1.0: 61.3 GiB).
    # Host: 16.9 B/param measured between steps (7 layers, fraction 1.0: 97.2 GiB; both from
    # peers-megatron_cpu_offload-L7-mb4-gb32.json) and a transient fp32 gradient copy during the step
    # (4 B/param), which the host OOM kills at 8 layers (fraction 1.0) and 12 and 13 layers (fraction 0.7)
    # show (megatron_cpu_offload-L8-fraction1.0-host-oom.json, megatron_cpu_offload-L12-fraction0.7-host-oom.json,
    # peers-megatron_cpu_offload-L13-mb2-gb32.json)
    gpu = {"weights": n * MODEL_BYTES, "main_grads": n * (4 if cfg.optim.accumulate_grads_in_fp32 else MODEL_BYTES),
           "optimizer_states": int(shard * 12 * (1 - f)),
           "transfer_buffers": int(shard * 2.8 * f),
           "activations": activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank)),
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"host_states": int(shard * 16.9 * f), "step_transient": int(shard * 4 * f), "process": HOST_PROCESS}
    step = {"compute": _compute_s(cfg, hw, world),
            "cpu_optimizer": shard * f * gpus_per_node / (hw.cpu_adam_gparams * 1e9),
            "gpu_optimizer": shard * (1 - f) / 120e9,
            "network": (dp - 1) / dp * n * (4 + MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return _finish("megatron_cpu_offload", cfg, hw, gpus_per_node, world, gpu, host, 0, step, pp_rank=pp_rank)


@_recompute_choice
def plan_zero3_offload(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1) -> SystemPlan:
    """ZeRO-3 with parameter and optimizer offload to CPU: 16-bit weights and fp32 grads, master and
    moments on the host, weights fetched over PCIe for every forward and backward, the CPU update after
    backward, not overlapped. (Assumed from DeepSpeed's design: no constant here is fitted to a run.)"""
    world, dp = _world(cfg, gpus_per_node, nodes)
    n = sum(p.numel for p in rank_params(cfg, 0))
    shard = -(-n // dp)
    largest = max(p.numel for p in rank_params(cfg, 0) if p.sub_group == 1) * 12  # one layer gathered
    gpu = {"gathered_weights": 2 * largest * MODEL_BYTES,
           "activations": activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp)),
           "workspace": WORKSPACE + CUDA_CONTEXT}
    host = {"host_states": shard * (MODEL_BYTES + 4 + 4 * STATES), "process": HOST_PROCESS}
    mb = cfg.num_microbatches(dp)
    fetch = (2 + recomputed_layers(cfg) / cfg.model.num_layers) * mb * n * MODEL_BYTES / (hw.pcie_gbs * 1e9)
    compute = _compute_s(cfg, hw, world)
    step = {"compute": compute,
            "pcie_h2d": max(0.0, fetch - compute),
            "pcie_d2h": shard * 4 / (hw.pcie_gbs * 1e9),
            "cpu_optimizer": shard * gpus_per_node / (hw.cpu_adam_gparams * 1e9),
            "network": (dp - 1) / dp * n * (4 + 2 * MODEL_BYTES) / (hw.net_gbps * 1e9) if dp > 1 else 0.0}
    return _finish("zero3_offload", cfg, hw, gpus_per_node, world, gpu, host, 0, step)


def plan(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1) -> Dict[str, SystemPlan]:
    return {"zero_cache": plan_zero_cache(cfg, hw, gpus_per_node, nodes),
            "megatron": plan_megatron(cfg, hw, gpus_per_node, nodes),
            "megatron_cpu_offload": plan_megatron_cpu_offload(cfg, hw, gpus_per_node, nodes),
            "zero3_offload": plan_zero3_offload(cfg, hw, gpus_per_node, nodes)}


def plan_for(cfg: Config, hw: Machine, gpus_per_node: int = 1, nodes: int = 1, pp_rank: int = 0) -> SystemPlan:
    """The plan of the optimizer the configuration asks for, for a rank of pipeline stage pp_rank (its
    parameters, optimizer states and micro batches in flight)."""
    return {"zero_cache": plan_zero_cache, "megatron": plan_megatron,
            "megatron_cpu_offload": plan_megatron_cpu_offload}[cfg.optim.optimizer](
        cfg, hw, gpus_per_node, nodes, pp_rank=pp_rank)
