"""How a chunk keeps its optimizer states, and torch's way between that and fp32.

A chunk's states are three rows in one flat byte buffer: the master weight, exp_avg, exp_avg_sq.
The master row is fp32, or, with optim.store_param_remainders, an int16 remainder that together with
the bf16 weight (the master's high half, which the model computes with) is the exact fp32 master: 4
bytes in place of 6. The moments are fp32 or bf16 (optim.exp_avg_dtype, optim.exp_avg_sq_dtype).

The split of an fp32 master u (its bits) into (weight, remainder): the weight is u's upper 16 bits
rounded by the remainder's top bit (to nearest, ties away from zero), the remainder u's lower 16
bits as a signed int16; joining subtracts that rounding again. It is exact for every bit pattern. A
tie (lower bits exactly 0x8000) rounds away from zero here, to even in ``tensor.to(torch.bfloat16)``:
a 16-bit remainder cannot tell the two masters a tie-to-even weight stands for apart. The one-pass
CPU kernel (cpu_adam.c) does the same arithmetic. (A NaN master whose upper half is all ones with the
top remainder bit set splits into a zero weight; it joins back to the NaN, and a non-finite gradient
norm skips the step that would make one.)

    fmt = StateFormat.from_config(cfg.optim, model_dtype)
    rows = fmt.rows(raw, n)                  # [master or remainder, exp_avg, exp_avg_sq], typed views
    decode(fmt, rows, hi, work)              # work [3, n] fp32 <- the states
    encode(fmt, work, rows, hi)              # the states (and the weights hi) <- work
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from angelgpt.zero_cache.placement import CODEC_SLICE, MOMENT_BYTES, STATES, slices, state_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StateFormat:
    remainders: bool = False  # the master row is the int16 remainder beside the bf16 weight
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    @classmethod
    def from_config(cls, optim, model_dtype: torch.dtype) -> "StateFormat":
        """The config's choice; remainders only where the weights are bf16 (an fp32 model's weight is
        its master already)."""
        return cls(bool(optim.store_param_remainders) and model_dtype == torch.bfloat16,
                   optim.exp_avg_dtype, optim.exp_avg_sq_dtype)

    @classmethod
    def from_metadata(cls, metadata: Optional[dict]) -> "StateFormat":
        """The format a checkpoint was saved in (as_metadata); fp32 for one saved before formats."""
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
    def bytes(self) -> int:
        """Bytes per element of the three rows."""
        return state_bytes(self.remainders, self.exp_avg, self.exp_avg_sq)

    @property
    def dtypes(self) -> List[torch.dtype]:
        return [torch.int16 if self.remainders else torch.float32, DTYPES[self.exp_avg], DTYPES[self.exp_avg_sq]]

    @property
    def names(self) -> List[str]:
        """The rows' checkpoint names."""
        return ["master_remainder" if self.remainders else "master", "exp_avg", "exp_avg_sq"]

    def describe(self) -> str:
        master = "bf16 weight + int16 remainder" if self.remainders else "fp32 master"
        return f"{master}, exp_avg {self.exp_avg}, exp_avg_sq {self.exp_avg_sq} ({self.bytes} bytes an element)"

    def states(self, raw: torch.Tensor, n: int):
        """A chunk's states in raw bytes: [3, n] fp32 where every row is fp32, else the typed rows."""
        if self.fp32:
            return raw.view(torch.float32).view(STATES, n)
        return self.rows(raw, n)

    def rows(self, raw: torch.Tensor, n: int) -> List[torch.Tensor]:
        """Typed views of the three rows of a flat uint8 buffer holding n elements' states (laid out
        4-byte rows first, so each row is aligned to its dtype in a 4-byte aligned buffer)."""
        out: List[Optional[torch.Tensor]] = [None] * STATES
        off = 0
        for k in sorted(range(STATES), key=lambda k: -self.dtypes[k].itemsize):
            size = n * self.dtypes[k].itemsize
            out[k] = raw[off:off + size].view(self.dtypes[k])
            off += size
        return out


def decoded_master(fmt: StateFormat, states, hi: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 masters of a chunk's states (its rows as StateFormat.states gives them; hi: its bf16
    weights where the master row holds remainders), as a new host tensor."""
    if not fmt.remainders:
        return states[0].detach().cpu().clone()
    return join_master(hi.cpu(), states[0].cpu(), torch.empty(states[0].numel(), dtype=torch.float32))


def join_master(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) <- the exact master of bf16 weights hi and int16 remainders rem."""
    borrow = (rem < 0).to(torch.int32)
    upper = (hi.view(torch.int16).to(torch.int32) - borrow).to(torch.int16).to(torch.int32)  # 16-bit wrap
    bits = upper * 65536 + (rem.to(torch.int32) & 0xFFFF)  # in int32's range: no overflow
    out.copy_(bits.view(torch.float32))
    return out


def split_master(master: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor) -> None:
    """hi (bf16) and rem (int16) <- fp32 master: the weight rounded by the remainder's top bit."""
    bits = master.view(torch.int32)
    rem.copy_((bits & 0xFFFF).to(torch.int16))  # values of 32768 and up wrap to negative (top bit set)
    hi.view(torch.int16).copy_(((bits >> 16) + ((bits & 0x8000) != 0).to(torch.int32)).to(torch.int16))


def decode(fmt: StateFormat, rows: List[torch.Tensor], hi: Optional[torch.Tensor], work: torch.Tensor) -> None:
    """work [3, n] fp32 <- the states (rows as StateFormat.rows gives them, sliced alike; hi: the bf16
    weights of the same elements where the master is a remainder), CODEC_SLICE elements at a time (the
    integer temporaries stay small)."""
    for a, b in slices(work.shape[1], CODEC_SLICE):
        if fmt.remainders:
            join_master(hi[a:b], rows[0][a:b], work[0, a:b])
        else:
            work[0, a:b].copy_(rows[0][a:b])
        work[1, a:b].copy_(rows[1][a:b])
        work[2, a:b].copy_(rows[2][a:b])


def encode(fmt: StateFormat, work: torch.Tensor, rows: List[torch.Tensor], hi: Optional[torch.Tensor]) -> None:
    """The states (and, with remainders, the weights hi) <- work [3, n] fp32; bf16 moments rounded to
    nearest even."""
    for a, b in slices(work.shape[1], CODEC_SLICE):
        if fmt.remainders:
            split_master(work[0, a:b], hi[a:b], rows[0][a:b])
        else:
            rows[0][a:b].copy_(work[0, a:b])
        rows[1][a:b].copy_(work[1, a:b])
        rows[2][a:b].copy_(work[2, a:b])


__all__ = ["DTYPES", "MOMENT_BYTES", "StateFormat", "decode", "decoded_master", "encode", "join_master",
           "split_master"]
