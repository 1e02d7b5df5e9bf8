"""ZeRO-Cache on CPU under gloo with real torchrun processes: AdamW equality over every tier mix,
training trajectory against optimizer megatron, checkpoint resume into another placement, refusals."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from angelgpt.config import parse
from angelgpt.planner.layout import rank_params
from angelgpt.planner.memory import sub_group_numels
from angelgpt.planner.plan import rank_tier_bytes
from tests.helpers import ROOT, check_one_line_error, resume_point, run_cli, train_tiny

pytestmark = pytest.mark.distributed
CHECK = Path(__file__).with_name("zero_cache_adamw_check.py")


def adamw_checks(tmp_path, nproc, *variants, env_extra=None):
    """The check's per-rank results for each list of overrides in `variants`, all from one torchrun launch."""
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    args = [str(arg) for i, overrides in enumerate(variants) for arg in [*(["--next"] if i else []), *overrides]]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(CHECK), str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == len(variants)
    return results


def adamw_check(tmp_path, nproc, *overrides, env_extra=None):
    """The check's per-rank results for one set of overrides."""
    return adamw_checks(tmp_path, nproc, overrides, env_extra=env_extra)[0]


# every pair of (DP, placement rate, NVMe) values meets in one case: 6 cases cover what 12 would
PAIRWISE = [(False, 0.0, 1), (True, 0.0, 2), (True, 0.5, 1), (False, 0.5, 2), (True, 1.0, 1), (False, 1.0, 2)]


def pairwise_overrides(nvme_path, nvme, rate, dp):
    """(overrides, device_update_fraction) of a PAIRWISE case."""
    overrides = [f"zero_cache.prefetch_cache_sub_group_rate={rate}"]
    fraction = 0.0
    if nvme:  # host memory too small for all states: what is not on the device spills to NVMe, and half
        # of the host chunks are updated on the device (NVMe chunks never are)
        # room for gradients, scratch and staging and some states, not every state (a rank owns half at DP=2)
        host_gib = {(1, 0.0): 0.0018, (2, 0.0): 0.0014, (1, 0.5): 0.0015, (2, 0.5): 0.0010}.get((dp, rate), 0.0015)
        fraction = 0.5
        overrides += [f"zero_cache.nvme_path={nvme_path}", f"zero_cache.host_max_gib={host_gib}",
                      f"zero_cache.device_update_fraction={fraction}"]
    return overrides, fraction


@pytest.fixture(scope="module")
def shared_check(tmp_path_factory):
    """run(nproc, variants, index, env_extra) -> the check's ranks for variants[index]; every set of
    overrides in `variants` runs in one launch, made by the first test to ask (tests that share it pass
    equal arguments but the index). Each set builds its own model and optimizer in that launch."""
    launches = {}

    def run(nproc, variants, index, env_extra=None):
        key = (nproc, tuple(tuple(map(str, v)) for v in variants), tuple(sorted((env_extra or {}).items())))
        if key not in launches:
            launches[key] = adamw_checks(tmp_path_factory.mktemp("check"), nproc, *variants, env_extra=env_extra)
        return launches[key][index]

    return run


@pytest.mark.parametrize("nvme, rate, dp", PAIRWISE,
                         ids=[f"{'nvme' if n else 'no-nvme'}-{r}-{d}" for n, r, d in PAIRWISE])
