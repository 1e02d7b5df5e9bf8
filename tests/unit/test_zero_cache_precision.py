"""ZeRO-Cache's compact state formats on one CPU rank with the tiny model in bf16, its states in every
tier (device, host, host updated by the device, NVMe, offloaded layers' weights): the master kept as a
16-bit remainder beside the bf16 weight (optim.store_param_remainders) is the fp32 path's master bit
for bit, bf16 moments (optim.exp_avg_dtype, exp_avg_sq_dtype) are the fp32 path's rounded, checkpoints
load across formats, and the placement counts the bytes the store allocates."""

import contextlib
import itertools

import pytest
import torch

from tests.helpers import one_quick

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


# host budgets (GiB) that still leave an NVMe chunk where the compact states take less room, and place each
# parameter's update on the processor the fp32 path's runs on (`updaters`)
HOST = {("offloaded", "both"): 0.0021, ("resident", "both"): 0.0026, ("resident", "remainders"): 0.0032,
        ("offloaded", "fp8-moments"): 0.0021, ("resident", "fp8-moments"): 0.0026,
        ("offloaded", "smallest"): 0.0018, ("resident", "smallest"): 0.0021}


def build(tmp_path, fmt=(), cpu_adam="native", name="a", layout="offloaded", host=None, device="cpu",
          dtype=torch.bfloat16, seen=None):
    """The tiny model in bf16 (seed 0) and ZeRO-Cache over every tier: a third of the states on the
    device, host chunks half updated by the device, the rest on NVMe (LAYOUTS); a separate fp32 master
    unless fmt asks for remainders."""
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
        "optim.clip_grad=0.5", "optim.store_param_remainders=false", *LAYOUTS[layout][0], *fmt,
        *([f"zero_cache.host_max_gib={host}"] if host else [])])
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    cfg, _ = resolve_config(cfg, MACHINES["h200"], 1, 1, on_gpu=device.type == "cuda")
    torch.manual_seed(0)
    model = build_gpt(cfg, on_gpu=False).to(device=device, dtype=dtype)
    if seen is not None:  # each parameter's gradients as backward leaves them (a hook before the optimizer's)
        for k, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, k=k: seen.setdefault(k, []).append(p.grad.clone()))
    return cfg, model, ZeroCacheOptimizer(model, cfg, device, 0)


