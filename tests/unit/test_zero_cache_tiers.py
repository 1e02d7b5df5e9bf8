"""ZeRO-Cache's NVMe tier on a local file system: a chunk file round-trips whole, and what a killed run left is
reclaimed; the optimizer refuses a config whose 'auto' settings were not resolved before building."""
import shutil
from pathlib import Path

import pytest
import torch

from angelgpt.zero_cache.tiers import NVMeTier

# Linux moves at most 0x7ffff000 bytes per read(2)/write(2); a layer of the 55 shape is a 9.7 GB chunk.
SYSCALL_MAX = 0x7FFFF000


@pytest.fixture
def roomy_dir(tmp_path):
    """A directory for a 2 GiB file: in memory (/dev/shm) where 8 GiB are free there (the system-call limit
    is the kernel's whatever the file system, and a disk makes the test slower), else tmp_path."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 8 * 2**30:
        path = Path(tempfile.mkdtemp(dir=shm))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


@pytest.mark.slow  # writes and reads a 2 GiB file
def test_a_chunk_larger_than_one_system_call_round_trips(roomy_dir):
    numel = (SYSCALL_MAX + (1 << 20)) // 4
    if shutil.disk_usage(roomy_dir).free < 2 * numel * 4:
        pytest.skip(f"needs {2 * numel * 4 / 2**30:.1f} GiB free under {roomy_dir}")
    tier = NVMeTier(str(roomy_dir))
    try:
        file = tier.create("g0000_decay", numel * 4)
        data = torch.arange(numel, dtype=torch.int32)  # every 4 bytes distinct, so a misplaced block shows
        NVMeTier.write(file, data.view(torch.float32))
        assert file.stat().st_size == numel * 4
        back = NVMeTier.read(file, torch.zeros(numel, dtype=torch.float32))
        assert torch.equal(back.view(torch.int32), data)
    finally:
        tier.close()
    assert not tier.dir.exists()


@pytest.mark.subprocess
def test_chunks_a_killed_run_left_are_reclaimed_and_a_live_runs_are_kept(tmp_path):
    import subprocess
    import sys

    killed = subprocess.run(
        [sys.executable, "-c", "import os, sys, torch; from angelgpt.zero_cache.tiers import NVMeTier; "
         "t = NVMeTier(sys.argv[1]); f = t.create('g0001_decay', 4 << 18); "
         "NVMeTier.write(f, torch.ones(1 << 18)); print(t.dir); os._exit(0)", str(tmp_path)],
        capture_output=True, text=True, check=True).stdout.strip()
    live = NVMeTier(str(tmp_path))
    NVMeTier.write(live.create("g0001_decay", 4 << 18), torch.ones(1 << 18))
    other = tmp_path / "angelgpt-not-a-tier"  # no lock file: not ours to remove
    other.mkdir()
    try:
        freed = NVMeTier.reclaim(str(tmp_path))
        assert freed >= 4 << 18  # the killed run's chunk file
        assert not Path(killed).exists()
        assert live.dir.exists() and other.exists()
        assert NVMeTier.read(live.dir / "g0001_decay.bin", torch.zeros(1 << 18)).eq(1).all()
    finally:
        live.close()
    assert NVMeTier.reclaim(str(tmp_path)) == 0 and not live.dir.exists()

