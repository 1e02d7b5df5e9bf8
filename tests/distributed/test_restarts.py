"""A crashed worker's job resumes by itself: with --max-restarts, rank 1 of two gloo workers is SIGKILLed
mid-run (after a save, or while one is being written), or every worker raises (a save that fails);
torchrun restarts the workers, they resume from the latest complete checkpoint (never a half-written
iter_N.tmp), and the run exits 0 with the losses (and saved tensors) of an uninterrupted run, leaving no
process behind."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from tests.helpers import ROOT, failure_report, processes_of, read_metrics, train_tiny, wait_for

pytestmark = pytest.mark.distributed
WIDER = ["model.num_layers=4", "model.hidden_size=256"]  # a few MB per checkpoint: a save takes a while
ITERS, EVERY = 30, 5
JOB = [*WIDER, f"train.train_iters={ITERS}", f"checkpoint.save_interval={EVERY}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    return train_tiny(root, "full", *JOB, f"checkpoint.save={root / 'ck'}", nproc=2), root / "ck"


def rank_1(launcher):
    """The worker process of RANK 1 under the launcher (torchrun's agent, also named in its command line
    by the worker module, has no RANK)."""
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "angelgpt.train.worker" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
                return p
        except psutil.Error:
            pass
    return None


def iterations(metrics):
    try:
        return [json.loads(line)["iteration"] for line in metrics.read_text().splitlines() if line.endswith("}")]
    except (OSError, ValueError):
        return []


def tracker(ck):
    return int((ck / "latest_checkpointed_iteration.txt").read_text())


def flat(path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("moment", ["during-a-save"])
def test_a_worker_killed_mid_run_restarts_from_the_latest_checkpoint_and_ends_like_an_uninterrupted_run(
        tmp_path, uninterrupted, moment):
    import torch

    full, full_ck = uninterrupted
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cpu",
                                 "--nproc-per-node", "2", *JOB, "logging.log_interval=1", "--max-restarts", "1",
                                 "--save", ck, "--metrics-file", metrics], cwd=ROOT, env=env, stdout=out, stderr=err)
    try:
        if moment == "after-a-save":  # two iterations past the first save
            assert wait_for(lambda: (ck / "latest_checkpointed_iteration.txt").exists()
                            and EVERY + 2 in iterations(metrics), timeout=300)
            partial = None
        else:  # the second save is being written
            assert wait_for(lambda: (ck / f"iter_{2 * EVERY:07d}.tmp").is_dir(), poll=0.001, timeout=300)
            partial = 2 * EVERY
        victim = rank_1(proc)
        assert victim is not None
        victim.kill()
        resumed_at = tracker(ck)
        assert resumed_at < ITERS, "the run ended before a worker could be killed"
        if partial is not None:
            assert not (ck / f"iter_{partial:07d}" / "manifest.json").exists() and resumed_at < partial
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / "out").read_text(),
                                       (tmp_path / "err").read_text())
    assert proc.returncode == 0, failure_report(done)
    assert wait_for(lambda: not processes_of(ck), timeout=10), processes_of(ck)
    assert done.stdout.count(f"resumed from {ck} at iteration") == 1
    assert f"resumed from {ck} at iteration {resumed_at}\n" in done.stdout
    assert ("angelgpt: worker local rank 1 was killed by SIGKILL: every worker restarts from the latest "
            "checkpoint (restart 1 of 1, --max-restarts)") in done.stderr
    records = read_metrics(metrics)
    # the restarted attempt's records: every iteration after the checkpoint, each with the uninterrupted loss
    after = [r for r in records[len(records) - (ITERS - resumed_at):]]
    assert [r["iteration"] for r in after] == list(range(resumed_at + 1, ITERS + 1))
    assert [r["lm_loss"] for r in after] == [r["lm_loss"] for r in full[resumed_at:]]
    a, b = flat(full_ck / f"iter_{ITERS:07d}"), flat(ck / f"iter_{ITERS:07d}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not [p for p in ck.iterdir() if p.name.endswith(".tmp")]


def test_a_worker_that_raises_mid_run_restarts_from_the_latest_checkpoint(tmp_path, uninterrupted):
    """The second save fails on every rank (a file stands where iter_N.tmp goes): the workers raise and
    exit, torchrun restarts them, and with the obstacle gone the run resumes from the first save and ends
    with the uninterrupted run's losses."""
    full, _ = uninterrupted
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    ck.mkdir()
    obstacle = ck / f"iter_{2 * EVERY:07d}.tmp"
    obstacle.write_text("in the way")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cpu",
                                 "--nproc-per-node", "2", *JOB, "logging.log_interval=1", "--max-restarts", "1",
                                 "--save", ck, "--metrics-file", metrics], cwd=ROOT, env=env, stdout=out, stderr=err)
    try:
        assert wait_for(lambda: "could not be saved" in (tmp_path / "err").read_text(), timeout=300)
        obstacle.unlink()
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / "out").read_text(),
                                       (tmp_path / "err").read_text())
    assert proc.returncode == 0, failure_report(done)
    assert f"the checkpoint of iteration {2 * EVERY} could not be saved" in done.stderr
    assert f"resumed from {ck} at iteration {EVERY}\n" in done.stdout
    assert wait_for(lambda: not processes_of(ck), timeout=10), processes_of(ck)
    after = read_metrics(metrics)[-(ITERS - EVERY):]
    assert [r["iteration"] for r in after] == list(range(EVERY + 1, ITERS + 1))
    assert [r["lm_loss"] for r in after] == [r["lm_loss"] for r in full[EVERY:]]
