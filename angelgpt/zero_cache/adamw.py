"""AdamW of a chunk's state rows where they live: the one-pass CPU kernel, or torch's fused AdamW
with the states decoded into fp32 rows a part at a time and encoded back where they are not fp32.

Owns nothing that changes. Touches: the rows and weights it is handed and the fp32 work rows it
decodes into; the chunk's step counter is advanced by the update before it runs, and only read here.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch.optim.adamw import adamw

from angelgpt.zero_cache.buffers import ChunkBuffers
from angelgpt.zero_cache.cpu_adam import CpuAdam
from angelgpt.zero_cache.layout import Chunk
from angelgpt.zero_cache.placement import CODEC_SLICE, slices
from angelgpt.zero_cache.precision import StateFormat, decode, encode


def cut(states, lo: int, hi: int) -> list:
    """Each row's slice [lo, hi) (rows of a [3, n] tensor, or the format's typed rows)."""
    return [r[lo:hi] for r in states]


class AdamW:
    def __init__(self, fmt: StateFormat, cpu_adam: Optional[CpuAdam], work: Dict[str, torch.Tensor],
                 betas: Tuple[float, float], eps: float, device: torch.device):
        """fmt: the states' format; cpu_adam: the one-pass CPU kernel (None: torch's AdamW on the CPU
        too); work: per updating tier, three fp32 rows to decode a slice into (states not all fp32)."""
        self.format, self.cpu_adam, self.work = fmt, cpu_adam, work
        self.betas, self.eps, self.device = betas, eps, device

    @property
    def one_pass(self) -> bool:
        """The CPU's updates run the one-pass kernel (built where some chunk's update is on the CPU)."""
        return self.cpu_adam is not None

    def apply(self, c: Chunk, b: ChunkBuffers, states, grad: torch.Tensor, hyper, coef: float, hi=None,
              base: int = 0) -> None:
        """AdamW where the chunk lives, of its states' rows (a slice of each from chunk element `base`,
        in the layout's format; hi: the slice's bf16 weights where the master row holds remainders). On
        the CPU the one-pass kernel where it was built (every CPU update uses it: placements agree); else
        torch's fused AdamW (fp32 gradient), clipping riding in the kernel (grad_scale divides the
        gradient), so it costs no extra pass over memory; states not all fp32 are decoded into fp32 rows
        (the work rows) a part at a time and encoded back."""
        if self.format.fp32:
            return self.apply_fp32(c, b, states, grad, hyper, coef)
        if self.cpu_adam is not None and not grad.is_cuda:
            return self.native(c, b, states, grad, hyper, coef, hi=hi, base=base)
        work = self.work["device" if grad.device.type == self.device.type and c.tier == "device" else "host"]
        for lo, end in slices(grad.numel(), min(CODEC_SLICE, work.shape[1])):
            rows, w, part = [r[lo:end] for r in states], work[:, :end - lo], None if hi is None else hi[lo:end]
            decode(self.format, rows, part, w)
            self.fused(c, b, w, grad[lo:end], hyper, coef)
            encode(self.format, w, rows, part, seed=(c.index, b.step_count), base=base + lo)

    def apply_fp32(self, c: Chunk, b: ChunkBuffers, states, grad: torch.Tensor, hyper, coef: float) -> None:
        """AdamW of fp32 rows: the one-pass kernel on the CPU where it was built (every CPU update uses it:
        placements agree), else torch's fused AdamW."""
        if self.cpu_adam is not None and not grad.is_cuda:
            return self.native(c, b, states, grad, hyper, coef)
        return self.fused(c, b, states, grad, hyper, coef)

    def fused(self, c: Chunk, b: ChunkBuffers, states, grad: torch.Tensor, hyper, coef: float) -> None:
        """torch's fused AdamW of fp32 rows (master, exp_avg, exp_avg_sq) from an fp32 gradient."""
        lr, wd = hyper[0 if c.decay else 1]
        scale = None if coef >= 1.0 else torch.full((), 1.0 / coef, dtype=torch.float32, device=grad.device)
        # torch's functional AdamW counts the step itself: it is handed the count before this update
        adamw([states[0]], [grad], [states[1]], [states[2]], [], [b.step - 1], fused=True, grad_scale=scale,
              lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=wd, eps=self.eps, amsgrad=False,
              maximize=False)

    def native(self, c: Chunk, b: ChunkBuffers, states, grad: torch.Tensor, hyper, coef: float, out=None,
               hi=None, base: int = 0) -> None:
        """The one-pass CPU kernel, the new weights into out (its own dtype) unless it is None (with hi:
        into hi itself); `base`: the chunk element the rows' first is (fp8 moments' random bits)."""
        lr, wd = hyper[0 if c.decay else 1]
        self.cpu_adam.step(states, grad, out, step=b.step_count, lr=lr, weight_decay=wd, betas=self.betas,
                           eps=self.eps, coef=coef, hi=hi, seed=(c.index, b.step_count), base=base)
