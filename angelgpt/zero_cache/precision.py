"""How a chunk keeps its optimizer states, and torch's way between that and fp32.

A chunk's states are three rows in one flat byte buffer: the master weight, exp_avg, exp_avg_sq.
The master row is fp32, or, with optim.store_param_remainders, an int16 remainder that together with
the bf16 weight (the master's high half, which the model computes with) is the exact fp32 master: 4
bytes in place of 6. The moments are fp32, bf16 or fp8 (optim.exp_avg_dtype, optim.exp_avg_sq_dtype).

The split of an fp32 master u (its bits) into (weight, remainder): the weight is u's upper 16 bits
rounded by the remainder's top bit (to nearest, ties away from zero), the remainder u's lower 16
bits as a signed int16; joining subtracts that rounding again. It is exact for every bit pattern. A
tie (lower bits exactly 0x8000) rounds away from zero here, to even in ``tensor.to(torch.bfloat16)``:
a 16-bit remainder cannot tell the two masters a tie-to-even weight stands for apart. The one-pass
CPU kernel (cpu_adam.c) does the same arithmetic. (A NaN master whose upper half is all ones with the
top remainder bit set splits into a zero weight; it joins back to the NaN, and a non-finite gradient
norm skips the step that would make one.)

    fmt = StateFormat.from_config(cfg, model_dtype)
    rows = fmt.rows(raw, n)                  # [master or remainder, exp_avg, exp_avg_sq], typed views
    decode(fmt, rows, hi, work)              # work [3, n] fp32 <- the states
    encode(fmt, work, rows, hi, seed, base)  # the states (and the weights hi) <- work

An fp8 moment (Blockwise) is one byte an element, float8 E4M3 codes, and one fp32 power-of-two scale
per FP8_BLOCK elements of the chunk: the block's largest magnitude over the scale is at most 448, E4M3's
largest. exp_avg_sq keeps its square root so (sqrt(v) spans half the binary orders of magnitude v does:
E4M3's 2**18 then covers 2**36 of v). Writes round stochastically: a value between two codes goes to
the upper with probability its distance from the lower over their gap, so small updates add up in
expectation instead of rounding away; the random bits are a hash of (chunk, row, step, element), the
same in every tier, on every device and in cpu_adam.c, so a run repeats bit for bit and a resume
continues as the uninterrupted run would. A value already a code times the scale is written exactly: the decoded values
(E4M3 has 4 significant bits, their squares 8) are exact in bf16, the dtype checkpoints keep them in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from angelgpt.zero_cache.placement import (CODEC_SLICE, FP8_BLOCK, MOMENT_BYTES, STATES, slices, state_bytes,
                                           state_nbytes)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}
E4M3_MAX = 448.0
# the smallest scale exponent of each fp8 moment, so that every decoded value is exact in bf16 (whose
# finest step is 2**-133): exp_avg's codes are multiples of 2**-9 of the scale (2**-9 * 2**-124); the
# second moment is the square of such a code (2**-18 of the scale squared: 2 * -57 - 18 >= -133). A block
# whose largest value is below 448 times that scale keeps coarser codes: exp_avg below 2**-133 and
# exp_avg_sq below 2**-132 round stochastically to that or 0
MIN_EXPONENT = {False: -124, True: -57}  # squared (exp_avg_sq)?


class Blockwise:
    """An fp8 moment's row: E4M3 codes [n] (uint8) and an fp32 scale per FP8_BLOCK of them. Sliced at
    block boundaries (relative to the chunk) like a tensor; copied, codes and scales, like one."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales

    def __getitem__(self, s: slice) -> "Blockwise":
        lo, hi, _ = s.indices(self.codes.numel())
        if lo % FP8_BLOCK:
            raise ValueError(f"an fp8 row is cut at block boundaries (multiples of {FP8_BLOCK}), not at {lo}")
        return Blockwise(self.codes[lo:hi], self.scales[lo // FP8_BLOCK:-(-hi // FP8_BLOCK)])

    def numel(self) -> int:
        return self.codes.numel()

    def copy_(self, other: "Blockwise", non_blocking: bool = False) -> "Blockwise":
        self.codes.copy_(other.codes, non_blocking=non_blocking)
        self.scales.copy_(other.scales, non_blocking=non_blocking)
        return self


@dataclass(frozen=True)
class StateFormat:
    remainders: bool = False  # the master row is the int16 remainder beside the bf16 weight
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    # CUDA rows convert through triton_codec's kernels where Triton imports (zero_cache.triton_codec):
    # the same bits as torch's ops, so formats that differ only in it are equal
    triton: bool = field(default=True, compare=False)

    @classmethod
    def from_config(cls, cfg, model_dtype: torch.dtype) -> "StateFormat":
        """The config's choice; remainders only where the weights are bf16 (an fp32 model's weight is
        its master already)."""
        o = cfg.optim
        return cls(o.store_param_remainders is True and model_dtype == torch.bfloat16, o.exp_avg_dtype,
                   o.exp_avg_sq_dtype, cfg.zero_cache.triton_codec)

    @classmethod
    def from_metadata(cls, metadata: Optional[dict]) -> "StateFormat":
        """The format a checkpoint was saved in (as_metadata); fp32 states, no remainders, for one whose
        metadata records no format."""
        saved = (metadata or {}).get("zero_cache_state_format") or {}
        return cls(bool(saved.get("remainders", False)), saved.get("exp_avg", "fp32"),
                   saved.get("exp_avg_sq", "fp32"))

    def as_metadata(self) -> dict:
        return {"zero_cache_state_format": {"remainders": self.remainders, "exp_avg": self.exp_avg,
                                            "exp_avg_sq": self.exp_avg_sq}}

    @property
    def fp32(self) -> bool:
        """Every row fp32 (the rows are one [3, n] fp32 tensor)."""
        return not self.remainders and self.exp_avg == "fp32" and self.exp_avg_sq == "fp32"

    @property
    def blockwise(self) -> bool:
        """A moment is fp8 (Blockwise rows, torch's codec: the one-pass CPU kernel does not take it)."""
        return "fp8" in (self.exp_avg, self.exp_avg_sq)

    @property
    def bytes(self):
        """Bytes per element of the three rows (placement.state_bytes: fp8 scales as the fraction)."""
        return state_bytes(self.remainders, self.exp_avg, self.exp_avg_sq)

    def nbytes(self, n: int) -> int:
        """Bytes of n elements' states (fp8 scales for every block begun)."""
        return state_nbytes(n, self.bytes)

    @property
    def kinds(self) -> List[str]:
        return ["remainder" if self.remainders else "fp32", self.exp_avg, self.exp_avg_sq]

    @property
    def dtypes(self) -> List[torch.dtype]:
        return [torch.int16 if self.remainders else torch.float32, DTYPES[self.exp_avg], DTYPES[self.exp_avg_sq]]

    @property
    def checkpoint_dtypes(self) -> List[torch.dtype]:
        """The rows' dtypes in a checkpoint: an fp8 moment is saved decoded, in bf16 (exact)."""
        return [torch.bfloat16 if d == torch.uint8 else d for d in self.dtypes]

    @property
    def names(self) -> List[str]:
        """The rows' checkpoint names."""
        return ["master_remainder" if self.remainders else "master", "exp_avg", "exp_avg_sq"]

    def describe(self) -> str:
        master = "bf16 weight + int16 remainder" if self.remainders else "fp32 master"
        return (f"{master}, exp_avg {_moment_name(self.exp_avg)}, exp_avg_sq {_moment_name(self.exp_avg_sq)} "
                f"({self.bytes:g} bytes an element)")

    def states(self, raw: torch.Tensor, n: int):
        """A chunk's states in raw bytes: [3, n] fp32 where every row is fp32, else the typed rows."""
        if self.fp32:
            return raw.view(torch.float32).view(STATES, n)
        return self.rows(raw, n)

    def rows(self, raw: torch.Tensor, n: int) -> list:
        """Typed views of the three rows of a flat uint8 buffer holding n elements' states (Blockwise for
        an fp8 moment), laid out fp8 scales first, then 4-byte rows, 2-byte rows and 1-byte codes, so
        that each is aligned to its dtype in a 4-byte aligned buffer."""
        out: list = [None] * STATES
        blocks = -(-n // FP8_BLOCK)
        off = 0
        scales = {}
        for k in range(STATES):
            if self.dtypes[k] == torch.uint8:
                scales[k] = raw[off:off + 4 * blocks].view(torch.float32)
                off += 4 * blocks
        for k in sorted(range(STATES), key=lambda k: -self.dtypes[k].itemsize):
            size = n * self.dtypes[k].itemsize
            out[k] = raw[off:off + size].view(self.dtypes[k])
            if k in scales:
                out[k] = Blockwise(out[k], scales[k])
            off += size
        return out


def _moment_name(kind: str) -> str:
    return "fp8 (E4M3, a scale per 256)" if kind == "fp8" else kind


@functools.lru_cache(maxsize=None)
def _triton_codec():
    """triton_codec (the same conversions as Triton kernels), or None where Triton does not import."""
    try:
        from angelgpt.zero_cache import triton_codec
    except ImportError:
        return None
    return triton_codec


def _kernels_for(*tensors: torch.Tensor, triton: bool = True):
    """triton_codec where it takes these tensors (contiguous, on CUDA, Triton there) and `triton` asks
    for it, else None: torch's ops convert them."""
    if triton and all(t.is_cuda and t.is_contiguous() for t in tensors):
        return _triton_codec()
    return None


def _codec_slice(work: torch.Tensor, triton: bool) -> int:
    """Elements decode and encode convert at a time: all of them where triton_codec's kernels take the
    rows (one launch per row), else CODEC_SLICE."""
    return max(1, work.shape[1]) if _kernels_for(work[0], triton=triton) else CODEC_SLICE


def decoded_master(fmt: StateFormat, states, hi: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 masters of a chunk's states (its rows as StateFormat.states gives them; hi: its bf16
    weights where the master row holds remainders), as a new host tensor."""
    if not fmt.remainders:
        return states[0].detach().cpu().clone()
    return join_master(hi.cpu(), states[0].cpu(), torch.empty(states[0].numel(), dtype=torch.float32))


def join_master(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor, triton: bool = True) -> torch.Tensor:
    """out (fp32) <- the exact master of bf16 weights hi and int16 remainders rem."""
    kernels = _kernels_for(hi, rem, out, triton=triton)
    if kernels:
        return kernels.join(hi, rem, out)
    borrow = (rem < 0).to(torch.int32)
    upper = (hi.view(torch.int16).to(torch.int32) - borrow).to(torch.int16).to(torch.int32)  # 16-bit wrap
    bits = upper * 65536 + (rem.to(torch.int32) & 0xFFFF)  # in int32's range: no overflow
    out.copy_(bits.view(torch.float32))
    return out


def split_master(master: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, triton: bool = True) -> None:
    """hi (bf16) and rem (int16) <- fp32 master: the weight rounded by the remainder's top bit."""
    kernels = _kernels_for(master, hi, rem, triton=triton)
    if kernels:
        return kernels.split(master, hi, rem)
    bits = master.view(torch.int32)
    rem.copy_((bits & 0xFFFF).to(torch.int16))  # values of 32768 and up wrap to negative (top bit set)
    hi.view(torch.int16).copy_(((bits >> 16) + ((bits & 0x8000) != 0).to(torch.int32)).to(torch.int16))


def decode(fmt: StateFormat, rows: list, hi: Optional[torch.Tensor], work: torch.Tensor) -> None:
    """work [3, n] fp32 <- the states (rows as StateFormat.rows gives them, sliced alike; hi: the bf16
    weights of the same elements where the master is a remainder), CODEC_SLICE elements at a time (the
    integer temporaries stay small), or at once by triton_codec's kernels (no temporaries)."""
    for a, b in slices(work.shape[1], _codec_slice(work, fmt.triton)):
        if fmt.remainders:
            join_master(hi[a:b], rows[0][a:b], work[0, a:b], triton=fmt.triton)
        else:
            work[0, a:b].copy_(rows[0][a:b])
        for k in (1, 2):
            read_moment(rows[k][a:b], work[k, a:b], squared=k == 2, triton=fmt.triton)


def encode(fmt: StateFormat, work: torch.Tensor, rows: list, hi: Optional[torch.Tensor],
           seed: Tuple[int, int] = (0, 0), base: int = 0) -> None:
    """The states (and, with remainders, the weights hi) <- work [3, n] fp32; bf16 moments rounded to
    nearest even, fp8 ones stochastically (seed: (chunk, step); base: the chunk element rows[k][0] is),
    a part at a time as decode does."""
    for a, b in slices(work.shape[1], _codec_slice(work, fmt.triton)):
        if fmt.remainders:
            split_master(work[0, a:b], hi[a:b], rows[0][a:b], triton=fmt.triton)
        else:
            rows[0][a:b].copy_(work[0, a:b])
        for k in (1, 2):
            write_moment(work[k, a:b], rows[k][a:b], squared=k == 2, seed=(seed[0] * STATES + k, seed[1]),
                         base=base + a, triton=fmt.triton)


def moment_as_bf16(row, squared: bool = False, triton: bool = True) -> torch.Tensor:
    """An fp8 moment's values (exp_avg_sq's squared) as a new host bf16 tensor, which holds them exactly
    (MIN_EXPONENT), decoded CODEC_SLICE elements at a time."""
    n = row.numel()
    out = torch.empty(n, dtype=torch.bfloat16)
    for a, b in slices(n, CODEC_SLICE):
        out[a:b].copy_(read_moment(row[a:b], torch.empty(b - a, device=row.codes.device), squared=squared,
                                   triton=triton))
    return out


def read_moment(row, out: torch.Tensor, squared: bool = False, triton: bool = True) -> torch.Tensor:
    """out (fp32) <- a moment row's values (an fp8 exp_avg_sq: the square of what is kept)."""
    if not isinstance(row, Blockwise):
        return out.copy_(row)
    kernels = _kernels_for(row.codes, row.scales, out, triton=triton)
    if kernels:
        return kernels.read_fp8(row.codes, row.scales, out, squared)
    n = row.numel()
    blocks = row.scales.numel()
    values = row.codes.view(torch.float8_e4m3fn).float()
    if n == blocks * FP8_BLOCK:
        values.view(blocks, FP8_BLOCK).mul_(row.scales.unsqueeze(1))
    else:
        values.mul_(row.scales.repeat_interleave(FP8_BLOCK)[:n])
    return out.copy_(values.square_() if squared else values)


def write_moment(values: torch.Tensor, row, squared: bool = False, seed: Tuple[int, int] = (0, 0),
                 base: int = 0, triton: bool = True) -> None:
    """A moment row <- fp32 values (an fp8 exp_avg_sq keeps their square root), rounded to nearest even
    into bf16, stochastically into fp8 (blockwise scales from each block's largest magnitude)."""
    if not isinstance(row, Blockwise):
        row.copy_(values)
        return
    kernels = _kernels_for(values, row.codes, row.scales, triton=triton)
    if kernels:
        return kernels.write_fp8(values, row.codes, row.scales, squared, salt(seed), base, _MIX[2:],
                                 MIN_EXPONENT[squared])
    x = values.sqrt() if squared else values
    n, blocks = x.numel(), row.scales.numel()
    padded = x if n == blocks * FP8_BLOCK else torch.nn.functional.pad(x, (0, blocks * FP8_BLOCK - n))
    amax = padded.view(blocks, FP8_BLOCK).abs().amax(1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # the smallest power of two over which amax is at most 448 (1.75 * 2**8), at least MIN_EXPONENT's
    k = (exponent - 9 + (mantissa > E4M3_MAX / 512).to(exponent.dtype)).clamp_(MIN_EXPONENT[squared], 127)
    scales = ((k + 127) << 23).view(torch.float32)  # 2**k from its bits (a normal float: exact everywhere)
    row.scales.copy_(scales)
    y = padded.view(blocks, FP8_BLOCK) / scales.unsqueeze(1)
    q = stochastic_e4m3(y.view(-1)[:n], random_bits(n, base, seed, x.device))
    row.codes.copy_(q.to(torch.float8_e4m3fn).view(torch.uint8))


# odd constants below 2**31: their products with 32-bit values stay inside int64
_MIX = (0x27D4EB2F, 0x165667B1, 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
_M32 = 0xFFFFFFFF


def salt(seed: Tuple[int, int]) -> int:
    """A row's seed (chunk * 3 + row, step) as the 32 bits random_bits starts from (cpu_adam.c too)."""
    return (seed[0] * _MIX[0] + seed[1] * _MIX[1]) & _M32


def random_bits(n: int, base: int, seed: Tuple[int, int], device) -> torch.Tensor:
    """32 random bits (int64) for elements base .. base + n of a row: a hash of (seed, element), the same
    on every device and in cpu_adam.c."""
    x = (torch.arange(base, base + n, dtype=torch.int64, device=device) * _MIX[2] + salt(seed)) & _M32
    for mul in _MIX[3:]:
        x ^= x >> 16
        x = (x * mul) & _M32
    x ^= x >> 15
    return x


def stochastic_e4m3(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """y (fp32, |y| <= 448) rounded stochastically onto E4M3's values (an fp32 tensor of them): to the
    upper neighbour with probability (y - lower) / (upper - lower), the bits deciding. On the fp32 bits:
    E4M3 keeps 3 of fp32's 23 mantissa bits (normal values, |y| >= 2**-6), fewer below, down to 2**-9
    apart; random bits added below the kept ones carry into them or not, and are cut off. Below 2**-9,
    the result is 0 or 2**-9."""
    a = y.abs().view(torch.int32)
    e = (a >> 23) - 127
    drop = 20 + (-6 - e).clamp(min=0)
    small = e < -9
    drop = torch.where(small, torch.zeros_like(drop), drop)
    mask = (torch.ones_like(a) << drop) - 1
    r = (bits & 0x7FFFFFFF).to(torch.int32)
    q = (a + (r & mask)) & ~mask
    # below 2**-9: 2**-9 (bits (127 - 9) << 23) with probability |y| * 2**9, from 24 of the bits
    up = (r & 0xFFFFFF) < (y.abs() * 2.0 ** 33).to(torch.int32)
    q = torch.where(small, torch.where(up, torch.full_like(q, (127 - 9) << 23), torch.zeros_like(q)), q)
    q = q | (y.view(torch.int32) & (-(1 << 31)))
    return q.view(torch.float32)


__all__ = ["DTYPES", "MIN_EXPONENT", "MOMENT_BYTES", "Blockwise", "StateFormat", "decode", "decoded_master",
           "encode", "join_master", "moment_as_bf16", "random_bits", "read_moment", "split_master",
           "stochastic_e4m3", "write_moment"]
