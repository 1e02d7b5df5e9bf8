"""A run lives as long as its launcher: SIGKILL of `angelgpt train` alone ends the torchrun agent and the
workers; and one run per checkpoint directory: a second one on the same --save DIR is refused while the
first lives, and takes the directory over once the first is dead."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, processes_of, run_cli, train_tiny, wait_for

pytestmark = pytest.mark.distributed


def start_cli(tmp_path, *args):
    """The CLI in the background, its output into files (nobody reads a pipe while it trains)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        return subprocess.Popen([sys.executable, "-m", "angelgpt", *map(str, args)], cwd=ROOT, env=env, text=True,
                                stdout=out, stderr=err)


def snapshot(ck):
    return {str(p.relative_to(ck)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(ck.rglob("*"))}


def tracker(ck):
    return int((ck / "latest_checkpointed_iteration.txt").read_text())


def start_training(tmp_path, ck, nproc):
    proc = start_cli(tmp_path, "train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", nproc,
                     "train.train_iters=100000", "checkpoint.save_interval=2", "--save", ck)
    if not wait_for(lambda: (ck / "latest_checkpointed_iteration.txt").exists() or proc.poll() is not None):
        proc.kill()
    assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
    return proc


def kill_launcher(proc, ck):
    """SIGKILLs the launcher alone; returns the seconds until no process of its run is left."""
    assert len(processes_of(ck)) >= 3  # launcher, torchrun agent, worker(s)
    proc.send_signal(signal.SIGKILL)
    t0 = time.time()
    proc.wait()
    try:
        assert wait_for(lambda: not processes_of(ck), timeout=15), [p.cmdline()[:4] for p in processes_of(ck)]
    finally:
        for p in processes_of(ck):
            p.kill()
    return time.time() - t0


def test_sigkill_of_the_launcher_ends_agent_and_workers(tmp_path):
    ck = tmp_path / "ck"
    proc = start_training(tmp_path, ck, nproc=2)
    took = kill_launcher(proc, ck)
    assert took < 15
    before = snapshot(ck)
    time.sleep(1.5)
    assert snapshot(ck) == before  # nothing saves after the run is gone


def test_second_run_on_a_directory_is_refused_until_the_first_is_dead(tmp_path):
    ck = tmp_path / "ck"
    first = start_training(tmp_path, ck, nproc=1)
    try:
        running = [p for p in processes_of(ck) if p.pid != first.pid]
        for p in running:  # frozen, so that its own saves do not hide what the second run writes
            p.suspend()
        before = snapshot(ck)
        second = run_cli("train", "--size", "tiny", "--device", "cpu", "train.train_iters=2", "--save", ck,
                         timeout=120)
        assert snapshot(ck) == before
        for p in running:
            p.resume()
    except BaseException:
        first.kill()
        raise
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in second.stdout + second.stderr, second.stderr
    assert lines[0].startswith(f"angelgpt: error: checkpoint directory {ck} is in use by another run "
                               f"(host {socket.gethostname()}, PID {first.pid})"), lines[0]
    assert "training from iteration" not in second.stdout
    assert "torchrun command" not in second.stdout  # refused before anything was printed or launched

    kill_launcher(first, ck)  # the kernel drops a dead holder's lock
    last = tracker(ck)
    resumed, out = train_tiny(tmp_path, "resumed", f"train.train_iters={last + 1}", f"checkpoint.save={ck}",
                              with_output=True)
    assert f"resumed from {ck} at iteration {last}" in out
    assert resumed[0]["iteration"] == last + 1 and tracker(ck) == last + 1


def test_dry_run_takes_no_lock_and_the_lock_names_its_holder(tmp_path):
    from angelgpt.config import ConfigError
    from angelgpt.train.lifetime import LOCK_NAME, take_save_lock

    ck = tmp_path / "ck"
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--dry-run", "--save", ck)
    assert proc.returncode == 0, proc.stderr
    assert not ck.exists()
    lock = take_save_lock(str(ck))  # creates the directory
    with pytest.raises(ConfigError, match=f"host {socket.gethostname()}, PID {os.getpid()}"):
        take_save_lock(str(ck))  # another open file description: refused, even in the same process
    assert take_save_lock(str(ck), nnodes=2, node_rank=1) is None  # only node 0 of several locks
    lock.release()
    take_save_lock(str(ck)).release()
    assert [p.name for p in ck.iterdir()] == [LOCK_NAME]
