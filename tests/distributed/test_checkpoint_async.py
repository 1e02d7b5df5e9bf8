"""checkpoint.async_save on real gloo processes: the background write holds the state of its iteration
while training goes on, manifests carry the CRCs of the bytes written, and a kill during the write
leaves the previous checkpoint as the latest one."""

import json
import os
import subprocess
import sys
import zlib

import psutil
import pytest

from tests.helpers import ROOT, train_tiny, wait_for

pytestmark = pytest.mark.distributed
CHECK = ROOT / "tests" / "distributed" / "async_save_check.py"


def _flat(path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _manifest_matches_files(path):
    from angelgpt.train.checkpoint import verify

    assert verify(path) is None
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert any(name.endswith(".distcp") for name in files)
    for name, meta in files.items():
        data = (path / name).read_bytes()
        assert (len(data), zlib.crc32(data)) == (meta["size"], meta["crc32"]), name


def test_async_save_writes_the_state_of_its_iteration_while_training_goes_on(tmp_path):
    import torch

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(CHECK), str(tmp_path / "async"), str(tmp_path / "ref")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint of iteration 2 written in the background" in proc.stdout
    held, reference = tmp_path / "async" / "iter_0000002", tmp_path / "ref" / "iter_0000002"
    for path in (held, reference, tmp_path / "async" / "iter_0000004"):
        _manifest_matches_files(path)
    written, expected = _flat(held), _flat(reference)
    assert sorted(written) == sorted(expected)
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optimizer.zero_cache.exp_avg_sq") for k in tensors)
    for key in tensors:
        assert torch.equal(written[key], expected[key]), key
    assert torch.load(held / "common.pt", weights_only=False)["iteration"] == 2
    # training went on: iteration 4's states are not iteration 2's
    later = _flat(tmp_path / "async" / "iter_0000004")
    assert any(not torch.equal(later[k], expected[k]) for k in tensors if k.startswith("optimizer.zero_cache.master"))


def test_kill_during_background_write_leaves_previous_checkpoint_latest(tmp_path):
    from angelgpt.train.checkpoint import verify

    ck = tmp_path / "ck"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cpu",
                             "--nproc-per-node", "2", "model.num_layers=4", "model.hidden_size=256",
                             "train.train_iters=400", "checkpoint.save_interval=2", "checkpoint.async_save=true",
                             f"checkpoint.save={ck}"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: (ck / "latest_checkpointed_iteration.txt").exists())
        assert wait_for(lambda: any(p.name.endswith(".tmp") for p in ck.iterdir() if p.is_dir()))
        for w in psutil.Process(proc.pid).children(recursive=True):
            if "angelgpt.train.worker" in " ".join(w.cmdline()):
                w.kill()
    finally:
        proc.kill()
        proc.wait()
    last = int((ck / "latest_checkpointed_iteration.txt").read_text())
    visible = sorted(p for p in ck.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
    assert visible and visible[-1].name == f"iter_{last:07d}"
    for path in visible:  # no half checkpoint under its final name
        assert verify(path) is None
    resumed = train_tiny(tmp_path, "resumed", "model.num_layers=4", "model.hidden_size=256",
                         f"checkpoint.load={ck}", f"train.train_iters={last + 1}")
    assert resumed[0]["iteration"] == last + 1
