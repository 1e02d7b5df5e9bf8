"""The host chunks' AdamW: one pass over memory that reads the gradient (model dtype, or fp32 where
micro batches add up in fp32), updates the states in the dtypes they are kept in (precision.py) and
writes the model-dtype weight beside the update (cpu_adam.c), built once per machine with the system C
compiler and cached; torch's fused AdamW with conversions around it where no compiler is found.

    adam = CpuAdam.load("auto")            # None: use torch (no compiler, or 'torch' asked for)
    adam.step(rows, grad, out, step=3, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, coef=1.0)
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

from angelgpt.system import c_compiler

SOURCE = Path(__file__).with_name("cpu_adam.c")
# -ffp-contract=off: every specialisation rounds alike (no fused multiply-adds chosen per loop), so the
# remainder and fp8 paths give the fp32 path's masters bit for bit on any CPU
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
         "-pthread"]


class CpuAdamUnavailable(RuntimeError):
    """The kernel could not be built or loaded (the message says why)."""


def cache_dir() -> Path:
    root = os.environ.get("ANGELGPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "angelgpt")
    return Path(root) / "cpu_adam"


def _cpu_flags() -> str:
    """The CPU's instruction-set flags: -march=native code is only reused on a CPU that has them all."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(compiler: Optional[str] = None) -> Path:
    """The shared library for this machine: from the cache, else compiled (into a temporary name, then
    renamed, so ranks that build at once never load a half-written file)."""
    cc = compiler or os.environ.get("CC") or c_compiler()  # a named one may not exist: said when it runs
    if not cc:
        raise CpuAdamUnavailable("no C compiler found (set CC)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *FLAGS, platform.machine(), _cpu_flags()]).encode())
    target = cache_dir() / f"cpu_adam-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        except OSError as e:
            raise CpuAdamUnavailable(f"C compiler '{cc}' not found (set CC)" if isinstance(e, FileNotFoundError)
                                     else f"C compiler '{cc}' did not run: {e}") from e
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise CpuAdamUnavailable(f"{cc} failed on {SOURCE.name}: {last}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuAdam:
    def __init__(self, path: Path, threads: Optional[int] = None):
        lib = ctypes.CDLL(str(path))  # a CDLL call releases the GIL: the update thread runs beside training
        fn = lib.angelgpt_adamw
        vp, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        u32, i64 = ctypes.c_uint32, ctypes.c_int64
        fn.argtypes = [vp, vp, vp, vp, vp, vp, i, i64, f, f, f, f, f, f, f, i, vp, vp, u32, u32, i64]
        fn.restype = None
        self._fn = fn
        self.path = path
        self.threads = threads or torch.get_num_threads()

    @classmethod
    def load(cls, mode: str) -> Optional["CpuAdam"]:
        """'native': the kernel or CpuAdamUnavailable; 'auto': the kernel, or None where it cannot be
        built; 'torch': None."""
        if mode == "torch":
            return None
        try:
            return cls(build())
        except (CpuAdamUnavailable, OSError) as e:
            if mode == "native":
                raise CpuAdamUnavailable(str(e)) from e
            return None

    def step(self, rows: Sequence[torch.Tensor], grad: torch.Tensor, out: Optional[torch.Tensor], *, step: int,
             lr: float, weight_decay: float, betas: Tuple[float, float], eps: float, coef: float,
             hi: Optional[torch.Tensor] = None, seed: Tuple[int, int] = (0, 0), base: int = 0) -> None:
        """One AdamW update of rows (master, exp_avg, exp_avg_sq, each [n] and contiguous: an fp32 master,
        or with hi the int16 remainder whose bf16 weights hi [n] make the fp32 master, both written back;
        fp32, bf16 or fp8 moments: precision.Blockwise, cut at a block boundary of the chunk, its random
        bits from seed (chunk, step) and base, the chunk element of element 0) from grad [n] (bf16 or
        fp32) scaled by coef (clipping; >= 1 leaves it), writing the new weights into out [n] (bf16 or
        fp32): a buffer of its own, grad itself (read before written; same dtype), or None (with hi,
        the new weights are hi itself)."""
        from angelgpt.zero_cache.precision import Blockwise, salt

        n = grad.numel()
        master, m, v = rows
        fp8 = [isinstance(r, Blockwise) for r in (m, v)]
        codes = [r.codes if f else r for r, f in zip((m, v), fp8)]
        assert all(r.numel() == n and r.is_contiguous() and not r.is_cuda for r in (master, *codes))
        assert all(f or r.dtype in _MOMENTS for r, f in zip((m, v), fp8))
        assert grad.dtype in (torch.bfloat16, torch.float32) and grad.is_contiguous() and not grad.is_cuda
        flags = _G_BF16 if grad.dtype == torch.bfloat16 else 0
        flags |= (_M_FP8 if fp8[0] else _M_BF16 if m.dtype == torch.bfloat16 else 0)
        flags |= (_V_FP8 if fp8[1] else _V_BF16 if v.dtype == torch.bfloat16 else 0)
        if hi is not None:
            assert master.dtype == torch.int16 and hi.dtype == torch.bfloat16 and hi.numel() == n \
                and hi.is_contiguous() and not hi.is_cuda and out is None
            flags |= _REM
        else:
            assert master.dtype == torch.float32
        if out is not None:
            assert out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous() and out.numel() == n \
                and not out.is_cuda
            same = out.data_ptr() == grad.data_ptr()
            assert not same or out.dtype == grad.dtype, "out over the gradient in another dtype"
            assert same or not _overlap(out, grad), "out overlaps the gradient without being it"
            flags |= (3 if same else 2 if out.dtype == torch.bfloat16 else 1) << _OUT_SHIFT
        step = float(step)
        bc1 = 1.0 - betas[0] ** step
        bc2_sqrt = math.sqrt(1.0 - betas[1] ** step)
        scale = 1.0 if coef >= 1.0 else 1.0 / coef  # as torch's grad_scale: the gradient is divided by it
        scales = [r.scales.data_ptr() if f else 0 for r, f in zip((m, v), fp8)]
        self._fn(master.data_ptr(), 0 if hi is None else hi.data_ptr(), codes[0].data_ptr(), codes[1].data_ptr(),
                 grad.data_ptr(), out.data_ptr() if out is not None and flags >> _OUT_SHIFT & 3 != 3 else 0, flags, n,
                 1.0 - lr * weight_decay, betas[0], betas[1], lr / bc1, bc2_sqrt, eps, scale, self.threads,
                 scales[0], scales[1], salt((seed[0] * 3 + 1, seed[1])), salt((seed[0] * 3 + 2, seed[1])), base)


# cpu_adam.c's flags
_G_BF16, _OUT_SHIFT, _REM, _M_BF16, _V_BF16, _M_FP8, _V_FP8 = 1, 1, 8, 16, 32, 64, 128
_MOMENTS = (torch.float32, torch.bfloat16)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes
