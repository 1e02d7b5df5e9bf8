"""Sequence parallelism on real gloo workers: TP 2 with parallel.sequence_parallel trains the tiny preset
exactly as one rank does (as TP 2 without it does: test_train_cpu), with the CPU optimizer and with
ZeRO-Cache."""

import math

import pytest

from tests.helpers import train_tiny

pytestmark = pytest.mark.distributed

STEPS = 20
SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]


def _same(base, other, what):
    assert [r["iteration"] for r in other] == [r["iteration"] for r in base] == list(range(1, STEPS + 1)), what
    for a, b in zip(base, other):
        for key in ("lm_loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (what, a["iteration"], key, a[key], b[key])


@pytest.mark.parametrize("optimizer", [
    ["optim.optimizer=megatron"],
    ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5"],
], ids=["megatron", "zero_cache-rate0.5"])
def test_tp2_with_sequence_parallel_matches_one_rank(tmp_path, optimizer):
    steps = f"train.train_iters={STEPS}"
    base = train_tiny(tmp_path, "tp1", steps, *optimizer)
    sp = train_tiny(tmp_path, "tp2-sp", steps, *optimizer, *SP, nproc=2)
    _same(base, sp, "TP 2 with sequence parallelism against TP 1")
    assert base[-1]["lm_loss"] < base[0]["lm_loss"]


def test_tp2_pp2_with_sequence_parallel_matches_one_rank(tmp_path):
    """Megatron's pipeline schedule on CPU (angelgpt.parallel.cpu_schedules) with sequence-parallel
    layers: the backward pass's sequence gathers stay on the CPU too."""
    steps = ["train.train_iters=4", "optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5"]
    base = train_tiny(tmp_path, "tp1", *steps)
    both = train_tiny(tmp_path, "tp2-pp2-sp", *steps, *SP, "parallel.pipeline_model_parallel_size=2", nproc=4)
    assert [r["iteration"] for r in both] == [1, 2, 3, 4]
    for a, b in zip(base, both):
        for key in ("lm_loss", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), (a["iteration"], key, a[key], b[key])