def test_update_equals_torch_adamw(shared_check, tmp_path_factory, dp, rate, nvme):
    cases = [c for c in PAIRWISE if c[2] == dp]  # the cases of one DP size share a launch
    settings = [pairwise_overrides(tmp_path_factory.getbasetemp() / f"nvme-{n}-{r}-{d}", n, r, d) for n, r, d in cases]
    index = cases.index((nvme, rate, dp))
    overrides, fraction = settings[index]
    ranks = shared_check(dp, [o for o, _ in settings], index)
    assert len(ranks) == dp
    for r in ranks:
        assert r["first_update_max_rel_err"] < 1e-6, r
        assert r["three_updates_rel_err"] < 1e-6, r
        expected = {"device"} if rate == 1.0 else ({"host"} if rate == 0.0 else {"device", "host"})
        if nvme and rate < 1.0:
            assert "nvme" in r["tiers"], r["tiers"]
            assert r["nvme_files"], "NVMe chunks were written to files"
            assert not Path(r["nvme_dir"]).exists(), "NVMe files are removed at close"
        else:
            assert set(r["tiers"]) == expected, r["tiers"]
        for tier, planned in r["planned"].items():
            assert r["allocated"][tier] == planned, (tier, r)
        # the planner, from the config alone, predicts what this rank's allocator handed out, per tier
        cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", *overrides])
        host_limit = cfg.zero_cache.host_max_gib * 2 ** 30 if nvme else 1 << 50
        predicted = rank_tier_bytes(cfg, dp, r["rank"], rate, host_limit, nvme, model_bytes=4, fraction=fraction)[2]
        for tier in ("device", "host", "nvme"):
            assert r["allocated"].get(tier, 0) == predicted[tier], (tier, r["allocated"], predicted)
        # fp32 master + 2 moments + the owned gradient (fp32 on CPU) per owned parameter, plus scratch
        assert sum(r["allocated"].values()) >= 16 * r["owned_numel"]
        # a checkpoint saves every state from its tier and loads into it in place: no tier copied whole
        views = r["checkpoint_views"]
        assert views["copy"] == 0 and views["chunk"] + views["nvme_file"] > 0, views
        assert views["shards_per_key"] == 1, views
        assert (views["nvme_file"] > 0) == ("nvme" in r["tiers"]), views
    assert sum(r["owned_numel"] for r in ranks) == ranks[0]["total_numel"]  # each state owned once over DP


def test_update_in_slices_equals_torch_adamw(tmp_path):
    """Chunks updated a slice at a time (here 1024 elements, so slices cut through parameters), on the
    device tier and on the host tier with offloaded weights, still equal torch AdamW."""
    cases = ((0.5, "false"), (0.0, "true"))
    results = adamw_checks(tmp_path, 2, *([f"zero_cache.prefetch_cache_sub_group_rate={rate}",
                                           f"zero_cache.offload_params={offload}",
                                           "zero_cache.update_slice_numel=1024"] for rate, offload in cases))
    for (rate, _), ranks in zip(cases, results):
        for r in ranks:
            assert set(r["scratch_numel"].values()) == {1024}, r["scratch_numel"]  # zero_cache.update_slice_numel
            assert r["first_update_max_rel_err"] < 1e-6, r
            assert r["three_updates_rel_err"] < 1e-6, r
            # a device-tier case, and a host-tier one whose layers' weights are offloaded
            expected = ({"device", "host"}, False) if rate else ({"host"}, True)
            assert (set(r["tiers"]), bool(r["offloaded_layers"])) == expected, r


@pytest.mark.parametrize("dp", [1, 2])
def test_accumulating_in_the_store_equals_torch_adamw(tmp_path, dp):
    """accumulate_in_store: three backward passes per step, each one's gradients reduced and added
    up in the store (device chunks, host chunks, offloaded layers) as it ends; the updates still
    equal torch AdamW on the summed gradients, and so does the same run without it."""
    rate = 0.25 if dp == 1 else 0.3  # some chunks on the device, and layers with every chunk off it
    variants = (["zero_cache.accumulate_in_store=true"], [])
    results = adamw_checks(tmp_path, dp, *([f"zero_cache.prefetch_cache_sub_group_rate={rate}",
                                            "zero_cache.offload_params=true", *extra] for extra in variants),
                           env_extra={"ANGELGPT_CHECK_MICROBATCHES": "3"})
    for extra, ranks in zip(variants, results):
        for r in ranks:
            assert r["accumulate_in_store"] == bool(extra), (extra, r)
            assert r["first_update_max_rel_err"] < 1e-6, (extra, r)
            assert r["three_updates_rel_err"] < 1e-6, (extra, r)
            assert set(r["tiers"]) == {"device", "host"} and r["offloaded_layers"], r
            cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", "train.micro_batch_size=2",
                                             f"train.global_batch_size={6 * dp}", "zero_cache.offload_params=true",
                                             *extra])
            predicted = rank_tier_bytes(cfg, dp, r["rank"], rate, 1 << 50, False, model_bytes=4)[2]
            for tier in ("device", "host"):  # staging slots and separate weight copies included
                assert r["allocated"][tier] == predicted[tier], (extra, tier, r["allocated"], predicted)


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_host_chunks_updated_on_the_device_equal_torch_adamw(shared_check, fraction):
    """device_update_fraction: that share of the host chunks streams through the device's two update
    buffers (slices of 1024 elements, so a chunk takes several trips and slices cut through
    parameters) while the CPU updates the rest; with gradients accumulated in the store over DP=2,
    the updates still equal torch AdamW, and the planner predicts the bytes (update buffers included)."""
    variants = [["zero_cache.prefetch_cache_sub_group_rate=0.3", "zero_cache.offload_params=false",
                 f"zero_cache.device_update_fraction={f}", "zero_cache.accumulate_in_store=true",
                 "zero_cache.update_slice_numel=1024"] for f in (0.5, 1.0)]
    index = (0.5, 1.0).index(fraction)  # both fractions share a launch
    overrides = variants[index]
    ranks = shared_check(2, variants, index,
                         env_extra={"ANGELGPT_CHECK_MICROBATCHES": "2"})
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", "train.micro_batch_size=2",
                                     "train.global_batch_size=8", *overrides])
    for r in ranks:
        assert r["first_update_max_rel_err"] < 1e-6, r
        assert r["three_updates_rel_err"] < 1e-6, r
        assert set(r["tiers"]) == {"device", "host"}, r["tiers"]
        if fraction == 1.0:
            assert r["device_updated"] == r["host_numel"], r
        else:
            assert 0 < r["device_updated"] < r["host_numel"], r
        predicted = rank_tier_bytes(cfg, 2, r["rank"], 0.3, 1 << 50, False, model_bytes=4, fraction=fraction)[2]
        for tier in ("device", "host"):
            assert r["allocated"][tier] == predicted[tier], (tier, r["allocated"], predicted)


