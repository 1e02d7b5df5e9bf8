"""The state codec's Triton kernels write what precision.py's torch ops write, bit for bit: fp8 moments
(blockwise scales, stochastic rounding from the element's hash) from values spanning every scale
exponent, zero and all-zero blocks, values already codes, a row not a whole number of blocks, a base
and a salt past 2**31; masters split and joined for every kind of bit pattern (ties, NaN, infinities,
signed zeros). Here the kernels run in Triton's interpreter on the CPU (where Triton is installed);
tests/gpu runs the same comparison compiled, on CUDA."""

import os
import subprocess
import sys

import pytest
import torch

from angelgpt.zero_cache.placement import FP8_BLOCK

pytestmark = pytest.mark.subprocess  # the comparison runs in a child process


def moment_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Values with a different magnitude per block (2**-150 .. 2**40), some blocks zero, some codes."""
    blocks = -(-n // FP8_BLOCK)
    exps = torch.randint(-150, 40, (blocks,), generator=gen).float()
    x = torch.randn(blocks * FP8_BLOCK, generator=gen) * torch.pow(2.0, exps).repeat_interleave(FP8_BLOCK)
    x = x.view(blocks, FP8_BLOCK)
    if blocks < 6:
        return x.reshape(-1)[:n].contiguous()
    x[1] = 0.0
    x[2, :FP8_BLOCK // 2] = -0.0
    x[3] = torch.arange(FP8_BLOCK) % 15 * 0.5  # codes of the scale 2**-1 .. and their negatives
    x[4] = -x[3]
    x[5, 7] = 3e-40  # a subnormal among tiny values
    return x.reshape(-1)[:n].contiguous()


def master_bits(n: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    special = torch.tensor([0, -2**31, 0x7F800000, -8388608, 0x7FC00000, 0x7FFF8000, -32768, 0x3F808000,
                            0x3F818000, 0x7F7FFFFF, 1, 0x8000, 0x7FFF, -1], dtype=torch.int64).to(torch.int32)
    bits[:special.numel()] = special
    return bits.view(torch.float32)


def compare_codec(triton_codec, device: str) -> None:
    """The kernels (the triton_codec module) on `device` against torch's ops on the CPU."""
    from angelgpt.zero_cache.precision import (_MIX, MIN_EXPONENT, join_master, read_moment, salt,
                                               split_master, write_moment, Blockwise)

    gen = torch.Generator().manual_seed(5)
    for n, base, seed in [(FP8_BLOCK * 37 + 100, 0, (1, 2)), (FP8_BLOCK * 64, 2**31 + FP8_BLOCK * 3, (2**30 + 7, 9)),
                          (100, FP8_BLOCK, (0, 0))]:
        for squared in (False, True):
            x = moment_values(n, gen)
            if squared:
                x = x.abs().square()
            blocks = -(-n // FP8_BLOCK)
            ref = Blockwise(torch.empty(n, dtype=torch.uint8), torch.empty(blocks))
            write_moment(x, ref, squared=squared, seed=seed, base=base)
            codes = torch.empty(n, dtype=torch.uint8, device=device)
            scales = torch.empty(blocks, device=device)
            triton_codec.write_fp8(x.to(device), codes, scales, squared, salt(seed), base, _MIX[2:],
                                   MIN_EXPONENT[squared])
            assert torch.equal(scales.cpu().view(torch.int32), ref.scales.view(torch.int32)), (n, squared)
            same = codes.cpu() == ref.codes
            assert same.all(), (n, base, squared, int((~same).sum()), x[~same][:5], codes.cpu()[~same][:5],
                                ref.codes[~same][:5])
            back = read_moment(ref, torch.empty(n), squared=squared)
            got = triton_codec.read_fp8(codes, scales, torch.empty(n, device=device), squared)
            assert torch.equal(got.cpu().view(torch.int32), back.view(torch.int32)), (n, squared)
    masters = master_bits(1 << 16, gen)
    hi, rem = torch.empty(masters.numel(), dtype=torch.bfloat16), torch.empty(masters.numel(), dtype=torch.int16)
    split_master(masters, hi, rem)
    dhi = torch.empty(masters.numel(), dtype=torch.bfloat16, device=device)
    drem = torch.empty(masters.numel(), dtype=torch.int16, device=device)
    triton_codec.split(masters.to(device), dhi, drem)
    assert torch.equal(dhi.cpu().view(torch.int16), hi.view(torch.int16))
    assert torch.equal(drem.cpu(), rem)
    joined = join_master(hi, rem, torch.empty(masters.numel()))
    got = triton_codec.join(dhi, drem, torch.empty(masters.numel(), device=device))
    assert torch.equal(got.cpu().view(torch.int32), joined.view(torch.int32))


def test_the_triton_codec_writes_what_torchs_ops_write():
    pytest.importorskip("triton")
    # the interpreter is chosen as Triton is imported: a process of its own
    code = ("import angelgpt.zero_cache.triton_codec as k; "
            "from tests.unit.test_zero_cache_triton_codec import compare_codec; compare_codec(k, 'cpu')")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
