"""A stop is a save on the GPU: a job signalled to every process (twice, as Slurm and `kill -- -PGID` deliver
it) mid-run saves at the next boundary and exits 0 with one line; `--load` continues from there with the
losses of an uninterrupted run, for Megatron's optimizer and ZeRO-Cache, with asynchronous saves."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from tests.helpers import ROOT, read_metrics, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ITERS = 14


def start(tmp_path, name, optimizer, *extra):
    metrics = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cuda",
                             "--nproc-per-node", "1", "--metrics-file", str(metrics), "logging.log_interval=1",
                             f"optim.optimizer={optimizer}", f"train.train_iters={ITERS}",
                             # 128 micro batches a step: time to signal the job mid-run
                             "train.global_batch_size=256", *map(str, extra)],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, metrics


def losses(metrics):
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(metrics)}


@pytest.mark.parametrize("optimizer", ["megatron", "zero_cache"])
def test_a_signalled_job_saves_exits_0_and_resumes_like_an_uninterrupted_run(tmp_path, optimizer):
    from angelgpt.train.checkpoint import verify

    proc, full = start(tmp_path, "full", optimizer)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    ck = tmp_path / "ck"
    proc, first = start(tmp_path, "first", optimizer, f"checkpoint.save={ck}", "checkpoint.save_interval=3",
                        "checkpoint.async_save=true")
    try:
        assert wait_for(lambda: first.exists() and len(first.read_text().splitlines()) >= 5, timeout=240)
        root = psutil.Process(proc.pid)
        everyone = [root, *root.children(recursive=True)]
        for _ in range(2):
            for p in everyone:
                p.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stopped = read_metrics(first)[-1]["iteration"]
    assert stopped < ITERS, "the job ran past the iterations the comparison covers"
    assert [line for line in err.splitlines() if line.startswith("angelgpt:")] == [
        f"angelgpt: stopped at iteration {stopped} (SIGTERM): saved {ck}/iter_{stopped:07d}"], err
    assert int((ck / "latest_checkpointed_iteration.txt").read_text()) == stopped
    assert verify(ck / f"iter_{stopped:07d}") is None
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everyone)

    proc, resumed = start(tmp_path, "resumed", optimizer, f"checkpoint.load={ck}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    expected, got = losses(full), losses(resumed)
    assert min(got) == stopped + 1 and max(got) == ITERS
    for it, loss in got.items():  # bf16 on the GPU: the tolerance tests/gpu's resumes use
        assert abs(loss - expected[it]) <= 1e-2 * abs(expected[it]), (it, loss, expected[it])