def test_a_layer_split_between_device_and_host_equals_torch_adamw(tmp_path):
    """Chunks smaller than a layer (here 16384 elements: a tiny layer's attention weights, its FC1 and
    its FC2 are a chunk each), so the placement puts part of a layer on the device and the rest on the
    host; with gradients accumulated in the store and half the host chunks updated on the device, the
    updates still equal torch AdamW and the planner predicts the bytes of each tier."""
    overrides = ["zero_cache.prefetch_cache_sub_group_rate=0.5", "zero_cache.accumulate_in_store=true",
                 "zero_cache.device_update_fraction=0.5", "zero_cache.offload_params=true",
                 "zero_cache.chunk_numel=16384"]
    ranks = adamw_check(tmp_path, 1, *overrides, env_extra={"ANGELGPT_CHECK_MICROBATCHES": "2"})
    r = ranks[0]
    assert r["first_update_max_rel_err"] < 1e-6, r
    assert r["three_updates_rel_err"] < 1e-6, r
    assert r["chunks_per_group"] >= 4 and r["split_groups"], r  # three weight chunks and the biases
    assert not set(r["split_groups"]) & set(r["offloaded_layers"]), r  # a layer partly on the device keeps its weights
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", "train.micro_batch_size=2",
                                     "train.global_batch_size=4", *overrides])
    predicted = rank_tier_bytes(cfg, 1, 0, 0.5, 1 << 50, False, model_bytes=4, fraction=0.5)[2]
    for tier in ("device", "host"):
        assert r["allocated"][tier] == predicted[tier], (tier, r["allocated"], predicted)


OFFLOADED = [(1, False, "auto"), (2, False, "torch"), (1, True, "auto"), (2, True, "auto")]


def offloaded_overrides(nvme_path, dp, nvme, cpu_adam):
    """The overrides of an OFFLOADED case."""
    overrides = ["zero_cache.prefetch_cache_sub_group_rate=0.0", "zero_cache.offload_params=true",
                 f"zero_cache.cpu_adam={cpu_adam}"]
    if nvme:
        host_gib = 0.0025 if dp == 1 else 0.0016  # some states on the host, the rest on NVMe
        overrides += [f"zero_cache.nvme_path={nvme_path}", f"zero_cache.host_max_gib={host_gib}"]
    return overrides


