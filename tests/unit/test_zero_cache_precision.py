"""ZeRO-Cache's compact state formats on one CPU rank with the tiny model in bf16, its states in every
tier (device, host, host updated by the device, NVMe, offloaded layers' weights): the master kept as a
16-bit remainder beside the bf16 weight (optim.store_param_remainders) is the fp32 path's master bit
for bit, bf16 moments (optim.exp_avg_dtype, exp_avg_sq_dtype) are the fp32 path's rounded, checkpoints
load across formats, and the placement counts the bytes the store allocates."""

import pytest
import torch

MICRO = 2
FORMATS = {"remainders": ["optim.store_param_remainders=true"],
           "bf16-moments": ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"],
           "both": ["optim.store_param_remainders=true", "optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]}


def test_a_master_splits_into_weight_and_remainder_and_joins_back_exactly():
    """Every fp32 bit pattern (random ones, signed zeros, the largest finite, infinities, NaNs, ties)
    splits into a bf16 weight and an int16 remainder that join back to it; the weight is torch's
    round-to-nearest-even except at exact ties of an even upper half, where it rounds away from zero."""
    from angelgpt.zero_cache.precision import join_master, split_master

    gen = torch.Generator().manual_seed(0)
    special = [0, -2**31, 0x7F7FFFFF, 0x7F800000, -0x800000, 0x7FC00000, -1, 0x3F808000, 0x3F818000, 0x7FFF8000]
    bits = torch.cat([torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64),
                      torch.tensor(special)]).to(torch.int32)
    master = bits.view(torch.float32)
    hi, rem = torch.empty(master.shape, dtype=torch.bfloat16), torch.empty(master.shape, dtype=torch.int16)
    split_master(master, hi, rem)
    assert torch.equal(join_master(hi, rem, torch.empty_like(master)).view(torch.int32), bits)
    finite = torch.isfinite(master)
    rne = master.to(torch.bfloat16).view(torch.int16)
    tie_even = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)
    assert torch.equal(hi.view(torch.int16)[finite & ~tie_even], rne[finite & ~tie_even])
    assert torch.equal(hi.view(torch.int16)[finite & tie_even], rne[finite & tie_even] + 1)  # away from zero
    assert int((finite & tie_even).sum()) >= 1


class _Scheduler:  # the checkpoint's scheduler entry (not what is tested here)
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


# two placements that between them put states in every tier and take every update path: offloaded
# layers (their weights on the host) with host and NVMe chunks; resident layers with host chunks the
# CPU updates, host chunks the device updates and an NVMe chunk
LAYOUTS = {"offloaded": ([], {"device", "host", "nvme", "streamed", "offloaded"}),
           "resident": (["zero_cache.offload_params=false", "model.num_layers=4", "zero_cache.host_max_gib=0.003"],
                        {"device", "host", "nvme", "streamed"})}


# host budgets (GiB) that still leave an NVMe chunk where the compact states take less room
HOST = {("offloaded", "both"): 0.0021, ("resident", "both"): 0.0026}


def build(tmp_path, fmt=(), cpu_adam="native", name="a", layout="offloaded", host=None, device="cpu",
          dtype=torch.bfloat16, seen=None):
    """The tiny model in bf16 (seed 0) and ZeRO-Cache over every tier: a third of the states on the
    device, host chunks half updated by the device, the rest on NVMe (LAYOUTS)."""
    from angelgpt.config import parse
    from angelgpt.model.gpt import build_gpt
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer
    from angelgpt.planner import MACHINES, resolve_config

    nvme = tmp_path / f"nvme-{name}"
    cfg = parse("tiny", overrides=[
        "optim.optimizer=zero_cache", "train.micro_batch_size=2", f"train.global_batch_size={2 * MICRO}",
        "zero_cache.prefetch_cache_sub_group_rate=0.3", "zero_cache.offload_params=true",
        "zero_cache.device_update_fraction=0.5", "zero_cache.accumulate_in_store=false", "model.recompute=none",
        f"zero_cache.cpu_adam={cpu_adam}", f"zero_cache.nvme_path={nvme}", "zero_cache.host_max_gib=0.0025",
        "optim.clip_grad=0.5", *LAYOUTS[layout][0], *fmt, *([f"zero_cache.host_max_gib={host}"] if host else [])])
    device = torch.device(device)
    cfg, _ = resolve_config(cfg, MACHINES["h200"], 1, 1, on_gpu=device.type == "cuda")
    torch.manual_seed(0)
    model = build_gpt(cfg, on_gpu=False).to(device=device, dtype=dtype)
    if seen is not None:  # each parameter's gradients as backward leaves them (a hook before the optimizer's)
        for k, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, k=k: seen.setdefault(k, []).append(p.grad.clone()))
    return cfg, model, ZeroCacheOptimizer(model, cfg, device, 0)


