"""The optimizer registry (angelgpt.config.optimizers): an optimizer added from one file
(tests/toy_optimizer.py, named in optim.custom_import) trains through the real launcher and torchrun,
saves and resumes exactly; the names and refusals come from the registry."""

import math
import shutil

import pytest

from angelgpt.config import ConfigError, parse
from angelgpt.config import optimizers
from angelgpt.train.checkpoint_check import TRACKER, iter_dir
from tests.helpers import check_one_line_error, run_cli, train_tiny

pytestmark = pytest.mark.distributed

TOY = ["optim.custom_import=[tests.toy_optimizer]", "optim.optimizer=toy_sgd", "optim.lr=0.5",
       "optim.lr_warmup_iters=0", "optim.lr_decay_style=constant", "train.train_iters=6"]


def test_an_optimizer_from_one_file_trains_saves_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = train_tiny(tmp_path, "full", *TOY, f"checkpoint.save={ckpt}", "checkpoint.save_interval=3")
    assert [r["iteration"] for r in full] == list(range(1, 7))
    assert full[-1]["lm_loss"] < full[0]["lm_loss"] - 0.1  # SGD moves the weights: the loss falls
    assert (ckpt / TRACKER).read_text().strip() == "6"
    stopped = tmp_path / "stopped"  # iteration 3's checkpoint as the newest, as a run stopped there leaves it
    shutil.copytree(iter_dir(ckpt, 3), iter_dir(stopped, 3))
    (stopped / TRACKER).write_text("3\n")
    resumed = train_tiny(tmp_path, "resumed", *TOY, f"checkpoint.load={stopped}")
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    by_iter = {r["iteration"]: r for r in full}
    for r in resumed:  # the weights and the momentum buffers came back: the same losses as without a stop
        assert math.isclose(r["lm_loss"], by_iter[r["iteration"]]["lm_loss"], rel_tol=1e-6), r["iteration"]


def test_a_module_that_does_not_import_is_refused_in_one_line():
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "optim.custom_import=[no_such_module]",
                   "optim.optimizer=toy_sgd")
    check_one_line_error(proc, "optim.custom_import: cannot import 'no_such_module'")


def test_an_unknown_optimizer_is_told_the_registered_names_custom_ones_included():
    with pytest.raises(ConfigError) as err:
        parse("tiny", None, ["optim.custom_import=[tests.toy_optimizer]", "optim.optimizer=sgd"])
    assert str(err.value) == ("optim.optimizer must be 'megatron', 'megatron_cpu_offload', 'zero_cache' or "
                              "'toy_sgd', got 'sgd'")


def test_the_spec_refuses_what_the_optimizer_cannot_do():
    cfg = parse("tiny", None, ["optim.custom_import=[tests.toy_optimizer]", "optim.optimizer=toy_sgd"])
    with pytest.raises(ConfigError, match="'toy_sgd' runs on the CPU only"):
        cfg.check_device(on_gpu=True)
    with pytest.raises(ConfigError, match="honoured by optim.optimizer 'zero_cache' only"):
        parse("tiny", None, ["optim.custom_import=[tests.toy_optimizer]", "optim.optimizer=toy_sgd",
                             "optim.exp_avg_dtype=bf16"])
    with pytest.raises(ConfigError, match="'megatron_cpu_offload' needs CUDA"):
        parse("tiny", None, ["optim.optimizer=megatron_cpu_offload"]).check_device(on_gpu=False)


def test_a_taken_name_is_not_registered_again():
    with pytest.raises(ConfigError, match="'megatron' is registered already"):
        optimizers.register(optimizers.OptimizerSpec(name="megatron", build="tests.toy_optimizer:build"))
    assert optimizers.get("megatron").planner_system == "megatron"
