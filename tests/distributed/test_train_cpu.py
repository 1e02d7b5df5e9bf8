"""Real torchrun workers under gloo on CPU: the tiny preset trains, parallel layouts agree, resume is exact."""

import math

import pytest

from tests.helpers import train_tiny

pytestmark = pytest.mark.distributed


def losses(records):
    return [r["lm_loss"] for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The tiny preset's 50 steps in one process, written to TensorBoard too: the run the layouts and the
    resumed run must reproduce."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return train_tiny(root, "plain", f"logging.tensorboard_dir={root / 'tb'}"), root / "tb"


def test_tiny_trains_50_steps_and_loss_falls(uninterrupted):
    records, _ = uninterrupted
    assert [r["iteration"] for r in records] == list(range(1, 51))
    first, last = records[0]["lm_loss"], records[-1]["lm_loss"]
    assert math.isclose(first, math.log(512), rel_tol=0.05)  # starts near uniform over the vocabulary
    assert last < 0.7 * first
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "elapsed_ms", "tokens_per_s", "tflops_per_gpu",
                "mem_gpu_gib", "mem_host_gib"):
        assert key in records[-1]


@pytest.mark.parametrize("layout", [("tp2", 2, ["parallel.tensor_model_parallel_size=2"]), ("dp2", 2, [])],
                         ids=lambda x: x[0])
def test_parallel_layout_matches_single_rank(tmp_path, uninterrupted, layout):
    name, nproc, overrides = layout
    base = losses(uninterrupted[0])
    other = losses(train_tiny(tmp_path, name, *overrides, nproc=nproc))
    assert len(other) == len(base) == 50
    for step, (a, b) in enumerate(zip(base, other), 1):
        assert math.isclose(a, b, rel_tol=1e-5), (step, a, b)
    assert base[-1] < base[0]


def test_stop_at_20_and_resume_matches_uninterrupted(tmp_path, uninterrupted):
    full, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    first = train_tiny(tmp_path, "first", "train.exit_interval=20", f"checkpoint.save={ckpt}")
    assert first[-1]["iteration"] == 20
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    resumed = train_tiny(tmp_path, "resumed", f"checkpoint.load={ckpt}")
    assert resumed[0]["iteration"] == 21 and resumed[-1]["iteration"] == 50
    by_iter = {r["iteration"]: r for r in full}
    for r in resumed:
        assert math.isclose(r["lm_loss"], by_iter[r["iteration"]]["lm_loss"], rel_tol=1e-6), r["iteration"]
        assert math.isclose(r["lr"], by_iter[r["iteration"]]["lr"], rel_tol=1e-9)
    assert resumed[-1]["consumed_samples"] == full[-1]["consumed_samples"]


def test_tensorboard_event_files(uninterrupted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(uninterrupted[1]))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/lm_loss")]
    assert steps == list(range(1, 51))


def test_auto_is_resolved_once_and_the_checkpoint_records_the_resolved_config(tmp_path):
    """The launcher prints what every 'auto' became and writes the concrete config beside the run
    (checkpoint.save/run-config.yaml), which the workers build from without resolving again; the
    checkpoint's manifest holds the same concrete config."""
    import json

    save = tmp_path / "ck"
    records, out = train_tiny(tmp_path, "auto", "train.train_iters=2", "model.recompute=auto",
                              "optim.optimizer=zero_cache", f"checkpoint.save={save}", nproc=2, with_output=True)
    resolved = [line for line in out.splitlines() if line.startswith("resolved: ")]
    assert len(resolved) == 1, out  # printed once, by the launcher
    assert "model.recompute=none" in resolved[0] and "zero_cache.prefetch_cache_sub_group_rate" not in resolved[0]
    assert "zero_cache.accumulate_in_store=false" in resolved[0] and "train.device=cpu" not in resolved[0]
    assert [r["iteration"] for r in records] == [1, 2]
    config = json.loads((save / "iter_0000002" / "manifest.json").read_text())["config"]

    def autos(tree, where=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from autos(value, f"{where}{key}.")
            elif value == "auto":
                yield where + key

    assert list(autos(config)) == [], config
    import yaml

    run_config = (save / "run-config.yaml").read_text()
    assert run_config.startswith("# the config `angelgpt train` resolved") and "# machine reading: {" in run_config
    assert yaml.safe_load(run_config) == config
