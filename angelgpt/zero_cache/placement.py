"""Placement of ZeRO-Cache chunks over tiers, and the bytes each tier holds; no torch here, so the
planner (`angelgpt plan`) computes exactly what the optimizer allocates without building anything.

Two sizes per element run through it: `grad_bytes`, the store's gradients (fp32 while micro batches
add up in fp32: optim.accumulate_grads_in_fp32; else the model's dtype), and `weight_bytes`, the
model's weights (fetched offloaded layers, their host copies, the uploads)."""

from __future__ import annotations

from typing import Dict, List, Optional

STATES = 3  # master weights, exp_avg, exp_avg_sq
FP32_STATE_BYTES = STATES * 4  # a chunk element's states, all in fp32
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}  # optim.exp_avg_dtype, optim.exp_avg_sq_dtype
# elements an fp8 moment's scale covers (blockwise: one fp32 power-of-two scale per block of the chunk)
FP8_BLOCK = 256
# most elements a device update buffer holds (two of them: host chunks updated on the device stream
# through them), fewer where zero_cache.update_slice_numel is smaller
DEVICE_UPDATE_SLICE = 1 << 25
# device slots that host chunks' running sums make their round trips through (accumulate_in_store): one
# more than two lets a slot's trip home overlap the next layer's backward
ACCUMULATION_SLOTS = 3
# elements decoded into fp32 at a time where a chunk's states are not all fp32 (torch's AdamW: on the
# device, and on the host without the one-pass kernel): three fp32 rows of this many per updating tier
CODEC_SLICE = 1 << 22
# of the device's memory, left free against fragmentation (the planner's margin and the optimizer's check)
GPU_HEADROOM = 0.03


def state_bytes(remainders: bool = False, exp_avg: str = "fp32", exp_avg_sq: str = "fp32"):
    """Bytes a chunk keeps per element: the master (fp32, or the 16-bit remainder that with the bf16
    weight makes it: optim.store_param_remainders) and the two moments in their dtypes, an fp8 moment's
    block scales (4 bytes per FP8_BLOCK elements) as the fraction (an int where there is none)."""
    whole = (2 if remainders else 4) + MOMENT_BYTES[exp_avg] + MOMENT_BYTES[exp_avg_sq]
    scaled = [exp_avg, exp_avg_sq].count("fp8")
    return whole + 4 * scaled / FP8_BLOCK if scaled else whole


def upload_buffers(remainders: bool) -> int:
    """Pinned buffers that carry a host chunk's updated weights up to the device, a slice each: two (one
    filled while the other's upload runs); three where the master row holds remainders, whose weights
    come down into the next buffer a slice ahead of the update, so that an upload is still in flight."""
    return 3 if remainders else 2


