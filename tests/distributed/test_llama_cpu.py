"""The llama-tiny preset (RMSNorm, SwiGLU, RoPE, no biases, untied output, 4 query heads sharing 2 key/value
heads) trains on CPU in real torchrun workers under gloo: TP 2 with sequence parallelism and PP 2 train as
one rank does (the same initial model whatever the layout, every logged loss within 1e-5), and ZeRO-Cache
starts from the same model, trains it and resumes it from a checkpoint."""

import math

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import read_metrics, resume_point, run_cli

pytestmark = pytest.mark.distributed

STEPS = 20
# micro batch 2 (global batch 8: 4 micro batches a step, so 1F1B has a steady state)
COMMON = (f"train.train_iters={STEPS}", "train.micro_batch_size=2", "logging.log_interval=1")


def train_llama(tmp_path, name, *overrides, nproc=1):
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_cli("train", "--size", "llama-tiny", "--device", "cpu", "--nproc-per-node", nproc,
                   "--metrics-file", metrics, *COMMON, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r["lm_loss"] for r in read_metrics(metrics)]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    losses = train_llama(tmp_path_factory.mktemp("single"), "single")
    assert len(losses) == STEPS
    assert math.isclose(losses[0], math.log(512), rel_tol=0.05)  # starts near uniform over the vocabulary
    assert losses[-1] < 0.8 * losses[0]
    return losses


@pytest.mark.parametrize("layout", [
    ("tp2-sp", ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    ("pp2", ["parallel.pipeline_model_parallel_size=2"]),
], ids=lambda x: x[0])
def test_llama_tiny_layout_trains_as_one_rank(tmp_path, single_rank, layout):
    name, overrides = layout
    other = train_llama(tmp_path, name, *overrides, nproc=2)
    assert len(other) == STEPS
    for step, (a, b) in enumerate(zip(single_rank, other), 1):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)


def test_llama_tiny_trains_and_resumes_with_zero_cache(tmp_path, single_rank):
    """From the same initial model as Megatron's optimizer; stopped at 10 and resumed from its checkpoint
    (SwiGLU's linear_fc1 is saved as its gate and up halves), the run goes on as the uninterrupted one."""
    zero_cache = ("optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5")
    saved = tmp_path / "saved"
    losses = train_llama(tmp_path, "zero_cache", *zero_cache, "checkpoint.save_interval=10", f"checkpoint.save={saved}")
    assert math.isclose(losses[0], single_rank[0], rel_tol=1e-5)
    assert losses[-1] < 0.8 * losses[0]
    ckpt = resume_point(saved, 10, tmp_path / "ckpt")
    resumed = train_llama(tmp_path, "resumed", *zero_cache, f"checkpoint.load={ckpt}")
    assert len(resumed) == STEPS - 10
    # one key a layer (ZeRO-Cache keeps layers in different tiers), SwiGLU's halves too
    keys = FileSystemReader(str(ckpt / "iter_0000010")).read_metadata().state_dict_metadata
    fc1 = sorted(k for k in keys if k.endswith(("linear_fc1.weight.layer0", "linear_fc1.weight.layer1")))
    assert fc1 == sorted(f"{prefix}decoder.layers.mlp.linear_fc1.weight.layer{i}" for i in (0, 1)
                         for prefix in ("", *(f"optimizer.zero_cache.{n}." for n in ("master", "exp_avg", "exp_avg_sq")))), fc1
    for step, (a, b) in enumerate(zip(losses[10:], resumed), 11):
        assert math.isclose(a, b, rel_tol=1e-6), (step, a, b)