@pytest.mark.parametrize("dp, nvme, cpu_adam", OFFLOADED)
def test_offloaded_weights_update_equals_torch_adamw(shared_check, tmp_path_factory, dp, nvme, cpu_adam):
    """offload_params: layers whose states are off the device keep their weights on the host, are
    fetched before each forward and released after their backward; updates still equal torch AdamW,
    with the one-pass CPU AdamW (writing the new weights over the gradient they came from) and with
    torch's."""
    cases = [c for c in OFFLOADED if c[0] == dp]  # the cases of one DP size share a launch
    variants = [offloaded_overrides(tmp_path_factory.getbasetemp() / f"offloaded-nvme-{d}", d, n, c)
                for d, n, c in cases]
    index = cases.index((dp, nvme, cpu_adam))
    overrides = variants[index]
    ranks = shared_check(dp, variants, index)
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", *overrides])
    for r in ranks:
        assert r["cpu_adam"] == ("native" if cpu_adam == "auto" and shutil.which("cc") else "torch"), r
        assert r["first_update_max_rel_err"] < 1e-6, r
        assert r["three_updates_rel_err"] < 1e-6, r
        assert r["offloaded_layers"] == list(range(1, cfg.model.num_layers + 1)), r["offloaded_layers"]
        assert r["released_after_use"], "offloaded layers hold no device weights between uses"
        if nvme:
            assert set(r["tiers"]) == {"host", "nvme"}, r["tiers"]
        host_limit = cfg.zero_cache.host_max_gib * 2 ** 30 if nvme else 1 << 50
        predicted = rank_tier_bytes(cfg, dp, r["rank"], 0.0, host_limit, nvme, model_bytes=4)[2]
        for tier in ("device", "host", "nvme"):
            assert r["allocated"].get(tier, 0) == predicted[tier], (tier, r["allocated"], predicted)


@pytest.fixture(scope="module")
def prefetch_runs(tmp_path_factory):
    """(the largest layer's parameters, knob -> the check's result with every layer offloaded): by default,
    and with a live cap of that layer in parameters and in fp32 bytes (the weights' size on CPU). The
    default runs between the capped ones, so neither cap can carry over into a run without it."""
    overrides = ["zero_cache.prefetch_cache_sub_group_rate=0.0", "zero_cache.offload_params=true"]
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", *overrides])
    sizes = sub_group_numels(rank_params(cfg))
    layer = max(sizes[g] for g in range(1, cfg.model.num_layers + 1))  # sub-group 1 + i is layer i
    knobs = {"max_live_parameters": f"zero_cache.max_live_parameters={layer}", "default": None,
             "max_contigous_params_size": f"zero_cache.max_contigous_params_size={4 * layer}"}
    results = adamw_checks(tmp_path_factory.mktemp("prefetch"), 1,
                           *([*overrides, knob] if knob else overrides for knob in knobs.values()))
    return layer, {name: ranks[0] for name, ranks in zip(knobs, results)}


@pytest.mark.parametrize("knob", ["default", "max_live_parameters", "max_contigous_params_size"])
def test_prefetch_depth_follows_the_knobs(prefetch_runs, knob):
    """Offloaded layers are prefetched while they fit prefetch_bucket_size (by default every layer of the
    tiny model); a live cap of one layer (in parameters, or in bytes) stops prefetching, so a forward
    without autograd holds one layer's weights at a time; updates equal torch AdamW either way."""
    layer, runs = prefetch_runs
    r = runs[knob]
    assert r["three_updates_rel_err"] < 1e-6, r
    if knob == "default":
        assert max(r["layer_params"]) == layer, r  # the cap of the other cases is one layer
        assert r["prefetch_depth"] >= len(r["layer_params"]) - 1
        assert r["eval_peak_live_params"] == sum(r["layer_params"]), r  # every layer fetched ahead of use
    else:
        assert r["prefetch_depth"] == 0
        assert r["eval_peak_live_params"] == layer, r  # one layer at a time


# TP 2 x DP 2 exercises both the tensor-parallel and the data-parallel paths of every case below; micro
# batches of 2 make two a step on each DP rank (global batch 8), so gradients add up across micro batches.
# The reference is Megatron's optimizer in one process on the same batches (that layouts train as one
# rank does is test_train_cpu's and test_pipeline_cpu's)
TRAJECTORY = ("train.train_iters=12", "train.micro_batch_size=2")


@pytest.mark.parametrize("layout", [("tp2dp2", 4, ["parallel.tensor_model_parallel_size=2"])],
                         ids=lambda x: x[0])
