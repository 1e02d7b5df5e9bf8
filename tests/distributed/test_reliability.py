"""Faults on real torchrun processes: kills during saves, signals, corrupted checkpoints,
non-finite losses, checkpoint rotation."""

import os
import subprocess
import sys
import threading

import psutil
import pytest

from tests.helpers import ROOT, check_one_line_error, run_cli, train_tiny, wait_for

pytestmark = pytest.mark.distributed
WIDER = ["model.num_layers=4", "model.hidden_size=256"]  # a few MB per checkpoint: saves take a while


def start_cli(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "angelgpt", *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def workers(proc):
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "angelgpt.train.worker" in " ".join(p.cmdline())]


def tracker(ck):
    return int((ck / "latest_checkpointed_iteration.txt").read_text())


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    from angelgpt.train.checkpoint import verify

    ck = tmp_path / "ck"
    proc = start_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", *WIDER,
                     "train.train_iters=400", "checkpoint.save_interval=2", f"checkpoint.save={ck}")
    try:
        assert wait_for(lambda: (ck / "latest_checkpointed_iteration.txt").exists())
        assert wait_for(lambda: any(p.name.endswith(".tmp") for p in ck.iterdir() if p.is_dir()))
        for w in workers(proc):
            w.kill()
    finally:
        proc.kill()
        proc.wait()
    last = tracker(ck)
    assert verify(ck / f"iter_{last:07d}") is None
    resumed = train_tiny(tmp_path, "resumed", *WIDER, f"checkpoint.load={ck}", f"train.train_iters={last + 2}",
                         nproc=2)
    assert resumed[0]["iteration"] == last + 1


def test_corrupted_or_partial_checkpoint_is_refused(tmp_path):
    ck = tmp_path / "ck"
    train_tiny(tmp_path, "a", "train.train_iters=2", f"checkpoint.save={ck}")
    data = next((ck / "iter_0000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", f"checkpoint.load={ck}")
    check_one_line_error(proc, "fails its checksum", in_worker=True)
    (ck / "iter_0000002" / "manifest.json").unlink()
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", f"checkpoint.load={ck}")
    check_one_line_error(proc, "is incomplete: it has no manifest.json", in_worker=True)


def test_consecutive_non_finite_steps_abort_with_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "model.init_method_std=1e30",
                   "train.max_consecutive_skips=3", f"checkpoint.save={ck}", "logging.log_interval=1")
    assert proc.returncode == 1
    assert "training aborted: 3 consecutive iterations had a non-finite loss" in proc.stderr
    assert "skipped iterations:   3" in proc.stdout
    assert tracker(ck) == 3


def test_checkpoint_keep_rotates_old_ones(tmp_path):
    ck = tmp_path / "ck"
    train_tiny(tmp_path, "k", "train.train_iters=20", "checkpoint.save_interval=5", "checkpoint.keep=2",
               f"checkpoint.save={ck}")
    assert sorted(p.name for p in ck.iterdir() if p.is_dir()) == ["iter_0000015", "iter_0000020"]


def test_worker_killed_by_sigkill_is_named_in_the_last_line(tmp_path):
    """A worker SIGKILLed (as the kernel's OOM killer does) without restarts left: the run fails and its
    last line says a worker was killed by SIGKILL and what to check, instead of torchrun's report alone."""
    proc = start_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", *WIDER,
                     "train.train_iters=100000", "logging.log_interval=1")
    try:
        assert wait_for(lambda: len([w for w in workers(proc) if "torch.distributed.run" not in " ".join(w.cmdline())]) == 2)
        out = proc.stdout.readline()
        while out and "iteration" not in out:  # training is under way
            out = proc.stdout.readline()
        [w for w in workers(proc) if "torch.distributed.run" not in " ".join(w.cmdline())][-1].kill()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("angelgpt: error: training workers exited with code 1: a worker was killed by "
                           "SIGKILL"), err[-2000:]
    assert "out-of-memory killer" in last


def test_a_rank_that_stops_answering_is_reported_by_the_others(tmp_path):
    """One of two gloo workers is frozen (SIGSTOP) mid-run: the other gives up after
    parallel.distributed_timeout_minutes, names itself, the phase of training and the backend's report,
    and exits; the run fails instead of hanging. (The frozen worker cannot act on the launcher's SIGTERM:
    the test kills it once the other has exited, as the launcher would after its grace period.)"""
    proc = start_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", *WIDER,
                     "train.train_iters=100000", "logging.log_interval=1", "parallel.distributed_timeout_minutes=0.1")
    lines = []
    try:
        line = proc.stdout.readline()
        while line and "iteration" not in line:  # training is under way
            line = proc.stdout.readline()
        ranks = {w.environ().get("RANK"): w for w in workers(proc) if "torch.distributed.run" not in " ".join(w.cmdline())}
        ranks["1"].suspend()
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        ranks["0"].wait(timeout=120)  # psutil.TimeoutExpired if rank 0 hangs instead of giving up
        ranks["1"].kill()
        proc.wait(timeout=120)
        reader.join(timeout=30)
    finally:
        proc.kill()
    err = "".join(lines)
    assert proc.returncode != 0
    reports = [x for x in err.splitlines() if "a collective timed out" in x]
    assert reports and reports[0].startswith("angelgpt: rank 0: a collective timed out after 0.1 min "
                                             "(parallel.distributed_timeout_minutes) during iteration "), err[-3000:]
    assert "another rank stopped answering" in reports[0]


def test_a_failed_save_keeps_the_previous_checkpoint_and_says_why(tmp_path):
    """The save of iteration 8 cannot create its directory (a file stands where iter_0000008.tmp goes):
    the run stops with one line naming the cause and the checkpoint still latest, exits non-zero with no
    process left, and the checkpoint of iteration 4 stays the latest and loads."""
    from angelgpt.train.checkpoint import verify

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "iter_0000008.tmp").write_text("in the way")
    proc = start_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", "train.train_iters=12",
                     "checkpoint.save_interval=4", f"checkpoint.save={ck}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert out.count("saved the checkpoint of iteration 4 in ") == 1, out[-3000:]  # one line per save
    lines = [line for line in err.splitlines() if line.startswith("angelgpt: ")]
    assert any("the checkpoint of iteration 8 could not be saved" in line and
               "the latest checkpoint is still iteration 4" in line for line in lines), err[-3000:]
    assert "angelgpt/train/" not in err, err[-3000:]  # no worker traceback (torchrun's agent reports exit 1)
    assert tracker(ck) == 4 and verify(ck / "iter_0000004") is None
    assert not (ck / "iter_0000008").exists()
    assert wait_for(lambda: not psutil.pid_exists(proc.pid) or not workers(proc), timeout=10)
    resumed = train_tiny(tmp_path, "resumed", f"checkpoint.load={ck}", "train.train_iters=6", nproc=2)
    assert resumed[0]["iteration"] == 5
