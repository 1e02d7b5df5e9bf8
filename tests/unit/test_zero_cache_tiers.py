"""ZeRO-Cache's NVMe tier on the local disk: a chunk file round-trips whole."""
import shutil

import pytest
import torch

from angelgpt.zero_cache.tiers import NVMeTier

# Linux moves at most 0x7ffff000 bytes per read(2)/write(2); a layer of the 55 shape is a 9.7 GB chunk.
SYSCALL_MAX = 0x7FFFF000


def test_a_chunk_larger_than_one_system_call_round_trips(tmp_path):
    numel = (SYSCALL_MAX + (1 << 20)) // 4
    if shutil.disk_usage(tmp_path).free < 2 * numel * 4:
        pytest.skip(f"needs {2 * numel * 4 / 2**30:.1f} GiB free under {tmp_path}")
    tier = NVMeTier(str(tmp_path))
    try:
        file = tier.create("g0000_decay", numel)
        data = torch.arange(numel, dtype=torch.int32)  # every 4 bytes distinct, so a misplaced block shows
        NVMeTier.write(file, data.view(torch.float32))
        assert file.stat().st_size == numel * 4
        back = NVMeTier.read(file, torch.zeros(numel, dtype=torch.float32))
        assert torch.equal(back.view(torch.int32), data)
    finally:
        tier.close()
    assert not tier.dir.exists()