def train_step(cfg, model, opt, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    device = opt.store.device
    pos = torch.arange(cfg.model.seq_length, device=device).expand(2, -1)
    total = 0.0
    for _ in range(MICRO):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen).to(device)
        loss = model(tokens, pos, None, labels=tokens).float().mean() / MICRO
        loss.backward()
        total += loss.item()
    ok, _, _ = opt.step()
    opt.wait()
    assert ok
    return total


def states(model, opt) -> dict:
    """name -> (fp32 master, exp_avg as kept, exp_avg_sq as kept, bf16 weight), NVMe chunks read back."""
    from angelgpt.zero_cache.precision import decoded_master

    store = opt.store
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    with opt.materialized():  # (over DP it fetches every offloaded layer: once, on every rank)
        for c in store.chunks:
            rows = opt.checkpoint._chunk_states(c)
            master = decoded_master(store.format, rows, c.hi)
            for (p, off, shape) in zip(c.params, c.offsets, c.shapes):
                n = shape.numel()
                out[names[id(p)]] = (master[off:off + n].clone(), rows[1][off:off + n].clone(),
                                     rows[2][off:off + n].clone(), p.detach().reshape(-1).clone())
    return out


def tiers(opt) -> set:
    s = opt.store
    return ({c.tier for c in s.chunks} | ({"streamed"} if any(c.device_update for c in s.chunks) else set())
            | ({"offloaded"} if any(s.partitioned) else set()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cpu_adam", ["native", "torch"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compact_states_update_as_the_fp32_path_does(megatron_single_rank, tmp_path, fmt, cpu_adam, layout):
    """One step from the same model and batches: the master (decoded from remainders) equals the fp32
    path's bit for bit in every tier, bf16 moments are the fp32 path's rounded to nearest even, and the
    bf16 weights are the master rounded to nearest (ties away from zero with remainders, which the fp32
    path rounds to even); three more steps give losses within 1e-3 (tests/gpu runs it on a GPU)."""
    compare_formats(tmp_path, fmt, cpu_adam, layout, "cpu")


def compare_formats(tmp_path, fmt, cpu_adam, layout, device, min_same=1.0):
    """The comparison above on `device`. Clipping is off, so each element's update depends on its own
    gradient alone: a parameter is compared bit for bit where both runs' backward passes gave it the
    same gradients (every one on a CPU; a GPU's atomics may add an embedding's rows in another order),
    at least `min_same` of the parameters."""
    from angelgpt.zero_cache.precision import split_master

    seen, seen2 = {}, {}
    off = ["optim.clip_grad=0"]
    cfg, model, opt = build(tmp_path, off, cpu_adam=cpu_adam, name="ref", layout=layout, device=device, seen=seen)
    cfg2, model2, opt2 = build(tmp_path, [*FORMATS[fmt], *off], cpu_adam=cpu_adam, name="compact", layout=layout,
                               host=HOST.get((layout, fmt)), device=device, seen=seen2)
    try:
        assert tiers(opt) == tiers(opt2) == LAYOUTS[layout][1]
        assert train_step(cfg, model, opt, 1) == train_step(cfg2, model2, opt2, 1)
        ref, got = states(model, opt), states(model2, opt2)
        remainders, bf16 = fmt != "bf16-moments", fmt != "remainders"
        same = [k for k in ref if all(torch.equal(a, b) for a, b in zip(seen[k], seen2[k]))]
        assert len(same) >= min_same * len(ref), sorted(set(ref) - set(same))
        for k in same:
            master, m, v, w = ref[k]
            master2, m2, v2, w2 = got[k]
            assert torch.equal(master2.view(torch.int32), master.view(torch.int32)), k
            assert m2.dtype == v2.dtype == (torch.bfloat16 if bf16 else torch.float32)
            assert torch.equal(m2, m.to(m2.dtype)) and torch.equal(v2, v.to(v2.dtype)), k
            if remainders:
                hi, rem = torch.empty_like(w), torch.empty(master.shape, dtype=torch.int16)
                split_master(master, hi, rem)
                assert torch.equal(w2, hi), k
            else:
                assert torch.equal(w2, w), k
        losses = [(train_step(cfg, model, opt, s), train_step(cfg2, model2, opt2, s)) for s in (2, 3, 4)]
        assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in losses), losses
    finally:
        opt.close()
        opt2.close()


def _save(model, opt, path):
    from angelgpt.train import checkpoint

    checkpoint.Saver(str(path), {}, None, True, torch.device("cpu")).save(1, 0, model, opt, _Scheduler(), False)


def _load(model, opt, path):
    from angelgpt.train import checkpoint

    checkpoint.load(str(path), model, opt, _Scheduler())


@pytest.mark.parametrize("saved,loaded", [("fp32", "both"), ("both", "fp32"), ("both", "both"),
                                          ("remainders", "bf16-moments"), ("both", "fp32-model")])
def test_a_checkpoint_loads_into_another_format(megatron_single_rank, tmp_path, saved, loaded):
    """Saved after a step in one format, loaded into a fresh optimizer of another (or into an fp32
    model, as a CPU run builds it): the masters are the saved ones bit for bit, the moments the saved
    ones in the loading dtype (rounded to nearest even), and the next step's loss equals the saving
    optimizer's own next loss to 1e-3 (to 1e-2 in the fp32 model)."""
    fmt = lambda name: [] if name.startswith("fp32") else FORMATS[name]  # noqa: E731
    cfg, model, opt = build(tmp_path, fmt(saved), name="saved")
    cfg2, model2, opt2 = build(tmp_path, fmt(loaded), name="loaded",
                               dtype=torch.float32 if loaded == "fp32-model" else torch.bfloat16)
    try:
        train_step(cfg, model, opt, 1)
        _save(model, opt, tmp_path / "ck")
        _load(model2, opt2, tmp_path / "ck")
        a, b = states(model, opt), states(model2, opt2)
        for k in a:
            assert torch.equal(b[k][0].view(torch.int32), a[k][0].view(torch.int32)), k
            assert torch.equal(b[k][1], a[k][1].to(b[k][1].dtype)) and torch.equal(b[k][2], a[k][2].to(b[k][2].dtype))
        assert int(opt2.store.chunks[0].step) == 1
        x, y = train_step(cfg, model, opt, 2), train_step(cfg2, model2, opt2, 2)
        assert abs(x - y) <= (1e-2 if loaded == "fp32-model" else 1e-3) * abs(x), (x, y)
    finally:
        opt.close()
        opt2.close()


@pytest.mark.parametrize("fmt", ["fp32", "both"])
def test_placement_counts_what_the_store_allocates(megatron_single_rank, tmp_path, fmt):
    """The bytes placement planned per tier are the bytes the tiers allocated, in each format; the
    compact one plans 2 + 2 + 2 = 6 bytes a parameter fewer."""
    cfg, model, opt = build(tmp_path, [] if fmt == "fp32" else FORMATS[fmt])
    try:
        planned, held = opt.store.planned_bytes, opt.store.allocated_bytes()
        numel = sum(c.numel for c in opt.store.chunks)
        states_planned = sum(planned.values())
        assert {t: held[t] for t in planned} == planned
        assert opt.store.format.bytes == (12 if fmt == "fp32" else 6)
        assert states_planned >= numel * opt.store.format.bytes
    finally:
        opt.close()


def test_the_readmes_bytes_per_parameter_are_the_placements():
    """README's and zero_cache/README.md's tables of bytes a parameter: the 2-byte weight, the states
    placement counts (placement.state_bytes) and a 4-byte (fp32 sums) or 2-byte gradient."""
    import re
    from pathlib import Path

    from angelgpt.zero_cache.placement import state_bytes

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    rows = re.findall(r"\| (false \(default\)|true) \| (fp32|bf16)[^|]*\| (\d+) \| (\d+) \|", readme)
    assert len(rows) == 3
    for remainders, moments, fp32_sums, bf16_sums in rows:
        states = state_bytes(remainders == "true", moments, moments)
        assert (int(fp32_sums), int(bf16_sums)) == (2 + states + 4, 2 + states + 2)
    inner = (root / "angelgpt" / "zero_cache" / "README.md").read_text()
    rows = re.findall(r"\| (default|`store_param_remainders: true`|and `exp_avg_dtype`[^|]*) \| [^|]+ \| (fp32|bf16) "
                      r"\| (\d+) \| (\d+) \| (\d+) \|", inner)
    assert len(rows) == 3
    for choice, moments, states, fp32_sums, bf16_sums in rows:
        assert int(states) == state_bytes(choice != "default", moments, moments)
        assert (int(fp32_sums), int(bf16_sums)) == (2 + int(states) + 4, 2 + int(states) + 2)


def test_plan_says_the_bytes_a_parameter_costs():
    """`angelgpt plan` prints ZeRO-Cache's model states a parameter for the formats chosen: 18 by default
    with fp32 sums, 16 with remainders, 12 with bf16 moments too, 10 with bf16 sums as well."""
    from angelgpt.config import parse
    from angelgpt.planner.report import bytes_per_parameter

    base = ["optim.optimizer=zero_cache", "train.micro_batch_size=2", "train.global_batch_size=32"]
    for extra, total in (([], 18), (FORMATS["remainders"], 16), (FORMATS["both"], 12),
                         ([*FORMATS["both"], "optim.accumulate_grads_in_fp32=false"], 10)):
        line = bytes_per_parameter(parse("h200-16b", overrides=[*base, *extra]), world=1)
        assert line.startswith(f"model states: {total} bytes a parameter"), line
