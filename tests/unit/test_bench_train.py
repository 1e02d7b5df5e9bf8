"""scripts/bench_train.py (benchmarks.train) reads why a run completed no step from the run's own output:
here the launcher's real refusal of a configuration the planner finds short of memory."""

from types import SimpleNamespace

import pytest
import torch

from angelgpt.cli import job
from angelgpt.config import parse
from benchmarks.train import failure


@pytest.mark.slow  # plans 20 layers of the 55 shape
def test_a_refusal_before_launch_is_recorded_with_what_was_short(monkeypatch, capsys):
    # the launcher reads the GPU from CUDA; this machine has none, so it is given an H200
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H200", total_memory=150_117_965_824))
    cfg = parse("h200-16b", overrides=["model.num_layers=20", "train.global_batch_size=32"])
    _, _, planned, _ = job.resolve_for(cfg, True, 1, 1)
    with pytest.raises(SystemExit) as exit_:
        job.check_plan(planned, force=False)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    got = failure(err, 2)
    assert got["oom"] and got["oom_kind"] in ("gpu and host", "host", "gpu"), (got, err)
    assert got["refused"].startswith("short of ") and "GiB" in got["refused"] and got["refused"] in err


def test_out_of_memory_and_the_oom_killer_are_told_apart():
    assert failure("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1) == \
        {"oom": True, "oom_kind": "gpu"}
    assert failure("worker exited: Signal 9 (SIGKILL) received by PID 4242", 1) == {"oom": True, "oom_kind": "host"}
    assert failure("ValueError: something else", 1) == {"oom": False, "oom_kind": None}
