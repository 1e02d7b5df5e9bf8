"""GPU path (Megatron DDP + distributed optimizer, bf16, NCCL). Skipped without CUDA."""

import pytest
import torch



pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("size, optimizer", [("tiny", "megatron"), ("llama-tiny", "megatron"), ("llama-tiny", "zero_cache")])
def test_tiny_trains_on_gpu(tmp_path, size, optimizer):
    """The tiny presets, GPT-2's architecture and Llama's (RMSNorm, SwiGLU, RoPE, no biases, untied, GQA)."""
    metrics = tmp_path / "gpu.jsonl"
    from tests.helpers import read_metrics, run_cli

    proc = run_cli("train", "--size", size, "--device", "cuda", "--metrics-file", metrics, "logging.log_interval=1",
                   f"optim.optimizer={optimizer}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(metrics)
    assert records[-1]["lm_loss"] < 0.7 * records[0]["lm_loss"]
    assert records[-1]["mem_gpu_gib"] > 0


@pytest.mark.parametrize("save", [["zero_cache.save_large_model_multi_slice=true"],
                                  ["zero_cache.save_large_model_multi_slice=false"],
                                  ["checkpoint.async_save=true", "checkpoint.save_interval=5"]],
                         ids=["streamed-save", "staged-save", "async-save"])
def test_zero_cache_checkpoint_resumes_on_gpu(tmp_path, save):
    """Saved with states on the GPU, in pinned host memory and in NVMe files (streamed tensor by tensor,
    staged into host memory first, or staged and written in the background while iterations 6-7 run, the
    run resuming from that background-written checkpoint of iteration 5), resumed with every state on the
    GPU: the run continues as if it had not stopped (bf16 tolerance)."""
    from tests.helpers import read_metrics, run_cli

    def train(name, *overrides):  # --force: the planner refuses the tiny host budget that sends states to NVMe
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_cli("train", "--size", "tiny", "--device", "cuda", "--force", "--metrics-file", metrics,
                       "logging.log_interval=1", "optim.optimizer=zero_cache", "train.train_iters=14", *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_metrics(metrics)

    spread = ["zero_cache.prefetch_cache_sub_group_rate=0.3", f"zero_cache.nvme_path={tmp_path / 'nvme'}",
              "zero_cache.host_max_gib=0.0021"]
    full = train("full", *spread)
    ck = tmp_path / "ck"
    first = train("first", *spread, "train.exit_interval=10", f"checkpoint.save={ck}", *save)
    start = 10
    if "checkpoint.async_save=true" in save:  # resume from the one written in the background
        assert first[5]["checkpoint"]["async"] == 1 and first[5]["checkpoint"]["stall_s"] > 0, first[5]
        start = 5
        (ck / "latest_checkpointed_iteration.txt").write_text("5\n")
    resumed = train("resumed", "zero_cache.prefetch_cache_sub_group_rate=1.0", f"checkpoint.load={ck}")
    assert resumed[0]["iteration"] == start + 1
    by_iter = {r["iteration"]: r["lm_loss"] for r in full}
    for r in resumed:
        assert abs(r["lm_loss"] - by_iter[r["iteration"]]) <= 1e-2 * abs(by_iter[r["iteration"]]), r


def test_recomputing_some_layers_trains_as_recomputing_none(tmp_path):
    """Megatron's 'block' recompute of the first layer of two (model.recompute_num_layers=1) with
    ZeRO-Cache: recompute repeats the same forward, so the losses follow the run that keeps every
    activation; 'auto' on a GPU with room to spare keeps every activation."""
    from tests.helpers import read_metrics, run_cli

    losses = {}
    for name, extra in (("none", ["model.recompute=none"]),
                        ("block", ["model.recompute=full", "model.recompute_num_layers=1"]),
                        ("auto", ["model.recompute=auto"])):
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_cli("train", "--size", "tiny", "--device", "cuda", "--metrics-file", metrics,
                       "logging.log_interval=1", "train.train_iters=6", "optim.optimizer=zero_cache",
                       "zero_cache.prefetch_cache_sub_group_rate=0.5", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = [r["lm_loss"] for r in read_metrics(metrics)]
        if name == "auto":
            assert "model.recompute=none" in next(line for line in proc.stdout.splitlines()
                                                  if line.startswith("resolved: ")), proc.stdout[-2000:]
    assert losses["block"] == pytest.approx(losses["none"], rel=2e-2), losses
    assert losses["auto"] == pytest.approx(losses["none"], rel=2e-2), losses
