"""One log line per interval with Megatron's field names, TensorBoard events and a JSON-lines file."""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Optional

import torch

from angelgpt.parallel.log import EVERY_RANK, get_logger

log = get_logger(__name__)
GIB = 1024 ** 3


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


class MetricsWriter:
    """Writes on the rank that owns the loss (the last pipeline stage's first TP/DP rank)."""

    def __init__(self, enabled: bool, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 append: bool = False):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        if metrics_file:
            Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(metrics_file, "a" if append else "w")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)

    def log(self, record: dict, train_iters: int, consumed: int, skipped: int) -> None:
        if not self.enabled:
            return
        line = (
            f" iteration {record['iteration']:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {record['elapsed_ms']:.1f} |"
            f" throughput per GPU (TFLOP/s/GPU): {record['tflops_per_gpu']:.1f} |"
            f" tokens/s: {record['tokens_per_s']:.0f} |"
            f" learning rate: {record['lr']:.6E} |"
            f" lm loss: {record['lm_loss']:.6E} |"
        )
        if record.get("val_loss") is not None:
            line += f" validation lm loss: {record['val_loss']:.6E} |"
        line += (
            f" grad norm: {record['grad_norm']:.3f} |"
            f" skipped iterations: {skipped:3d} |"
            f" mem GPU (GiB): {record['mem_gpu_gib']:.2f} | mem host (GiB): {record['mem_host_gib']:.2f} |"
        )
        log.info(line, extra=EVERY_RANK)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            step = record["iteration"]
            for key, value in record.items():
                if isinstance(value, dict):
                    for sub, v in value.items():
                        self.tb.add_scalar(f"{key}/{sub}", v, step)
                elif key != "iteration" and value is not None:
                    self.tb.add_scalar(f"train/{key}", value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
