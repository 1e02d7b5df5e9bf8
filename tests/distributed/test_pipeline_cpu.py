"""Pipeline parallelism on CPU: Megatron's 1F1B schedule under gloo (angelgpt.parallel.cpu_schedules) in
real torchrun workers. TP 2 x PP 2 x DP 2 trains as one rank does (every logged loss within 1e-5) with
both optimizers; at PP 2 alone the tied embedding's two copies stay equal and checkpoints move between
PP 2 and PP 1; a PP size that does not divide the layers is refused before launch."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, check_one_line_error, dry_run, resume_point, run_cli, run_config_in, train_tiny

pytestmark = pytest.mark.distributed

STEPS = 20
# the tiny preset with micro batch 2 (global batch 8: 4 micro batches per step at DP 1, 2 at DP 2, so
# 1F1B has a steady state), evaluated at 10 and 20 (the schedule's forward-only path)
COMMON = (f"train.train_iters={STEPS}", "train.micro_batch_size=2", "train.eval_interval=10")
OPTIMIZERS = {
    "megatron": ("optim.optimizer=megatron",),  # on CPU: CPUDataParallelAdamW
    "zero_cache-0.5": ("optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5"),
}
LAYOUTS = {  # the pipeline with TP and DP around it (PP 2 alone trains in the tied and checkpoint tests)
    "tp2-pp2-dp2": (8, ("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2")),
}
CHECK = Path(__file__).with_name("pipeline_tied_check.py")


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    """TP 1 x PP 1 x DP 1 runs of each optimizer, trained once for the module, saving at iteration 10 into
    the directory the run's records carry as `saved` (PP 1's checkpoint, which the checkpoint tests move)."""
    runs = {}

    def get(optimizer):
        if optimizer not in runs:
            root = tmp_path_factory.mktemp("single")
            records = train_tiny(root, optimizer, *COMMON, *OPTIMIZERS[optimizer], "checkpoint.save_interval=10",
                                 f"checkpoint.save={root / 'saved'}")
            runs[optimizer] = (records, root / "saved")
        return runs[optimizer]

    return get


def assert_same_losses(base, other, steps):
    assert [r["iteration"] for r in other] == steps, [r["iteration"] for r in other]
    by_iter = {r["iteration"]: r for r in base}
    for r in other:
        b = by_iter[r["iteration"]]
        assert math.isclose(r["lm_loss"], b["lm_loss"], rel_tol=1e-5), (r["iteration"], r["lm_loss"], b["lm_loss"])
        assert math.isclose(r["lr"], b["lr"], rel_tol=1e-9), r["iteration"]
        if b.get("val_loss") is not None:
            assert math.isclose(r["val_loss"], b["val_loss"], rel_tol=1e-5), (r["iteration"], r["val_loss"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))  # ZeRO-Cache at rate 0.0 across TP x DP: test_zero_cache
def test_pipeline_matches_single_rank(tmp_path, single_rank, optimizer, layout):
    nproc, overrides = LAYOUTS[layout]
    other = train_tiny(tmp_path, layout, *COMMON, *OPTIMIZERS[optimizer], *overrides, nproc=nproc)
    base, _ = single_rank(optimizer)
    assert_same_losses(base, other, list(range(1, STEPS + 1)))
    assert sum(r["val_loss"] is not None for r in other) == 2
    assert base[-1]["lm_loss"] < base[0]["lm_loss"]


def tied_check(tmp_path, *overrides, drop_sync=False):
    out = tmp_path / "tied"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               ANGELGPT_CHECK_NO_EMBEDDING_SYNC="1" if drop_sync else "0")
    resolved, printed = dry_run(tmp_path, "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2",
                                "parallel.pipeline_model_parallel_size=2", "train.train_iters=5", *overrides)
    assert printed is not None, resolved.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(CHECK), str(out), "--run-config", run_config_in(printed)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert sorted(r["stage"] for r in records) == [0, 1]
    return records


@pytest.mark.parametrize("optimizer", ["megatron", "zero_cache-0.5"])
def test_tied_embedding_copies_stay_equal(tmp_path, optimizer):
    """The first stage's word embeddings and the last stage's output weight: one update, bitwise equal."""
    for r in tied_check(tmp_path, *OPTIMIZERS[optimizer]):
        assert r["equal"] and r["max_diff"] == 0.0, r
        assert r["moved"] > 1e-4, r  # trained, not frozen


def test_tied_embedding_check_sees_a_missing_sync(tmp_path):
    """Without the all-reduce of the two copies' gradients they drift apart, and the check says so."""
    for r in tied_check(tmp_path, *OPTIMIZERS["megatron"], drop_sync=True):
        assert not r["equal"] and r["max_diff"] > 1e-4, r


@pytest.mark.parametrize("case", [("megatron", 2, 1), ("megatron", 1, 2), ("zero_cache-0.5", 2, 1)],
                         ids=lambda c: f"{c[0]}-pp{c[1]}-to-pp{c[2]}")
def test_checkpoint_moves_between_pipeline_sizes(tmp_path, single_rank, case):
    """Saved at iteration 10 with one PP size (PP 1: by the single-rank run on its way), resumed with the
    other: the losses go on as the uninterrupted single-rank run's (model and optimizer states resharded by
    dist_checkpointing)."""
    optimizer, saved_pp, loaded_pp = case
    full, single_saved = single_rank(optimizer)
    if saved_pp == 1:
        ckpt = resume_point(single_saved, 10, tmp_path / "ckpt")
    else:
        ckpt = tmp_path / "ckpt"
        first = train_tiny(tmp_path, "first", *COMMON, *OPTIMIZERS[optimizer], "train.exit_interval=10",
                           f"parallel.pipeline_model_parallel_size={saved_pp}", f"checkpoint.save={ckpt}",
                           nproc=saved_pp)
        assert first[-1]["iteration"] == 10
        assert_same_losses(full, first, list(range(1, 11)))
    resumed = train_tiny(tmp_path, "resumed", *COMMON, *OPTIMIZERS[optimizer], f"checkpoint.load={ckpt}",
                         f"parallel.pipeline_model_parallel_size={loaded_pp}", nproc=loaded_pp)
    assert_same_losses(full, resumed, list(range(11, STEPS + 1)))
    assert resumed[-1]["consumed_samples"] == full[-1]["consumed_samples"]


def test_pipeline_size_that_does_not_divide_the_layers_is_refused():
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "3",
                   "parallel.pipeline_model_parallel_size=3")
    check_one_line_error(proc, "parallel.pipeline_model_parallel_size (3) must divide model.num_layers (2)")