def test_trajectory_follows_megatron_optimizer(tmp_path, layout):
    name, nproc, extra = layout
    ref = train_tiny(tmp_path, "megatron", *TRAJECTORY)
    # half the states on the host, half of those updated on the device (CPU standing in for it)
    zc, out = train_tiny(tmp_path, "zc", *TRAJECTORY, "optim.optimizer=zero_cache",
                         "zero_cache.prefetch_cache_sub_group_rate=0.5", "zero_cache.device_update_fraction=0.5",
                         *extra, nproc=nproc, with_output=True)
    on_device = re.search(r"host states updated on the device ([\d,]+)", out)
    assert on_device and int(on_device.group(1).replace(",", "")) > 0, out[-2000:]
    # every layer's states on the host, weights offloaded and fetched per micro batch,
    # and each micro batch's gradients reduced and added up in the store as it ends
    offload = train_tiny(tmp_path, "zc-offload", *TRAJECTORY, "optim.optimizer=zero_cache",
                         "zero_cache.prefetch_cache_sub_group_rate=0.0", "zero_cache.offload_params=true",
                         "zero_cache.accumulate_in_store=true", *extra, nproc=nproc)
    for run in (zc, offload):
        for a, b in zip(ref, run):
            assert math.isclose(a["lm_loss"], b["lm_loss"], rel_tol=1e-5), (a["iteration"], a["lm_loss"], b["lm_loss"])
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)
        assert len(run) == 12


def _flat_checkpoint(path):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def test_a_checkpoint_at_rate_0_resumes_at_rate_05_in_smaller_chunks(tmp_path):
    # rate 0.0 with offloaded weights: the checkpoint reads them from their host copies
    zc = ["optim.optimizer=zero_cache", "train.train_iters=20", "zero_cache.offload_params=true"]
    full = train_tiny(tmp_path, "full", *zc, "zero_cache.prefetch_cache_sub_group_rate=0.0",
                      "checkpoint.save_interval=10", f"checkpoint.save={tmp_path / 'full'}", nproc=2)
    ck = resume_point(tmp_path / "full", 10, tmp_path / "ck")
    # resumed with half the states on the device, the host chunks of layers whose weights stay there
    # (the output layer's) updated on the device, and chunks of at most 16384 elements (a layer's
    # states in several chunks: the checkpoint keeps them per parameter)
    resumed = train_tiny(tmp_path, "resumed", *zc, "zero_cache.prefetch_cache_sub_group_rate=0.5",
                         "zero_cache.device_update_fraction=1.0", "zero_cache.chunk_numel=16384",
                         f"checkpoint.load={ck}", f"checkpoint.save={tmp_path / 'resumed'}", nproc=2)
    _assert_resumed_like_uninterrupted(tmp_path, full, resumed, 20)


def _assert_resumed_like_uninterrupted(tmp_path, full, resumed, last):
    """Resumed at iteration 11: the same losses and, at the last iteration, the same checkpoint."""
    import torch

    assert resumed[0]["iteration"] == 11
    by_iter = {r["iteration"]: r["lm_loss"] for r in full}
    for r in resumed:
        assert math.isclose(r["lm_loss"], by_iter[r["iteration"]], rel_tol=1e-6), r["iteration"]
    a = _flat_checkpoint(tmp_path / "full" / f"iter_{last:07d}")
    b = _flat_checkpoint(tmp_path / "resumed" / f"iter_{last:07d}")
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optimizer.zero_cache.exp_avg_sq") for k in tensors)
    for k in tensors:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-8), k


def test_checkpoint_saved_from_nvme_resumes_into_nvme(tmp_path):
    """States saved from their NVMe files (mapped, not read whole) and loaded into the files of another
    placement, in place, continue the run as if it had not stopped."""
    zc = ["optim.optimizer=zero_cache", "train.train_iters=14"]
    nvme = [f"zero_cache.nvme_path={tmp_path / 'nvme'}", "zero_cache.prefetch_cache_sub_group_rate=0.0",
            "zero_cache.host_max_gib=0.0013"]
    full, out = train_tiny(tmp_path, "full", *zc, *nvme, "checkpoint.save_interval=10",
                           f"checkpoint.save={tmp_path / 'full'}", nproc=2, with_output=True)
    assert re.search(r"nvme [1-9]", out), out  # saved with states on NVMe
    ck = resume_point(tmp_path / "full", 10, tmp_path / "ck")
    resumed, out = train_tiny(tmp_path, "resumed", *zc, f"zero_cache.nvme_path={tmp_path / 'nvme2'}",
                              "zero_cache.prefetch_cache_sub_group_rate=0.5", "zero_cache.host_max_gib=0.001",
                              f"checkpoint.load={ck}", f"checkpoint.save={tmp_path / 'resumed'}", nproc=2,
                              with_output=True)
    assert re.search(r"nvme [1-9]", out), out  # loaded into states on NVMe
    _assert_resumed_like_uninterrupted(tmp_path, full, resumed, 14)


