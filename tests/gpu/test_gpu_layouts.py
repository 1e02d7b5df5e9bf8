"""Several ranks on one GPU (tests/gpu/shared_gpu_worker.py: every rank on GPU 0, gloo default group,
pipeline P2P through host memory), for Megatron's optimizer and ZeRO-Cache: data, tensor (with sequence
parallelism) and pipeline parallelism and their products train on the GPU code paths, data parallelism
gives the one-rank run's losses, and a checkpoint written at one layout resumes at another. Skipped
without CUDA."""

import pytest
import torch

from tests.helpers import train_shared_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ITERS = 10
TP2, PP2, SP = "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2", \
    "parallel.sequence_parallel=true"
LAYOUTS = {"dp2": (2, []), "tp2-sp": (2, [TP2, SP]), "pp2": (2, [PP2]), "tp2-pp2": (4, [TP2, PP2]),
           "dp2-tp2": (4, [TP2])}
OPTIMIZERS = {"megatron": ["optim.optimizer=megatron"],
              "zero_cache": ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5"]}


def _losses(records):
    return [r["lm_loss"] for r in records]


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def one_rank(request, tmp_path_factory):
    """The one-rank run of an optimizer, the reference of its layouts."""
    name = request.param
    return name, _losses(train_shared_gpu(tmp_path_factory.mktemp(name), "one", *OPTIMIZERS[name],
                                          f"train.train_iters={ITERS}"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_on_one_gpu_as_one_rank(one_rank, layout, tmp_path):
    """Each layout starts from the one rank's weights (the same seed draws the same full weights, each
    rank keeping its slice) and gives the one rank's losses: the first within bf16 rounding of the
    split GEMMs and sums, the later ones within 1%."""
    name, reference = one_rank
    nproc, extra = LAYOUTS[layout]
    losses = _losses(train_shared_gpu(tmp_path, layout, *OPTIMIZERS[name], *extra, f"train.train_iters={ITERS}",
                                      nproc=nproc))
    assert len(losses) == ITERS and losses[-1] < losses[0], losses
    assert losses[0] == pytest.approx(reference[0], rel=1e-3), (losses, reference)
    assert losses == pytest.approx(reference, rel=1e-2), (losses, reference)


def test_every_optimizer_and_build_starts_from_the_same_model(tmp_path):
    """Megatron's optimizer (the model built whole), ZeRO-Cache (layers built on the meta device and
    made real one at a time on the GPU) with offloaded weights, and ZeRO-Cache at TP 2 with sequence
    parallelism: the same seed, the same first loss on the same batch."""
    runs = {"megatron": (1, OPTIMIZERS["megatron"]),
            "zero_cache-offloaded": (1, ["optim.optimizer=zero_cache", "zero_cache.offload_params=true"]),
            "zero_cache-tp2-sp": (2, OPTIMIZERS["zero_cache"] + [TP2, SP])}
    first = {name: _losses(train_shared_gpu(tmp_path, name, *extra, "train.train_iters=1", nproc=n))[0]
             for name, (n, extra) in runs.items()}
    assert first["zero_cache-offloaded"] == pytest.approx(first["megatron"], rel=1e-4), first
    assert first["zero_cache-tp2-sp"] == pytest.approx(first["megatron"], rel=1e-3), first


DP_RESHARDABLE = "checkpoint.dist_ckpt_optim_fully_reshardable=false"
FULLY = "checkpoint.dist_ckpt_optim_fully_reshardable=true"
RESHARDS = {
    # Megatron's distributed optimizer and its CPU offload saved fully_reshardable: TP, PP and DP changed
    # (the resuming run's own choice of format left at the default: a load follows the checkpoint)
    **{f"{name}-{case}": (name, n_save, [FULLY, *save], n_load, load) for name in ("megatron", "megatron_cpu_offload")
       for case, (n_save, save, n_load, load) in {
        "tp2-to-tp1": (2, [TP2], 1, []), "pp2-to-dp2": (2, [PP2], 2, []), "dp2-to-tp2": (2, [], 2, [TP2]),
    }.items()},
    # the default format, dp_reshardable, resumes at another data-parallel size
    "megatron-dp_reshardable-dp2-to-dp1": ("megatron", 2, [DP_RESHARDABLE], 1, [DP_RESHARDABLE]),
    "megatron_cpu_offload-dp_reshardable-dp2-to-dp1": ("megatron_cpu_offload", 2, [], 1, []),
    "zero_cache-tp2pp2-to-dp2": ("zero_cache", 4, [TP2, PP2], 2, []),
    "zero_cache-dp2-to-tp2-sp": ("zero_cache", 2, [], 2, [TP2, SP]),
}


@pytest.mark.parametrize("case", list(RESHARDS))
def test_checkpoint_resumes_at_another_layout_on_one_gpu(case, tmp_path):
    """Saved at iteration 5 of 10 at one layout, resumed at another: iterations 6-10 give the losses
    the saving run went on to (the same states and data; only the order of sums differs)."""
    name, n_save, save_layout, n_load, load_layout = RESHARDS[case]
    optimizer = OPTIMIZERS.get(name, [f"optim.optimizer={name}"])
    ck = tmp_path / "ck"
    saved = train_shared_gpu(tmp_path, "saved", *optimizer, *save_layout, f"train.train_iters={ITERS}",
                             f"checkpoint.save={ck}", "checkpoint.save_interval=5", nproc=n_save)
    (ck / "latest_checkpointed_iteration.txt").write_text("5\n")
    resumed = train_shared_gpu(tmp_path, "resumed", *optimizer, *load_layout, f"train.train_iters={ITERS}",
                               f"checkpoint.load={ck}", nproc=n_load)
    assert [r["iteration"] for r in resumed] == list(range(6, ITERS + 1))
    assert _losses(resumed) == pytest.approx(_losses(saved)[5:], rel=1e-2), (_losses(resumed), _losses(saved))


def test_megatron_dp_reshardable_checkpoint_at_another_tp_is_refused_in_one_line(tmp_path):
    """Megatron's dp_reshardable optimizer state (the default, checkpoint.dist_ckpt_optim_fully_reshardable
    false) resumes at another data-parallel size only: a resume at another TP x PP is refused before training,
    in one line, whatever the resuming run's own choice of format."""
    ck = tmp_path / "ck"
    train_shared_gpu(tmp_path, "saved", *OPTIMIZERS["megatron"], DP_RESHARDABLE, "train.train_iters=2",
                     f"checkpoint.save={ck}", nproc=2)
    proc = train_shared_gpu(tmp_path, "resumed", *OPTIMIZERS["megatron"], TP2, "train.train_iters=4",
                            f"checkpoint.load={ck}", nproc=2, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("angelgpt: error: ")]
    assert len(lines) == 1 and "dp_reshardable" in lines[0] and "1 x 1, this run is 1 x 2" in lines[0], proc.stderr[-3000:]


@pytest.mark.parametrize("saver, loader", [("megatron", "zero_cache"), ("zero_cache", "megatron")])
def test_another_optimizers_checkpoint_is_refused_in_one_line_on_one_gpu(tmp_path, saver, loader):
    """Megatron's distributed optimizer and ZeRO-Cache lay out the model's states their own ways: each
    refuses the other's checkpoint in the workers, in one line naming the optimizer that saved it and the
    way on (export, then import), and saves nothing."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    train_shared_gpu(tmp_path, "saved", *OPTIMIZERS[saver], "train.train_iters=2", f"checkpoint.save={ck}")
    proc = train_shared_gpu(tmp_path, "resumed", *OPTIMIZERS[loader], "train.train_iters=4", f"checkpoint.load={ck}",
                            f"checkpoint.save={out}", check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("angelgpt: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"it was saved with optim.optimizer={saver} on cuda" in lines[0], lines[0]
    assert f"angelgpt export --load {ck} --output HF_DIR, then angelgpt import --hf HF_DIR" in lines[0], lines[0]
    assert not (out / "latest_checkpointed_iteration.txt").exists()
