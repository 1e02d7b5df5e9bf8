"""The state codec's CUDA kernels: precision.py's torch arithmetic, the same bits, in one pass each.

torch's codec writes an fp8 moment in some forty element-wise operations (int64 random bits, the
stochastic rounding, the blockwise scales), each a pass over memory: on the GPU they bound the device
update of host chunks, not PCIe. These Triton kernels do each of precision.py's four
conversions in one pass, with the same integer arithmetic (the random bits in 32-bit unsigned
arithmetic, which is what precision.py's masked int64 arithmetic computes) and only exact or
correctly rounded float operations (sqrt_rn, div_rn), and the decoded values built from their integer
parts (a float product in a Triton kernel may flush subnormal results to zero), so they write what
torch's ops write, bit for bit (tests/gpu checks it on random and edge values).

precision.py imports this module on the first contiguous CUDA tensors it converts (where Triton does
not import, torch's ops do the work); zero_cache.triton_codec=false keeps torch's ops.
"""


import threading

import torch
import triton
import triton.language as tl

from angelgpt.zero_cache.placement import FP8_BLOCK

ROWS = 8  # fp8 blocks per program
BLOCK = 1024  # elements per program of the master's split and join
# launches one thread at a time: a kernel's first launch with new argument properties compiles it, and
# Triton's compilation is not safe from two threads at once (the training thread updates device chunks
# while the device-update thread updates host chunks)
_LAUNCH = threading.Lock()