def test_a_placement_only_one_rank_cannot_hold_is_refused_by_all(tmp_path):
    """DP partitions are uneven, so one rank may not fit where the other does: every rank stops and the
    user gets that rank's numbers in one line, not a collective's traceback."""
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", 2, "optim.optimizer=zero_cache",
                   "zero_cache.prefetch_cache_sub_group_rate=0.5", f"zero_cache.nvme_path={tmp_path / 'nvme'}",
                   "zero_cache.host_max_gib=0.0008")
    check_one_line_error(proc, "rank 1: zero_cache: model states do not fit", in_worker=True)


def test_placement_that_cannot_hold_the_model_is_refused():
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "optim.optimizer=zero_cache",
                   "zero_cache.host_max_gib=0.0001")
    check_one_line_error(proc, "model states do not fit", in_worker=True)
    assert "host needs" in proc.stderr and "has 107,374 B" in proc.stderr


def test_unwritable_nvme_path_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "optim.optimizer=zero_cache",
                   f"zero_cache.nvme_path={blocker / 'sub'}")
    check_one_line_error(proc, "is not writable", in_worker=True)


def test_native_cpu_adam_without_a_compiler_is_refused(tmp_path):
    """cpu_adam native where no C compiler runs: one line naming it, on every rank; nothing cached."""
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", 2, "optim.optimizer=zero_cache",
                   "zero_cache.cpu_adam=native", env={"CC": str(tmp_path / "no-cc"), "ANGELGPT_CACHE": str(tmp_path)})
    check_one_line_error(proc, f"zero_cache.cpu_adam=native cannot be built: C compiler '{tmp_path / 'no-cc'}' "
                               "not found (set CC)", in_worker=True)
    assert not list((tmp_path / "cpu_adam").glob("*")), "no half-built library left"


def test_pinning_beyond_the_memlock_limit_is_refused():
    """With ulimit -l lowered to 64 KiB, an unprivileged process that must pin 64 MiB is refused with both
    numbers; the same within the limit, or with the limit lifted (privileged), passes."""
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 16, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))\n"
              "from angelgpt.config import ConfigError\n"
              "from angelgpt.zero_cache.tiers import check_memlock\n"
              "check_memlock(1 << 15, privileged=False)\n"
              "check_memlock(64 << 20, privileged=True)\n"
              "try:\n"
              "    check_memlock(64 << 20, privileged=False)\n"
              "except ConfigError as exc:\n"
              "    print(exc)\n"
              "    sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("zero_cache: 67,108,864 B (0.06 GiB) of host memory must be pinned but the "
                                   "memlock limit (ulimit -l) allows 65,536 B; raise it (ulimit -l unlimited, "
                                   "or docker run --ulimit memlock=-1)")


def test_compact_states_at_dp2_equal_the_fp32_path(tmp_path):
    """Two torchrun ranks, each with its own batches: the master kept as a remainder beside the bf16
    weight and bf16 moments give, on each rank, the fp32 path's masters bit for bit (its moments
    rounded, its weights the masters split) after a step, with resident layers gathered and offloaded
    layers fetched over DP; losses within 1e-3 for three more steps; a checkpoint of the compact
    optimizer loads into an fp32 one at DP 2 with the masters bit for bit; and one of fp8 moments resumes
    at DP 2 with the next step's states and loss the saving optimizer's bit for bit."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(Path(__file__).with_name("zero_cache_precision_check.py")), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["layouts"]["offloaded"]["first"] != ranks[1]["layouts"]["offloaded"]["first"]  # own batches
    for r in ranks:
        assert r["checkpoint_masters_equal"] and r["fp8_resume_equal"], r
        for layout, x in r["layouts"].items():
            assert x["owned"] > 0 and x["masters_equal"] and x["moments_rounded"] and x["weights_split"], (layout, x)
            assert x["first"][0] == x["first"][1], x
            assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in x["losses"]), x
            assert {"device", "host"} <= set(x["tiers"]), x
        assert "offloaded" in r["layouts"]["offloaded"]["tiers"], r
