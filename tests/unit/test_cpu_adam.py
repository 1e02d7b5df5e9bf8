"""The one-pass CPU AdamW kernel (zero_cache/cpu_adam.c) against torch's fused AdamW with the dtype
conversions around it, and its build and fallback rules."""

import shutil

import pytest
import torch

from angelgpt.zero_cache.cpu_adam import CpuAdam, CpuAdamUnavailable, build
from tests.helpers import one_quick

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

HYPER = dict(lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def reference(states, grad, step, coef):
    """torch: gradient up to fp32, fused AdamW (clipping as grad_scale), weights back to grad's dtype."""
    g = grad.float()
    scale = None if coef >= 1.0 else torch.tensor(1.0 / coef)
    torch._fused_adamw_([states[0]], [g], [states[1]], [states[2]], [], [torch.tensor(float(step))],
                        lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                        weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False, maximize=False,
                        grad_scale=scale)
    return states[0].to(grad.dtype)


@pytest.fixture(scope="module")
def adam():
    # the machine's cached build (keyed on the source, flags and CPU); test_load_modes builds into a new cache
    return CpuAdam(build(), threads=3)  # three threads taking five blocks, the last one partial


@pytest.mark.parametrize("dtype", one_quick(torch.bfloat16, [torch.bfloat16, torch.float32]))
@pytest.mark.parametrize("out_mode", one_quick("buffer", ["buffer", "over_grad", "none"]))
def test_matches_torch_adamw(adam, dtype, out_mode):
    n = 300_007  # not a multiple of any vector width, nor of the 65,536-element block
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(3, n, generator=gen)
    states[2].abs_()
    ref = states.clone()
    for step, coef in [(1, 1.0), (2, 0.3), (3, 5.0)]:  # coef >= 1: no clipping
        grad = torch.randn(n, generator=gen).to(dtype)
        expected = reference(ref, grad.clone(), step, coef)
        out = {"buffer": torch.empty(n, dtype=dtype), "over_grad": grad, "none": None}[out_mode]
        before = grad.clone()
        adam.step(states, grad, out, step=step, coef=coef, **HYPER)
        torch.testing.assert_close(states, ref, rtol=1e-5, atol=1e-6)  # ulps of O(1) terms
        if out is not None:
            assert torch.equal(out, states[0].to(dtype))  # the new weight, rounded to nearest even
            assert (out.float() - expected.float()).abs().max() <= (expected.float().abs().max() * 2 ** -7)
        if out_mode != "over_grad":
            assert torch.equal(grad, before)  # the gradient is only read


def test_fp32_gradient_writes_bf16_weights(adam):
    """Gradients added up in fp32 (optim.accumulate_grads_in_fp32), weights in bf16: the fp32 gradient is
    read as it is (not rounded to bf16 first) and the new weights are written in bf16."""
    n = 200_003
    gen = torch.Generator().manual_seed(1)
    states = torch.randn(3, n, generator=gen)
    states[2].abs_()
    ref, rounded = states.clone(), states.clone()
    grad = torch.randn(n, generator=gen) * (1 + 2 ** -12)  # most of these are not bf16 values
    assert not torch.equal(grad, grad.to(torch.bfloat16).float())
    out = torch.empty(n, dtype=torch.bfloat16)
    adam.step(states, grad, out, step=2, coef=0.7, **HYPER)
    reference(ref, grad.clone(), 2, 0.7)
    reference(rounded, grad.to(torch.bfloat16), 2, 0.7)
    torch.testing.assert_close(states, ref, rtol=1e-5, atol=1e-6)
    assert (states[1] - ref[1]).abs().max() < (rounded[1] - ref[1]).abs().max() / 10  # fp32, not bf16, read
    assert torch.equal(out, states[0].to(torch.bfloat16))
    with pytest.raises(AssertionError, match="another dtype"):
        adam.step(states, grad, grad.view(torch.bfloat16)[:n], step=3, coef=1.0, **HYPER)


def test_bf16_rounding_is_torchs():
    """The weights written in bf16 round as torch rounds (nearest, ties to even; NaN and inf kept)."""
    values = torch.tensor([1.0, 1.00390625, 1.01171875, -2.5e-39, 3.4e38, float("inf"), float("-inf"), 0.0,
                           1 + 2 ** -8, 1 + 3 * 2 ** -8, 65504.0, -1e-3])
    lib = CpuAdam(build(), threads=1)
    states = torch.zeros(3, values.numel())
    states[0] = values
    out = torch.empty(values.numel(), dtype=torch.bfloat16)
    # lr 0, no decay and a zero gradient leave the master as it is: out is its bf16 rounding
    lib.step(states, torch.zeros(values.numel(), dtype=torch.bfloat16), out, step=1, lr=0.0, weight_decay=0.0,
             betas=(0.9, 0.95), eps=1e-8, coef=1.0)
    assert torch.equal(out, values.to(torch.bfloat16))


@pytest.mark.slow  # compiles the kernel into a new cache
def test_load_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGELGPT_CACHE", str(tmp_path))
    assert CpuAdam.load("torch") is None
    kernel = CpuAdam.load("auto")
    assert kernel is not None and kernel.path.parent == tmp_path / "cpu_adam"
    assert CpuAdam.load("native").path == kernel.path  # cached: built once
    assert [p.name for p in kernel.path.parent.iterdir()] == [kernel.path.name]  # no temporary left
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert CpuAdam.load("auto") is None  # falls back to torch's AdamW
    with pytest.raises(CpuAdamUnavailable, match="no-such-cc"):
        CpuAdam.load("native")


@pytest.mark.parametrize("fmt", [("fp8", "fp8", True), pytest.param(("fp8", "bf16", False), marks=pytest.mark.slow),
                                 pytest.param(("fp32", "fp8", True), marks=pytest.mark.slow)])
def test_fp8_moments_are_precisions_encoding_of_the_fp32_update(adam, fmt):
    """With an fp8 moment the kernel updates a block at a time: its masters (and weights) are the fp32
    kernel's from the same decoded moments bit for bit, and its fp8 codes and scales are
    precision.encode's of that update's moments (the same random bits, the same rounding), over values
    from 0 through E4M3's subnormal range of a block to its largest, a partial last block and several
    threads' worth of blocks, the rows starting mid-chunk (`base`)."""
    from angelgpt.zero_cache.precision import StateFormat, encode, join_master, read_moment, split_master, write_moment

    m_kind, v_kind, remainders = fmt
    f = StateFormat(remainders, m_kind, v_kind)
    n = 300_007
    gen = torch.Generator().manual_seed(3)
    spread = torch.logspace(-9, 0, n)[torch.randperm(n, generator=gen)]  # magnitudes across a block's range
    m0, v0 = torch.randn(n, generator=gen) * spread * 1e-3, torch.rand(n, generator=gen) * spread * 1e-6
    m0[::997] = 0.0
    m0[256 * 3:256 * 4] *= 1e-30  # blocks at the smallest scales (precision.MIN_EXPONENT)
    v0[256 * 5:256 * 6] *= 1e-24
    grad = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    master = torch.randn(n, generator=gen)
    rows = f.rows(torch.zeros(f.nbytes(n), dtype=torch.uint8), n)
    hi = torch.empty(n, dtype=torch.bfloat16) if remainders else None
    if remainders:
        split_master(master, hi, rows[0])
        master = join_master(hi, rows[0], torch.empty(n))
    else:
        rows[0].copy_(master)
    write_moment(m0, rows[1], seed=(1, 1))
    write_moment(v0, rows[2], squared=True, seed=(1, 2))
    ref = torch.stack([master.clone(), read_moment(rows[1], torch.empty(n)),
                       read_moment(rows[2], torch.empty(n), squared=True)])
    adam.step(list(ref), grad, None, step=4, coef=1.0, **HYPER)
    base = 256 * 1000
    adam.step(rows, grad, None, step=4, coef=1.0, hi=hi, seed=(7, 4), **HYPER, base=base)
    got = join_master(hi, rows[0], torch.empty(n)) if remainders else rows[0]
    assert torch.equal(got.view(torch.int32), ref[0].view(torch.int32))
    expect = f.rows(torch.zeros(f.nbytes(n), dtype=torch.uint8), n)
    encode(f, ref, expect, torch.empty(n, dtype=torch.bfloat16) if remainders else None, seed=(7, 4), base=base)
    for k, kind in ((1, m_kind), (2, v_kind)):
        if kind == "fp8":
            assert torch.equal(rows[k].codes, expect[k].codes) and torch.equal(rows[k].scales, expect[k].scales), k
            assert (rows[k].codes.view(torch.float8_e4m3fn).float().abs() < 2 ** -6).any()  # subnormal codes
        else:
            assert torch.equal(rows[k], expect[k]), k
