"""The host chunks' AdamW: one pass over memory that reads the gradient (model dtype, or fp32 where
micro batches add up in fp32) and writes the model-dtype weight beside the fp32 update (cpu_adam.c), built once per machine with the system C
compiler and cached; torch's fused AdamW with conversions around it where no compiler is found.

    adam = CpuAdam.load("auto")            # None: use torch (no compiler, or 'torch' asked for)
    adam.step(states, grad, out, step=3, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, coef=1.0)
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
from typing import Optional, Tuple

import torch

from angelgpt.system import c_compiler

SOURCE = Path(__file__).with_name("cpu_adam.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC", "-pthread"]


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
        fp, vp, i, f = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        fn.argtypes = [fp, fp, fp, vp, i, vp, i, i, ctypes.c_int64, f, f, f, f, f, f, f, i]
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

    def step(self, states: torch.Tensor, grad: torch.Tensor, out: Optional[torch.Tensor], *, step: int, lr: float,
             weight_decay: float, betas: Tuple[float, float], eps: float, coef: float) -> None:
        """One AdamW update of states [3, n] (fp32 master, exp_avg, exp_avg_sq; rows contiguous) from
        grad [n] (bf16 or fp32) scaled by coef (clipping; >= 1 leaves it), writing the new weights into
        out [n] (bf16 or fp32): a buffer of its own, grad itself (read before written; same dtype), or
        None."""
        n = grad.numel()
        assert states.dtype == torch.float32 and states.shape[1] == n and states.stride(1) == 1
        assert grad.dtype in (torch.bfloat16, torch.float32) and grad.is_contiguous() and not grad.is_cuda
        if out is None:
            out_kind = 0
        else:
            assert out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous() and out.numel() == n \
                and not out.is_cuda
            same = out.data_ptr() == grad.data_ptr()
            assert not same or out.dtype == grad.dtype, "out over the gradient in another dtype"
            assert same or not _overlap(out, grad), "out overlaps the gradient without being it"
            out_kind = 2 if same else 1
        step = float(step)
        bc1 = 1.0 - betas[0] ** step
        bc2_sqrt = math.sqrt(1.0 - betas[1] ** step)
        scale = 1.0 if coef >= 1.0 else 1.0 / coef  # as torch's grad_scale: the gradient is divided by it
        self._fn(states[0].data_ptr(), states[1].data_ptr(), states[2].data_ptr(), grad.data_ptr(),
                 int(grad.dtype == torch.bfloat16), 0 if out_kind != 1 else out.data_ptr(), out_kind,
                 int(out is not None and out.dtype == torch.bfloat16), n,
                 1.0 - lr * weight_decay, betas[0], betas[1], lr / bc1, bc2_sqrt, eps, scale, self.threads)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes
