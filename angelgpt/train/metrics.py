"""One log line per interval with Megatron's field names, TensorBoard events, a JSON-lines file and
Weights & Biases (optional); torch.profiler traces of chosen iterations and a CUDA memory snapshot."""

from __future__ import annotations

import json
import os
import resource
import socket
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from angelgpt.parallel.log import EVERY_RANK, get_logger

log = get_logger(__name__)
from angelgpt.system import GIB


def host_memory_gib() -> float:
    """Peak resident set size of this process."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def gpu_memory_gib(reserved: bool = False) -> float:
    """Peak GPU memory allocated by tensors, or reserved by the caching allocator (what the device lost)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / GIB


def gpu_alloc_retries() -> int:
    """Times the caching allocator found no free block, freed its cache and retried (each one
    synchronizes the device): nonzero when a run sits at the edge of GPU memory."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def scalars(record: dict) -> Iterator[Tuple[str, float]]:
    """A record's values as TensorBoard and W&B name them: 'train/KEY', a nested dict's 'KEY/SUB'."""
    for key, value in record.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                yield f"{key}/{sub}", v
        elif key != "iteration" and value is not None:
            yield f"train/{key}", value


class MetricsWriter:
    """Writes on the rank that owns the loss (the last pipeline stage's first TP/DP rank). Off a GPU
    (`on_gpu` False) the log line leaves out the GPU fields (TFLOP/s per GPU, GPU memory); the records
    written keep every key."""

    def __init__(self, enabled: bool, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 append: bool = False, wandb_project: Optional[str] = None, wandb_mode: Optional[str] = None,
                 wandb_dir: Optional[str] = None, run_config: Optional[dict] = None, on_gpu: bool = True):
        self.enabled = enabled
        self.on_gpu = on_gpu
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        if metrics_file:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(metrics_file, "a" if append else "w")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            self.wandb = _start_wandb(wandb_project, wandb_mode, wandb_dir, run_config)

    @classmethod
    def for_config(cls, enabled: bool, cfg, append: bool = False) -> "MetricsWriter":
        """The writer of cfg.logging's sinks; W&B gets the (resolved) config as its run config. On a GPU
        as the worker decides it: train.device 'cuda', or 'auto' where CUDA is available."""
        from angelgpt.config import to_dict

        lg = cfg.logging
        on_gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
        return cls(enabled, lg.metrics_file, lg.tensorboard_dir, append, lg.wandb_project, lg.wandb_mode,
                   lg.wandb_dir, to_dict(cfg), on_gpu)

    def log(self, record: dict, train_iters: int, consumed: int, skipped: int) -> None:
        if not self.enabled:
            return
        line = (
            f" iteration {record['iteration']:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {record['elapsed_ms']:.1f} |"
            + (f" throughput per GPU (TFLOP/s/GPU): {record['tflops_per_gpu']:.1f} |" if self.on_gpu else "")
            + f" tokens/s: {record['tokens_per_s']:.0f} |"
            f" learning rate: {record['lr']:.6E} |"
            f" lm loss: {record['lm_loss']:.6E} |"
        )
        if record.get("val_loss") is not None:
            line += f" validation lm loss: {record['val_loss']:.6E} |"
        line += (
            f" grad norm: {record['grad_norm']:.3f} |"
            f" skipped iterations: {skipped:3d} |"
            + (f" mem GPU (GiB): {record['mem_gpu_gib']:.2f} |" if self.on_gpu else "")
            + f" mem host (GiB): {record['mem_host_gib']:.2f} |"
        )
        log.info(line, extra=EVERY_RANK)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            step = record["iteration"]
            for name, value in scalars(record):
                self.tb.add_scalar(name, value, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(dict(scalars(record)), step=record["iteration"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(project: str, mode: Optional[str], directory: Optional[str], run_config: Optional[dict]):
    """A W&B run (wandb imported here, only when asked for); a run that cannot start is one line."""
    from angelgpt.config import ConfigError

    try:
        import wandb
    except ImportError:
        raise ConfigError("logging.wandb_project is set but wandb is not installed: "
                          "pip install 'angelgpt[wandb]' (or wandb)") from None
    kwargs = {"project": project, "config": run_config or {}}
    if mode is not None:
        kwargs["mode"] = mode
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        kwargs["dir"] = directory
    try:
        return wandb.init(**kwargs)
    except Exception as exc:
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"logging.wandb_project: wandb could not start a run ({text[:200]}); `wandb login`, "
                          f"or logging.wandb_mode=offline") from None


class Profiling:
    """logging.profile_steps and logging.memory_snapshot for one run of the training loop.

    The loop calls begin(N) before iteration N, end(N) after it, and close() when it stops. Iterations
    START..END run under torch.profiler (CPU, and CUDA on GPU, with shapes and memory) on every rank;
    at END (or at close, when the run stops inside the window) each rank writes
    HOST_rankR.TIME.pt.trace.json under the profile directory (torch.profiler.tensorboard_trace_handler),
    each iteration marked ProfilerStep#N as torch.profiler's own schedule marks steps.
    """

    SNAPSHOT_ITERATIONS = 3

    def __init__(self, logging_cfg, on_gpu: bool, owns_log: bool, first_iteration: int):
        import torch.distributed as dist

        self.on_gpu = on_gpu
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.window = logging_cfg.profile_steps
        self.profile_dir = logging_cfg.profile_dir or (
            os.path.join(logging_cfg.tensorboard_dir, "profile") if logging_cfg.tensorboard_dir else "profile")
        self.prof = None
        self.step = None
        self.profiled = []
        self.snapshot = None
        self.snapshot_after = first_iteration + self.SNAPSHOT_ITERATIONS
        path = logging_cfg.memory_snapshot
        if path and not on_gpu:
            if owns_log:
                log.info(f"logging.memory_snapshot ({path}) applies to GPUs (the CUDA caching allocator's "
                         f"history); nothing is written on CPU", extra=EVERY_RANK)
        elif path:
            if world > 1:
                p = Path(path)
                path = str(p.with_name(f"{p.stem}.rank{self.rank}{p.suffix}"))
            self.snapshot = path
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    def begin(self, iteration: int) -> None:
        if not self.window or not self.window[0] <= iteration <= self.window[1] or iteration in self.profiled:
            return
        if self.prof is None:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            Path(self.profile_dir).mkdir(parents=True, exist_ok=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_gpu else [])
            handler = tensorboard_trace_handler(self.profile_dir,
                                                worker_name=f"{socket.gethostname()}_rank{self.rank}")
            self.prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                                on_trace_ready=handler)
            self.prof.start()
        self.step = torch.profiler.record_function(f"ProfilerStep#{iteration}")
        self.step.__enter__()
        self.profiled.append(iteration)

    def end(self, iteration: int) -> bool:
        """After iteration N; True when a trace or snapshot was written (time the step timer should skip)."""
        wrote = False
        if self.step is not None:
            self.step.__exit__(None, None, None)
            self.step = None
            if iteration >= self.window[1]:
                self._stop_profile()
                wrote = True
        if self.snapshot and iteration >= self.snapshot_after:
            self._write_snapshot()
            wrote = True
        return wrote

    def close(self) -> None:
        if self.step is not None:
            self.step.__exit__(None, None, None)
            self.step = None
        if self.prof is not None:
            self._stop_profile()
        if self.snapshot:
            self._write_snapshot()

    def _stop_profile(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()
        self.prof.stop()  # the handler writes the trace
        self.prof = None
        log.info(f"profile of iteration{'s' if len(self.profiled) > 1 else ''} "
                 f"{self.profiled[0]}{f'-{self.profiled[-1]}' if len(self.profiled) > 1 else ''} written under "
                 f"{self.profile_dir} (one .pt.trace.json per rank; `tensorboard --logdir` with torch-tb-profiler)")

    def _write_snapshot(self) -> None:
        Path(self.snapshot).parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
        log.info(f"CUDA memory snapshot written to {self.snapshot} (open it at https://pytorch.org/memory_viz)")
        self.snapshot = None
