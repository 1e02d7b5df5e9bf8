"""GPU path (Megatron DDP + distributed optimizer, bf16, NCCL). Skipped without CUDA."""

import pytest
import torch



pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_tiny_trains_on_gpu(tmp_path):
    metrics = tmp_path / "gpu.jsonl"
    from tests.conftest import read_metrics, run_cli

    proc = run_cli("train", "--size", "tiny", "--device", "cuda", "--metrics-file", metrics, "logging.log_interval=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["lm_loss"] < 0.7 * records[0]["lm_loss"]
    assert records[-1]["mem_gpu_gib"] > 0
