"""The Megatron-style log line names what was measured: off a GPU it has no GPU fields (TFLOP/s per GPU,
GPU memory), while the metrics file's records keep every key."""

import json
import logging

from angelgpt.config import parse
from angelgpt.train.metrics import MetricsWriter

RECORD = {"iteration": 3, "lm_loss": 10.5, "val_loss": None, "lr": 1e-4, "grad_norm": 1.25, "elapsed_ms": 12.0,
          "tokens_per_s": 1000.0, "tflops_per_gpu": 0.0, "mem_gpu_gib": 0.0, "mem_gpu_reserved_gib": 0.0,
          "gpu_alloc_retries": 0, "mem_host_gib": 1.5, "consumed_samples": 24}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _log_line(writer):
    handler = _Lines()
    logger = logging.getLogger("angelgpt.train.metrics")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        writer.log(dict(RECORD), 10, 24, 0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (line,) = handler.lines
    return line


def test_the_cpu_log_line_has_no_gpu_fields_and_the_record_keeps_every_key(tmp_path):
    path = tmp_path / "m.jsonl"
    cfg = parse("tiny", None, ["train.device=cpu", f"logging.metrics_file={path}"])
    writer = MetricsWriter.for_config(True, cfg)
    line = _log_line(writer)
    writer.close()
    assert "GPU" not in line
    assert "tokens/s: 1000 |" in line and "mem host (GiB): 1.50 |" in line and "lm loss: 1.050000E+01 |" in line
    (written,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert written == RECORD


def test_the_gpu_log_line_has_megatrons_gpu_fields():
    cfg = parse("tiny", None, ["train.device=cuda"])
    line = _log_line(MetricsWriter.for_config(True, cfg))
    assert "throughput per GPU (TFLOP/s/GPU): 0.0 |" in line and "mem GPU (GiB): 0.00 |" in line
    assert "tokens/s: 1000 |" in line and "mem host (GiB): 1.50 |" in line