@triton.jit(do_not_specialize=["salt", "base", "mix2", "mix3", "mix4"])
def _write_fp8_kernel(x_ptr, codes_ptr, scales_ptr, n, nblocks, salt, base, mix2, mix3, mix4,
                      SQUARED: tl.constexpr, MIN_EXP: tl.constexpr, R: tl.constexpr, B: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    idx = rows[:, None] * B + tl.arange(0, B)[None, :]
    inside = idx < n
    x = tl.load(x_ptr + idx, mask=inside, other=0.0)
    if SQUARED:
        x = tl.sqrt_rn(x)
    # the scale: frexp(amax) = (mantissa, exponent), k = exponent - 9 + (mantissa > 0.875), 2**k
    amax = tl.max(tl.abs(x), axis=1)
    ab = amax.to(tl.int32, bitcast=True)
    k = ((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax == 0.0, -9, k)  # frexp(0) = (0, 0)
    k = tl.minimum(tl.maximum(k, MIN_EXP), 127)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(scales_ptr + rows, scale, mask=rows < nblocks)
    y = tl.math.div_rn(x, scale[:, None])
    # random bits: a hash of (salt, element), 32-bit unsigned
    h = (idx.to(tl.uint32) + base.to(tl.uint32)) * mix2.to(tl.uint32) + salt.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * mix3.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * mix4.to(tl.uint32)
    h = h ^ (h >> 15)
    r = (h & 0x7FFFFFFF).to(tl.int32)
    # stochastic rounding onto E4M3's values (precision.stochastic_e4m3)
    ya = tl.abs(y)
    a = ya.to(tl.int32, bitcast=True)
    e = (a >> 23) - 127
    small = e < -9
    drop = tl.where(small, 0, 20 + tl.maximum(-6 - e, 0))
    mask = (1 << drop) - 1
    q = (a + (r & mask)) & ~mask
    up = (r & 0xFFFFFF) < (ya * 8589934592.0).to(tl.int32)
    q = tl.where(small, tl.where(up, (127 - 9) << 23, 0), q)
    # the E4M3 code of the value q (normal from 2**-6, else a multiple of 2**-9)
    normal = (((q >> 23) - 120) << 3) | ((q >> 20) & 7)
    sub = (q.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
    code = tl.where(q >= (121 << 23), normal, sub)
    code = code | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    tl.store(codes_ptr + idx, code.to(tl.uint8), mask=inside)

@triton.jit
def _exact_bits(sig, e2):
    """The fp32 bits of sig * 2**e2 (sig an integer below 2**24 and the product exact in fp32, subnormal
    or not; infinity above fp32's range), from integers: a float product here may flush subnormals."""
    f = sig.to(tl.float32).to(tl.int32, bitcast=True)  # exact: exponent field 127 + log2(leading bit)
    field = (f >> 23) + e2
    bits = tl.where(field >= 1, f + (e2 << 23), sig << tl.minimum(tl.maximum(e2 + 149, 0), 31))
    bits = tl.where(field >= 255, 0x7F800000, bits)
    return tl.where(sig == 0, 0, bits)


@triton.jit
def _read_fp8_kernel(codes_ptr, scales_ptr, out_ptr, n, SQUARED: tl.constexpr, R: tl.constexpr, B: tl.constexpr):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    idx = rows[:, None] * B + tl.arange(0, B)[None, :]
    inside = idx < n
    c = tl.load(codes_ptr + idx, mask=inside, other=0).to(tl.int32)
    s = tl.load(scales_ptr + rows, mask=rows * B < n, other=1.0)
    k = (s.to(tl.int32, bitcast=True) >> 23) - 127  # the scale is 2**k (a normal power of two)
    # the code's value times 2**k is sig * 2**e2: E4M3 normal (1 + m/8) * 2**(e - 7), subnormal m * 2**-9
    e, m = (c >> 3) & 0xF, c & 7
    sig = tl.where(e == 0, m, m + 8)
    e2 = tl.where(e == 0, -9, e - 10) + k[:, None]
    if SQUARED:
        bits = _exact_bits(sig * sig, 2 * e2)
    else:
        bits = _exact_bits(sig, e2) | ((c & 0x80) << 24)
    bits = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits)  # E4M3's NaN
    tl.store(out_ptr + idx, bits.to(tl.float32, bitcast=True), mask=inside)


@triton.jit
def _join_kernel(hi_ptr, rem_ptr, out_ptr, n, B: tl.constexpr):
    idx = tl.program_id(0) * B + tl.arange(0, B)
    inside = idx < n
    hi = tl.load(hi_ptr + idx, mask=inside, other=0).to(tl.int32)
    rem = tl.load(rem_ptr + idx, mask=inside, other=0).to(tl.int32)
    upper = (hi - (rem < 0).to(tl.int32)).to(tl.int16).to(tl.int32)  # 16-bit wrap
    bits = (upper << 16) | (rem & 0xFFFF)
    tl.store(out_ptr + idx, bits.to(tl.float32, bitcast=True), mask=inside)

@triton.jit
def _split_kernel(master_ptr, hi_ptr, rem_ptr, n, B: tl.constexpr):
    idx = tl.program_id(0) * B + tl.arange(0, B)
    inside = idx < n
    bits = tl.load(master_ptr + idx, mask=inside, other=0.0).to(tl.int32, bitcast=True)
    tl.store(rem_ptr + idx, (bits & 0xFFFF).to(tl.int16), mask=inside)
    tl.store(hi_ptr + idx, ((bits >> 16) + ((bits & 0x8000) != 0).to(tl.int32)).to(tl.int16), mask=inside)


def _grid(n: int, per_program: int):
    return (max(1, -(-n // per_program)),)


def write_fp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, squared: bool, salt: int, base: int,
              mix, min_exponent: int) -> None:
    """codes, scales <- fp32 x (precision.write_moment of a Blockwise row)."""
    n = x.numel()
    with _LAUNCH:
        _write_fp8_kernel[_grid(n, ROWS * FP8_BLOCK)](
            x, codes, scales, n, scales.numel(), salt, base & 0xFFFFFFFF, *mix,
            SQUARED=squared, MIN_EXP=min_exponent, R=ROWS, B=FP8_BLOCK)


def read_fp8(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, squared: bool) -> torch.Tensor:
    """out <- the values of codes times their block's scale (squared: their squares)."""
    n = codes.numel()
    with _LAUNCH:
        _read_fp8_kernel[_grid(n, ROWS * FP8_BLOCK)](codes, scales, out, n, SQUARED=squared, R=ROWS, B=FP8_BLOCK)
    return out


def join(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) <- the masters of bf16 weights hi and int16 remainders rem."""
    n = out.numel()
    with _LAUNCH:
        _join_kernel[_grid(n, BLOCK)](hi.view(torch.int16), rem, out, n, B=BLOCK)
    return out


def split(master: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor) -> None:
    """hi (bf16), rem (int16) <- fp32 masters."""
    n = master.numel()
    with _LAUNCH:
        _split_kernel[_grid(n, BLOCK)](master, hi.view(torch.int16), rem, n, B=BLOCK)
