"""The torchrun command `angelgpt train --dry-run` prints trains as printed: pasted into a shell, it runs
the workers on the run config the dry run resolved and wrote, and they resolve nothing again."""

import os
import subprocess

import pytest

from tests.helpers import ROOT, dry_run, failure_report, read_metrics, run_config_in

pytestmark = pytest.mark.distributed


def test_the_dry_runs_command_trains_as_printed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    proc, cmd = dry_run(tmp_path, "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2",
                        "--metrics-file", metrics, "train.train_iters=2", "logging.log_interval=1")
    assert proc.returncode == 0 and cmd is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not metrics.exists()  # a dry run trains nothing
    line = next(l for l in proc.stdout.splitlines() if l.startswith("torchrun command: ")).partition(": ")[2]
    assert f"# workers: {line}\n" in open(run_config_in(cmd)).read()
    # pasted into a shell, from another directory
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, failure_report(run)
    assert [r["iteration"] for r in read_metrics(metrics)] == [1, 2]
    assert "resolved: " not in run.stdout + run.stderr  # resolved once, by the dry run