def state_nbytes(numel: int, states) -> int:
    """Bytes a chunk of `numel` elements keeps, `states` bytes an element (state_bytes): the rows, and
    an fp8 moment's scales for every block begun (the last block may be partial)."""
    whole = int(states)
    scaled = round((states - whole) * FP8_BLOCK / 4)
    return whole * numel + 4 * scaled * -(-numel // FP8_BLOCK)


def slices(numel: int, size: int):
    """[lo, hi) ranges of at most `size` elements covering a chunk."""
    return [(lo, min(numel, lo + size)) for lo in range(0, numel, size)]


def chunk_runs(numels: List[int], cap: int) -> List[List[int]]:
    """Indices of consecutive parameters packed into chunks of at most `cap` elements
    (zero_cache.chunk_numel; a larger parameter is a chunk alone)."""
    runs: List[List[int]] = []
    size = 0
    for i, n in enumerate(numels):
        if runs and size + n <= cap:
            runs[-1].append(i)
            size += n
        else:
            runs.append([i])
            size = n
    return runs


def partition(numels: List[int], ranks: int) -> List[int]:
    """Owner rank per parameter: largest first onto the least-loaded rank (deterministic)."""
    load = [0] * ranks
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


def plan_tiers(chunk_bytes: List[int], rate: float, host_limit: int, nvme_enabled: bool) -> List[str]:
    """Tier per chunk, chunks in forward order: device for the first `rate` of the bytes, then host, then NVMe."""
    total = sum(chunk_bytes)
    tiers, on_device, on_host = [], 0, 0
    for b in chunk_bytes:
        # the device holds a prefix: once a chunk leaves it, every later one does (a small chunk that
        # would still fit must not keep its layer on the device, which would keep the layer's weights there)
        if rate >= 1.0 or (rate > 0.0 and on_device + b <= rate * total + 0.5 * b and "host" not in tiers
                           and "nvme" not in tiers):
            tiers.append("device")
            on_device += b
        elif not nvme_enabled or on_host + b <= host_limit:
            tiers.append("host")
            on_host += b
        else:
            tiers.append("nvme")
    return tiers


def tier_bytes(numels: List[int], tiers: List[str], grad_bytes: int, slice_numel: int,
               states: int = FP32_STATE_BYTES) -> Dict[str, int]:
    """Bytes each tier holds for chunks of these sizes and tiers: the states (`states` bytes an
    element: state_bytes) where the chunk lives, its gradient on the device (device chunks) or host,
    one fp32 update scratch of at most `slice_numel` elements per updating tier (and, where the states
    are not all fp32, three fp32 rows to decode them into), NVMe staging (two buffers of the largest NVMe chunk's states) on the host.
    The planner uses this too."""
    need = {"device": 0, "host": 0, "nvme": 0}
    for n, t in zip(numels, tiers):
        need[t] += state_nbytes(n, states)
        need["device" if t == "device" else "host"] += grad_bytes * n
    for tier, members in (("device", ("device",)), ("host", ("host", "nvme"))):
        sizes = [n for n, t in zip(numels, tiers) if t in members]
        if sizes:
            need[tier] += 4 * min(max(sizes), slice_numel)  # fp32 gradient scratch of the slice being updated
            if states != FP32_STATE_BYTES:
                need[tier] += STATES * 4 * min(max(sizes), CODEC_SLICE)
    nvme = [n for n, t in zip(numels, tiers) if t == "nvme"]
    if nvme:
        need["host"] += 2 * state_nbytes(max(nvme), states)
    return need


def host_room_for_states(host_limit: float, numels: List[int], grad_bytes: int, nvme_enabled: bool,
                         slice_numel: int, states: int = FP32_STATE_BYTES) -> float:
    """Host bytes left for chunk states once the host's fixed share is set aside: every off-device
    gradient (at most all of them), the update scratch and, with NVMe, its two staging buffers."""
    largest = max(numels, default=0)
    fixed = sum(n * grad_bytes for n in numels) + 4 * min(largest, slice_numel)
    if states != FP32_STATE_BYTES:
        fixed += STATES * 4 * min(largest, CODEC_SLICE)
    if nvme_enabled:
        fixed += 2 * state_nbytes(largest, states)
    return host_limit - fixed


def prefetch_depth(layer_numel: int, prefetch_bucket_size: int, max_live_parameters: int,
                   max_contigous_params_size: int, dtype_bytes: int) -> int:
    """Offloaded layers fetched ahead of the one that runs: the next always, more while they fit in
    prefetch_bucket_size; fewer where max_live_parameters or max_contigous_params_size (the running
    layer included; -1 for no limit) allow fewer."""
    depth = max(1, prefetch_bucket_size // max(1, layer_numel))
    caps = [c for c in (max_live_parameters,
                        max_contigous_params_size // dtype_bytes if max_contigous_params_size > 0 else -1) if c >= 0]
    if caps:
        depth = min(depth, min(caps) // max(1, layer_numel) - 1)
    return max(0, depth)


def training_reserve(beside_store: int, largest_group: int, grad_bytes: int, offloaded: bool, model_numel: int,
                     accumulating_on_device: bool, depth: int, weight_bytes: Optional[int] = None) -> int:
    """Device bytes training needs beside the store and the resident weights: what the caller counts
    (activations and workspace, `beside_store`), the gradients (every parameter's while micro batches
    add up on the device: in fp32 main grads, beside which autograd's gradients of one sub-group are in
    flight, or in the model's gradients themselves; else the two largest sub-groups' in flight), and,
    with offloaded layers, the one in use, those prefetched (`depth`) and one autograd has not freed yet."""
    weight_bytes = grad_bytes if weight_bytes is None else weight_bytes
    fetched = (2 + depth) * largest_group * weight_bytes if offloaded else 0
    if accumulating_on_device:
        grads = model_numel * grad_bytes + (largest_group * weight_bytes if grad_bytes != weight_bytes else 0)
    else:
        grads = 2 * largest_group * grad_bytes
    return beside_store + grads + fetched


def offloaded_layers(chunk_groups: List[int], tiers: List[str], n_groups: int, enabled: bool) -> List[bool]:
    """Per sub-group: are its weights offloaded (offload_params)? Transformer layers only (not the first
    and last sub-groups, which run at both ends of the model), and only when none of this rank's chunks
    of it is on the device (a rank that owns none of a layer does not object)."""
    flags = []
    for gi in range(n_groups):
        mine = [t for g, t in zip(chunk_groups, tiers) if g == gi]
        flags.append(enabled and 0 < gi < n_groups - 1 and all(t != "device" for t in mine))
    return flags


def accumulation_bytes(groups: List[int], numels: List[int], tiers: List[str], grad_bytes: int) -> int:
    """Device bytes that accumulating in the store adds: ACCUMULATION_SLOTS slots of the largest
    sub-group's off-device gradients (a running sum makes its round trip through one)."""
    return grad_bytes * ACCUMULATION_SLOTS * largest_off_device_group(groups, numels, tiers)


def own_weight_buffers(accumulate_in_store: bool, grad_bytes: int, weight_bytes: int,
                       remainders: bool = False) -> bool:
    """Do offloaded layers keep their weights in buffers of their own? Yes when their gradient buffers
    fill from the first micro batch on (accumulating in the store, while later micro batches still fetch
    the weights), hold another dtype than the weights (fp32 gradients), or the weights are the master's
    high half (optim.store_param_remainders: they must outlive the backward); else the weights wait in
    the gradient buffer until the last backward's gradients replace them."""
    return accumulate_in_store or grad_bytes != weight_bytes or remainders


def largest_off_device_group(groups: List[int], numels: List[int], tiers: List[str]) -> int:
    """Elements of the sub-group with the most off-device chunk elements (the size of an accumulation slot)."""
    per_group: Dict[int, int] = {}
    for g, n, t in zip(groups, numels, tiers):
        if t != "device":
            per_group[g] = per_group.get(g, 0) + n
    return max(per_group.values(), default=0)


def device_updated(groups: List[int], numels: List[int], tiers: List[str], flags: List[bool],
                   fraction: float) -> List[bool]:
    """Per chunk: is this host chunk updated on the device (states up, fused AdamW there, states back)
    rather than by the CPU? About `fraction` of the host chunks' elements, interleaved with the CPU's
    share in forward order (both update in forward order at once, and the next forward needs the first
    layers first). Host chunks only (NVMe chunks stream through the CPU), and only of layers whose
    weights stay on the device (the device update writes the new weights in place)."""
    out, done, seen = [], 0, 0
    for g, n, t in zip(groups, numels, tiers):
        mine = t == "host" and not flags[g] and fraction > 0.0
        if mine:
            seen += n
            mine = done + n <= fraction * seen + 0.5 * n
            done += n if mine else 0
        out.append(mine)
    return out


def device_update_bytes(numels: List[int], streamed: List[bool], grad_bytes: int, slice_numel: int,
                        states: int = FP32_STATE_BYTES) -> int:
    """Device memory of the two device update buffers (none when no chunk is updated there): fp32
    master, exp_avg, exp_avg_sq and gradient, where the store's gradients are not fp32 the gradient as
    it arrives in their dtype (an fp32 gradient arrives in its row directly), and where the states are
    not all fp32 the states as they arrive (`states` bytes an element), decoded on the device."""
    largest = max((n for n, s in zip(numels, streamed) if s), default=0)
    n = device_update_elements(largest, slice_numel)
    return 2 * (((STATES + 1) * 4 + (grad_bytes if grad_bytes != 4 else 0)) * n + packed_nbytes(n, states))


def packed_nbytes(n: int, states) -> int:
    """Bytes of a device update buffer's states as they arrive (none where they are all fp32: they
    arrive in their rows), a multiple of 8 so the buffer's parts stay aligned."""
    return 0 if states == FP32_STATE_BYTES else -(-state_nbytes(n, states) // 8) * 8


def device_update_slice(slice_numel: int) -> int:
    """Elements a device update buffer takes at a time (zero_cache.update_slice_numel, at most
    DEVICE_UPDATE_SLICE)."""
    return min(slice_numel, DEVICE_UPDATE_SLICE)


def device_update_elements(largest: int, slice_numel: int) -> int:
    """Elements a device update buffer holds for a largest streamed chunk of `largest` elements (a
    multiple of 8, so every part of the buffers stays aligned to its dtype)."""
    return -(-min(largest, device_update_slice(slice_numel)) // 8) * 8


def place(groups: List[int], numels: List[int], n_groups: int, rate: float, host_limit: float, nvme_enabled: bool,
          grad_bytes: int, offload_params: bool, slice_numel: int, accumulate_in_store: bool = False, allowed=None,
          device_update_fraction: float = 0.0, weight_bytes: Optional[int] = None,
          states: int = FP32_STATE_BYTES, remainders: bool = False):
    """Tiers per chunk, offloaded-weights flag per sub-group, bytes per tier, and per chunk whether the
    device updates it (`device_updated`). With NVMe, what the host cannot hold goes there: the host
    budget for states shrinks until everything on the host (states, gradients, scratch, staging) fits,
    or nothing more can move, and grows into what the device chunks' gradients leave free of the first
    pass's reserve while chunks still fit. An offloaded layer's weights live in its pinned gradient
    buffer (the last backward reads them before its gradients land there, and the update writes the
    new weights back), or in a pinned buffer of their own (own_weight_buffers). Host chunks updated on
    the device (`device_updated`) need two update buffers on the device, which share their memory with
    the accumulation slots. slice_numel: elements updated at a time (zero_cache.update_slice_numel);
    weight_bytes defaults to grad_bytes; `states`: the bytes a chunk keeps per element (state_bytes);
    `remainders`: the masters are remainders beside the weights (optim.store_param_remainders), which
    offloaded layers then keep in buffers of their own."""
    weight_bytes = grad_bytes if weight_bytes is None else weight_bytes
    separate = own_weight_buffers(accumulate_in_store, grad_bytes, weight_bytes, remainders)
    room = host_room_for_states(host_limit, numels, grad_bytes, nvme_enabled, slice_numel, states)
    fitting, last = None, None  # the last placement that fits; the tiers of the pass before
    for _ in range(4 * len(numels) + 4):  # each pass moves a chunk between host and NVMe, or stops
        tiers = plan_tiers([state_nbytes(n, states) for n in numels], rate, room, nvme_enabled)
        flags = offloaded_layers(groups, tiers, n_groups, offload_params)
        if allowed is not None:  # over DP a layer is offloaded on every rank or on none
            flags = [f and a for f, a in zip(flags, allowed)]
        need = tier_bytes(numels, tiers, grad_bytes, slice_numel, states)
        if separate:  # offloaded layers' weights in buffers of their own, else in their gradient buffers
            need["host"] += weight_bytes * sum(n for g, n in zip(groups, numels) if flags[g])
        slots = accumulation_bytes(groups, numels, tiers, grad_bytes) if accumulate_in_store else 0
        # the accumulation slots and the device update buffers share one device buffer: the update runs
        # between the last backward and the next forward, the round trips during later backward passes
        streamed = device_updated(groups, numels, tiers, flags, device_update_fraction)
        need["device"] += max(slots, device_update_bytes(numels, streamed, grad_bytes, slice_numel, states))
        over = need["host"] - host_limit
        if not nvme_enabled:
            return tiers, flags, need, streamed
        if over <= 0:
            fitting = tiers, flags, need, streamed
        if tiers == last or (over > 0 and (fitting or room <= 0)) or (over <= 0 and "nvme" not in tiers):
            return fitting or (tiers, flags, need, streamed)
        # next pass: the host states that were placed, less what is over the limit or plus what is free
        room = sum(state_nbytes(n, states) for n, t in zip(numels, tiers) if t == "host") - over
        last = tiers
    return fitting or (tiers, flags, need, streamed)
