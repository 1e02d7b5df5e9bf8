"""torchrun worker for the ZeRO-Cache AdamW equality test (CPU, gloo).

    torchrun --standalone --nproc-per-node 2 tests/distributed/zero_cache_adamw_check.py OUT.json \
        zero_cache.prefetch_cache_sub_group_rate=0.5 zero_cache.nvme_path=/tmp/nv zero_cache.host_max_gib=0.0001 \
        --next zero_cache.prefetch_cache_sub_group_rate=0.0

Three ZeRO-Cache updates of the tiny GPT against torch.optim.AdamW on an unsharded fp32 copy that
sees the DP-averaged gradients, the same clipping and weight-decay groups, for each set of overrides
(sets separated by --next; each builds its own model, reference and optimizer, and closes them). Writes,
per set and rank, the largest per-parameter relative error after one update, the whole-model relative
error after three, bytes per tier, and where the NVMe files were.
"""

import collections
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def mapped_file(address: int):
    """The file mapped at this address of the process (None for anonymous memory)."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else None
    return None


def checkpoint_views(model, opt) -> dict:
    """Where the tensors of the optimizer's checkpoint state live, for save and for load: inside a chunk's
    own states (host or device tier), in its NVMe file mapped into memory, or elsewhere (a copy)."""
    from angelgpt.train.checkpoint_state import per_layer_keys

    counts = {"chunk": 0, "nvme_file": 0, "copy": 0, "shards_per_key": 1}
    for loading in (False, True):
        model_sd = model.sharded_state_dict()
        state = opt.sharded_state_dict(model_sd, is_loading=loading)["state"]
        # as checkpoints name them: every key has one local tensor (tiers differ between layers)
        keys = collections.Counter(t.key for t in [*per_layer_keys(state).values(), *per_layer_keys(model_sd).values()]
                                   if hasattr(t, "prepend_axis_num"))
        counts["shards_per_key"] = max(counts["shards_per_key"], *keys.values())
        for ten in state.values():
            ptr = ten.data.data_ptr()
            if any(c.tier != "nvme" and b.states.data_ptr() <= ptr < b.states.data_ptr() + b.states.nbytes
                   for c, b in zip(opt.layout.chunks, opt.buffers.chunks)):
                counts["chunk"] += 1
            elif mapped_file(ptr) in {str(b.file) for c, b in zip(opt.layout.chunks, opt.buffers.chunks)
                                      if c.tier == "nvme"}:
                counts["nvme_file"] += 1
            else:
                counts["copy"] += 1
    opt.checkpoint._loading = {}
    return counts


def concrete(cfg, on_gpu: bool):
    """The config with every 'auto' made concrete as the workers settle it (the planner's resolve_config
    for this machine; the optimizer takes only resolved configs), and the device bytes training needs
    beside the store (on CUDA; the CPU's capacity check counts none)."""
    from angelgpt.planner import MACHINES, beside_store_bytes, read_this_machine, resolve_config

    machine = read_this_machine(cfg.zero_cache, 1) if on_gpu else MACHINES["h200"]
    cfg, _ = resolve_config(cfg, machine, 1, 1, on_gpu)
    return cfg, beside_store_bytes(cfg) if on_gpu else 0


def check(overrides, on_gpu: bool, device) -> dict:
    """This rank's result of the three updates with `overrides` (the module docstring)."""
    from megatron.core import parallel_state

    from angelgpt.config import parse
    from angelgpt.model.gpt import build_gpt
    from angelgpt.optimizer.cpu import param_groups
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    micro = int(os.environ.get("ANGELGPT_CHECK_MICROBATCHES", "1"))  # backward passes per step
    dp_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", "optim.clip_grad=0.5", "optim.weight_decay=0.1",
                                     "train.micro_batch_size=2", f"train.global_batch_size={2 * dp_size * micro}",
                                     *overrides])
    torch.manual_seed(0)
    model = build_gpt(cfg, on_gpu=False).to(device)
    torch.manual_seed(0)
    ref = build_gpt(cfg, on_gpu=False).to(device)  # the same weights: CPU init draws them from the seed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    cfg, beside = concrete(cfg, on_gpu)
    opt = ZeroCacheOptimizer(model, cfg, device, beside)  # the hooks offload each layer during the backward passes
    layout, nvme, weights = opt.layout, opt.buffers.nvme, opt.weights
    o = cfg.optim
    ref_opt = torch.optim.AdamW(param_groups(ref, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                eps=o.adam_eps, weight_decay=o.weight_decay)
    dp = parallel_state.get_data_parallel_world_size()
    rank = dist.get_rank()
    lrs = [1e-3, 2e-3, 5e-4]
    nvme_files = []
    for step, lr in enumerate(lrs):
        for g in opt.param_groups + ref_opt.param_groups:
            g["lr"] = lr
        for k in range(micro):
            gen = torch.Generator().manual_seed(100 + 10 * step + rank + 1000 * k)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen).to(device)
            pos = torch.arange(cfg.model.seq_length, device=device).expand(2, -1)
            for m in (model, ref):
                (m(tokens, pos, None, labels=tokens).mean() / micro).backward()
        for p in ref.parameters():  # reference: the DP-averaged gradient on an unsharded copy
            dist.all_reduce(p.grad)
            p.grad /= dp
        torch.nn.utils.clip_grad_norm_(ref.parameters(), o.clip_grad)
        ref_opt.step()
        ok, norm, _ = opt.step()
        assert ok
        opt.wait()  # pipelined: the update lands at the next forward's pre-hooks, or here
        if nvme:
            nvme_files = sorted(str(f) for f in nvme.dir.iterdir())
        opt.zero_grad()
        ref_opt.zero_grad()
        if step == 0:  # one update: every parameter on its own
            with opt.materialized():
                first_err = max(((p.to(q.device) - q).norm() / q.norm()).item()
                                for p, q in zip(model.parameters(), ref.parameters()))
    weights.peak_live_params = 0  # a forward without autograd (evaluation): each layer is released after use
    with torch.no_grad():
        model(tokens, pos, None, labels=tokens)
    eval_peak = weights.peak_live_params
    # after three updates the key biases, whose true gradient is zero, carry rounding noise that Adam
    # normalises into full steps, so the later updates are compared over the whole model
    with opt.materialized():  # offloaded layers' weights read from their host copies
        diff = sum(((p.to(q.device) - q) ** 2).sum() for p, q in zip(model.parameters(), ref.parameters())).sqrt()
        err = (diff / sum((q ** 2).sum() for q in ref.parameters()).sqrt()).item()
    offloaded = [gi for gi, f in enumerate(layout.partitioned) if f]
    released = all(p.numel() == 0 for gi in offloaded for p in layout.sub_groups[gi])
    tiers = sorted({c.tier for c in layout.chunks})
    allocated = opt.memory()
    nvme_dir = str(nvme.dir) if nvme else None
    with opt.materialized():  # as a checkpoint sees them: offloaded weights from their host copies
        in_place = checkpoint_views(model, opt)
    opt.close()
    result = {"rank": rank, "first_update_max_rel_err": first_err, "three_updates_rel_err": err, "tiers": tiers, "allocated": allocated, "planned": dict(layout.planned_bytes),
              "nvme_files": nvme_files, "nvme_dir": nvme_dir, "owned_numel": sum(c.numel for c in layout.chunks),
              "total_numel": sum(ref_p.numel() for ref_p in ref.parameters()), "offloaded_layers": offloaded,
              "released_after_use": released, "prefetch_depth": weights.prefetch_depth,
              "eval_peak_live_params": eval_peak, "checkpoint_views": in_place,
              "device_updated": sum(c.numel for c in layout.chunks if c.device_update),
              "cpu_adam": "native" if opt.cpu_adam else "torch",
              "host_numel": sum(c.numel for c in layout.chunks if c.tier == "host"),
              "split_groups": [gi for gi, cs in enumerate(layout.chunks_of) if len({c.tier for c in cs}) > 1],
              "chunks_per_group": max(len(cs) for cs in layout.chunks_of),
              "layer_params": [layout.dp_layouts[gi][1] * layout.dp_size for gi in offloaded],
              "accumulate_in_store": layout.accumulate,
              "scratch_numel": {t: s.numel() for t, s in opt.buffers.scratch.items()}}
    return result


def main():
    from angelgpt import parallel

    out, variants = sys.argv[1], [[]]
    for arg in sys.argv[2:]:
        if arg == "--next":
            variants.append([])
        else:
            variants[-1].append(arg)
    on_gpu = os.environ.get("ANGELGPT_CHECK_DEVICE") == "cuda"  # fp32 model on CUDA: device tier on the GPU
    parallel.initialize(1, 1, on_gpu=on_gpu)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    results = []
    for overrides in variants:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, check(overrides, on_gpu, device))
        results.append(gathered)
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    parallel.destroy()


if __name__ == "__main__":
    main()
