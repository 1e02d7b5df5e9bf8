"""A stop is a save: stop requests as schedulers and terminals send them (to the launcher, to the workers,
to every process of the job, twice), during set-up and during a save, after the grace, and the wall-clock
limit. Every case: the exit code and the one line as stated, the latest checkpoint complete and loadable,
no process left."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT, read_metrics, train_tiny, wait_for

pytestmark = pytest.mark.distributed
WIDER = ["model.num_layers=4", "model.hidden_size=256"]  # a few MB per checkpoint: saves take a while


def start(ck, metrics, *extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cpu",
                             "--nproc-per-node", "2", "train.train_iters=100000", "logging.log_interval=1",
                             f"checkpoint.save={ck}", "--metrics-file", str(metrics), *map(str, extra)],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def job(proc):
    """The launcher and every process under it (the torchrun agent, the workers)."""
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def workers(proc):
    return [p for p in job(proc) if "angelgpt.train.worker" in (cmd := " ".join(p.cmdline()))
            and "torch.distributed.run" not in cmd]


def iterations(metrics):
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def finish(proc, everyone, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    assert wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in everyone),
                    timeout=10), "a process of the job is left running"
    return out, err


def check_stopped_and_saved(proc, out, err, ck, metrics, signame):
    from angelgpt.train.checkpoint import verify

    assert proc.returncode == 0, err[-3000:]
    stopped = read_metrics(metrics)[-1]["iteration"]
    assert int((ck / "latest_checkpointed_iteration.txt").read_text()) == stopped
    assert verify(ck / f"iter_{stopped:07d}") is None
    assert not [p for p in ck.iterdir() if p.name.endswith(".tmp")]
    lines = [line for line in err.splitlines() if line.startswith("angelgpt:")]
    assert lines == [f"angelgpt: stopped at iteration {stopped} ({signame}): saved {ck}/iter_{stopped:07d}"], err
    assert "Traceback" not in err and "ChildFailedError" not in err
    return stopped


@pytest.mark.parametrize("target,sig,times", [
    ("launcher", signal.SIGINT, 2),         # Ctrl-C, and Ctrl-C again (`kill PID`, systemd: the same path)
    ("workers", signal.SIGTERM, 1),         # the workers alone
    ("everyone", signal.SIGUSR1, 2),        # Slurm's --signal=USR1 to every process of the job, twice
], ids=["launcher-int-twice", "workers-term", "everyone-usr1-twice"])
def test_a_stop_request_saves_at_the_next_boundary_and_exits_0(tmp_path, target, sig, times):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start(ck, metrics, *WIDER, "checkpoint.save_interval=3", "checkpoint.async_save=true")
    try:
        assert wait_for(lambda: iterations(metrics) >= 4)
        everyone = job(proc)
        chosen = {"launcher": everyone[:1], "workers": workers(proc), "everyone": everyone}[target]
        for _ in range(times):
            for p in chosen:
                p.send_signal(sig)
            time.sleep(0.2)
        out, err = finish(proc, everyone)
    finally:
        proc.kill()
    check_stopped_and_saved(proc, out, err, ck, metrics, sig.name)


def test_a_stop_during_a_save_finishes_that_save_and_the_next(tmp_path):
    """Signals to every process while a checkpoint is being written: the save goes on, the stop saves
    the next boundary, and a resume continues from there."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start(ck, metrics, *WIDER, "checkpoint.save_interval=2")
    try:
        assert wait_for(lambda: any(p.name.endswith(".tmp") for p in ck.iterdir()) if ck.exists() else False)
        everyone = job(proc)
        for _ in range(2):
            for p in everyone:
                p.send_signal(signal.SIGTERM)
        out, err = finish(proc, everyone)
    finally:
        proc.kill()
    stopped = check_stopped_and_saved(proc, out, err, ck, metrics, "SIGTERM")
    resumed = train_tiny(tmp_path, "resumed", *WIDER, f"checkpoint.load={ck}", f"train.train_iters={stopped + 2}",
                         nproc=2)
    assert resumed[0]["iteration"] == stopped + 1


def test_a_stop_during_set_up_ends_before_training_and_saves_nothing_new(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start(ck, metrics)
    try:
        assert wait_for(lambda: len(workers(proc)) == 2)
        everyone = job(proc)
        proc.send_signal(signal.SIGTERM)
        out, err = finish(proc, everyone)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("angelgpt:")]
    assert lines == ["angelgpt: stopped before iteration 1 (SIGTERM): nothing new to save"], err
    assert not metrics.exists() or iterations(metrics) == 0


def test_a_stop_request_after_the_grace_ends_the_job_at_once(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    proc = start(ck, metrics, "checkpoint.stop_grace_s=0.2")
    try:
        assert wait_for(lambda: len(workers(proc)) == 2)  # still setting up: the stop waits for iteration 1
        everyone = job(proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = finish(proc, everyone, timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("angelgpt: error: training workers exited with code 143: asked "
                                                   "to stop again 0.2 s (checkpoint.stop_grace_s) after"), err
    assert not (ck / "latest_checkpointed_iteration.txt").exists()


def test_the_wall_clock_limit_saves_and_exits_0_before_it(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    limit_s = 30.0  # set-up on a loaded 2-core machine takes most of 20 s
    proc = start(ck, metrics, *WIDER, f"train.exit_duration_mins={limit_s / 60}", "checkpoint.save_interval=2")
    started = psutil.Process(proc.pid).create_time()  # the limit counts from the launcher's start
    out, err = finish(proc, job(proc), timeout=120)
    stopped = check_stopped_and_saved(proc, out, err, ck, metrics, f"train.exit_duration_mins: {limit_s / 60:g} min")
    assert stopped > 2  # it trained on after a save it measured
    saved_at = (ck / f"iter_{stopped:07d}" / "manifest.json").stat().st_mtime
    assert saved_at < started + limit_s, f"the last save ended {saved_at - started:.1f} s after the start"