def train_step(cfg, model, opt, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    device = opt.device
    pos = torch.arange(cfg.model.seq_length, device=device).expand(2, -1)
    total = 0.0
    opt.zero_grad()  # as the training loop does before each step
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
    """name -> (fp32 master, exp_avg as kept, exp_avg_sq as kept, bf16 weight), NVMe chunks read back;
    fp8 moments decoded into bf16 (exact), and their scales per element under name + '.scales'."""
    from angelgpt.zero_cache.precision import Blockwise, decoded_master, read_moment

    layout = opt.layout
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    with opt.materialized():  # (over DP it fetches every offloaded layer: once, on every rank)
        for c in layout.chunks:
            rows = opt.checkpoint._chunk_states(c)
            master = decoded_master(layout.format, rows, opt.buffers.chunks[c.index].hi)
            scales = [r.scales.cpu().repeat_interleave(256)[:c.numel] if isinstance(r, Blockwise) else None
                      for r in rows]
            rows = [read_moment(r, torch.empty(c.numel), squared=k == 2).to(torch.bfloat16)
                    if isinstance(r, Blockwise) else r for k, r in enumerate(rows)]
            for (p, off, shape) in zip(c.params, c.offsets, c.shapes):
                if scales[1] is not None:
                    out[names[id(p)] + ".scales"] = [s[off:off + shape.numel()].clone() for s in scales[1:]]
            for (p, off, shape) in zip(c.params, c.offsets, c.shapes):
                n = shape.numel()
                out[names[id(p)]] = (master[off:off + n].clone(), rows[1][off:off + n].clone(),
                                     rows[2][off:off + n].clone(), p.detach().reshape(-1).clone())
    return out


def updaters(model, opt) -> dict:
    """name -> where its update runs: "device" (a device chunk, or a host chunk the device updates: torch's
    fused AdamW) or "cpu" (the CPU kernel). Two runs compare bit for bit only where these agree: on a GPU
    the two kernels may round an element's update differently (CUDA contracts to fused multiply-adds)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: "device" if c.tier == "device" or c.device_update else "cpu"
            for c in opt.layout.chunks for p in c.params}


def tiers(opt) -> set:
    s = opt.layout
    return ({c.tier for c in s.chunks} | ({"streamed"} if any(c.device_update for c in s.chunks) else set())
            | ({"offloaded"} if any(s.partitioned) else set()))


@pytest.mark.parametrize("fmt,cpu_adam,layout", one_quick(("both", "torch", "offloaded"), itertools.product(
    FORMATS, ["native", "torch"], LAYOUTS)))
def test_compact_states_update_as_the_fp32_path_does(megatron_single_rank, tmp_path, fmt, cpu_adam, layout):
    """One step from the same model and batches: the master (decoded from remainders) equals the fp32
    path's bit for bit in every tier, bf16 moments are the fp32 path's rounded to nearest even, and the
    bf16 weights are the master rounded to nearest (ties away from zero with remainders, which the fp32
    path rounds to even); three more steps give losses within 1e-3 (tests/gpu runs it on a GPU)."""
    compare_formats(tmp_path, fmt, cpu_adam, layout, "cpu")


def compare_formats(tmp_path, fmt, cpu_adam, layout, device, min_same=1.0):
    """The comparison above on `device` (beside_fp32 says which parameters are compared bit for bit)."""
    from angelgpt.zero_cache.precision import split_master

    with beside_fp32(tmp_path, FORMATS[fmt], HOST.get((layout, fmt)), cpu_adam, layout, device,
                     min_same) as (ref, got, same, more):
        remainders, bf16 = fmt != "bf16-moments", fmt != "remainders"
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
        losses = more((2, 3, 4))
        assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in losses), losses


@contextlib.contextmanager
def beside_fp32(tmp_path, overrides, host, cpu_adam, layout, device, min_same):
    """Two runs from the same model and batches, the fp32 path's and one with `overrides` (its host
    budget `host`), clipping off so each element's update depends on its own gradient alone, placed
    alike: the layout's tiers, each parameter updated on the same processor in both. After one step of
    each (equal losses) yields (ref, got, same, more): their states (`states`), the parameters whose
    gradients were equal in both runs (every one on a CPU; a GPU's atomics may add an embedding's rows
    in another order; at least `min_same` of them), and more(seeds) -> the two runs' losses of more
    steps."""
    seen, seen2 = {}, {}
    off = ["optim.clip_grad=0"]
    cfg, model, opt = build(tmp_path, off, cpu_adam=cpu_adam, name="ref", layout=layout, device=device, seen=seen)
    try:
        cfg2, model2, opt2 = build(tmp_path, [*overrides, *off], cpu_adam=cpu_adam, name="other", layout=layout,
                                   host=host, device=device, seen=seen2)
    except BaseException:
        opt.close()
        raise
    try:
        assert tiers(opt) == tiers(opt2) == LAYOUTS[layout][1]
        assert updaters(model, opt) == updaters(model2, opt2)
        assert train_step(cfg, model, opt, 1) == train_step(cfg2, model2, opt2, 1)
        ref, got = states(model, opt), states(model2, opt2)
        same = [k for k in ref if all(torch.equal(a, b) for a, b in zip(seen[k], seen2[k]))]
        assert len(same) >= min_same * len(ref), sorted(set(ref) - set(same))
        yield ref, got, same, lambda seeds: [(train_step(cfg, model, opt, s), train_step(cfg2, model2, opt2, s))
                                              for s in seeds]
    finally:
        opt.close()
        opt2.close()


def _save(model, opt, path):
    from angelgpt.train import checkpoint

    checkpoint.Saver(str(path), {}, None, True, torch.device("cpu")).save(1, 0, model, opt, _Scheduler(), False)


def _load(model, opt, path):
    from angelgpt.train import checkpoint

    checkpoint.load(str(path), model, opt, _Scheduler())


@pytest.mark.slow  # a save and a load through the checkpoint code each (tests/unit/test_checkpoint_saver.py is quick)
@pytest.mark.parametrize("saved,loaded", [("fp32", "both"), ("both", "fp32"), ("both", "both"),
                                          ("remainders", "bf16-moments"), ("both", "fp32-model"),
                                          ("smallest", "smallest"), ("smallest", "fp32"), ("fp8-moments", "both"),
                                          ("fp32", "smallest"), ("fp32", "fp32")])
def test_a_checkpoint_loads_into_another_format(megatron_single_rank, tmp_path, saved, loaded):
    """Saved after a step in one format, loaded into a fresh optimizer of another (or into an fp32
    model, as a CPU run builds it): the masters are the saved ones bit for bit, the moments the saved
    ones in the loading dtype (rounded to nearest even; fp8 ones, saved decoded, exactly; into fp8,
    within a code's step), and the next step's loss equals the saving optimizer's own next loss to 1e-3
    (to 1e-2 in the fp32 model); in the same format the next step's states are the saving optimizer's
    bit for bit."""
    fmt = lambda name: [] if name.startswith("fp32") else {**FORMATS, **FP8}[name]  # noqa: E731
    cfg, model, opt = build(tmp_path, fmt(saved), name="saved")
    cfg2, model2, opt2 = build(tmp_path, fmt(loaded), name="loaded",
                               dtype=torch.float32 if loaded == "fp32-model" else torch.bfloat16)
    try:
        train_step(cfg, model, opt, 1)
        _save(model, opt, tmp_path / "ck")
        _load(model2, opt2, tmp_path / "ck")
        a, b = states(model, opt), states(model2, opt2)
        for k in (k for k in a if not k.endswith(".scales")):
            assert torch.equal(b[k][0].view(torch.int32), a[k][0].view(torch.int32)), k
            for j in (1, 2):
                if loaded in FP8 and saved not in FP8:  # rounded to a neighbouring code
                    ref, got = (a[k][j].float(), b[k][j].float()) if j == 1 else (a[k][j].float().sqrt(),
                                                                                 b[k][j].float().sqrt())
                    assert torch.all((got - ref).abs() <= ref.abs() / 8 + b[k + ".scales"][j - 1] * 2.0 ** -9), k
                else:
                    assert torch.equal(b[k][j], a[k][j].to(b[k][j].dtype)), (k, j)
        assert int(opt2.buffers.chunks[0].step) == 1
        x, y = train_step(cfg, model, opt, 2), train_step(cfg2, model2, opt2, 2)
        assert abs(x - y) <= (1e-2 if loaded == "fp32-model" else 1e-3) * abs(x), (x, y)
        if saved == loaded:
            a, b = states(model, opt), states(model2, opt2)
            bad = [(k, j) for k in a for j, (u, v) in enumerate(zip(a[k], b[k])) if not torch.equal(u, v)]
            assert not bad, (bad, x, y)
    finally:
        opt.close()
        opt2.close()


@pytest.mark.parametrize("fmt", one_quick("smallest", ["fp32", "both", "smallest"]))
def test_placement_counts_what_the_store_allocates(megatron_single_rank, tmp_path, fmt):
    """The bytes placement planned per tier are the bytes the tiers allocated, in each format; the
    compact one plans 2 + 2 + 2 = 6 bytes a parameter fewer, fp8 moments 2 + 3 + 3 fewer and two fp32
    scales per 256 elements."""
    cfg, model, opt = build(tmp_path, [] if fmt == "fp32" else {**FORMATS, **FP8}[fmt],
                            host=HOST.get(("offloaded", fmt)))
    try:
        planned, held = opt.layout.planned_bytes, opt.memory()
        numel = sum(c.numel for c in opt.layout.chunks)
        states_planned = sum(planned.values())
        assert {t: held[t] for t in planned} == planned
        assert opt.layout.format.bytes == {"fp32": 12, "both": 6, "smallest": 4 + 8 / 256}[fmt]
        bufs = opt.buffers.chunks
        assert sum(b.raw.numel() for b in bufs if b.raw is not None) + sum(
            b.file.stat().st_size for b in bufs if b.file is not None) == sum(
            4 * -(-c.numel // 256) * 2 + 4 * c.numel if fmt == "smallest" else c.numel * opt.layout.format.bytes
            for c in opt.layout.chunks)
        assert states_planned >= numel * opt.layout.format.bytes
    finally:
        opt.close()


def test_the_docs_bytes_per_parameter_are_the_placements():
    """docs/zero-cache-and-planner.md's and zero_cache/README.md's tables of bytes a parameter: the
    2-byte weight, the states placement counts (placement.state_bytes) and a 4-byte (fp32 sums) or
    2-byte gradient."""
    import re
    from pathlib import Path

    from angelgpt.zero_cache.placement import state_bytes

    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "zero-cache-and-planner.md").read_text()
    said = lambda x: float(f"{x:.2f}")  # noqa: E731  (the tables give two decimals)
    rows = re.findall(r"\| (false|true)[^|]*\| (fp32|bf16|fp8)[^|]*\| ([\d.]+) \| ([\d.]+) \|", guide)
    assert len(rows) == 4
    for remainders, moments, fp32_sums, bf16_sums in rows:
        states = state_bytes(remainders == "true", moments, moments)
        assert (float(fp32_sums), float(bf16_sums)) == (said(2 + states + 4), said(2 + states + 2))
    inner = (root / "angelgpt" / "zero_cache" / "README.md").read_text()
    rows = re.findall(r"\| (`store_param_remainders: false`|default[^|]*|and `exp_avg_dtype`[^|]*) \| [^|]+ \| "
                      r"(fp32|bf16|fp8) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", inner)
    assert len(rows) == 4
    for choice, moments, states, fp32_sums, bf16_sums in rows:
        exact = state_bytes(choice != "`store_param_remainders: false`", moments, moments)
        assert float(states) == said(exact)
        assert (float(fp32_sums), float(bf16_sums)) == (said(2 + exact + 4), said(2 + exact + 2))


def test_plan_says_the_bytes_a_parameter_costs():
    """`angelgpt plan` prints ZeRO-Cache's model states a parameter for the formats chosen: 16 by default
    with fp32 sums (remainders: 'auto' is on for a GPU's bf16 model), 18 with a separate fp32 master, 16
    with remainders asked for, 12 with bf16 moments too, 10 with bf16 sums as well, 8.03 with fp8
    moments instead."""
    from angelgpt.config import parse
    from angelgpt.planner.report import bytes_per_parameter

    base = ["optim.optimizer=zero_cache", "train.micro_batch_size=2", "train.global_batch_size=32"]
    for extra, total in (([], 16), (["optim.store_param_remainders=false"], 18), (FORMATS["remainders"], 16),
                         (FORMATS["both"], 12),
                         ([*FORMATS["both"], "optim.accumulate_grads_in_fp32=false"], 10),
                         ([*FP8["smallest"], "optim.accumulate_grads_in_fp32=false"], 8.03)):
        line = bytes_per_parameter(parse("h200-16b", overrides=[*base, *extra]), world=1)
        assert line.startswith(f"model states: {total} bytes a parameter"), line


FP8 = {"fp8-moments": ["optim.exp_avg_dtype=fp8", "optim.exp_avg_sq_dtype=fp8"],
       "smallest": ["optim.store_param_remainders=true", "optim.exp_avg_dtype=fp8", "optim.exp_avg_sq_dtype=fp8"]}


def test_fp8_moments_keep_codes_exactly_and_round_the_rest_without_bias():
    """An fp8 row (E4M3 codes, a power-of-two scale per 256): values that are codes times the scale are
    written exactly, whatever the random bits; others go to one of the two neighbouring codes with the
    mean of many writes the value itself (stochastic rounding), also below E4M3's normal range and for
    exp_avg_sq (kept as its square root); decoded values, squared ones too, are exact in bf16."""
    from angelgpt.zero_cache.precision import Blockwise, read_moment, write_moment

    def row(n):
        return Blockwise(torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // 256), dtype=torch.float32))

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen) * torch.logspace(-6, 0, 1000)  # a tail block of 232
    r = row(x.numel())
    write_moment(x, r, seed=(1, 1))
    kept = read_moment(r, torch.empty(x.numel()))
    assert torch.equal(kept.to(torch.bfloat16).float(), kept)
    for seed in ((2, 7), (5, 9)):  # a code is written back as itself
        r2 = row(x.numel())
        write_moment(kept, r2, seed=seed)
        assert torch.equal(r2.codes, r.codes) and torch.equal(r2.scales, r.scales)
    blocks = torch.split(x.abs(), 256)
    scales = torch.stack([b.max() for b in blocks])
    assert torch.all(scales / r.scales <= 448) and torch.all(scales / r.scales > 224)
    assert torch.all(torch.frexp(r.scales).mantissa == 0.5)  # powers of two
    gap = (r.scales.repeat_interleave(256)[:x.numel()] * 32)  # the largest step between codes of a block
    assert torch.all((kept - x).abs() <= gap)
    for value in (0.3, -0.0041, 3e-5):  # one block's largest is 1: 3e-5 is below E4M3's normal range
        many = torch.full((256 * 400,), value)
        many[::256] = 1.0
        rr = row(many.numel())
        write_moment(many, rr, seed=(3, 3))
        got = read_moment(rr, torch.empty(many.numel())).view(400, 256)[:, 1:]
        assert got.unique().numel() == 2
        assert abs(got.double().mean().item() - value) < 0.01 * abs(value), value
    for tiny, squared in ((1e-37, False), (1e-36, True)):  # blocks at the smallest scale: still exact in bf16
        small = x.abs() * tiny
        rt = row(small.numel())
        write_moment(small, rt, squared=squared, seed=(6, 6))
        back = read_moment(rt, torch.empty(small.numel()), squared=squared)
        assert torch.equal(back.to(torch.bfloat16).float(), back) and back.abs().max() > 0
    v = x.square()
    rv = row(v.numel())
    write_moment(v, rv, squared=True, seed=(4, 1))
    vv = read_moment(rv, torch.empty(v.numel()), squared=True)
    assert torch.equal(vv.to(torch.bfloat16).float(), vv)
    write_moment(vv, r2, squared=True, seed=(8, 8))
    assert torch.equal(r2.codes, rv.codes) and torch.equal(r2.scales, rv.scales)


@pytest.mark.parametrize("fmt,cpu_adam,layout", one_quick(("smallest", "torch", "offloaded"), itertools.product(
    FP8, ["native", "torch"], LAYOUTS)))
def test_fp8_moments_update_as_the_fp32_path_within_a_code(megatron_single_rank, tmp_path, fmt, cpu_adam, layout):
    """One step in every tier from the same model and batches: the master equals the fp32 path's bit
    for bit (the first step's moments start at zero, which fp8 keeps exactly) and each moment is the
    fp32 path's rounded to one of its two neighbouring fp8 values; three more steps give losses within
    1e-2 of the fp32 path's (tests/gpu runs it on a GPU)."""
    fp8_against_fp32(tmp_path, fmt, cpu_adam, layout, "cpu")


def fp8_against_fp32(tmp_path, fmt, cpu_adam, layout, device, min_same=1.0):
    """The comparison above on `device` (beside_fp32 says which parameters are compared bit for bit)."""
    with beside_fp32(tmp_path, FP8[fmt], HOST[layout, fmt], cpu_adam, layout, device,
                     min_same) as (ref, got, same, more):
        for k in same:
            master, m, v, _ = ref[k]
            master2, m2, v2, _ = got[k]
            assert torch.equal(master2.view(torch.int32), master.view(torch.int32)), k
            assert m2.dtype == v2.dtype == torch.bfloat16  # decoded (exact)
            # within a code's step of the fp32 path's: an eighth of the value, or the block's smallest step
            # (a block may span two parameters of the tiny model: the smallest step is its larger one's)
            step_m, step_v = (s * 2.0 ** -9 for s in got[k + ".scales"])
            m, v = m.cpu(), v.cpu()
            assert torch.all((m2.float() - m).abs() <= m.abs() / 8 + step_m), k
            assert torch.all((v2.float().sqrt() - v.sqrt()).abs() <= v.sqrt() / 8 + step_v), k
        losses = more((2, 3, 4))
        assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in losses), losses